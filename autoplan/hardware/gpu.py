"""GPUs: datasheet numbers and matmul efficiency curves from `cost_models/gpus/*.toml`."""

from __future__ import annotations

import bisect
import functools
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from autoplan.errors import UserError
from autoplan.paths import cost_models_dir
from autoplan.hardware.toml import _check_sources, _clean_number, _curve, _integer, _number, _read_toml, _require
from autoplan.hardware.units import GB, GIB, PRECISIONS, REQUIRED_PRECISIONS, TFLOPS, TOPOLOGIES, US


_GPU_NUMBERS = (
    "memory_gib", "hbm_bandwidth_gb_per_s", "gpus_per_node", "scaleup_domain_gpus",
    "intra_node_bandwidth_gb_per_s", "intra_node_latency_us", "collective_base_latency_us",
    "nic_bandwidth_gb_per_s", "inter_node_latency_us",
)


_GPU_OPTIONAL_NUMBERS = ("host_link_gb_per_s", "host_memory_gib", "host_cpu_cores")


_GPU_KEYS = frozenset(_GPU_NUMBERS + _GPU_OPTIONAL_NUMBERS + ("key", "name", "aliases", "intra_node_topology", "peak_tflops",
                                      "efficiency", "sources", "measured_at", "method",
                                      "fused_library_kernels"))


_EFF_REQUIRED = (
    "matmul_gflop", "matmul_fraction_16bit", "matmul_min_dim", "matmul_min_dim_factor_16bit",
    "intra_node_busbw_fraction", "intra_node_allreduce_busbw_fraction", "nvls_min_gpus",
    "inter_node_busbw_fraction", "inter_node_alltoall_busbw_fraction", "hbm_fraction",
)


_EFF_OPTIONAL = ("matmul_fraction_fp8", "matmul_min_dim_factor_fp8", "matmul_fraction_fp32",
                 "attention_fraction")


_FLOOR_FRACTION = 0.02  # lowest matmul efficiency returned when extrapolating below the smallest GEMM


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak (dimensionless), each with its source in the data file."""

    matmul_flops: tuple[float, ...]
    """FLOP per matmul (2*m*n*k) at which the matmul curves are given, ascending."""
    matmul_fraction: Mapping[str, tuple[float, ...]]
    """Achieved/peak at `matmul_flops`, per precision class: '16bit' always, 'fp8', 'fp32' if measured."""
    matmul_min_dim: tuple[int, ...]
    """Smallest of m, n, k at which the shape factors are given, ascending."""
    matmul_min_dim_factor: Mapping[str, tuple[float, ...]]
    """Multiplier on the curve's plateau for skinny GEMMs, per precision class, at `matmul_min_dim`."""
    intra_node_busbw_fraction: float
    """Ring collectives (AG/RS/A2A, ring all-reduce): measured busbw / intra-node link bandwidth."""
    intra_node_allreduce_busbw_fraction: float
    """All-reduce busbw / link bandwidth with NVLS where it applies (can exceed 1), else = ring."""
    nvls_min_gpus: int
    """Smallest intra-node group that gets the NVLS all-reduce fraction; 0 = never."""
    inter_node_busbw_fraction: float
    """Per-GPU NIC rate achieved by ring/hierarchical collectives / NIC line rate."""
    inter_node_alltoall_busbw_fraction: float
    """All-to-all busbw across nodes / one NIC's line rate (all-to-all cannot aggregate NICs)."""
    hbm_fraction: float
    """Memory-bound kernels: achieved / datasheet HBM bandwidth (STREAM copy)."""
    attention_fraction: float | None = None
    """FlashAttention-2 achieved / bf16 peak where measured, else None (cost model decides)."""


