"""GPUs, clusters and prices: the hardware side of the cost model, read from `cost_models/`.

Data files (format in cost_models/README.md) name their units in their keys (`memory_gib`,
`hbm_bandwidth_gb_per_s`, `peak_tflops`, `*_us`); this module converts them once to SI base
units (bytes, bytes/s, FLOP/s, seconds) so the cost functions never see a GB or a TFLOP.
Every number in a file must have its source in the file's `[sources]` table under the same
dotted key; loading enforces it. Files are found only through `autoplan.paths.cost_models_dir()`.

Layout of ranks (used by `Cluster.nodes_spanned`): rank r lives on node r // gpus_per_node and
in NVLink domain r // scaleup_domain_gpus, the order torchrun gives by default.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from autoplan.errors import UserError
from autoplan.limits import MAX_GPUS, check_at_most
from autoplan.paths import cost_models_dir

GIB = 2**30  # memory_gib: vendors print GiB as "GB" (hardware.md conventions, [STAS-ACC])
GB = 1e9  # bandwidths are decimal (hardware.md conventions)
TFLOPS = 1e12
US = 1e-6

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
REQUIRED_PRECISIONS = ("fp32", "fp16")
TOPOLOGIES = ("switch", "mesh", "pcie")
_GPU_NUMBERS = (
    "memory_gib", "hbm_bandwidth_gb_per_s", "gpus_per_node", "scaleup_domain_gpus",
    "intra_node_bandwidth_gb_per_s", "intra_node_latency_us", "collective_base_latency_us",
    "nic_bandwidth_gb_per_s", "inter_node_latency_us",
)
_GPU_OPTIONAL_NUMBERS = ("host_link_gb_per_s", "host_memory_gib", "host_cpu_cores")
_GPU_KEYS = frozenset(_GPU_NUMBERS + _GPU_OPTIONAL_NUMBERS + ("key", "name", "aliases", "intra_node_topology", "peak_tflops",
                                      "efficiency", "sources", "measured_at", "method"))
_EFF_REQUIRED = (
    "matmul_gflop", "matmul_fraction_16bit", "matmul_min_dim", "matmul_min_dim_factor_16bit",
    "intra_node_busbw_fraction", "intra_node_allreduce_busbw_fraction", "nvls_min_gpus",
    "inter_node_busbw_fraction", "inter_node_alltoall_busbw_fraction", "hbm_fraction",
)
_EFF_OPTIONAL = ("matmul_fraction_fp8", "matmul_min_dim_factor_fp8", "matmul_fraction_fp32",
                 "attention_fraction")
_CLUSTER_NUMBERS = ("gpus_per_node", "num_nodes", "scaleup_domain_gpus", "intra_node_bandwidth_gb_per_s",
                    "intra_node_latency_us", "nic_bandwidth_gb_per_s", "inter_node_latency_us")
_CLUSTER_KEYS = frozenset(_CLUSTER_NUMBERS + ("name", "description", "gpu", "measured_at", "method",
                                              "sources", "kind"))
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


@dataclass(frozen=True)
class Cluster:
    """A GPU type times a number of GPUs, with the bandwidths its collectives see, in SI units."""

    name: str
    """Cluster name (file stem, or '<n>x <gpu key>' when made from --gpu)."""
    gpu: GPU
    """The accelerator."""
    num_gpus: int
    """Total GPUs (ranks)."""
    gpus_per_node: int
    """GPUs per node (NIC sharing); ranks fill nodes in order."""
    num_nodes: int
    """ceil(num_gpus / gpus_per_node); only a single node may be partial."""
    scaleup_domain_gpus: int
    """GPUs on one scale-up fabric (NVLink domain); a multiple of gpus_per_node."""
    intra_node_bandwidth_bytes_per_s: float
    """Per-GPU unidirectional scale-up bandwidth, bytes/s."""
    intra_node_latency_s: float
    """Per ring step latency inside the scale-up domain, seconds."""
    inter_node_bandwidth_bytes_per_s: float
    """Per-GPU unidirectional NIC line rate across domains, bytes/s."""
    inter_node_latency_s: float
    """Per ring step latency across domains, seconds."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Source of each cluster-level number (file-unit keys, e.g. 'nic_bandwidth_gb_per_s')."""
    measured_at: str | None = None
    """Date of calibration if the numbers were measured (calibrate writes it)."""
    method: str | None = None
    """How they were measured."""
    memory_headroom_bytes: float = 0.0
    """Memory per GPU a plan must leave free (allocator fragmentation, spikes), bytes."""

    @property
    def inter_node_override_gb_per_s(self) -> float | None:
        """The NIC rate per GPU where it is not the GPU's typical system's, else None."""
        nic = self.inter_node_bandwidth_bytes_per_s
        return None if nic == self.gpu.nic_bandwidth_bytes_per_s else nic / GB

    def nodes_spanned(self, group_size: int, stride: int = 1) -> int:
        """Nodes touched by the group {0, stride, ..., (group_size-1)*stride} of ranks."""
        return _units_spanned(group_size, stride, self.gpus_per_node, self.num_gpus)

    def domains_spanned(self, group_size: int, stride: int = 1) -> int:
        """Scale-up (NVLink) domains touched by the same group; 1 means it never uses a NIC."""
        return _units_spanned(group_size, stride, self.scaleup_domain_gpus, self.num_gpus)

    def crosses_nodes(self, group_size: int, stride: int = 1) -> bool:
        """True if the group leaves its scale-up domain (its traffic goes over NICs)."""
        return self.domains_spanned(group_size, stride) > 1

    def with_num_gpus(self, num_gpus: int) -> "Cluster":
        """The same cluster settings for another GPU count (what --gpus does to a --hardware file)."""
        return _build_cluster(self.name, self.gpu, num_gpus, self.gpus_per_node, self.scaleup_domain_gpus,
                              self.intra_node_bandwidth_bytes_per_s, self.intra_node_latency_s,
                              self.inter_node_bandwidth_bytes_per_s, self.inter_node_latency_s,
                              self.sources, self.measured_at, self.method)


