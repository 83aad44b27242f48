"""The cost model's collective volume (cost/volume.py): which window a collective falls in,
what ring attention sends."""

from __future__ import annotations

from autoplan.config import ParallelConfig
from autoplan.cost.sac import OP_SAC
from dataclasses import replace

from autoplan.cost.layers import DEFAULT_RUNTIME, Runtime
from autoplan.cost.stages import partition
from autoplan.cost.volume import (END, FIRST, MICROBATCH, Traffic, by_kind, cp_hop_bytes, cp_hops, cp_traffic,
                                  rank_traffic, tp_forward_reruns)
from autoplan.trace.graph import SideValue


def test_a_once_a_step_gather_is_in_the_last_micro_batch_only_when_it_is_the_first():
    # ZeRO-2 gathers its weights with the first micro-batch and keeps them to the last
    # backward; the dry run measures the last micro-batch and the step's end
    traffic = [Traffic("reduce_scatter", "float32", 400, MICROBATCH),
               Traffic("all_gather", "bfloat16", 200, FIRST),
               Traffic("all_reduce", "float32", 10, END)]
    assert by_kind(traffic, 1, "last micro-batch") == {("reduce_scatter", "float32"): 400,
                                                       ("all_gather", "bfloat16"): 200,
                                                       ("all_reduce", "float32"): 10}
    assert by_kind(traffic, 4, "last micro-batch") == {("reduce_scatter", "float32"): 400,
                                                       ("all_reduce", "float32"): 10}
    assert by_kind(traffic, 4) == {("reduce_scatter", "float32"): 1600,
                                   ("all_gather", "bfloat16"): 200, ("all_reduce", "float32"): 10}


def _cp_config(cp: int = 4, precision: str = "bf16") -> ParallelConfig:
    return ParallelConfig(global_batch=8, seq_len=1024, dp=2, cp=cp, micro_batch=1, precision=precision)


def test_ring_attention_sends_kv_in_16_bits_and_the_gradients_in_fp32(make_gpt_graph):
    # one micro-batch's K/V chunk on a cp-4 rank: 2 x 256 tokens x 1024 hidden x 2 bytes
    graph = make_gpt_graph(seq=1024)
    block = graph.blocks[0]
    chunk = 2 * 256 * 1024 * 2
    assert cp_hop_bytes(graph, block, _cp_config()) == chunk
    # autoplan's runtime: K/V 3 hops forward, 3 in backward; fp32 gradients 3 hops home
    traffic = by_kind(cp_traffic(graph, block, _cp_config()), 1)
    assert traffic == {("send", "bfloat16"): 6 * chunk, ("recv", "bfloat16"): 6 * chunk,
                       ("send", "float32"): 3 * 2 * chunk, ("recv", "float32"): 3 * 2 * chunk}
    # recomputation runs the forward ring again: full, and selective under the op policy
    # (the ring is no aten op it can keep); torchtitan's op SAC keeps the SDPA op, ring and all
    for recompute, policy, forward in (("full", "op", 6), ("selective", "op", 6),
                                       ("selective", "attention_core", 6), ("selective", OP_SAC, 3)):
        assert cp_hops(4, recompute, policy)[0] == forward, (recompute, policy)
    # torch's ring starts the accumulators at their owner (cp hops); Transformer Engine sends
    # them in K/V's dtype, so all Megatron's ring is 16-bit, 3 (cp - 1) hops
    assert cp_hops(4, grad_ring="fp32-home") == (3, 3, 4)
    megatron = by_kind(cp_traffic(graph, block, _cp_config(), grad_ring="kv-dtype"), 1)
    assert megatron == {("send", "bfloat16"): 9 * chunk, ("recv", "bfloat16"): 9 * chunk}
    # an fp32 run sends everything in fp32: K/V and gradients together
    fp32 = by_kind(cp_traffic(graph, block, _cp_config(precision="fp32")), 1)
    assert fp32 == {("send", "float32"): 9 * 2 * chunk, ("recv", "float32"): 9 * 2 * chunk}


def test_a_recomputation_reruns_the_tp_collectives_its_checkpoint_needs():
    # (input all-gathers, output reductions) of a layer's forward run again. torch's
    # non-reentrant checkpoint (autoplan's runtime, torchtitan) stops after the attention's
    # output reduction, which the MLP's saved input derives from; the MLP's feeds only the
    # residual sum. autoplan's selective policy saves no collective's output, so it reruns
    # as full does (`autoplan check`: tests/commands/test_check.py)
    for recompute in ("full", "selective"):
        assert tp_forward_reruns(recompute, True) == (2, 1)
        assert tp_forward_reruns(recompute, False) == (0, 1)  # no forward input collective
    assert tp_forward_reruns("none", True) == (0, 0)
    # Megatron's reentrant checkpoint reruns the whole forward; its selective recomputation
    # reruns the core attention only, which holds no TP collective
    assert tp_forward_reruns("full", True, "attention_core", checkpoint_early_stop=False) == (2, 2)
    assert tp_forward_reruns("selective", True, "attention_core", checkpoint_early_stop=False) == (0, 0)
    # torchtitan's op SAC saves the reduce-scatters' outputs, not the all-gathers' or an all-reduce's
    assert tp_forward_reruns("selective", True, OP_SAC) == (2, 0)
    assert tp_forward_reruns("selective", False, OP_SAC) == (0, 1)


