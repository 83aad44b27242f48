"""Alpha-beta collectives on the two-level topology (hardware.md B.1, D.1-D.3)."""

from __future__ import annotations

import pytest

from autoplan.cost import comm, hw


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