@dataclass(frozen=True)
class PriceEntry:
    """One price: USD per GPU-hour with the date and source it was read from."""

    usd_per_gpu_hour: float
    """Price in US dollars per GPU per hour."""
    date: str
    """Date of the source."""
    source: str
    """Where the number comes from."""


@dataclass(frozen=True)
class Prices:
    """A price list (cost_models/prices/<name>.toml) plus command-line overrides."""

    name: str
    """Price list name."""
    entries: Mapping[str, PriceEntry]
    """Price per canonical GPU key (or a custom key from a hardware file)."""

    def usd_per_gpu_hour(self, key: str) -> float:
        """USD per GPU-hour for a GPU key or alias; UserError saying how to give a missing one."""
        return self.entry(key).usd_per_gpu_hour

    def entry(self, key: str) -> PriceEntry:
        """The full price entry for a GPU key or alias."""
        canonical = _canonical_key(key)
        if canonical not in self.entries:
            raise UserError(
                f"No price for GPU '{key}' in price list '{self.name}' (it has: "
                f"{', '.join(sorted(self.entries)) or 'none'}). Give one on the command line with "
                f"--price {canonical}=USD_PER_GPU_HOUR, e.g. --price {canonical}=2.50.")
        return self.entries[canonical]

    def has(self, key: str) -> bool:
        """True if a price is known for this key or alias."""
        return _canonical_key(key) in self.entries


# ---------------------------------------------------------------- public functions

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


def load_hardware_file(path: str | Path) -> Cluster:
    """A Cluster from a GPU file or a cluster file (cost_models/README.md); UserError if malformed.

    A GPU file gives one node of that GPU's typical system; a cluster file gives num_nodes (default 1)
    nodes. Use `Cluster.with_num_gpus` to size it for --gpus.
    """
    path = Path(path)
    table = _read_toml(path)
    if "gpu" not in table:
        gpu = _gpu_from_table(table, str(path))
        return make_cluster(gpu, gpu.gpus_per_node)
    return _cluster_from_table(table, path)


