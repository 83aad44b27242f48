"""Collective communication times: an alpha-beta model on a two-level topology.

Sources (../shared/reference/hardware.md, cited by section):
- B.1 / D.1 (nccl-tests PERFORMANCE.md): per-rank time = alpha + F * S / busbw with the
  bus-bandwidth factor F = 2(n-1)/n for all-reduce, (n-1)/n for all-gather,
  reduce-scatter and all-to-all on the full array S, 1 for send/recv.
- D.2 (NCCL src/graph/tuning.cc): ring latency = base + (steps - inter_steps) * intra_step
  + inter_steps * inter_step, steps = 2(n-1) (all-reduce) or n-1 (AG/RS), inter_steps =
  2(nodes-1) or nodes-1.
- D.3: a flat ring over n ranks that crosses nodes uses the NICs of every member on a node
  in parallel, so its bus bandwidth is min(NVLink busbw, members-per-node x NIC busbw);
  all-to-all cannot aggregate NICs: its off-node bytes leave through each GPU's own NIC.
- B.2: NVLink SHARP (NVLS) all-reduce only for groups of at least `nvls_min_gpus`.
Rank order is Megatron's: tp innermost, then cp, then dp, then pp (outermost); EP is
carved from the dp x cp ranks next to tp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Fabric:
    """The link numbers the cost model needs, in SI units (built from a Cluster by hw.fabric)."""

    gpus_per_node: int  # GPUs sharing a host (and its NICs)
    scaleup_domain: int  # GPUs reachable over NVLink (72 for NVL72)
    intra_bytes_per_s: float  # NVLink per GPU, one direction
    intra_busbw_fraction: float  # ring collectives over NVLink
    intra_allreduce_busbw_fraction: float  # all-reduce with NVLS where allowed
    nvls_min_gpus: int
    intra_step_latency_s: float
    base_latency_s: float
    nic_bytes_per_s: float  # per GPU, one direction
    inter_busbw_fraction: float
    inter_alltoall_fraction: float
    inter_step_latency_s: float


@dataclass(frozen=True)
class GroupSpan:
    """Where the ranks of one process group sit: `per_node` members share an NVLink domain."""

    size: int
    per_node: int
    nodes: int


def group_span(size: int, stride: int, domain_gpus: int) -> GroupSpan:
    """Placement of a group of `size` ranks spaced `stride` apart over domains of `domain_gpus`."""
    if size <= 1:
        return GroupSpan(1, 1, 1)
    per_node = 1 if stride >= domain_gpus else max(1, min(size, domain_gpus // stride))
    return GroupSpan(size, per_node, math.ceil(size / per_node))


def ring_allreduce_time_s(payload_bytes: float, n: int, busbw_bytes_per_s: float,
                          latency_s: float) -> float:
    """Textbook ring all-reduce: 2(n-1)/n * S / busbw + latency (nccl-tests PERFORMANCE.md)."""
    if n <= 1 or payload_bytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * payload_bytes / busbw_bytes_per_s + latency_s


def ring_latency_s(steps: int, inter_steps: int, fabric: Fabric) -> float:
    """NCCL ring latency model (hardware.md D.2)."""
    return (fabric.base_latency_s + (steps - inter_steps) * fabric.intra_step_latency_s
            + inter_steps * fabric.inter_step_latency_s)


def ring_busbw_bytes_per_s(span: GroupSpan, fabric: Fabric, allreduce: bool) -> float:
    """Bus bandwidth of a ring collective over `span` (hardware.md D.1, D.3)."""
    intra_fraction = fabric.intra_busbw_fraction
    if allreduce and span.per_node >= fabric.nvls_min_gpus:
        intra_fraction = max(intra_fraction, fabric.intra_allreduce_busbw_fraction)
    intra = fabric.intra_bytes_per_s * intra_fraction
    if span.nodes <= 1:
        return intra
    nic = span.per_node * fabric.nic_bytes_per_s * fabric.inter_busbw_fraction
    return min(intra, nic) if span.per_node > 1 else nic


def allreduce_time_s(payload_bytes: float, span: GroupSpan, fabric: Fabric) -> float:
    """All-reduce of a per-rank buffer of `payload_bytes` over `span`."""
    n = span.size
    if n <= 1 or payload_bytes <= 0:
        return 0.0
    inter = 2 * (span.nodes - 1)
    return ring_allreduce_time_s(payload_bytes, n, ring_busbw_bytes_per_s(span, fabric, True),
                                 ring_latency_s(2 * (n - 1), inter, fabric))


def allgather_time_s(total_bytes: float, span: GroupSpan, fabric: Fabric) -> float:
    """All-gather (or reduce-scatter) of a full array of `total_bytes`: (n-1)/n * S / busbw + alpha."""
    n = span.size
    if n <= 1 or total_bytes <= 0:
        return 0.0
    busbw = ring_busbw_bytes_per_s(span, fabric, False)
    return (n - 1) / n * total_bytes / busbw + ring_latency_s(n - 1, span.nodes - 1, fabric)


reduce_scatter_time_s = allgather_time_s


def dp_allgather_time_s(dense_params: float, expert_params: float, bytes_per_param: float,
                        groups: Groups, fabric: Fabric) -> float:
    """All-gather (or reduce-scatter) of a rank's parameters, or their gradients, over the
    data-parallel groups: dense ones over dp x cp, expert ones over the expert-DP group."""
    return (allgather_time_s(dense_params * bytes_per_param, groups.dp, fabric)
            + allgather_time_s(expert_params * bytes_per_param, groups.expert_dp, fabric))


def alltoall_time_s(total_bytes: float, span: GroupSpan, fabric: Fabric) -> float:
    """All-to-all where each rank sends `total_bytes` spread evenly over the group.

    Bytes to members on the same NVLink domain go over NVLink, the rest through the GPU's
    own NIC; the two proceed in parallel (hardware.md D.3, [NCCLT-267]).
    """
    n = span.size
    if n <= 1 or total_bytes <= 0:
        return 0.0
    local = total_bytes * (span.per_node - 1) / n
    remote = total_bytes * (n - span.per_node) / n
    t_local = local / (fabric.intra_bytes_per_s * fabric.intra_busbw_fraction)
    t_remote = remote / (fabric.nic_bytes_per_s * fabric.inter_alltoall_fraction) if remote else 0.0
    latency = fabric.base_latency_s + (fabric.inter_step_latency_s if remote else
                                       fabric.intra_step_latency_s)
    return max(t_local, t_remote) + latency


def moe_dispatch_time_s(tokens: float, top_k: int, token_bytes: float, span: GroupSpan,
                        fabric: Fabric) -> float:
    """Token dispatch (or combine) of expert parallelism with node-aware forwarding.

    A token crosses the network once per remote node holding one of its top_k experts and
    is then forwarded over NVLink (DeepSeek-V3 report §3.2.2, DeepEP): with experts spread
    evenly over `nodes` domains a token reaches (nodes - 1) x (1 - (1 - 1/nodes)^k) remote
    ones on average. Inside a domain every routed copy moves over NVLink.
    """
    n = span.size
    if n <= 1 or tokens <= 0:
        return 0.0
    local_copies = tokens * top_k * (min(span.per_node, n) - 1) / n
    t_local = local_copies * token_bytes / (fabric.intra_bytes_per_s * fabric.intra_busbw_fraction)
    if span.nodes <= 1:
        return t_local + fabric.base_latency_s + fabric.intra_step_latency_s
    nodes = span.nodes
    remote_nodes = (nodes - 1) * (1 - (1 - 1 / nodes) ** top_k)
    remote = tokens * remote_nodes * token_bytes
    t_remote = remote / (fabric.nic_bytes_per_s * fabric.inter_alltoall_fraction)
    return max(t_local, t_remote) + fabric.base_latency_s + fabric.inter_step_latency_s


def p2p_time_s(payload_bytes: float, cross_node: bool, fabric: Fabric) -> float:
    """Send/recv of `payload_bytes` between two ranks (busbw factor 1)."""
    if payload_bytes <= 0:
        return 0.0
    if cross_node:
        bw = fabric.nic_bytes_per_s * fabric.inter_busbw_fraction
        return payload_bytes / bw + fabric.base_latency_s + fabric.inter_step_latency_s
    bw = fabric.intra_bytes_per_s * fabric.intra_busbw_fraction
    return payload_bytes / bw + fabric.base_latency_s + fabric.intra_step_latency_s


def expert_dp_degree(tp: int, cp: int, dp: int, ep: int) -> int:
    """Replicas of each routed expert: tp x cp x dp / ep with EP (expert-TP 1), else dp x cp."""
    if ep <= 1:
        return dp * cp
    return max(1, tp * cp * dp // ep)


@dataclass(frozen=True)
class Groups:
    """Process-group placement for one configuration (Megatron rank order tp, cp, dp, pp)."""

    tp: GroupSpan
    cp: GroupSpan
    dp: GroupSpan  # data-parallel group of dense parameters (dp x cp ranks hold replicas)
    ep: GroupSpan
    expert_dp: GroupSpan  # data-parallel group of expert parameters: tp*dp*cp/ep
    pp_cross_node: bool


def config_groups(tp: int, cp: int, dp: int, pp: int, ep: int, fabric: Fabric) -> Groups:
    """Spans of every group; NVLink reach is the scale-up domain (NVL72 > one tray)."""
    domain = fabric.scaleup_domain
    dp_cp = dp * cp
    return Groups(
        tp=group_span(tp, 1, domain),
        cp=group_span(cp, tp, domain),
        # gradients of dense parameters are reduced over dp x cp (CP ranks hold copies)
        dp=group_span(dp_cp, tp, domain) if cp > 1 else group_span(dp, tp * cp, domain),
        # expert-TP 1 (Megatron-Core with EP): expert ranks are laid out ep-innermost
        ep=group_span(ep, 1, domain),
        expert_dp=group_span(expert_dp_degree(tp, cp, dp, ep), ep, domain),
        pp_cross_node=tp * cp * dp >= domain,
    )


# Overlap is not free. NVIDIA/nccl#1428 (A100-SXM4-80GB GPT training, Nsight Systems): a GEMM
# overlapped with an NCCL all-gather took 2.08 ms vs 1.18 ms alone (attention 0.33 vs 0.18 ms);
# the collective competes for HBM bandwidth (NCCL stages data through device memory at 2-3x
# the link rate, sjeaugey, ibid.) and SMs. So while a collective runs under compute, the
# compute advances at 1.18/2.08 of its normal rate.
OVERLAP_COMPUTE_RATE = 1.18 / 2.08


def contended_exposed_s(total_s: float, exposed_s: float) -> float:
    """Step time a collective adds: its exposed part, plus the compute lost while its hidden
    part ran: a hidden second costs (1 - OVERLAP_COMPUTE_RATE) s of slower compute."""
    hidden = max(0.0, total_s - exposed_s)
    return exposed_s + hidden * (1.0 - OVERLAP_COMPUTE_RATE)
