"""Turn a calibration's measurements into a hardware file the cost model reads.

GPU peaks and link rates stay datasheet values and the measured efficiency fractions replace
the shipped ones; on the CPU test device, which has no datasheet, the measured best values
become the peaks and rates themselves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

import torch

from autoplan.calibrate.measure import CalibrationResult, ring_steps
from autoplan.errors import UserError
from autoplan.files import refuse_link, write_output
from autoplan.hardware import (GB, GIB, TFLOPS, US, GPU, Cluster, list_gpus, load_gpu, make_cluster,
                               write_hardware_file)


def base_gpu_for(device: str, name: str | None = None) -> GPU:
    """The catalogue GPU whose datasheet numbers the measurement refines.

    --gpu NAME wins; on CUDA the device name is matched against the catalogue keys and aliases
    (e.g. 'NVIDIA H200' -> h200-sxm-141gb); CPU ranks use the 'cpu' test device.
    """
    if name:
        return load_gpu(name)
    if device != "cuda":
        return load_gpu("cpu")
    words = torch.cuda.get_device_name().lower().replace("nvidia", "").replace("amd", "").split()
    label = "-".join(words)
    gpus = list_gpus()
    candidates = [g for g in gpus if g.key == label or label in g.aliases] or [
        g for g in gpus if any(alias in label.split("-") for alias in (g.key, *g.aliases))]
    if len(candidates) == 1:
        return candidates[0]
    raise UserError(f"cannot tell which catalogue GPU '{torch.cuda.get_device_name()}' is "
                    f"({'several match: ' + ', '.join(g.key for g in candidates) if candidates else 'none matches'}); "
                    "name it with --gpu (see `autoplan gpus`).")


def _source(result: CalibrationResult, what: str) -> str:
    return f"measured {result.measured_at}: {what} ({result.method()})"


def _kept(base: GPU, key: str, why: str) -> str:
    return f"not measured ({why}); kept from {base.key}: {base.sources.get(key, 'base GPU file')}"


def _matmul_updates(result: CalibrationResult, base: GPU, standard: bool) -> dict[str, Any]:
    """Peaks and efficiency curves from the matmul points (file units, dotted keys)."""
    by_dtype: dict[str, dict[float, list[tuple[float, int]]]] = {}
    for p in result.matmul:
        by_dtype.setdefault(p.dtype, {}).setdefault(p.flops, []).append((p.flops_per_s, min(p.m, p.n, p.k)))
    if not by_dtype:
        return {}
    axis = sorted({f for points in by_dtype.values() for f in points})
    cpu = result.device == "cpu"
    updates: dict[str, Any] = {"efficiency.matmul_gflop": [f / 1e9 for f in axis]}
    sources = {"efficiency.matmul_gflop": _source(result, "GEMM sizes timed, 2*m*n*k FLOP")}
    peaks = dict(base.peak_flops_by_precision)
    for dtype, points in by_dtype.items():
        rates = {f: statistics.mean(r for r, _ in pts) for f, pts in points.items()}
        if cpu:  # no datasheet: the best measured rate is the peak
            peaks[dtype] = max(rates.values())
            updates[f"peak_tflops.{dtype}"] = peaks[dtype] / TFLOPS
            sources[f"peak_tflops.{dtype}"] = _source(result, f"best torch.mm {dtype} rate over the sizes timed")
    curves: dict[str, tuple[str, list[float]]] = {}
    sixteen = "bf16" if "bf16" in by_dtype else ("fp16" if "fp16" in by_dtype else None)
    for cls, dtype in (("16bit", sixteen), ("fp32", "fp32" if "fp32" in by_dtype else None)):
        if dtype is None or any(f not in by_dtype[dtype] for f in axis):
            continue
        rates = {f: statistics.mean(r for r, _ in pts) for f, pts in by_dtype[dtype].items()}
        curves[cls] = (dtype, [rates[f] / peaks[dtype] for f in axis])
    if "16bit" not in curves:
        raise UserError("calibrate measured no 16-bit matmul on every shape, which the hardware file needs")
    for cls, (dtype, curve) in curves.items():
        updates[f"efficiency.matmul_fraction_{cls}"] = curve
        sources[f"efficiency.matmul_fraction_{cls}"] = _source(
            result, f"torch.mm {dtype} rate / peak_tflops.{dtype} at each matmul_gflop")
    for cls in base.efficiency.matmul_fraction:
        if cls not in curves:  # e.g. fp8: resample the shipped curve onto the new size axis
            precision = {"fp8": "fp8", "fp32": "fp32"}.get(cls, "bf16")
            updates[f"efficiency.matmul_fraction_{cls}"] = [
                base.matmul_efficiency(f, 10**9, precision) for f in axis]
            sources[f"efficiency.matmul_fraction_{cls}"] = _kept(
                base, f"efficiency.matmul_fraction_{cls}",
                f"{cls} not timed; shipped curve resampled at the measured sizes")
    if not standard:  # model shapes: the FLOP curve already holds the shape effects
        updates["efficiency.matmul_min_dim"] = [1]
        sources["efficiency.matmul_min_dim"] = _source(
            result, "GEMMs timed at the model's own shapes, so no separate shape factor")
        for cls in base.efficiency.matmul_min_dim_factor:
            updates[f"efficiency.matmul_min_dim_factor_{cls}"] = [1.0]
            sources[f"efficiency.matmul_min_dim_factor_{cls}"] = sources["efficiency.matmul_min_dim"]
    return {"values": updates, "sources": sources}


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _latency_split(alphas: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(base, per-step) from (steps, alpha) pairs: non-negative least squares of alpha = base + steps*step."""
    n = len(alphas)
    ms = sum(s for s, _ in alphas) / n
    ma = sum(a for _, a in alphas) / n
    sxx = sum((s - ms) ** 2 for s, _ in alphas)
    slope = sum((s - ms) * (a - ma) for s, a in alphas) / sxx if sxx > 0 else 0.0
    base = ma - slope * ms
    if slope < 0:
        return max(0.0, ma), 0.0
    if base < 0:
        return 0.0, sum(s * a for s, a in alphas) / sum(s * s for s, _ in alphas)
    return base, slope