def make_cluster(gpu: GPU, num_gpus: int, gpus_per_node: int | None = None,
                 inter_node_bandwidth_gb_per_s: float | None = None) -> Cluster:
    """`num_gpus` of `gpu` in its typical system, with optional command-line overrides.

    num_gpus below a node's size makes one partial node; above it, it must fill whole nodes
    (UserError otherwise): a partial last node would make the layout of parallel groups ambiguous.
    """
    sources = {"gpus_per_node": f"GPU {gpu.key} typical system",
               "nic_bandwidth_gb_per_s": f"GPU {gpu.key} data file"}
    if gpus_per_node is not None:
        sources["gpus_per_node"] = "command line --gpus-per-node"
    if inter_node_bandwidth_gb_per_s is not None:
        if not inter_node_bandwidth_gb_per_s > 0:
            raise UserError(f"--inter-node-bandwidth must be a positive number of GB/s per GPU (50 for a "
                            f"400 Gb/s NIC per GPU), got {inter_node_bandwidth_gb_per_s:g}.")
        sources["nic_bandwidth_gb_per_s"] = "command line"
    per_node = gpu.gpus_per_node if gpus_per_node is None else gpus_per_node
    domain = gpu.scaleup_domain_gpus
    if gpus_per_node is not None and gpu.scaleup_domain_gpus == gpu.gpus_per_node:
        domain = per_node  # NVLink ends at the node boundary on 8-GPU boards: a smaller node is a smaller domain
    nic = gpu.nic_bandwidth_bytes_per_s if inter_node_bandwidth_gb_per_s is None else inter_node_bandwidth_gb_per_s * GB
    return _build_cluster(f"{num_gpus}x {gpu.key}", gpu, num_gpus, per_node, domain,
                          gpu.intra_node_bandwidth_bytes_per_s, gpu.intra_node_latency_s, nic,
                          gpu.inter_node_latency_s, sources, None, None)


def load_prices(overrides: Mapping[str, float] | None = None, price_list: str = "default") -> Prices:
    """Prices from cost_models/prices/<price_list>.toml, with `overrides` {gpu key or alias: USD/GPU-h}."""
    path = cost_models_dir() / "prices" / f"{price_list}.toml"
    if not path.is_file():
        lists = sorted(p.stem for p in (cost_models_dir() / "prices").glob("*.toml"))
        raise UserError(f"Unknown price list '{price_list}'; known: {', '.join(lists)}.")
    table = _read_toml(path)
    entries: dict[str, PriceEntry] = {}
    for key, item in _require(table, "prices", dict, path).items():
        where = f"{path} [prices.{key}]"
        entries[_canonical_key(key)] = PriceEntry(
            usd_per_gpu_hour=_positive(_require(item, "usd_per_gpu_hour", (int, float), where), where),
            date=str(_require(item, "date", str, where)), source=str(_require(item, "source", str, where)))
    for key, usd in (overrides or {}).items():
        if not isinstance(usd, (int, float)) or not usd > 0 or math.isinf(usd):
            raise UserError(f"Price for '{key}' must be a positive number of USD per GPU-hour, got {usd!r}.")
        entries[_canonical_key(key)] = PriceEntry(float(usd), "command line", "--price on the command line")
    return Prices(name=str(table.get("name", price_list)), entries=MappingProxyType(entries))


def parse_price_options(values: Iterable[str]) -> dict[str, float]:
    """Parse repeated `--price key=usd` options into {key: usd}; UserError on a malformed one."""
    prices: dict[str, float] = {}
    for value in values:
        key, sep, usd = value.partition("=")
        try:
            number = float(usd)
        except ValueError:
            number = float("nan")
        if not sep or not key.strip() or not number > 0 or math.isinf(number):
            raise UserError(f"--price expects GPU=USD_PER_GPU_HOUR with a positive number, e.g. "
                            f"--price h100=2.50; got '{value}'.")
        prices[key.strip().lower()] = number
    return prices


def write_hardware_file(cluster_or_gpu: Cluster | GPU, path: str | Path, measured_at: str, method: str) -> Path:
    """Write a cluster file (embedded [gpu] table) that `load_hardware_file` reads back.

    The GPU's sources are kept as they are (replace measured values with `GPU.with_values` first);
    cluster-level numbers get their recorded source or 'method (measured_at)'.
    """
    if isinstance(cluster_or_gpu, GPU):
        cluster_or_gpu = make_cluster(cluster_or_gpu, cluster_or_gpu.gpus_per_node)
    c = cluster_or_gpu
    values = {
        "gpus_per_node": c.gpus_per_node, "num_nodes": c.num_nodes, "scaleup_domain_gpus": c.scaleup_domain_gpus,
        "intra_node_bandwidth_gb_per_s": c.intra_node_bandwidth_bytes_per_s / GB,
        "intra_node_latency_us": c.intra_node_latency_s / US,
        "nic_bandwidth_gb_per_s": c.inter_node_bandwidth_bytes_per_s / GB,
        "inter_node_latency_us": c.inter_node_latency_s / US,
    }
    default_source = f"{method} ({measured_at})"
    table: dict[str, Any] = {"kind": "cluster", "name": c.name, "measured_at": measured_at, "method": method}
    table.update({k: _clean_number(v) for k, v in values.items()})
    table["sources"] = {k: c.sources.get(k, default_source) for k in values}
    table["gpu"] = _gpu_to_table(c.gpu)
    path = Path(path)
    path.write_text(_dump_toml(table), encoding="utf-8")
    return path


