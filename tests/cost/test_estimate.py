"""estimate(): consistency with layer/stage costs, MFU accounting, bad input, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import Runtime, estimate, layer_cost, partition, stage_cost, step_time_s
from autoplan.errors import UserError


def _config(**kw):
    base = dict(global_batch=16, seq_len=1024, dp=2, tp=2, pp=2, micro_batch=1)
    return ParallelConfig(**{**base, **kw})


def test_estimate_equals_sum_of_stage_costs(make_gpt_graph, h100_cluster):
    graph = make_gpt_graph(layers=8, seq=1024)
    config = _config(recompute="selective")
    cluster = h100_cluster(8)
    est = estimate(graph, config, cluster)
    stages = [stage_cost(graph, config, cluster, i, layers) for i, layers in enumerate(partition(graph, config))]
    step = step_time_s(stages, config, cluster, graph)
    assert est.step_time_s == step.step_s
    # a stage's time per micro-batch is the sum of its layers' (plus pipeline p2p)
    first = stages[0]
    assert first.fwd_s == pytest.approx(sum(c.fwd_s for c in first.layers))
    lc = layer_cost(graph.blocks[0], graph, config, cluster, "selective")
    assert lc.recompute_s > 0 and lc.activation_bytes > 0


def test_model_flops_per_token_is_6n_plus_attention(make_gpt_graph, h100_cluster):
    # MFU counts 3 x forward FLOPs: 6 x matmul params + 12 l h s (non-causal attention, x3)
    layers, h, s, v = 4, 1024, 1024, 32000
    graph = make_gpt_graph(layers=layers, hidden=h, seq=s, vocab=v)
    est = estimate(graph, _config(global_batch=8, dp=8, tp=1, pp=1), h100_cluster(8))
    matmul = layers * 12 * h * h + h * v
    assert est.model_flops_per_token == pytest.approx(6 * matmul + 12 * layers * h * s, rel=1e-6)
    assert est.hfu == pytest.approx(est.mfu)  # no recomputation


def test_full_recompute_costs_one_more_forward(make_gpt_graph, h100_cluster):
    graph = make_gpt_graph(layers=4, seq=1024)
    cluster = h100_cluster(8)
    config = _config(global_batch=8, dp=8, tp=1, pp=1)
    lc_none = layer_cost(graph.blocks[0], graph, config, cluster, "none")
    lc_full = layer_cost(graph.blocks[0], graph, config, cluster, "full")
    assert lc_full.recompute_s == pytest.approx(lc_none.fwd_s)
    assert lc_full.bwd_s == pytest.approx(2 * lc_none.fwd_s, rel=0.3)  # 2x GEMMs, 2.5x attention
    # below ZeRO-2 autoplan's runtime autocasts from fp32 weights: the residual stream, and so
    # the checkpointed block input, is fp32, twice the traced 16-bit input; with 16-bit module
    # weights it is the traced input itself
    assert lc_full.activation_bytes == 2 * graph.blocks[0].input_bytes
    sixteen_bit = layer_cost(graph.blocks[0], graph, config, cluster, "full",
                             runtime=Runtime(fp32_module_weights=False))
    assert sixteen_bit.activation_bytes == graph.blocks[0].input_bytes


def test_zero_stages_shrink_memory(make_gpt_graph, h100_cluster):
    graph = make_gpt_graph(layers=8, hidden=2048, seq=1024)
    cluster = h100_cluster(8)
    # the ZeRO paper's layout (16-bit module weights, fp32 master in the optimizer)
    paper = Runtime(fp32_module_weights=False)
    mem = [estimate(graph, _config(global_batch=8, dp=8, tp=1, pp=1, zero_stage=z), cluster,
                    runtime=paper).memory_breakdown_gib for z in range(4)]
    assert mem[1]["optimizer"] == pytest.approx(mem[0]["optimizer"] / 8)
    assert mem[2]["gradients"] == pytest.approx(mem[0]["gradients"] / 8)
    assert mem[3]["parameters"] == pytest.approx(mem[0]["parameters"] / 8)
    # autoplan's runtime (fp32 module weights under autocast below ZeRO-2): same 16 B without
    # ZeRO, but ZeRO-1 shards only Adam's moments, so it keeps 4 B/param more than the paper
    ours = [estimate(graph, _config(global_batch=8, dp=8, tp=1, pp=1, zero_stage=z), cluster)
            .memory_breakdown_gib for z in range(4)]
    states = ("parameters", "gradients", "optimizer")
    assert sum(ours[0][k] for k in states) == pytest.approx(sum(mem[0][k] for k in states))
    params_gib = mem[0]["parameters"] / 2  # 16-bit weights: 2 B per parameter
    assert sum(ours[1][k] for k in states) - sum(mem[1][k] for k in states) == \
        pytest.approx(params_gib * (4 - 4 / 8))
    # FSDP2 keeps fp32 shards with fp32 gradient shards: ZeRO-3 holds the paper's 16/dp B in
    # all; ZeRO-2 holds 2 B/param more than the paper's 2 + 14/dp (fp32, not 16-bit, sharded
    # gradients: 4/dp, not 2/dp)
    assert sum(ours[3][k] for k in states) == pytest.approx(sum(mem[3][k] for k in states))
    assert ours[3]["gradients"] == pytest.approx(2 * mem[3]["gradients"])
    assert sum(ours[2][k] for k in states) - sum(mem[2][k] for k in states) == \
        pytest.approx(params_gib * 2 / 8)


def test_infeasible_when_memory_exceeds_the_gpu(make_gpt_graph, h100_cluster):
    graph = make_gpt_graph(layers=48, hidden=8192, heads=64, seq=4096)
    est = estimate(graph, ParallelConfig(global_batch=8, seq_len=4096, dp=8), h100_cluster(8))
    assert not est.feasible and "GiB" in est.reason


@pytest.mark.parametrize("changes, words", [
    (dict(dp=3), "product"),
    (dict(tp=3, dp=1, pp=1), "heads"),
    (dict(ep=2), "experts"),
    (dict(micro_batch=3), "micro-batch"),
    (dict(vpp=2), "interleaved"),
    (dict(pp=16, dp=1, tp=1), "stages"),
])
def test_inconsistent_config_is_a_user_error(make_gpt_graph, h100_cluster, changes, words):
    graph = make_gpt_graph(layers=8, heads=16, seq=1024)
    with pytest.raises(UserError, match=words):
        estimate(graph, _config(**changes), h100_cluster(8))


def test_fp8_on_a100_is_a_user_error(make_gpt_graph):
    from autoplan.hardware import load_gpu, make_cluster

    graph = make_gpt_graph(layers=4, seq=1024)
    with pytest.raises(UserError, match="fp8"):
        estimate(graph, _config(precision="fp8"), make_cluster(load_gpu("a100"), 8))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_json_has_issue_keys():
    out = _cli("estimate", "tiny-gpt", "--gpu", "h100", "--gpus", "8", "--tp", "2",
               "--global-batch", "16", "--micro-batch", "2", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for key in ("feasible", "reason", "step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu",
                "hfu", "tflops_per_gpu", "bubble_fraction", "memory_gib_per_gpu",
                "memory_breakdown_gib", "time_breakdown_s", "comm_breakdown_s"):
        assert key in data
    assert set(data["memory_breakdown_gib"]) == {"parameters", "gradients", "optimizer",
                                                 "activations", "buffers", "temporaries", "overhead"}
    assert set(data["time_breakdown_s"]) == {"compute", "recompute", "exposed_comm", "bubble"}  # no offload
    assert data["config"]["dp"] == 4  # omitted dp = N / (tp x pp x cp)


@pytest.mark.parametrize("args, words", [
    (("--gpu", "h999", "--gpus", "8"), "Known GPUs"),
    (("--gpu", "h100", "--gpus", "8", "--tp", "3"), "divide"),
    (("--gpu", "a100", "--gpus", "8", "--precision", "fp8"), "fp8"),
])
def test_cli_bad_input_exits_2(args, words):
    out = _cli("estimate", "tiny-gpt", *args, "--global-batch", "16")
    assert out.returncode == 2
    assert words in out.stderr and "Traceback" not in out.stderr


def test_a_tied_embedding_under_a_pipeline_adds_its_gradients_all_reduce_to_the_step(make_gpt_graph, h100_cluster):
    # the textbook graph's head is tied: the first and the last stage all-reduce their copies'
    # gradients after the backward (exposed, once a step); an untied head adds nothing
    from dataclasses import replace

    from autoplan.cost import comm, hw
    from autoplan.cost.volume import tied_grad_bytes

    graph = make_gpt_graph(layers=8, seq=1024)
    untied = replace(graph, segments=[graph.pre, *graph.blocks,
                                      replace(graph.post, parameters=graph.post.parameters + graph.vocab * 1024)])
    cluster = h100_cluster(16)
    config = _config(dp=2, tp=2, pp=4)
    tied_est, untied_est = estimate(graph, config, cluster), estimate(untied, config, cluster)
    # pp ranks 0 and 3: 3 x tp x dp = 12 ranks apart, across the 8-GPU NVLink domain
    span = comm.group_span(2, 12, 8)
    expected = comm.allreduce_time_s(tied_grad_bytes(graph, config), span, hw.fabric(cluster))
    assert tied_grad_bytes(graph, config) == graph.vocab * 1024 * 4 / 2
    assert tied_est.comm_breakdown_s["tied"] == pytest.approx(expected) and expected > 0
    assert "tied" not in untied_est.comm_breakdown_s
    assert "tied" not in estimate(graph, _config(dp=8, tp=2, pp=1), cluster).comm_breakdown_s


def test_the_float8_all_gather_moves_a_byte_per_block_weight(make_gpt_graph, h100_cluster):
    """torchao's FSDP float8 all-gather: a block's weights go in float8 (1 byte, not bf16's 2);
    the gradients' fp32 reduce-scatter and the embedding's 16-bit gather are unchanged."""
    from autoplan.cost import memory, volume

    graph = make_gpt_graph(layers=4, hidden=1024, seq=1024)
    cluster = h100_cluster(8)
    plain = _config(global_batch=8, dp=8, tp=1, pp=1, zero_stage=3, precision="fp8")
    float8 = plain.with_(float8_all_gather=True)
    block = graph.blocks[0]
    gathers = [next(t for t in volume.zero3_traffic(memory.BlockParams(1e6, 0.0), block, c)
                    if t.kind == "all_gather") for c in (plain, float8)]
    assert gathers[1].bytes == gathers[0].bytes / 2 and gathers[1].dtype == "float8_e4m3fn"
    assert memory.fsdp_gather_bytes_per_param(float8, "pre") == 2
    costs = [layer_cost(block, graph, c, cluster).comm_total_s["zero3"] for c in (plain, float8)]
    # AG forward + AG backward (2 B/param, then 1) + RS of fp32 gradients (4 B/param): the
    # bandwidth terms go from 8 to 6 units; each collective's latency does not shrink
    assert (2 * 1 + 4) / (2 * 2 + 4) < costs[1] / costs[0] < 1
