"""CPU offload moves model states to host memory: the GPU keeps the working copies only, the
host the sharded fp32 states (FSDP2's CPUOffloadPolicy in autoplan/runtime/data_parallel.py),
and a node's host memory bounds what it can take."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import estimate
from autoplan.errors import UserError
from autoplan.hardware import load_gpu, make_cluster

GIB = 2**30
DP = 8
# fp32 weights + fp32 gradients + Adam's two fp32 moments: what a rank's shard holds per param
SHARDED_STATE_BYTES = 4 + 4 + 8


def _config(**kw) -> ParallelConfig:
    base = dict(global_batch=8, seq_len=1024, dp=DP, micro_batch=1, zero_stage=3, offload="both")
    return ParallelConfig(**{**base, **kw})


def _params(graph) -> float:
    """Parameters one rank holds at pp = tp = 1: every block copy, the embedding and the head."""
    return sum(b.parameters * len(b.paths) for b in (graph.pre, *graph.blocks, graph.post))


@pytest.mark.parametrize("zero", [2, 3])
def test_gpu_keeps_the_working_copies_and_the_host_the_sharded_states(make_gpt_graph, h100_cluster, zero):
    graph = make_gpt_graph(layers=4, seq=1024)
    cluster = h100_cluster(DP)
    off = estimate(graph, _config(zero_stage=zero), cluster)
    plain = estimate(graph, _config(zero_stage=zero, offload="none"), cluster)
    mem = {k: v * GIB for k, v in off.memory_breakdown_gib.items()}
    params = _params(graph)
    # ZeRO-2 keeps the gathered 16-bit weights from forward to backward; ZeRO-3 gathers them
    # per block into the buffers (2 blocks, the same with or without offload)
    assert mem["parameters"] == pytest.approx(2 * params if zero == 2 else 0.0, rel=1e-9)
    assert mem["gradients"] == 0.0 and mem["optimizer"] == 0.0
    assert off.memory_breakdown_gib["buffers"] == plain.memory_breakdown_gib["buffers"]
    host = off.host_memory_gib_per_gpu * GIB
    assert host == pytest.approx(SHARDED_STATE_BYTES * params / DP, rel=1e-9)
    assert off.host_memory_gib_per_node == pytest.approx(8 * off.host_memory_gib_per_gpu, rel=1e-9)
    # what left the GPU is what the host holds
    moved = sum(plain.memory_breakdown_gib[k] - off.memory_breakdown_gib[k]
                for k in ("parameters", "gradients", "optimizer"))
    assert moved * GIB == pytest.approx(host, rel=1e-9)
    assert plain.host_memory_gib_per_gpu == 0.0


def test_pipelined_fsdp_keeps_unsharded_gradients_and_gathered_weights_on_the_gpu(make_gpt_graph, h100_cluster):
    # torch.distributed.pipelining turns FSDP's gradient sync and reshard-after-backward off
    # until the last micro-batch: the fp32 accumulated gradients and the gathered 16-bit
    # weights are GPU tensors whether the shards live on the host or not
    graph = make_gpt_graph(layers=4, seq=1024)
    dp = 4
    est = estimate(graph, _config(dp=dp, pp=2), h100_cluster(8))
    for stage in est.per_stage:
        mem = stage["memory_breakdown_gib"]
        stage_params = mem["parameters"] * GIB / 2  # 16-bit gathered copy
        assert stage_params > 0
        assert mem["gradients"] * GIB == pytest.approx(4 * stage_params, rel=1e-9)
        assert mem["optimizer"] == 0.0
    worst = max(s["memory_breakdown_gib"]["parameters"] for s in est.per_stage) * GIB / 2
    assert est.host_memory_gib_per_gpu * GIB == pytest.approx(SHARDED_STATE_BYTES * worst / dp, rel=1e-9)


def test_host_memory_over_the_nodes_capacity_is_infeasible(make_gpt_graph):
    graph = make_gpt_graph(layers=4, seq=1024)
    h100 = load_gpu("h100")
    assert h100.host_memory_bytes == 2048 * GIB  # DGX H100: 2 TB ([BASEPOD])
    fits = estimate(graph, _config(), make_cluster(h100, DP))
    assert fits.feasible, fits.reason
    need = fits.host_memory_gib_per_node * GIB
    small = make_cluster(replace(h100, host_memory_bytes=need * 0.99), DP)
    over = estimate(graph, _config(), small)
    assert not over.feasible
    assert "host memory" in over.reason and "per node" in over.reason
    # without offload the host holds no model states and is not checked
    assert estimate(graph, _config(offload="none"), small).feasible


def test_parameter_offload_below_zero_2_is_refused(make_gpt_graph, h100_cluster):
    graph = make_gpt_graph(layers=4, seq=1024)
    with pytest.raises(UserError, match="ZeRO stage 2 or 3"):
        estimate(graph, _config(zero_stage=0), h100_cluster(DP))
