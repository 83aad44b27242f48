"""The one place the cost model reads hardware numbers (autoplan.hardware GPU / Cluster, SI units)."""

from __future__ import annotations

import functools
import tomllib

from autoplan.cost.comm import Fabric
from autoplan.paths import cost_models_dir


def peak_flops_per_s(gpu, precision: str) -> float:
    """Dense peak FLOP/s; UserError for a precision the GPU lacks (fp8 on A100)."""
    return gpu.peak_flops(precision)


def matmul_fraction(gpu, flops: float, min_dim: float, precision: str) -> float:
    """Achieved / peak for one GEMM (measured curve of the GPU file, hardware.md B.4)."""
    return gpu.matmul_efficiency(max(flops, 1.0), max(int(min_dim), 1), precision)


def attention_fraction(gpu, flops: float = 0.0, head_dim: int = 128) -> float:
    """FlashAttention achieved / 16-bit peak: the GPU file's measurement where it has one,
    else a GEMM whose smallest dimension is the head dimension (the attention matmuls'
    inner dimension) on the measured matmul curve."""
    measured = gpu.efficiency.attention_fraction
    if measured:
        return measured
    return gpu.matmul_efficiency(max(flops, 1.0), head_dim, "bf16")


def hbm_bytes_per_s(gpu) -> float:
    """Achieved HBM bandwidth of memory-bound kernels: datasheet x STREAM fraction (B.4)."""
    return gpu.hbm_bandwidth_bytes_per_s * gpu.efficiency.hbm_fraction


def memory_budget_bytes(cluster) -> float:
    """Each GPU's memory less the cluster's headroom: what a job may use (`autoplan check`)."""
    return cluster.gpu.memory_bytes - cluster.memory_headroom_bytes


@functools.cache
def model_error_fraction() -> float:
    """How far the runtime's memory may exceed the estimate (cost_models/memory_model_error.toml)."""
    with open(cost_models_dir() / "memory_model_error.toml", "rb") as f:
        return float(tomllib.load(f)["fraction_of_estimate"])


def usable_memory_bytes(cluster) -> float:
    """What a plan's estimate may fill on each GPU: the budget less the estimate's measured
    error, so that the runtime's own memory stays within the budget."""
    return memory_budget_bytes(cluster) / (1.0 + model_error_fraction())


def fabric(cluster) -> Fabric:
    """Link numbers of a Cluster (its overrides of the GPU's typical system included)."""
    gpu = cluster.gpu
    eff = gpu.efficiency
    return Fabric(
        gpus_per_node=cluster.gpus_per_node,
        scaleup_domain=cluster.scaleup_domain_gpus,
        intra_bytes_per_s=cluster.intra_node_bandwidth_bytes_per_s,
        intra_busbw_fraction=eff.intra_node_busbw_fraction,
        intra_allreduce_busbw_fraction=eff.intra_node_allreduce_busbw_fraction,
        nvls_min_gpus=eff.nvls_min_gpus if eff.nvls_min_gpus else 10**9,
        intra_step_latency_s=cluster.intra_node_latency_s,
        base_latency_s=gpu.collective_base_latency_s,
        nic_bytes_per_s=cluster.inter_node_bandwidth_bytes_per_s,
        inter_busbw_fraction=eff.inter_node_busbw_fraction,
        inter_alltoall_fraction=eff.inter_node_alltoall_busbw_fraction,
        inter_step_latency_s=cluster.inter_node_latency_s,
    )