@dataclass(frozen=True)
class GPU:
    """One accelerator type in SI units. Build with `load_gpu`; never construct by hand."""

    key: str
    """Canonical lower-case key, e.g. 'h100-sxm-80gb' (the data file's stem)."""
    name: str
    """Human name, e.g. 'NVIDIA H100 SXM5 80GB'."""
    aliases: tuple[str, ...]
    """Other lower-case names accepted by `load_gpu`, e.g. ('h100',)."""
    memory_bytes: float
    """Usable device memory in bytes."""
    hbm_bandwidth_bytes_per_s: float
    """Datasheet device-memory bandwidth, bytes/s."""
    peak_flops_by_precision: Mapping[str, float]
    """Dense peak FLOP/s per precision; a missing precision is unsupported on this GPU."""
    intra_node_topology: str
    """'switch' (NVSwitch: any group gets the full link), 'mesh' (xGMI: one link per peer), 'pcie'."""
    intra_node_bandwidth_bytes_per_s: float
    """Per-GPU unidirectional scale-up link bandwidth (NVLink/xGMI/PCIe), bytes/s."""
    intra_node_latency_s: float
    """Per ring step latency inside the scale-up domain, seconds (NCCL hwLat)."""
    collective_base_latency_s: float
    """Fixed latency of one collective call, seconds (NCCL baseLat)."""
    gpus_per_node: int
    """GPUs sharing a host / NIC tray in the typical system."""
    nic_bandwidth_bytes_per_s: float
    """Scale-out NIC line rate per GPU, unidirectional, bytes/s."""
    inter_node_latency_s: float
    """Per ring step latency of a step that crosses nodes, seconds."""
    scaleup_domain_gpus: int
    """GPUs reachable over the scale-up link (8 for DGX, 72 for NVL72)."""
    efficiency: Efficiency
    """Achieved fractions of the peaks above."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Source of each number, keyed like the data file ('peak_tflops.bf16')."""
    host_link_bytes_per_s: float | None = None
    """Achieved host<->device copy bandwidth per GPU (PCIe / NVLink-C2C), bytes/s; None if not in the file."""
    host_memory_bytes: float | None = None
    """Host (CPU) DRAM of the typical system, per node of `gpus_per_node` GPUs, bytes; None if not in the file."""
    host_cpu_cores: int | None = None
    """Host CPU cores of the typical system, per node; None if not in the file."""
    fused_library_kernels: bool = True
    """Model libraries run their fused GPU kernels here (mamba-ssm's selective scan for
    transformers' Mamba); false for the CPU test device, where they run their Python loops."""

    @property
    def memory_gib(self) -> float:
        """Usable memory in GiB (for display)."""
        return self.memory_bytes / GIB

    def precisions(self) -> tuple[str, ...]:
        """Precisions this GPU supports, in PRECISIONS order."""
        return tuple(p for p in PRECISIONS if p in self.peak_flops_by_precision)

    def supports(self, precision: str) -> bool:
        """True if the GPU has a dense peak for `precision`."""
        return _check_precision(precision) in self.peak_flops_by_precision

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for `precision`; UserError if the GPU lacks it (e.g. fp8 on A100)."""
        precision = _check_precision(precision)
        if precision not in self.peak_flops_by_precision:
            raise UserError(
                f"{self.name} ({self.key}) has no {precision} support in its data file; it supports "
                f"{', '.join(self.precisions())}. Choose one of those with --precision, or a GPU with "
                f"{precision} (see `autoplan gpus`).")
        return self.peak_flops_by_precision[precision]

    def matmul_efficiency(self, flops: float, min_dim: int, precision: str = "bf16") -> float:
        """Achieved/peak for one GEMM of `flops` FLOP whose smallest dimension is `min_dim`.

        min(curve over FLOP count, plateau x shape factor over min_dim), both interpolated linearly
        in log10 of x; above the last point the curve stays flat; below the first FLOP point it is
        extrapolated along the first segment (small GEMMs are latency-bound) down to 2%. Data:
        hardware.md B.4 ([AZ-*] cuBLASLt curve, [STAS-ACC] MAMF plateau). Memory-bound GEMMs are
        the cost model's business (roofline with `hbm_bandwidth_bytes_per_s`).
        """
        if flops <= 0 or min_dim <= 0:
            raise ValueError(f"matmul_efficiency needs positive flops and min_dim, got {flops}, {min_dim}")
        cls = self._precision_class(precision)
        eff = self.efficiency
        curve = eff.matmul_fraction[cls]
        by_flops = _interp_log(eff.matmul_flops, curve, flops, extrapolate_low=True)
        factor_cls = cls if cls in eff.matmul_min_dim_factor else "16bit"
        by_dim = max(curve) * _interp_log(eff.matmul_min_dim, eff.matmul_min_dim_factor[factor_cls], min_dim)
        return max(_FLOOR_FRACTION, min(by_flops, by_dim))

    def intra_node_group_bandwidth_bytes_per_s(self, group_size: int) -> float:
        """Scale-up bandwidth one GPU gets in a collective over `group_size` GPUs of one domain.

        A full mesh (MI300X xGMI) gives one link per peer, so a group of g gets (g-1)/(n-1) of the
        all-to-all figure (2 MI300X: 64 of 448 GB/s, hardware.md B.2/D.3); a switch or PCIe gives all.
        """
        if group_size <= 1:
            return self.intra_node_bandwidth_bytes_per_s
        if self.intra_node_topology == "mesh" and self.gpus_per_node > 1:
            peers = min(group_size, self.gpus_per_node) - 1
            return self.intra_node_bandwidth_bytes_per_s * peers / (self.gpus_per_node - 1)
        return self.intra_node_bandwidth_bytes_per_s

    def to_table(self) -> dict[str, Any]:
        """The data-file form of this GPU (file units), inverse of loading."""
        return _gpu_to_table(self)

    def with_values(self, updates: Mapping[str, Any], source: str) -> "GPU":
        """A copy with file-unit values replaced (dotted keys, e.g. 'peak_tflops.bf16') and sourced."""
        table = self.to_table()
        for dotted, value in updates.items():
            head, _, leaf = dotted.rpartition(".")
            target = table.setdefault(head, {}) if head else table
            target[leaf] = value
            table["sources"][dotted] = source
        return _gpu_from_table(table, f"{self.key} (updated)")

    def _precision_class(self, precision: str) -> str:
        self.peak_flops(precision)  # raises for an unsupported precision
        curves = self.efficiency.matmul_fraction
        if precision == "fp8" and "fp8" in curves:
            return "fp8"
        if precision in ("fp32", "tf32") and "fp32" in curves:
            return "fp32"
        return "16bit"


def list_gpus() -> list[GPU]:
    """Every GPU in cost_models/gpus/, sorted by key."""
    paths = sorted(_gpus_dir().glob("*.toml"))
    return list(_load_catalog(tuple((str(p), p.stat().st_mtime_ns) for p in paths)))


@functools.lru_cache(maxsize=8)
def _load_catalog(files: tuple[tuple[str, int], ...]) -> tuple[GPU, ...]:
    """Parsed GPU files, memoised on (path, mtime) so loops over prices/GPUs do not re-read them."""
    return tuple(_load_gpu_file(Path(path)) for path, _ in files)


def load_gpu(name: str) -> GPU:
    """The GPU with this key or alias (case-insensitive); UserError listing the known names."""
    wanted = name.strip().lower()
    gpus = list_gpus()
    for gpu in gpus:
        if wanted == gpu.key or wanted in gpu.aliases:
            return gpu
    known = "; ".join(f"{g.key} ({', '.join(g.aliases)})" if g.aliases else g.key for g in gpus)
    raise UserError(f"Unknown GPU '{name}'. Known GPUs (aliases in brackets): {known}. Use one of these "
                    f"with --gpu, or describe your own hardware in a TOML file and pass --hardware FILE.")


def _gpus_dir() -> Path:
    return cost_models_dir() / "gpus"


def _load_gpu_file(path: Path) -> GPU:
    gpu = _gpu_from_table(_read_toml(path), str(path))
    if gpu.key != path.stem:
        raise UserError(f"{path}: key '{gpu.key}' must equal the file name '{path.stem}'.")
    return gpu


def _gpu_from_table(table: Mapping[str, Any], where: str) -> GPU:
    unknown = sorted(set(table) - _GPU_KEYS)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_GPU_KEYS))}.")
    sources = _check_sources(table, where)
    key = _require(table, "key", str, where).strip().lower()
    aliases = _require(table, "aliases", list, where) if "aliases" in table else []
    if not all(isinstance(a, str) for a in aliases):
        raise UserError(f"{where}: 'aliases' must be a list of strings.")
    topology = _require(table, "intra_node_topology", str, where)
    if topology not in TOPOLOGIES:
        raise UserError(f"{where}: 'intra_node_topology' must be one of {', '.join(TOPOLOGIES)}, got '{topology}'.")
    peaks_table = _require(table, "peak_tflops", dict, where)
    unknown = sorted(set(peaks_table) - set(PRECISIONS))
    if unknown:
        raise UserError(f"{where}: unknown precision(s) {', '.join(unknown)} in [peak_tflops]; use {', '.join(PRECISIONS)}.")
    for precision in REQUIRED_PRECISIONS:
        _require(peaks_table, precision, (int, float), f"{where} [peak_tflops]")
    peaks = {p: _number(peaks_table, p, f"{where} [peak_tflops]") * TFLOPS for p in PRECISIONS if p in peaks_table}
    return GPU(
        key=key, name=_require(table, "name", str, where), aliases=tuple(a.strip().lower() for a in aliases),
        memory_bytes=_number(table, "memory_gib", where) * GIB,
        hbm_bandwidth_bytes_per_s=_number(table, "hbm_bandwidth_gb_per_s", where) * GB,
        peak_flops_by_precision=MappingProxyType(peaks), intra_node_topology=topology,
        intra_node_bandwidth_bytes_per_s=_number(table, "intra_node_bandwidth_gb_per_s", where) * GB,
        intra_node_latency_s=_number(table, "intra_node_latency_us", where, allow_zero=True) * US,
        collective_base_latency_s=_number(table, "collective_base_latency_us", where, allow_zero=True) * US,
        gpus_per_node=_integer(table, "gpus_per_node", where),
        nic_bandwidth_bytes_per_s=_number(table, "nic_bandwidth_gb_per_s", where) * GB,
        inter_node_latency_s=_number(table, "inter_node_latency_us", where, allow_zero=True) * US,
        scaleup_domain_gpus=_integer(table, "scaleup_domain_gpus", where),
        efficiency=_efficiency_from_table(_require(table, "efficiency", dict, where), f"{where} [efficiency]",
                                          has_fp8="fp8" in peaks),
        sources=MappingProxyType(sources),
        host_link_bytes_per_s=(_number(table, "host_link_gb_per_s", where) * GB
                               if "host_link_gb_per_s" in table else None),
        host_memory_bytes=(_number(table, "host_memory_gib", where) * GIB
                           if "host_memory_gib" in table else None),
        host_cpu_cores=_integer(table, "host_cpu_cores", where) if "host_cpu_cores" in table else None,
        fused_library_kernels=_require(table, "fused_library_kernels", bool, where)
        if "fused_library_kernels" in table else True,
    )


def _efficiency_from_table(t: Mapping[str, Any], where: str, has_fp8: bool) -> Efficiency:
    unknown = sorted(set(t) - set(_EFF_REQUIRED) - set(_EFF_OPTIONAL))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}.")
    flops = _curve(t, "matmul_gflop", where)
    dims = _curve(t, "matmul_min_dim", where)
    if list(flops) != sorted(set(flops)) or list(dims) != sorted(set(dims)):
        raise UserError(f"{where}: 'matmul_gflop' and 'matmul_min_dim' must be strictly ascending.")
    fractions = {"16bit": _curve(t, "matmul_fraction_16bit", where, len(flops))}
    factors = {"16bit": _curve(t, "matmul_min_dim_factor_16bit", where, len(dims))}
    for cls in ("fp8", "fp32"):
        if f"matmul_fraction_{cls}" in t:
            fractions[cls] = _curve(t, f"matmul_fraction_{cls}", where, len(flops))
    if "matmul_min_dim_factor_fp8" in t:
        factors["fp8"] = _curve(t, "matmul_min_dim_factor_fp8", where, len(dims))
    if has_fp8 and "fp8" not in fractions:
        raise UserError(f"{where}: the GPU has an fp8 peak, so 'matmul_fraction_fp8' is required.")
    nvls = _require(t, "nvls_min_gpus", int, where)
    if nvls < 0:
        raise UserError(f"{where}: 'nvls_min_gpus' must be >= 0 (0 = no NVLS).")
    return Efficiency(
        matmul_flops=tuple(f * 1e9 for f in flops), matmul_fraction=MappingProxyType(fractions),
        matmul_min_dim=tuple(int(d) for d in dims), matmul_min_dim_factor=MappingProxyType(factors),
        intra_node_busbw_fraction=_number(t, "intra_node_busbw_fraction", where),
        intra_node_allreduce_busbw_fraction=_number(t, "intra_node_allreduce_busbw_fraction", where),
        nvls_min_gpus=nvls, inter_node_busbw_fraction=_number(t, "inter_node_busbw_fraction", where),
        inter_node_alltoall_busbw_fraction=_number(t, "inter_node_alltoall_busbw_fraction", where),
        hbm_fraction=_number(t, "hbm_fraction", where),
        attention_fraction=_number(t, "attention_fraction", where) if "attention_fraction" in t else None,
    )


def _interp_log(xs: tuple[float, ...], ys: tuple[float, ...], x: float, extrapolate_low: bool = False) -> float:
    """Piecewise-linear in log10(x); flat beyond the ends (or along the first segment below, if asked)."""
    if len(xs) == 1:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    if x <= xs[0] and not extrapolate_low:
        return ys[0]
    i = max(1, bisect.bisect_right(xs, x)) if x > xs[0] else 1
    x0, x1, y0, y1 = math.log10(xs[i - 1]), math.log10(xs[i]), ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (math.log10(x) - x0) / (x1 - x0)


def _check_precision(precision: str) -> str:
    p = str(precision).strip().lower()
    if p not in PRECISIONS:
        raise UserError(f"Unknown precision '{precision}'; use one of {', '.join(PRECISIONS)}.")
    return p


def _canonical_key(key: str) -> str:
    """GPU key for a key or alias if it names a catalogue GPU, else the lower-cased key itself."""
    wanted = key.strip().lower()
    for gpu in list_gpus():
        if wanted == gpu.key or wanted in gpu.aliases:
            return gpu.key
    return wanted


def _gpu_to_table(gpu: GPU) -> dict[str, Any]:
    e = gpu.efficiency
    eff: dict[str, Any] = {"matmul_gflop": [_clean_number(f / 1e9) for f in e.matmul_flops]}
    for cls, curve in e.matmul_fraction.items():
        eff[f"matmul_fraction_{cls}"] = list(curve)
    eff["matmul_min_dim"] = list(e.matmul_min_dim)
    for cls, curve in e.matmul_min_dim_factor.items():
        eff[f"matmul_min_dim_factor_{cls}"] = list(curve)
    for name in ("intra_node_busbw_fraction", "intra_node_allreduce_busbw_fraction", "nvls_min_gpus",
                 "inter_node_busbw_fraction", "inter_node_alltoall_busbw_fraction", "hbm_fraction",
                 "attention_fraction"):
        if getattr(e, name) is not None:
            eff[name] = getattr(e, name)
    c = _clean_number
    return {
        "key": gpu.key, "name": gpu.name, "aliases": list(gpu.aliases),
        "memory_gib": c(gpu.memory_bytes / GIB), "hbm_bandwidth_gb_per_s": c(gpu.hbm_bandwidth_bytes_per_s / GB),
        "gpus_per_node": gpu.gpus_per_node, "scaleup_domain_gpus": gpu.scaleup_domain_gpus,
        "intra_node_topology": gpu.intra_node_topology,
        "intra_node_bandwidth_gb_per_s": c(gpu.intra_node_bandwidth_bytes_per_s / GB),
        "intra_node_latency_us": c(gpu.intra_node_latency_s / US),
        "collective_base_latency_us": c(gpu.collective_base_latency_s / US),
        "nic_bandwidth_gb_per_s": c(gpu.nic_bandwidth_bytes_per_s / GB),
        "inter_node_latency_us": c(gpu.inter_node_latency_s / US),
        "peak_tflops": {p: c(v / TFLOPS) for p, v in gpu.peak_flops_by_precision.items()},
        "efficiency": eff,
        **({"host_link_gb_per_s": c(gpu.host_link_bytes_per_s / GB)} if gpu.host_link_bytes_per_s else {}),
        **({"host_memory_gib": c(gpu.host_memory_bytes / GIB)} if gpu.host_memory_bytes else {}),
        **({"host_cpu_cores": gpu.host_cpu_cores} if gpu.host_cpu_cores else {}),
        **({} if gpu.fused_library_kernels else {"fused_library_kernels": False}),
        "sources": dict(gpu.sources),
    }


@functools.lru_cache(maxsize=1)
def cpu_adam_params_per_s_per_core() -> float:
    """Parameters one host CPU core updates per second with torch's CPU AdamW (fp32),
    measured with the AdamW torch builds by default, as the runtime does (cost_models/cpu_adam.toml:
    command, machine and results there)."""
    with open(cost_models_dir() / "cpu_adam.toml", "rb") as f:
        return float(tomllib.load(f)["default_adamw_params_per_s_per_core"])
