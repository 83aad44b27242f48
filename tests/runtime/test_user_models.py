"""In-process checks of how the runtime meets user models: what it calls them with, how it
reads their output, and which axes it refuses (with the reason the planner can show).
Their training parity on several ranks is in test_parity.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hf_models
from autoplan.errors import UserError
from autoplan.plan import Plan
from autoplan.runtime.context_parallel import context_parallel_supported
from autoplan.runtime.expert_parallel import expert_parallel_supported
from autoplan.runtime.model_io import attention_window, logits_of, model_call, without_causal_only_mask
from autoplan.runtime.mesh import build_mesh
from autoplan.runtime.parallelize import apply_plan, validate_plan
from autoplan.trace.fake_group import fake_process_group
from runtime_models import TinyEncoder, TinyGPT, plan_dict


def _meta(kind: str, **config):
    with torch.device("meta"):
        return hf_models.build(kind, **config)


class ListExpertsMoE(nn.Module):
    """A hand-written Mixtral-style layer: router + top-2 loop over an nn.ModuleList."""

    def __init__(self, dim: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x):
        weights, chosen = F.softmax(self.gate(x), -1).topk(2, -1)
        out = torch.zeros_like(x)
        for k in range(2):
            for e, expert in enumerate(self.experts):
                hit = chosen[..., k] == e
                out[hit] += weights[..., k][hit, None] * expert(x[hit])
        return out


class ExpertWeightReadingMoE(ListExpertsMoE):
    """A loop that reads an expert's weight besides calling it."""

    def forward(self, x):
        return x * self.experts[0].weight.mean()


def test_logits_of_every_output_convention():
    logits = torch.randn(2, 3, 5)
    hf_output = hf_models.output_with_logits(logits)
    assert logits_of(logits) is logits
    assert logits_of(hf_output) is logits
    assert logits_of({"logits": logits}) is logits
    assert logits_of((logits, torch.zeros(()))) is logits
    with pytest.raises(UserError, match="not logits"):
        logits_of({"loss": logits})


def test_hf_models_get_positions_and_a_mask_only_for_zigzag_positions():
    call = model_call(_meta("hf_llama"))
    ids = torch.zeros(2, 8, dtype=torch.long)
    contiguous = call.kwargs(ids, torch.arange(8))
    assert contiguous["position_ids"].tolist() == [list(range(8))]
    assert contiguous["use_cache"] is False and "attention_mask" not in contiguous
    zigzag = call.kwargs(ids, torch.tensor([0, 1, 2, 3, 12, 13, 14, 15]), zigzag=True)
    assert zigzag["position_ids"].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert torch.equal(zigzag["attention_mask"], torch.ones_like(ids))
    with torch.device("meta"):
        assert model_call(TinyGPT()).kwargs(ids, torch.arange(8)) == {}


def test_context_parallel_accepts_hf_sdpa_attention_only():
    llama = _meta("hf_llama")
    assert context_parallel_supported(llama.model.layers[0].self_attn) is None
    eager = _meta("hf_llama", attn_implementation="eager")
    assert "'eager'" in context_parallel_supported(eager.model.layers[0].self_attn)
    plan = Plan.from_dict(plan_dict("hf_llama", cp=2))
    with pytest.raises(UserError, match=r"model\.layers\.0\.self_attn.*'eager'"):
        validate_plan(eager, plan)
    # attention that is not causal (an encoder's) runs the ring without the causal mask
    bert = _meta("hf_bert")
    assert context_parallel_supported(bert.bert.encoder.layer[0].attention.self) is None


def test_context_parallel_takes_multihead_attention_called_without_weights():
    """nn.MultiheadAttention reaches SDPA (ring attention) only with need_weights=False, as
    nn.TransformerEncoderLayer calls it; a call asking for weights is refused with that reason."""
    from autoplan.runtime.context_parallel import _check_mha_call

    with torch.device("meta"):
        model = TinyEncoder()
    plan = Plan.from_dict(dict(plan_dict("encoder", cp=2), cp_modules=["encoder.layers.0.self_attn"],
                               cp_buffers={}))
    validate_plan(model, plan)
    x = torch.zeros(4, 1, 16)
    _check_mha_call((x, x, x, None, False), {})
    _check_mha_call((x, x, x), {"need_weights": False})
    with pytest.raises(UserError, match="need_weights=False"):
        _check_mha_call((x, x, x), {})