def test_pipeline_stages_hand_the_side_values_on_in_the_dtype_they_took_them_in(make_gpt_graph):
    # 4 layers over pp 2 x vpp 2, one per virtual stage: the cos/sin tables (traced at seq
    # 1024: 1024 x 32 fp32 each) cross every cut beside the hidden states, and no gradient
    # comes back. Stage 0 sends them fp32 (the model's buffers); a later stage passes them on
    # as it took them in: at ZeRO-2 FSDP's bf16 cast of its inputs, at ZeRO-0 fp32 still
    table = SideValue(elements=1024 * 32, dtype="float32", element_bytes=4, requires_grad=False,
                      batch_power=0, seq_power=1)
    graph = replace(make_gpt_graph(layers=4, seq=1024), pipeline_side_values=[(table, table)] * 3)
    fp32 = 2 * 1024 * 32 * 4
    for zero, later in ((2, ("bfloat16", fp32 // 2)), (0, ("float32", fp32))):
        config = ParallelConfig(global_batch=8, seq_len=1024, dp=2, pp=2, vpp=2, micro_batch=2,
                                zero_stage=zero, schedule="interleaved-1f1b")
        stream = "bfloat16" if zero == 2 else "float32"
        hidden = 2 * 1024 * 1024 * (2 if zero == 2 else 4)
        with_sides = [by_kind(rank_traffic(graph, config, partition(graph, config), rank), 1)
                      for rank in (0, 1)]
        alone = [by_kind(rank_traffic(graph, config, partition(graph, config), rank,
                                      Runtime(pp_hands_on_side_values=False)), 1) for rank in (0, 1)]
        extra = [{key: with_sides[r][key] - alone[r].get(key, 0) for key in with_sides[r]
                  if with_sides[r][key] != alone[r].get(key, 0)} for r in (0, 1)]
        # rank 0: stage 0 sends fp32, stage 2 receives from stage 1 and sends to stage 3
        expected0 = {("send", "float32"): fp32}
        expected0[("send", later[0])] = expected0.get(("send", later[0]), 0) + later[1]
        expected0[("recv", later[0])] = later[1]
        # rank 1: stage 1 receives fp32 and passes them on; stage 3 receives from stage 2
        expected1 = {("recv", "float32"): fp32}
        expected1[("recv", later[0])] = expected1.get(("recv", later[0]), 0) + later[1]
        expected1[("send", later[0])] = later[1]
        assert extra == [expected0, expected1], zero
        assert alone[0][("send", stream)] == 3 * hidden  # stage 0's, stage 2's and its gradient
    # one micro-batch's tables at cp 2: half the sequence on a rank, whatever the micro-batch
    cp = ParallelConfig(global_batch=8, seq_len=1024, dp=2, cp=2, pp=2, micro_batch=4)
    sent = by_kind(rank_traffic(graph, cp, partition(graph, cp), 0, DEFAULT_RUNTIME), 1)
    without = by_kind(rank_traffic(graph, cp, partition(graph, cp), 0, Runtime(pp_hands_on_side_values=False)), 1)
    assert sent[("send", "float32")] - without[("send", "float32")] == fp32 / 2


def test_the_first_and_last_stage_sum_a_tied_embeddings_gradient_once_a_step(make_gpt_graph):
    # the textbook graph's head is tied (post holds its norm alone): under pp 4 the first and
    # the last pipeline rank each all-reduce their fp32 copy's gradient, / tp, and at ZeRO-3
    # their FSDP shard of it, / dp; the ranks between them and an untied head issue none
    tied = make_gpt_graph(vocab=32000, hidden=1024)
    post = replace(tied.post, parameters=tied.post.parameters + 32000 * 1024)
    untied = replace(tied, segments=[tied.pre, *tied.blocks, post])
    for zero, shards in ((0, 2), (3, 4)):
        config = ParallelConfig(global_batch=8, seq_len=1024, dp=2, tp=2, pp=4, micro_batch=1, zero_stage=zero)
        def tie(graph, rank):
            return [t for t in rank_traffic(graph, config, partition(graph, config), rank)
                    if (t.kind, t.when, t.bytes) == ("all_reduce", END, 32000 * 1024 * 4 / shards)]
        assert [len(tie(tied, rank)) for rank in range(4)] == [1, 0, 0, 1], zero
        assert [len(tie(untied, rank)) for rank in range(4)] == [0, 0, 0, 0], zero
