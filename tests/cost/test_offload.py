"""CPU offload costs time: host<->device copies and the CPU Adam step (ZeRO-Offload / -Infinity)."""

from __future__ import annotations

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import estimate, offload
from autoplan.hardware import load_gpu


# CPU AdamW on an H100 rank: 1.03e8 params/s per core measured (cost_models/cpu_adam.toml) x
# 14 host cores per GPU (DGX H100: 112 cores / 8 GPUs, [BASEPOD]) = 1.442e9 params/s, slower
# than 60 GB/s of host DRAM at 28 B/param (2.14e9 params/s): the cores bound it
H100_CPU_ADAM_PARAMS_PER_S = 1.03e8 * 112 / 8


def test_cpu_adam_is_the_measured_core_rate_times_the_cores_per_gpu():
    gpu = load_gpu("h100")
    assert offload.cpu_adam_s(1e9, 28, gpu) == pytest.approx(1e9 / H100_CPU_ADAM_PARAMS_PER_S, rel=1e-9)
    # with enough bytes per parameter host DRAM is the bound instead
    assert offload.cpu_adam_s(1e9, 200, gpu) == pytest.approx(200e9 / 60e9, rel=1e-9)


def test_optimizer_offload_is_copies_plus_cpu_adam():
    gpu = load_gpu("h100")
    params = 1e9
    # 2 B gradients out, 2 B weights back over the 51 GB/s host link (hardware.md B.2 [AZ-H100]),
    # CPU Adam; no backward to hide the gradient copy under
    adam = params / H100_CPU_ADAM_PARAMS_PER_S
    expected = 2e9 / 51e9 + adam + 2e9 / 51e9
    assert offload.optimizer_offload_s(params, 2, 2, 28, 0.0, gpu) == pytest.approx(expected, rel=1e-9)
    # a backward longer than the gradient copy hides it; the rest stays
    hidden = offload.optimizer_offload_s(params, 2, 2, 28, 1.0, gpu)
    assert hidden == pytest.approx(adam + 2e9 / 51e9, rel=1e-9)


def test_param_offload_copies_weights_twice_and_hides_under_compute():
    gpu = load_gpu("a100-sxm4-80gb")  # PCIe Gen4: 26.28 GB/s
    total, exposed = offload.param_offload_s(1e9, 2, 2, 0.0, 0.0, gpu)
    assert total == pytest.approx(2 * 2e9 / 26.28e9, rel=1e-9)
    assert exposed == pytest.approx(total)
    _, hidden = offload.param_offload_s(1e9, 2, 2, 10.0, 10.0, gpu)
    assert hidden == 0.0


def test_gpu_without_host_link_uses_the_slowest_default():
    assert offload.host_link_bytes_per_s(load_gpu("cpu")) == offload.DEFAULT_HOST_LINK_BYTES_PER_S


@pytest.mark.parametrize("mode", ["optimizer", "params", "both"])
def test_offload_makes_a_step_slower_never_free(make_gpt_graph, h100_cluster, mode):
    # The planner must not get memory savings for free: each offload mode adds step time.
    # ZeRO-3: parameter offload needs ZeRO-2/3 (FSDP2's CPUOffloadPolicy)
    graph = make_gpt_graph(layers=4, seq=1024)
    base = dict(global_batch=8, seq_len=1024, dp=8, micro_batch=1, zero_stage=3)
    cluster = h100_cluster(8)
    plain = estimate(graph, ParallelConfig(**base), cluster)
    off = estimate(graph, ParallelConfig(**base, offload=mode), cluster)
    assert off.step_time_s > plain.step_time_s
    assert off.memory_gib_per_gpu < plain.memory_gib_per_gpu
    # the step-time breakdown names offload, and its parts still add up to the step
    assert "offload" not in plain.time_breakdown_s
    assert off.time_breakdown_s["offload"] > 0.0
    assert "offload" not in off.comm_breakdown_s
    assert sum(off.time_breakdown_s.values()) == pytest.approx(off.step_time_s, rel=1e-9)
    assert off.time_breakdown_s["exposed_comm"] == pytest.approx(sum(off.comm_breakdown_s.values()), rel=1e-9)


def test_fsdp2_offload_step_is_the_cpu_adam_plus_the_exposed_block_copies(make_gpt_graph, h100_cluster):
    # FSDP2 copies the gradient and weight shards with every block (layers.param_offload_comm_s);
    # the step after backward is the CPU AdamW on this rank's shard alone
    graph = make_gpt_graph(layers=4, seq=1024)
    config = ParallelConfig(global_batch=8, seq_len=1024, dp=8, micro_batch=1, zero_stage=3, offload="both")
    est = estimate(graph, config, h100_cluster(8))
    params = sum(b.parameters * len(b.paths) for b in (graph.pre, *graph.blocks, graph.post)) / 8
    adam = offload.cpu_adam_s(params, 28, load_gpu("h100"))
    assert adam == pytest.approx(params / H100_CPU_ADAM_PARAMS_PER_S, rel=1e-9)
    assert est.time_breakdown_s["offload"] >= adam * (1 - 1e-9)