def test_expert_parallel_supports_fused_hf_experts_and_names_what_it_refuses():
    mixtral, qwen = _meta("hf_mixtral"), _meta("hf_qwen2moe")
    assert expert_parallel_supported(mixtral.model.layers[0].mlp) is None
    assert expert_parallel_supported(qwen.model.layers[0].mlp) is None
    assert expert_parallel_supported(ListExpertsMoE()) is None
    uneven = ListExpertsMoE()
    uneven.experts[3] = nn.Linear(16, 16, bias=False)
    assert "same names and shapes" in expert_parallel_supported(uneven)
    keyed = ListExpertsMoE()
    keyed.experts = nn.ModuleDict({"a": nn.Linear(16, 16)})
    assert "nn.ModuleDict" in expert_parallel_supported(keyed)
    assert "no `experts`" in expert_parallel_supported(mixtral.model.layers[0].self_attn)
    # GPT-OSS's layout (biases, (E, H, 2I) weights, [gate, up] interleaved): its own forward
    # runs each rank's experts
    assert expert_parallel_supported(_meta("hf_gpt_oss").model.layers[0].mlp) is None
    experts = mixtral.model.layers[0].mlp.experts
    experts.scale = nn.Parameter(torch.ones(()))  # a parameter not stacked by expert
    assert "stacked by expert" in expert_parallel_supported(mixtral.model.layers[0].mlp)


def test_ep_plan_on_a_module_list_moe_exits_with_the_module_and_reason():
    model = nn.Sequential(nn.Embedding(8, 16), ListExpertsMoE())
    model[1].experts[3] = nn.Linear(16, 16, bias=False)
    plan = Plan.from_dict(dict(plan_dict("llama", dp=2), ep=2, ep_modules=["1"]))
    with pytest.raises(UserError, match=r"'1' \(ListExpertsMoE\).*same names and shapes"):
        validate_plan(model, plan)


def _list_ep(model: nn.Module):
    """apply_plan's expert parallelism (dp=2, ep=2) on the current (fake) process group."""
    plan = Plan.from_dict(dict(plan_dict("llama", dp=2), ep=2, ep_modules=["1"]))
    validate_plan(model, plan)
    return apply_plan(model, plan, build_mesh(plan, "cpu"), data_parallel=False)


def test_module_list_ep_keeps_the_ranks_experts_under_their_names():
    model = nn.Sequential(nn.Embedding(8, 16), ListExpertsMoE())
    with fake_process_group(2, rank=1):
        par = _list_ep(model)
    experts = model[1].experts
    assert [type(e).__name__ for e in experts] == ["RemoteExpert"] * 2 + ["Linear"] * 2
    assert par.one_rank_experts == [experts[2], experts[3]] == par.expert_modules
    assert sorted(k for k in model.state_dict() if "experts" in k) == [
        "1.experts.2.bias", "1.experts.2.weight", "1.experts.3.bias", "1.experts.3.weight"]
    assert type(model[1]).forward is ListExpertsMoE.forward  # the class keeps the user's code


def test_module_list_ep_names_a_loop_that_reads_its_experts():
    model = nn.Sequential(nn.Embedding(8, 16), ExpertWeightReadingMoE())
    with fake_process_group(2):
        _list_ep(model)
        with pytest.raises(UserError, match=r"1's forward reads `weight` of expert 0"):
            model(torch.zeros(2, 3, dtype=torch.long))


def test_pp_plan_on_an_unsplittable_hf_model_exits_with_the_reason():
    plan = Plan.from_dict(plan_dict("hf_t5", pp=2))  # an encoder-decoder: no family of the shell split
    with pytest.raises(UserError, match=r"T5ForConditionalGeneration.*torch\.fx cannot trace"):
        validate_plan(_meta("hf_t5"), plan)