# ---------------------------------------------------------------- parsing

def _gpus_dir() -> Path:
    return cost_models_dir() / "gpus"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise UserError(f"Hardware file {path} does not exist.") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path} is not valid TOML: {exc}. See cost_models/README.md for the format.") from None


def _load_gpu_file(path: Path) -> GPU:
    gpu = _gpu_from_table(_read_toml(path), str(path))
    if gpu.key != path.stem:
        raise UserError(f"{path}: key '{gpu.key}' must equal the file name '{path.stem}'.")
    return gpu


def _require(table: Mapping[str, Any], key: str, kind: Any, where: str | Path) -> Any:
    if key not in table:
        raise UserError(f"{where}: required key '{key}' is missing (format: cost_models/README.md).")
    value = table[key]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise UserError(f"{where}: key '{key}' has the wrong type ({type(value).__name__}: {value!r}).")
    return value


def _positive(value: float, where: str, allow_zero: bool = False) -> float:
    if not (value >= 0 if allow_zero else value > 0) or math.isinf(value):
        raise UserError(f"{where} must be a {'non-negative' if allow_zero else 'positive'} number, got {value}.")
    return value


def _number(table: Mapping[str, Any], key: str, where: str, allow_zero: bool = False) -> float:
    return _positive(_require(table, key, (int, float), where), f"{where}: '{key}'", allow_zero)


def _integer(table: Mapping[str, Any], key: str, where: str) -> int:
    return int(_positive(_require(table, key, int, where), f"{where}: '{key}'"))


def _curve(table: Mapping[str, Any], key: str, where: str, length: int | None = None) -> tuple[float, ...]:
    values = _require(table, key, list, where)
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
        raise UserError(f"{where}: '{key}' must be a non-empty list of positive numbers, got {values!r}.")
    if length is not None and len(values) != length:
        raise UserError(f"{where}: '{key}' has {len(values)} points but its x axis has {length}.")
    return tuple(float(v) for v in values)


def _check_sources(table: Mapping[str, Any], where: str) -> dict[str, str]:
    """Every number (or list of numbers) needs a non-empty [sources] entry under its dotted key."""
    sources = table.get("sources", {})
    if not isinstance(sources, dict):
        raise UserError(f"{where}: 'sources' must be a table of dotted key = \"source\".")
    for dotted in _numeric_keys(table):
        text = sources.get(dotted)
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"{where}: the number '{dotted}' has no source. Add [sources] \"{dotted}\" = "
                            f"\"where it comes from\" (a datasheet, a paper, or 'measured <date> with <tool>').")
    return dict(sources)


