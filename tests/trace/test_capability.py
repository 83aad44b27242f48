"""The plan-time capability contract: autoplan.runtime applied on the fake process group
refuses the axes it cannot run, naming the module; the search and --fix obey it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from autoplan.models import build_model
from autoplan.models.sources import load_model
from autoplan.trace.tracer import trace_model

MODELS = Path(__file__).parent / "capability_models"
PLAN = ["--gpu", "cpu", "--gpus", "4", "--global-batch", "8", "--seq-len", "32", "--json"]


def _graph(name: str, builder: str = ""):
    """The traced model of a capability model file; `builder`: a build function of the file
    other than its build_model."""
    loaded = load_model(str(MODELS / name))
    model = loaded.module
    if builder:
        with torch.device("meta"):
            model = getattr(sys.modules[type(model).__module__], builder)()
    return trace_model(model, loaded.example_inputs(1, 32))


def test_expert_parallelism_of_a_hand_written_loop_moe_is_offered():
    graph = _graph("loop_moe.py")  # its nn.ModuleList `experts` (runtime/expert_list.py)
    assert [e["module"] for e in graph.expert_parallel] == ["layers.0.moe", "layers.1.moe"]
    assert graph.refused == {}  # ep and pp apply; tp/cp are not offered by the facts


def test_expert_parallelism_of_a_list_not_named_experts_is_refused_naming_the_module():
    graph = _graph("ffns_moe.py")
    assert [e["module"] for e in graph.expert_parallel] == ["layers.0.moe", "layers.1.moe"]
    assert "layers.0.moe" in graph.refused["ep"] and "SparseMoE" in graph.refused["ep"]
    assert "no `experts` submodule" in graph.refused["ep"]
    assert set(graph.refused) == {"ep"}


def test_tensor_parallelism_of_a_hard_coded_head_count_is_refused_naming_the_module():
    graph = _graph("fixed_heads.py")
    assert graph.tensor_parallel  # the data flow has legal pairs ...
    assert "layers.0.attn" in graph.refused["tp"]  # ... but the view needs all heads per rank
    # the cause, not torch's words ("shape ... is invalid for input of size ...")
    assert "reshape with -1" in graph.refused["tp"] and "invalid for input" not in graph.refused["tp"]
    assert set(graph.refused) == {"tp"}  # cp and pp run


def test_timm_attention_mixing_a_mask_made_in_forward_is_refused_with_that_cause():
    # its qkv gets colwise_qkv_global (the attention runs on DTensors); the plain mask it
    # builds in forward cannot meet the DTensor scores
    graph = _graph("timm_causal_mask.py")
    assert graph.tp_styles["layers.*"]["attn.qkv"] == "colwise_qkv_global:4,4"
    reason = graph.refused["tp"]
    assert "layers.0.attn" in reason and "plain tensor made in its forward" in reason


def test_tensor_parallelism_splitting_each_head_instead_of_the_heads_is_refused():
    # view(b, s, self.n, -1) runs on a column shard without an error, into all heads at half
    # their size: the probe checks each rank's attention runs its share of the heads
    graph = _graph("split_heads.py")
    reason = graph.refused["tp"]
    assert "layers.0.attn" in reason and "runs 4 heads of size 8 per rank at tp=2, not 2 of size 16" in reason
    # the cause (the model's head count on a rank's share) in the probe's words, not an exception's
    assert "view(batch, seq, -1, head_dim)" in reason and "LocalHeads" not in reason
    assert set(graph.refused) == {"tp"}


def test_kv_heads_replicated_past_tp_are_probed_on_their_own_code_path():
    # tp=2 shards the 2 K/V heads and runs; at tp=4 each rank computes one replicated K/V
    # head for one q head, which the model's own repeat ratio (2) gets wrong: only tp=4 is
    # refused, with the runtime's failure
    from autoplan.solve.space import tp_reason

    graph = _graph("fixed_kv_ratio.py")
    assert set(graph.refused) == {"tp_kv"} and "(probed at tp=4) layers.0.attn" in graph.refused["tp_kv"]
    assert tp_reason(graph, 2, 4) is None
    assert tp_reason(graph, 4, 4).startswith("autoplan's runtime cannot share the 2 kv heads of layers "
                                             "over tp=4 ranks: (probed at tp=4) layers.0.attn")


def test_an_encoder_gets_context_parallelism_and_the_cause_of_its_tp_refusal():
    graph = _graph("encoder_full_width.py")
    assert graph.context_parallel == ["blocks.0.attn", "blocks.1.attn"]
    assert "cp" not in graph.refused  # ring attention without causality ran on the fake group
    # its view(b, s, self.heads, -1) gets the rank's head count (an attribute named for
    # heads), and its reshape(b, s, d) to the full width then fails: the probe names that
    assert "blocks.0.attn" in graph.refused["tp"] and "reshape with -1" in graph.refused["tp"]


def test_reference_llama_passes_every_probe():
    config = dict(model_type="llama", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=256)
    with torch.device("meta"):
        model = build_model(config)
    graph = trace_model(model, (torch.zeros(1, 16, dtype=torch.long, device="meta"),))
    assert graph.refused == {}
    assert graph.capability_probe_s > 0


def test_search_never_picks_a_refused_axis(run_cli):
    code, out, err = run_cli("plan", str(MODELS / "ffns_moe.py"), *PLAN, "--fix", "dp=4", "--fix", "zero=3")
    assert code == 0, err
    assert json.loads(out)["plan"]["ep"] == 1


def test_fix_of_ep_on_a_loop_moe_plans_and_costs_it(run_cli):
    code, out, err = run_cli("plan", str(MODELS / "loop_moe.py"), *PLAN, "--fix", "ep=2")
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert plan["ep"] == 2 and plan["ep_modules"] == ["layers.0.moe", "layers.1.moe"]
    assert plan["estimate"]["comm_breakdown_s"]["ep"] > 0  # the all-to-all is costed


def test_fix_of_a_refused_axis_exits_2_naming_module_and_reason(run_cli):
    code, _, err = run_cli("plan", str(MODELS / "ffns_moe.py"), *PLAN, "--fix", "ep=2")
    err = " ".join(err.split())  # the CLI wraps lines
    assert code == 2
    assert "layers.0.moe" in err and "expert parallelism cannot shard" in err
    assert "no `experts` submodule" in err
    assert "Traceback" not in err
    code, _, err = run_cli("plan", str(MODELS / "fixed_heads.py"), *PLAN, "--fix", "tp=2")
    err = " ".join(err.split())
    assert code == 2 and "layers.0.attn" in err and "tensor parallelism" in err


def test_probing_context_parallel_leaves_sdpa_as_it_was():
    # The runtime's CP swaps F.scaled_dot_product_attention process-wide; the planner traces
    # more models in the same process (report, tests) and must keep seeing torch's own.
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    loaded = load_model("tiny-gpt")
    graph = trace_model(loaded.module, loaded.example_inputs(1, 64), name="tiny-gpt")
    assert graph.context_parallel and "cp" not in graph.refused  # the CP probe did run
    assert F.scaled_dot_product_attention is original


def test_hugging_face_llama_tensor_parallelism_passes_the_probe():
    # the runtime trains it (tests/runtime/test_parity.py hf_llama_dp2_tp2_zero3): the probe
    # must call it as the runtime does, with position_ids, or under SP the model derives
    # positions from its local sequence shard and fails where the job would not
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    import hf_models

    with torch.device("meta"):
        model = hf_models.build("hf_llama")
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    assert graph.tensor_parallel and "tp" not in graph.refused, graph.refused


@pytest.mark.parametrize("name, refused, buffers", [("neox_frac", "torch.arange over the 16 tokens", {}),
                                                    ("rope_fp32", None, {"freqs_cis": 0}),
                                                    ("moe_loop", None, {})])
def test_context_parallelism_is_refused_where_forward_numbers_the_local_shard(name, refused, buffers):
    # neox_frac's rotary takes torch.arange(x.shape[-2]): under CP that is the rank's shard,
    # and the 4-rank job trained with wrong losses (benchmarks/corpus_matrix.py). rope_fp32
    # (Llama reference) slices its rotary table buffer to the input's length with
    # Tensor.__getitem__, which the trace finds, so cp_buffers re-index it to each rank's
    # positions (its cp2 job trained 2e-4 off the one-rank losses while the trace missed
    # it). moe_loop has no positions and trains with parity, so it keeps CP
    from tests import corpus

    entry = corpus.ENTRIES[name]
    with torch.device("meta"):
        model = entry.build("tiny")
    graph = trace_model(model, entry.example_inputs("tiny", batch=1, seq=32))
    assert graph.context_parallel
    assert graph.cp_buffers == buffers
    if refused:
        assert refused in graph.refused["cp"], graph.refused
        assert "layers.0.attention" in graph.refused["cp"]
    else:
        assert "cp" not in graph.refused, graph.refused


def test_a_position_table_cut_to_the_shards_length_is_caught_where_no_slice_was_traced():
    # the probe's last line of defence when cp_buffers misses a table: a forward that cuts
    # a buffer to the rank's token count would give every rank the first shard's positions
    from autoplan.trace.capability import LocalPositions, _LocalPositionsGuard

    table = torch.arange(64.0).reshape(32, 2)
    with _LocalPositionsGuard(16, 32, {id(table): "rope"}):
        table[:8]  # another length: not the shard's
        with pytest.raises(LocalPositions, match="cuts the buffer rope to its first 16 rows"):
            table[:16]


def test_t5_tensor_parallelism_is_probed_on_the_blocks_the_copy_keeps():
    # T5's first block (relative position bias) is another class than the rest of its list,
    # so its styles are keyed by block path; the probe keeps two copies per class, and keys
    # of the blocks it drops refused TP as "the plan names module paths this model does
    # not have" instead of the runtime's own reason
    import pytest

    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=4,
                                   num_decoder_layers=4, num_heads=4)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(config)
    ids = torch.zeros(1, 32, dtype=torch.long, device="meta")
    graph = trace_model(model, (), example_kwargs={"input_ids": ids, "decoder_input_ids": ids.clone()})
    assert "encoder.block.3" in graph.tp_styles  # keyed per block path
    # the encoder's last norm feeds the decoder's cross-attention, which gathers a plain
    # shard; the decoder's is the model's last, before its head
    assert graph.tp_styles[""]["encoder.final_layer_norm"] == "sequence_parallel"
    assert graph.tp_styles[""]["decoder.final_layer_norm"] == "final_norm"
    # each rank takes its heads of the relative position bias; ring attention cannot add it
    assert "tp" not in graph.refused, graph.refused["tp"]
    assert graph.tp_styles["encoder.block.0"]["layer.0.SelfAttention.relative_attention_bias"] == "head_embedding"
    assert "relative position bias" in graph.refused["cp"], graph.refused["cp"]


def test_one_class_run_with_other_settings_is_probed_again():
    # the same T5 classes and parameters, attention by SDPA or written out ("eager"): the
    # eager one adds a mask made for the whole sequence to a rank's shard of the scores, so
    # it cannot take SP; probed in one process, the second must not get the first's verdict
    transformers = pytest.importorskip("transformers")
    ids = torch.zeros(1, 32, dtype=torch.long, device="meta")
    shardable = {}
    for attention in ("sdpa", "eager"):
        config = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                       num_heads=4, use_cache=False)
        config._attn_implementation = attention
        with torch.device("meta"):
            model = transformers.T5ForConditionalGeneration(config)
        graph = trace_model(model, (ids,), example_kwargs={"decoder_input_ids": ids.clone()})
        shardable[attention] = graph.sequence_shardable
    assert shardable == {"sdpa": True, "eager": False}


def test_context_parallel_refused_at_run_time_names_the_module(tmp_path):
    # ring attention refuses a masked SDPA when the forward calls it, in its own words;
    # the refusal names the module that called it
    source = (MODELS / "fixed_heads.py").read_text().replace(
        "F.scaled_dot_product_attention(q, k, v, is_causal=True)",
        "F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(s, s, dtype=torch.bool, device=x.device))")
    assert "attn_mask=" in source
    path = tmp_path / "masked.py"
    path.write_text(source)
    loaded = load_model(str(path))
    graph = trace_model(loaded.module, loaded.example_inputs(1, 32))
    assert graph.context_parallel
    assert "SDPA without attn_mask" in graph.refused["cp"]
    assert "layers.0.attn" in graph.refused["cp"], graph.refused["cp"]


def test_pipeline_probe_of_keyword_token_ids_calls_the_stage_positionally():
    # a model file's example_inputs may give {"input_ids": ...}; the pipeline's first stage
    # takes the ids positionally, as the job's schedule passes them: the probe refused PP
    # ("unexpected keyword argument 'input_ids'"). The probe cache keys on the call form,
    # so the positional trace of the same model is probed on its own.
    import pytest

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(1, 32, dtype=torch.long, device="meta")
    by_keyword = trace_model(model, {"input_ids": ids})
    assert "pp" not in by_keyword.refused, by_keyword.refused["pp"]
    assert "pp" not in trace_model(model, (ids,)).refused


def test_a_head_tied_to_the_embedding_is_offered_a_pipeline(tmp_path, run_cli):
    # a copy of the embedding on the first stage, of the head on the last, their gradients
    # summed (runtime/pipeline.py StageTie): the probe runs the pipeline and the search plans it
    config = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                  max_position_embeddings=256, tie_word_embeddings=True)
    with torch.device("meta"):
        model = build_model(config)
    assert model.lm_head.weight is model.embed_tokens.weight
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    assert "pp" not in graph.refused, graph.refused["pp"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = run_cli("plan", str(path), *PLAN, "--fix", "pp=2")
    assert code == 0, err
    assert json.loads(out)["plan"]["pp"] == 2


def test_bert_is_offered_tensor_and_context_parallelism():
    # positions and token types added whole to the token embedding, a post-norm residual,
    # and the bidirectional mask transformers materialises only on the probe's fake tensors
    # (a real run without padding passes none): each refused TP or CP where the job trains
    import pytest

    pytest.importorskip("transformers")
    from tests.runtime import hf_models

    with torch.device("meta"):
        model = hf_models.build("hf_bert")
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    assert graph.tensor_parallel and "tp" not in graph.refused, graph.refused
    assert "cp" not in graph.refused, graph.refused
    assert graph.tp_styles[""]["bert.embeddings.token_type_embeddings"] == "whole_embedding"


def test_roberta_numbers_its_own_positions_so_it_gets_no_position_ids_and_no_context_parallelism():
    # positions from padding_idx + 1, past padding tokens: position_ids = 0, 1, 2, ... would
    # shift them (the job's losses 3.0e-3 off the model's own from the first step)
    pytest.importorskip("transformers")
    from autoplan.runtime.model_io import model_call
    from tests.runtime import hf_models

    with torch.device("meta"):
        model = hf_models.build("hf_roberta_untied")
        bert = hf_models.build("hf_bert")
    ids = torch.zeros(1, 32, dtype=torch.long)
    assert "position_ids" not in model_call(model).kwargs(ids, torch.arange(32))
    assert "position_ids" in model_call(bert).kwargs(ids, torch.arange(32))  # BERT's are 0, 1, 2, ...
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    assert "numbers its tokens itself" in graph.refused["cp"]
    assert graph.tensor_parallel and "tp" not in graph.refused


@pytest.mark.parametrize("kind, block, style", [
    ("hf_falcon_alibi", "transformer.h.*", "head_inputs:4:attention_mask"),
    ("hf_mpt", "transformer.blocks.*", "head_inputs:4:position_bias"),
    # heads folded into the batch of baddbmm and bmm, (batch * heads, 1, keys)
    ("hf_bloom", "transformer.h.*", "head_inputs:4:alibi"),
])
def test_an_alibi_bias_of_every_head_is_handed_to_each_rank_as_its_heads(kind, block, style):
    # the model builds the bias whole and hands it to each attention: under TP a rank runs a
    # share of the heads, so its attention added every head's bias and failed at the first
    # step (Falcon: a (batch, heads, q, k) mask; MPT: (heads, 1, max_seq_len)); the attention
    # now takes its heads of the named input. Under SP the model sizes its mask from the shard
    pytest.importorskip("transformers")
    from tests.runtime import hf_models

    with torch.device("meta"):
        model = hf_models.build(kind)
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    assert "tp" not in graph.refused and "sp" in graph.refused, graph.refused
    attention = next(path for path, s in graph.tp_styles[block].items() if s.startswith("head_inputs"))
    assert graph.tp_styles[block][attention] == style


def test_a_rotary_model_hands_its_attention_no_tensor_of_every_head():
    pytest.importorskip("transformers")
    from tests.runtime import hf_models

    with torch.device("meta"):
        model = hf_models.build("hf_falcon_alibi", alibi=False)
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    assert "tp" not in graph.refused and "sp" not in graph.refused, graph.refused
    assert not any(s.startswith("head_inputs") for t in graph.tp_styles.values() for s in t.values())


def test_a_state_the_traced_forward_leaves_on_a_module_does_not_stop_the_probe():
    # RecurrentGemma keeps its recurrence's state in an attribute: after the trace it holds a
    # tensor autograd made, which copy.deepcopy refuses (plan ended in a traceback)
    transformers = pytest.importorskip("transformers")
    config = transformers.RecurrentGemmaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, lru_width=64, head_dim=16, use_cache=False)
    with torch.device("meta"):
        model = transformers.RecurrentGemmaForCausalLM(config)
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    assert "tp" not in graph.refused, graph.refused  # the probe ran its copy of the model
    # its recurrence's (heads, d, d) blocks are no experts: taken for a token-wise MoE, it would
    # run on a rank's share of the tokens under SP (its convolution refuses SP here anyway)
    assert graph.expert_parallel == [] and "ep" not in graph.refused
    assert not any("temporal_block" in path for styles in graph.tp_styles.values() for path in styles)
    assert "conv_1d" in graph.refused["sp"]


def test_a_token_mixer_outside_attention_refuses_cp_and_sp():
    # a running mean over the tokens on the residual stream: a rank holding a share of the
    # sequence would average its own tokens only, and nothing would fail
    graph = _graph("token_mixer.py")
    assert graph.context_parallel and graph.tensor_parallel
    assert "running total, cumsum" in graph.refused["cp"] and "use cp=1" in graph.refused["cp"]
    assert "outside the tensor-parallel regions" in graph.refused["sp"]
    assert "tp" not in graph.refused and not graph.sequence_shardable


@pytest.mark.parametrize("family,fields,what", [
    # a short causal convolution in every other layer (LFM2); a Mamba-2 mixer beside attention
    # (Granite-4.0-H: scan and convolution); MiniMax's lightning attention, written out with
    # matmuls: trained under CP each ran on a rank's tokens alone, the losses 6e-5 to 3e-3 off
    ("Lfm2", dict(layer_types=["conv", "full_attention"]), "a convolution over the sequence"),
    ("GraniteMoeHybrid", dict(layer_types=["mamba", "attention"], num_local_experts=4,
                              num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16),
     "a convolution over the sequence"),
    ("MiniMax", dict(layer_types=["linear_attention", "full_attention"], num_local_experts=4,
                     num_experts_per_tok=2), "an attention written out with matmuls"),
])
def test_hybrid_models_mixing_tokens_outside_attention_refuse_cp(family, fields, what):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{family}Config")(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, use_cache=False, **fields)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = getattr(transformers, f"{family}ForCausalLM")(config)
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    assert graph.context_parallel == ["model.layers.1.self_attn"]
    assert f"model.layers.0.{'self_attn' if family == 'MiniMax' else ''}" in graph.refused["cp"]
    assert what in graph.refused["cp"], graph.refused["cp"]


def test_a_known_failure_is_said_as_its_cause_without_torchs_words():
    from autoplan.trace.capability import known_failure

    reason = known_failure("shape '[2, 16, 4, 16]' is invalid for input of size 1024", "RuntimeError")
    assert reason.startswith("its forward reshapes to a size fixed in its code")
    assert "RuntimeError" not in reason and "invalid for input" not in reason
    assert known_failure("CUDA out of memory", "RuntimeError") is None  # unknown: quoted by the caller


def test_attention_written_out_with_matmuls_is_checked_for_its_share_of_the_heads():
    # no SDPA: q @ k^T and @ v on `view(b, s, self.n, -1)`, which at tp=2 runs all 4 heads at
    # half their size without an error; the probe checks its per-head matmuls as an SDPA's
    graph = _graph("written_out_heads.py")
    assert graph.segment("blocks").heads == 4
    reason = graph.refused["tp"]
    assert "blocks.0.attn" in reason and "runs 4 heads of size 8 per rank at tp=2, not 2 of size 16" in reason
    assert set(graph.refused) == {"tp"}


def test_attention_written_out_holding_its_head_count_is_split_by_heads():
    # the same attention holding its count as `n_head`: the runtime hands it the rank's
    # (tests/runtime/test_parity.py written_out_tp2_traced trains it)
    graph = _graph("written_out_heads.py", "build_head_counted")
    assert graph.tp_styles["blocks.*"]["attn.q"] == "colwise_heads:4,4"
    assert "tp" not in graph.refused


@pytest.mark.parametrize("builder", ["build_folded", "build_einsum"])
def test_attention_written_out_in_a_form_whose_heads_are_not_read_is_left_whole(builder):
    # torch.bmm on heads folded into the batch, or an einsum: each rank could run all `n`
    # heads at half their size without an error, so no block is split (tp is not offered)
    graph = _graph("written_out_heads.py", builder)
    assert graph.tensor_parallel == [] and graph.tp_styles == {}
    assert [(u["module"], "an einsum, or heads folded into the batch other than" in u["reason"])
            for u in graph.tp_unsplit] == [("attn", True)]


def test_heads_folded_into_the_batch_by_reshapes_are_read_and_checked_per_rank():
    # bmm on (batch * heads, seq, size), each operand one reshape of (batch, heads, seq,
    # size), as BLOOM: split by heads where the runtime hands the module the rank's count;
    # where the count is an attribute not named for heads each rank would run all heads at
    # half their size without an error, which the probe catches on the folded bmm
    counted = _graph("written_out_heads.py", "build_folded_as_bloom_counted")
    assert counted.tp_styles["blocks.*"]["attn.q"] == "colwise_heads:4,4"
    assert "tp" not in counted.refused, counted.refused
    graph = _graph("written_out_heads.py", "build_folded_as_bloom")
    assert "runs 4 heads of size 8 per rank at tp=2, not 2 of size 16" in graph.refused["tp"]
