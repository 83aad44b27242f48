"""Alpha-beta collectives on the two-level topology (hardware.md B.1, D.1-D.3)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import comm, hw, layers
from autoplan.paths import cost_models_dir
from autoplan.trace.tracer import graph_for_config


def test_ring_allreduce_textbook():
    # 2(n-1)/n * S / busbw + latency, nccl-tests PERFORMANCE.md
    t = comm.ring_allreduce_time_s(1e9, 8, 100e9, 50e-6)
    assert t == pytest.approx(2 * 7 / 8 * 1e9 / 100e9 + 50e-6)
    assert comm.ring_allreduce_time_s(1e9, 1, 100e9, 50e-6) == 0.0


def test_intra_node_allreduce_uses_gpu_numbers(h100_cluster):
    cluster = h100_cluster(8)
    fabric = hw.fabric(cluster)
    gpu = cluster.gpu
    span = comm.group_span(8, 1, fabric.scaleup_domain)
    assert (span.per_node, span.nodes) == (8, 1)
    # 8 >= nvls_min_gpus: the NVLS all-reduce fraction of the NVLink bandwidth
    busbw = gpu.intra_node_bandwidth_bytes_per_s * gpu.efficiency.intra_node_allreduce_busbw_fraction
    latency = gpu.collective_base_latency_s + 14 * gpu.intra_node_latency_s  # 2(n-1) ring steps
    expected = 2 * 7 / 8 * 1e9 / busbw + latency
    assert comm.allreduce_time_s(1e9, span, fabric) == pytest.approx(expected)


def test_group_placement_follows_rank_order():
    # tp innermost: a tp=8 group fills a node; the dp group of tp=8 has one rank per node
    assert comm.group_span(8, 1, 8) == comm.GroupSpan(8, 8, 1)
    assert comm.group_span(4, 8, 8) == comm.GroupSpan(4, 1, 4)
    assert comm.group_span(16, 2, 8) == comm.GroupSpan(16, 4, 4)


def test_crossing_nodes_is_slower_and_uses_the_nic(h100_cluster):
    fabric = hw.fabric(h100_cluster(64))
    inside = comm.allgather_time_s(1e9, comm.group_span(8, 1, 8), fabric)
    across = comm.allgather_time_s(1e9, comm.group_span(8, 8, 8), fabric)
    assert across > 3 * inside
    # one member per node: the ring runs at one NIC's achieved rate
    nic = fabric.nic_bytes_per_s * fabric.inter_busbw_fraction
    assert across == pytest.approx(7 / 8 * 1e9 / nic, rel=0.01)


def test_alltoall_cannot_aggregate_nics(h100_cluster):
    fabric = hw.fabric(h100_cluster(64))
    span = comm.group_span(16, 1, 8)  # two nodes
    t = comm.alltoall_time_s(1e9, span, fabric)
    remote = 1e9 * 8 / 16 / (fabric.nic_bytes_per_s * fabric.inter_alltoall_fraction)
    assert t >= remote
    assert t == pytest.approx(remote, rel=0.01)


def test_ep64_all_to_all_spans_eight_nodes_and_moves_each_routed_copy(h100_cluster):
    """EP 64 on 8-GPU nodes (DeepSeek-V3 report §3.2: EP64 over 8 nodes): the group crosses
    the network; on a 72-GPU NVLink domain it stays on NVLink. Bytes per dispatch are tokens x
    top_k x hidden x 2 (bf16): routed copies to the 7 node peers over NVLink, and one copy per
    remote node holding one of the token's experts over the NIC (node-aware forwarding)."""
    fabric = hw.fabric(h100_cluster(512))
    groups = comm.config_groups(tp=1, cp=1, dp=512, pp=1, ep=64, fabric=fabric)
    assert groups.ep == comm.GroupSpan(64, 8, 8)
    nvl72 = comm.config_groups(1, 1, 72, 1, 64, replace(fabric, scaleup_domain=72))
    assert nvl72.ep == comm.GroupSpan(64, 64, 1)
    tokens, top_k, token_bytes = 4096, 8, 7168 * 2
    local = tokens * top_k * 7 / 64 * token_bytes / (fabric.intra_bytes_per_s * fabric.intra_busbw_fraction)
    remote_nodes = 7 * (1 - (7 / 8) ** top_k)  # expected remote nodes among a token's 8 experts
    remote = tokens * remote_nodes * token_bytes / (fabric.nic_bytes_per_s * fabric.inter_alltoall_fraction)
    assert remote > local  # the NIC, not NVLink, bounds a cross-node dispatch
    expected = remote + fabric.base_latency_s + fabric.inter_step_latency_s
    assert comm.moe_dispatch_time_s(tokens, top_k, token_bytes, groups.ep, fabric) == pytest.approx(expected)


def test_ep_comm_is_dispatch_and_combine_in_forward_and_backward(h100_cluster):
    """Four all-to-alls per micro-batch (GShard §2.2: dispatch + combine, each again in
    backward), six when a recomputation replays the forward's two."""
    raw = json.loads((cost_models_dir() / "models" / "tiny-moe.json").read_text())
    graph = graph_for_config({k: v for k, v in raw.items() if not k.startswith("_")}, 1, 128,
                             probe_runtime=False)
    block = next(b for b in graph.blocks if b.experts)
    fabric = hw.fabric(h100_cluster(32))
    config = ParallelConfig(global_batch=32, seq_len=128, dp=32, ep=4, micro_batch=2)
    groups = comm.config_groups(1, 1, 32, 1, 4, fabric)
    one = comm.moe_dispatch_time_s(2 * 128, block.top_k, block.hidden * 2, groups.ep, fabric)
    assert one > 0
    assert layers.ep_comm_s(graph, block, config, fabric, groups, "none") == pytest.approx(4 * one)
    assert layers.ep_comm_s(graph, block, config, fabric, groups, "full") == pytest.approx(6 * one)
    # selective: Megatron's reruns the attention core only; autoplan's "op" policy saves the
    # matmul outputs, so the all-to-alls between them run again (as `autoplan check` logs)
    assert layers.ep_comm_s(graph, block, config, fabric, groups, "selective") == pytest.approx(4 * one)
    assert layers.ep_comm_s(graph, block, config, fabric, groups, "selective",
                            selective_policy="op") == pytest.approx(6 * one)
    # torch.autocast from fp32 module weights (ZeRO-0/1 in autoplan's runtime): the dispatch and
    # its gradient move the fp32 residual stream, the combine and its gradient 16-bit outputs
    fp32 = comm.moe_dispatch_time_s(2 * 128, block.top_k, block.hidden * 4, groups.ep, fabric)
    assert fp32 > one
    assert layers.ep_comm_s(graph, block, config, fabric, groups, "none", fp32_module_weights=True) == \
        pytest.approx(2 * (fp32 + one))