def _numeric_keys(table: Mapping[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in table.items():
        if key in ("sources", "gpu"):
            continue
        if isinstance(value, dict):
            keys += _numeric_keys(value, f"{prefix}{key}.")
        elif isinstance(value, (int, float, list)) and not isinstance(value, bool) and not (
                isinstance(value, list) and all(isinstance(v, str) for v in value)):
            keys.append(prefix + key)
    return keys


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


def _cluster_from_table(table: Mapping[str, Any], path: Path) -> Cluster:
    where = str(path)
    unknown = sorted(set(table) - _CLUSTER_KEYS)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_CLUSTER_KEYS))}.")
    sources = _check_sources(table, where)
    spec = table["gpu"]
    if isinstance(spec, str):
        gpu = load_gpu(spec)
    elif isinstance(spec, dict):
        gpu = _gpu_from_table(spec, f"{where} [gpu]")
    else:
        raise UserError(f"{where}: 'gpu' must be a GPU key (string) or a [gpu] table.")
    for key in ("gpus_per_node", "num_nodes", "scaleup_domain_gpus"):
        if key in table and (not isinstance(table[key], int) or isinstance(table[key], bool)):
            raise UserError(f"{where}: '{key}' must be an integer, got {table[key]!r}.")
    get = lambda key, default, unit=1.0: (  # noqa: E731 - file-unit override or the GPU's SI default
        _number(table, key, where, allow_zero=key.endswith("_us")) * unit if key in table else default)
    per_node = int(get("gpus_per_node", gpu.gpus_per_node))
    domain_default = per_node if gpu.scaleup_domain_gpus == gpu.gpus_per_node else gpu.scaleup_domain_gpus
    num_nodes = int(get("num_nodes", 1))
    measured_at, method = table.get("measured_at"), table.get("method")
    return _build_cluster(
        str(table.get("name", path.stem)), gpu, num_nodes * per_node, per_node,
        int(get("scaleup_domain_gpus", domain_default)),
        get("intra_node_bandwidth_gb_per_s", gpu.intra_node_bandwidth_bytes_per_s, GB),
        get("intra_node_latency_us", gpu.intra_node_latency_s, US),
        get("nic_bandwidth_gb_per_s", gpu.nic_bandwidth_bytes_per_s, GB),
        get("inter_node_latency_us", gpu.inter_node_latency_s, US),
        MappingProxyType(sources), None if measured_at is None else str(measured_at),
        None if method is None else str(method))


def _build_cluster(name: str, gpu: GPU, num_gpus: int, gpus_per_node: int, domain: int,
                   intra_bw: float, intra_lat: float, inter_bw: float, inter_lat: float,
                   sources: Mapping[str, str], measured_at: str | None, method: str | None) -> Cluster:
    if not isinstance(num_gpus, int) or num_gpus <= 0:
        raise UserError(f"The number of GPUs must be a positive integer, got {num_gpus!r}.")
    if not isinstance(gpus_per_node, int) or gpus_per_node <= 0:
        raise UserError(f"GPUs per node must be a positive integer, got {gpus_per_node!r}.")
    if num_gpus > gpus_per_node and num_gpus % gpus_per_node:
        raise UserError(f"{num_gpus} GPUs do not fill whole nodes of {gpus_per_node}; use a multiple of "
                        f"{gpus_per_node} (or fewer than one node), or set --gpus-per-node.")
    if domain % gpus_per_node:
        raise UserError(f"The scale-up domain of {domain} GPUs is not a whole number of {gpus_per_node}-GPU "
                        f"nodes; pick --gpus-per-node dividing {domain}.")
    return Cluster(name=name, gpu=gpu, num_gpus=num_gpus, gpus_per_node=gpus_per_node,
                   num_nodes=-(-num_gpus // gpus_per_node), scaleup_domain_gpus=domain,
                   intra_node_bandwidth_bytes_per_s=intra_bw, intra_node_latency_s=intra_lat,
                   inter_node_bandwidth_bytes_per_s=inter_bw, inter_node_latency_s=inter_lat,
                   sources=MappingProxyType(dict(sources)), measured_at=measured_at, method=method)


def _units_spanned(group_size: int, stride: int, unit: int, num_gpus: int) -> int:
    """Distinct blocks of `unit` consecutive ranks hit by ranks 0, stride, ..., (g-1)*stride."""
    if group_size < 1 or stride < 1:
        raise ValueError(f"group_size and stride must be >= 1, got {group_size}, {stride}")
    if (group_size - 1) * stride >= num_gpus:
        raise ValueError(f"a group of {group_size} with stride {stride} needs more than {num_gpus} ranks")
    if stride >= unit:
        return group_size  # every member in its own block
    return (group_size - 1) * stride // unit + 1  # gaps < unit: every block in the range is hit


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


# ---------------------------------------------------------------- writing

def _clean_number(value: float) -> float | int:
    """Round-off noise from unit conversion removed (12 significant digits), ints kept as ints."""
    if isinstance(value, int):
        return value
    rounded = float(f"{value:.12g}")
    return int(rounded) if rounded.is_integer() and abs(rounded) < 2**53 else rounded


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
        "sources": dict(gpu.sources),
    }