def _comm_updates(result: CalibrationResult, base: GPU) -> dict[str, Any]:
    """Link rates, busbw fractions and latencies from the collective fits (file units)."""
    fits = result.fits()
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    cpu = result.device == "cpu"
    eff = base.efficiency
    intra = {op: f for (scope, op), f in fits.items() if scope == "intra"}
    if intra:
        n = next(iter(intra.values())).group_size
        nvls = eff.nvls_min_gpus and n >= eff.nvls_min_gpus
        link = max(f.busbw_bytes_per_s for f in intra.values()) if cpu else base.intra_node_bandwidth_bytes_per_s
        ring_ops = [op for op in intra if op != "all_reduce" or not nvls]
        what = f"intra-node group of {n} ranks"
        if cpu:
            values["intra_node_bandwidth_gb_per_s"] = link / GB
            sources["intra_node_bandwidth_gb_per_s"] = _source(result, f"best fitted busbw of the collectives, {what}")
        values["efficiency.intra_node_busbw_fraction"] = _median([intra[o].busbw_bytes_per_s for o in ring_ops]) / link
        sources["efficiency.intra_node_busbw_fraction"] = _source(
            result, f"median fitted busbw of {', '.join(ring_ops)} / intra_node_bandwidth_gb_per_s, {what}")
        if nvls or not eff.nvls_min_gpus:
            values["efficiency.intra_node_allreduce_busbw_fraction"] = intra["all_reduce"].busbw_bytes_per_s / link
            sources["efficiency.intra_node_allreduce_busbw_fraction"] = _source(
                result, f"fitted all_reduce busbw / intra_node_bandwidth_gb_per_s, {what}")
        else:
            sources["efficiency.intra_node_allreduce_busbw_fraction"] = _kept(
                base, "efficiency.intra_node_allreduce_busbw_fraction",
                f"group of {n} < nvls_min_gpus {eff.nvls_min_gpus}, so the NVLS all-reduce did not run")
        base_s, step_s = _latency_split([(ring_steps(op, n), f.alpha_s) for op, f in intra.items()])
        values["collective_base_latency_us"] = base_s / US
        values["intra_node_latency_us"] = step_s / US
        how = ("alpha of every collective fitted as base + steps x per-step "
               "(steps: all_reduce 2(n-1), AG/RS n-1, a2a/p2p 1)")
        sources["collective_base_latency_us"] = _source(result, f"{how}, {what}")
        sources["intra_node_latency_us"] = sources["collective_base_latency_us"]
    else:
        for key in ("intra_node_bandwidth_gb_per_s", "efficiency.intra_node_busbw_fraction",
                    "efficiency.intra_node_allreduce_busbw_fraction", "collective_base_latency_us",
                    "intra_node_latency_us"):
            sources[key] = _kept(base, key, "fewer than 2 ranks per node")
        base_s = base.collective_base_latency_s
    inter = {op: f for (scope, op), f in fits.items() if scope == "inter"}
    if inter:
        k = next(iter(inter.values())).group_size
        nic = max(f.busbw_bytes_per_s for f in inter.values()) if cpu else base.nic_bandwidth_bytes_per_s
        what = f"one rank per node, {k} nodes, every local rank at once"
        if cpu:
            values["nic_bandwidth_gb_per_s"] = nic / GB
            sources["nic_bandwidth_gb_per_s"] = _source(result, f"best fitted busbw across nodes, {what}")
        ring = [op for op in inter if op != "all_to_all"]
        values["efficiency.inter_node_busbw_fraction"] = _median([inter[o].busbw_bytes_per_s for o in ring]) / nic
        sources["efficiency.inter_node_busbw_fraction"] = _source(
            result, f"median fitted busbw of {', '.join(ring)} / nic_bandwidth_gb_per_s, {what}")
        values["efficiency.inter_node_alltoall_busbw_fraction"] = inter["all_to_all"].busbw_bytes_per_s / nic
        sources["efficiency.inter_node_alltoall_busbw_fraction"] = _source(
            result, f"fitted all_to_all busbw / nic_bandwidth_gb_per_s, {what}")
        pairs = [(ring_steps(op, k), f.alpha_s - base_s) for op, f in inter.items()]
        step = max(0.0, sum(s * a for s, a in pairs) / sum(s * s for s, _ in pairs))
        values["inter_node_latency_us"] = step / US
        sources["inter_node_latency_us"] = _source(result, f"(alpha - collective base) per inter-node step, {what}")
    else:
        for key in ("nic_bandwidth_gb_per_s", "efficiency.inter_node_busbw_fraction",
                    "efficiency.inter_node_alltoall_busbw_fraction", "inter_node_latency_us"):
            sources[key] = _kept(base, key, "one node: no inter-node group")
    return {"values": values, "sources": sources}