def test_only_the_mask_transformers_builds_for_fake_tensors_is_dropped():
    """The capability probe runs on fake tensors, where transformers materialises a causal
    mask that a real run does not pass; only that one may go (never a real mask)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    attention = _meta("hf_llama").model.layers[0].self_attn
    real = {"hidden_states": torch.zeros(1), "attention_mask": torch.zeros(1, 1, 4, 4)}
    assert without_causal_only_mask(attention, real) is real
    with FakeTensorMode() as mode:
        fake = {"attention_mask": mode.from_tensor(torch.ones(1, 1, 4, 4, dtype=torch.bool))}
        bias = {"attention_mask": mode.from_tensor(torch.zeros(1, 1, 4, 4))}
    assert without_causal_only_mask(attention, fake)["attention_mask"] is None
    # under SDPA transformers' masks are boolean: a float one is a bias the model adds (ALiBi)
    assert without_causal_only_mask(attention, bias) is bias
    # a bidirectional encoder's (BERT's) real run passes no mask either: all tokens attend
    bert_attention = _meta("hf_bert").bert.encoder.layer[0].attention.self
    assert without_causal_only_mask(bert_attention, fake)["attention_mask"] is None
    assert without_causal_only_mask(bert_attention, real) is real
    # a sliding window no longer than the mask's keys: the real run builds that mask too
    local, whole = _meta("hf_gemma3").model.layers  # windows 8 and none (hf_models)
    with FakeTensorMode() as mode:
        short = {"attention_mask": mode.from_tensor(torch.ones(1, 1, 4, 4, dtype=torch.bool))}
        long = {"attention_mask": mode.from_tensor(torch.ones(1, 1, 8, 8, dtype=torch.bool))}
    assert without_causal_only_mask(local.self_attn, short)["attention_mask"] is None
    assert without_causal_only_mask(local.self_attn, long) is long
    assert without_causal_only_mask(whole.self_attn, long)["attention_mask"] is None


def test_at_ring_attention_a_mask_standing_for_causality_goes_and_any_other_stays():
    """Where ring attention takes over (the length attended over known): a mask sized from a
    sequence-parallel shard, and the plain causal pattern a model that always builds its mask
    gets (Falcon's), go; padding, a bias (float: Falcon's ALiBi, fake or real) and any mask
    of an encoder stay, and ring attention refuses them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    attention = _meta("hf_llama").model.layers[0].self_attn
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None].expand(2, 1, 4, 4)
    padded = causal.clone()
    padded[0, :, :, 0] = False  # the first sample's first token is padding

    def dropped(module, mask, queries=4) -> bool:
        return without_causal_only_mask(module, {"attention_mask": mask}, queries)["attention_mask"] is None

    assert dropped(attention, causal)
    assert not dropped(attention, causal, queries=None)  # outside ring attention a real mask stays
    assert not dropped(attention, padded)
    edited = causal.clone()  # the verdict is kept for one mask object as long as it is unchanged
    assert dropped(attention, edited)
    edited[1, :, :, 0] = False
    assert not dropped(attention, edited)
    assert not dropped(attention, torch.zeros(2, 1, 4, 4).masked_fill(~causal, float("-inf")))
    assert dropped(attention, causal[:, :, :2])  # (2 x 4): sized from a shard of the queries
    bert_attention = _meta("hf_bert").bert.encoder.layer[0].attention.self
    assert not dropped(bert_attention, causal)
    with FakeTensorMode() as mode:
        fake_bool, fake_bias = mode.from_tensor(causal), mode.from_tensor(torch.zeros(2, 1, 4, 4))
    assert dropped(attention, fake_bool) and not dropped(attention, fake_bias)
    assert not dropped(attention, fake_bias, queries=None)  # TP alone: a bias stays too


@pytest.mark.parametrize("kind,config,window", [
    ("hf_gemma3", {}, 8),  # on its local layers only (module attribute, None on the others)
    ("hf_mistral", {"sliding_window": 24}, 24),  # one window for every layer, read from the config
    ("hf_mistral", {"sliding_window": None}, 0),
    ("hf_qwen2", {"sliding_window": 16, "use_sliding_window": False}, 0),  # configured but unused
    ("hf_llama", {}, 0),
])
def test_attention_window_is_the_one_transformers_masks_by(kind, config, window):
    assert attention_window(_meta(kind, **config)) == window


def test_token_ids_are_drawn_below_what_the_head_predicts_over():
    # CPM-Ant's token embedding holds 32 x 32 prompt rows besides its 256-token vocabulary, and
    # its head predicts over the 256: ids drawn below the embedding's 1,280 rows were labels
    # the logits cannot score, and the job died at its first step (IndexError in cross_entropy)
    transformers = pytest.importorskip("transformers")
    from autoplan.runtime.data import SyntheticTokens
    from autoplan.runtime.model_io import vocab_embedding, vocab_size_of

    config = transformers.CpmAntConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                       dim_head=16, dim_ff=128, vocab_size=256, use_cache=False)
    torch.manual_seed(0)
    model = transformers.CpmAntForCausalLM(config)
    assert vocab_embedding(model).num_embeddings == 256 + 32 * 32
    vocab = vocab_size_of(model)
    assert vocab == 256
    tokens = SyntheticTokens(vocab, seed=0).global_batch(0, rows=64, seq_len=16)
    logits = logits_of(model(input_ids=tokens[:, :-1], use_cache=False))
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert logits.shape[-1] == vocab and torch.isfinite(loss)