def _dump_toml(table: Mapping[str, Any], prefix: str = "") -> str:
    """Minimal TOML writer for str/int/float/bool/list scalars and nested tables (no new dependency)."""
    scalars = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    parts = ["\n".join(scalars)] if scalars else []
    for key, value in table.items():
        if isinstance(value, dict):
            name = f"{prefix}{_toml_key(key)}"
            parts.append(f"[{name}]\n" + _dump_toml(value, name + ".").rstrip("\n"))
    return "\n\n".join(parts) + "\n"


def _toml_key(key: str) -> str:
    return key if key and all(ch.isalnum() or ch in "_-" for ch in key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write {value} to a hardware file")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


__all__ = [
    "GPU", "Cluster", "Efficiency", "Prices", "PriceEntry", "PRECISIONS", "list_gpus", "load_gpu",
    "load_hardware_file", "make_cluster", "load_prices", "parse_price_options", "write_hardware_file",
    "resolve_cluster",
]


def resolve_cluster(gpu: str | None, hardware: str | None, gpus: int, gpus_per_node: int | None,
                    memory_headroom_gib: float | None = None,
                    inter_node_bandwidth_gb_per_s: float | None = None):
    """--gpu NAME or --hardware FILE, --gpus N, --gpus-per-node K, --memory-headroom GIB (None:
    the default fraction of the GPU's memory),
    --inter-node-bandwidth GB/S -> Cluster (UserError on bad input)."""
    if gpus is None or gpus < 1:
        raise UserError(f"--gpus must be a positive number of GPUs, got {gpus}")
    check_at_most("--gpus", gpus, MAX_GPUS)
    if hardware:
        cluster = load_hardware_file(hardware)
        nic = (cluster.inter_node_bandwidth_bytes_per_s / GB if inter_node_bandwidth_gb_per_s is None
               else inter_node_bandwidth_gb_per_s)
        cluster = make_cluster(cluster.gpu, gpus, gpus_per_node or cluster.gpus_per_node, nic)
    elif not gpu:
        raise UserError("give the GPU type with --gpu NAME (see `autoplan gpus`) or a hardware file with --hardware FILE")
    else:
        cluster = make_cluster(load_gpu(gpu), gpus, gpus_per_node, inter_node_bandwidth_gb_per_s)
    return with_memory_headroom(cluster, memory_headroom_gib)


def with_num_gpus(cluster: Cluster, num_gpus: int) -> Cluster:
    """The same kind of cluster (GPU, node size, NIC rate, memory headroom) at another size."""
    resized = make_cluster(cluster.gpu, num_gpus, cluster.gpus_per_node, cluster.inter_node_override_gb_per_s)
    return replace(resized, memory_headroom_bytes=cluster.memory_headroom_bytes)


def default_memory_headroom_fraction() -> float:
    """Fraction of each GPU's memory plans leave free by default (cost_models/memory_headroom.toml,
    sources there: the caching allocator's fragmentation, not counted by the estimate)."""
    with open(cost_models_dir() / "memory_headroom.toml", "rb") as f:
        return float(tomllib.load(f)["fraction_of_memory"])


@functools.lru_cache(maxsize=1)
def cpu_adam_params_per_s_per_core() -> float:
    """Parameters one host CPU core updates per second with torch's CPU AdamW (fp32),
    measured with the AdamW torch builds by default, as the runtime does (cost_models/cpu_adam.toml:
    command, machine and results there)."""
    with open(cost_models_dir() / "cpu_adam.toml", "rb") as f:
        return float(tomllib.load(f)["default_adamw_params_per_s_per_core"])


def with_memory_headroom(cluster: Cluster, headroom_gib: float | None) -> Cluster:
    """The cluster with `headroom_gib` of every GPU's memory kept free by plans; None: the
    default fraction of the GPU's memory (`default_memory_headroom_fraction`)."""
    if headroom_gib is None:
        headroom_gib = default_memory_headroom_fraction() * cluster.gpu.memory_bytes / GIB
    headroom_gib = float(headroom_gib)
    if not 0.0 <= headroom_gib < cluster.gpu.memory_bytes / GIB:
        raise UserError(f"--memory-headroom must be at least 0 and less than the "
                        f"{cluster.gpu.memory_bytes / GIB:.0f} GiB of a {cluster.gpu.key}, got {headroom_gib:g} GiB")
    return replace(cluster, memory_headroom_bytes=headroom_gib * GIB)