def calibrated_gpu(result: CalibrationResult, base: GPU, standard_shapes: bool = True) -> GPU:
    """`base` with every measured number replaced and every kept number's source saying so."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for part in (_matmul_updates(result, base, standard_shapes), _comm_updates(result, base)):
        values.update(part.get("values", {}))
        sources.update(part.get("sources", {}))
    if result.copy_bytes_per_s:
        mib = result.copy_bytes / 2**20
        if result.device == "cpu":
            values["hbm_bandwidth_gb_per_s"] = result.copy_bytes_per_s / GB
            values["efficiency.hbm_fraction"] = 1.0
            sources["hbm_bandwidth_gb_per_s"] = _source(
                result, f"Tensor.copy_ of {mib:.0f} MiB fp32, bytes read+written / time")
            sources["efficiency.hbm_fraction"] = ("1.0 because hbm_bandwidth_gb_per_s is itself the measured "
                                                  "copy bandwidth")
        else:
            values["efficiency.hbm_fraction"] = result.copy_bytes_per_s / base.hbm_bandwidth_bytes_per_s
            sources["efficiency.hbm_fraction"] = _source(
                result, f"Tensor.copy_ of {mib:.0f} MiB fp32, bytes read+written / time / hbm_bandwidth_gb_per_s")
    if result.device_memory_bytes:
        values["memory_gib"] = result.device_memory_bytes / GIB
        sources["memory_gib"] = _source(result, "torch.cuda.get_device_properties().total_memory")
    gpu = base.with_values({k: _finite(k, v) for k, v in values.items()}, "measured")
    merged = dict(gpu.sources)
    merged.update(sources)
    return dataclasses.replace(gpu, key=base.key, name=f"{base.name} (calibrated {result.measured_at[:10]})",
                               sources=merged)


def _finite(key: str, value: Any) -> Any:
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 or (v == 0 and key.endswith("_us"))
               for v in values):
        raise UserError(f"calibrate measured an unusable value for {key}: {value!r}; the machine may be "
                        "overloaded, run it again with fewer other jobs.")
    return value


def calibrated_cluster(result: CalibrationResult, base: GPU, gpu: GPU, gpus_per_node: int | None = None) -> Cluster:
    """A cluster of the measured nodes: ranks per node from torchrun (CUDA: the node's GPU count)."""
    env = result.env
    if gpus_per_node is None:
        gpus_per_node = env.local_world_size
        if result.device == "cuda":
            gpus_per_node = max(gpus_per_node, torch.cuda.device_count())
        elif env.num_nodes == 1:  # the CPU test device's convention: up to base.gpus_per_node ranks per host
            gpus_per_node = max(gpus_per_node, base.gpus_per_node)
    if gpu.scaleup_domain_gpus == base.gpus_per_node:
        gpu = dataclasses.replace(gpu, gpus_per_node=gpus_per_node, scaleup_domain_gpus=gpus_per_node)
    else:
        gpu = dataclasses.replace(gpu, gpus_per_node=gpus_per_node)
    cluster = make_cluster(gpu, env.num_nodes * gpus_per_node, gpus_per_node)
    src = gpu.sources
    per_node = ("torchrun LOCAL_WORLD_SIZE / the node's device count" if result.device == "cuda" else
                "LOCAL_WORLD_SIZE, or the cpu device's convention (ranks sharing one host) on one node")
    domain = (src.get("scaleup_domain_gpus", "base GPU file") if base.scaleup_domain_gpus > base.gpus_per_node
              else "one scale-up domain per node (as the base GPU's board)")
    sources = {
        "gpus_per_node": f"{per_node}, calibration {result.measured_at}",
        "num_nodes": f"nodes in the calibration run (WORLD_SIZE / LOCAL_WORLD_SIZE), {result.measured_at}",
        "scaleup_domain_gpus": domain,
    }
    for key in ("intra_node_bandwidth_gb_per_s", "intra_node_latency_us", "nic_bandwidth_gb_per_s",
                "inter_node_latency_us"):
        sources[key] = src.get(key, "base GPU file")
    return dataclasses.replace(cluster, name=f"calibrated-{gpu.key}-{result.measured_at[:10]}", sources=sources,
                               measured_at=result.measured_at, method=result.method())


def measurements_path(hardware_file: str | Path) -> Path:
    """The raw measurements written beside a calibrated hardware file."""
    path = Path(hardware_file)
    return path.with_name(path.stem + ".measurements.json")


def write(result: CalibrationResult, base: GPU, path: str | Path, standard_shapes: bool = True,
          gpus_per_node: int | None = None) -> tuple[Path, Cluster]:
    """Write the hardware file (cost_models format) and its raw measurements beside it."""
    gpu = calibrated_gpu(result, base, standard_shapes)
    cluster = calibrated_cluster(result, base, gpu, gpus_per_node)
    path = Path(path)
    refuse_link(measurements_path(path))  # before the hardware file, so neither is half-written
    path.parent.mkdir(parents=True, exist_ok=True)
    write_hardware_file(cluster, path, measured_at=result.measured_at, method=result.method())
    data = result.to_dict()
    data["base_gpu"] = base.key
    write_output(measurements_path(path), json.dumps(data, indent=2) + "\n")
    return path, cluster
