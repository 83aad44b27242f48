"""Clusters: GPUs, nodes and their links, built from a GPU and a count or read from a
`cost_models/clusters/*.toml` (or a `calibrate` output) file.

Layout of ranks (used by `Cluster.nodes_spanned`): rank r lives on node r // gpus_per_node and
in NVLink domain r // scaleup_domain_gpus, the order torchrun gives by default.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from autoplan.errors import UserError
from autoplan.files import write_output
from autoplan.limits import MAX_GPUS, check_at_most
from autoplan.paths import cost_models_dir
from autoplan.hardware.gpu import GPU, _gpu_from_table, _gpu_to_table, load_gpu
from autoplan.hardware.toml import _check_sources, _clean_number, _dump_toml, _number, _read_toml
from autoplan.hardware.units import GB, GIB, US


_CLUSTER_NUMBERS = ("gpus_per_node", "num_nodes", "scaleup_domain_gpus", "intra_node_bandwidth_gb_per_s",
                    "intra_node_latency_us", "nic_bandwidth_gb_per_s", "inter_node_latency_us")


_CLUSTER_KEYS = frozenset(_CLUSTER_NUMBERS + ("name", "description", "gpu", "measured_at", "method",
                                              "sources", "kind"))


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
        if not 0 < inter_node_bandwidth_gb_per_s < math.inf:
            raise UserError(f"--inter-node-bandwidth must be a positive, finite number of GB/s per GPU (50 for a "
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
    write_output(path, _dump_toml(table))
    return path


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


def resolve_cluster(gpu: str | None, hardware: str | None, gpus: int, gpus_per_node: int | None,
                    memory_headroom_gib: float | None = None,
                    inter_node_bandwidth_gb_per_s: float | None = None):
    """--gpu NAME or --hardware FILE, --gpus N, --gpus-per-node K, --memory-headroom GIB (None:
    the default fraction of the GPU's memory),
    --inter-node-bandwidth GB/S -> Cluster (UserError on bad input)."""
    if gpus is None or gpus < 1:
        raise UserError(f"--gpus must be a positive number of GPUs, got {gpus}")
    check_at_most("--gpus", gpus, MAX_GPUS)
    if hardware and gpu:
        raise UserError(f"--gpu {gpu} and --hardware {hardware} both name the GPU; give --hardware alone "
                        "(its file names the GPU) or --gpu alone")
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
