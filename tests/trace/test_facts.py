"""Tensor-parallel pairs read off the data flow: exact pairs, and what is left unsplit and why."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.trace.tracer import trace_model

HIDDEN, HEADS, KV_HEADS, FFN = 64, 4, 2, 96


class PlainRMSNorm(nn.Module):
    """An RMSNorm written out in Python ops, as many repositories do (not an nn norm)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class GQAAttention(nn.Module):
    def __init__(self, manual: bool = False):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.q = nn.Linear(HIDDEN, HEADS * self.head_dim, bias=False)
        self.k = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.v = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.o = nn.Linear(HEADS * self.head_dim, HIDDEN, bias=False)
        self.manual = manual

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        if self.manual:
            scores = (q @ k.transpose(-2, -1)) / self.head_dim ** 0.5
            out = torch.softmax(scores, dim=-1) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, FFN, bias=False)
        self.w3 = nn.Linear(HIDDEN, FFN, bias=False)
        self.w2 = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PlainNormBlock(nn.Module):
    """Pre-norm block whose norms are Python ops: walking back from ffn.w1 through the norm and
    the residual add reaches attn.o, which is no pair (o -> w1 crashed a dp=2 tp=2 job)."""

    def __init__(self, manual: bool = False):
        super().__init__()
        self.attn_norm, self.ffn_norm = PlainRMSNorm(HIDDEN), PlainRMSNorm(HIDDEN)
        self.attn, self.ffn = GQAAttention(manual), SwiGLU()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class TimmAttention(nn.Module):
    """timm's ViT attention: one qkv Linear, reshaped to (3, b, heads, s, d) and unbound."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, c = x.shape
        qkv = self.qkv(x).reshape(b, s, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, c))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TimmBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn, self.mlp = TimmAttention(), Mlp()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MHABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.mlp = Mlp()

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class FusedGateUp(nn.Module):
    """Phi-3 style MLP: one Linear for gate and up, chunked in two."""

    def __init__(self):
        super().__init__()
        self.gate_up = nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class FusedGateUpBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn, self.mlp = GQAAttention(), FusedGateUp()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Stack(nn.Module):
    def __init__(self, block, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _trace(block):
    with torch.device("meta"):
        model = Stack(block)
    return trace_model(model, (torch.empty(2, 16, HIDDEN, device="meta"),))


def _pairs(graph) -> list[tuple[str, tuple[str, ...], str]]:
    return sorted((p["kind"], tuple(p["column"]), p["row"]) for p in graph.tensor_parallel)


def test_plain_norm_block_pairs_are_exactly_qkv_o_and_gate_up_down():
    graph = _trace(PlainNormBlock)
    assert _pairs(graph) == [("attention", ("attn.q", "attn.k", "attn.v"), "attn.o"),
                             ("mlp", ("ffn.w1", "ffn.w3"), "ffn.w2")]
    assert graph.tp_unsplit == []
    block = graph.blocks[0]
    assert (block.heads, block.kv_heads, block.ffn) == (HEADS, KV_HEADS, FFN)


def test_manual_attention_with_matmul_and_softmax_is_a_pair():
    graph = _trace(lambda: PlainNormBlock(manual=True))
    assert ("attention", ("attn.q", "attn.k", "attn.v"), "attn.o") in _pairs(graph)
    assert all(p["row"] != "ffn.w1" for p in graph.tensor_parallel)


def test_styles_are_stated_once_per_block_class():
    graph = _trace(PlainNormBlock)
    assert set(graph.tp_styles) == {"", "layers.*"}
    assert graph.tp_styles["layers.*"] == {
        "attn.q": "colwise", "attn.k": f"colwise_kv:{HEADS},{KV_HEADS}",
        "attn.v": f"colwise_kv:{HEADS},{KV_HEADS}", "attn.o": "rowwise",
        "attn": "prepare_input", "ffn.w1": "colwise", "ffn.w3": "colwise", "ffn.w2": "rowwise",
        "ffn": "prepare_input",
        # written out in plain ops, a norm by its class name (as the recorder counts HF's)
        "attn_norm": "sequence_parallel", "ffn_norm": "sequence_parallel"}


def test_timm_fused_qkv_is_split_per_rank_with_its_attention_on_dtensors():
    # the (..., 3, heads, head_dim) view makes the output [all q | all k | all v]; the
    # forward reads the full width from its input, so the runtime keeps the model's shapes
    graph = _trace(TimmBlock)
    assert graph.tp_unsplit == []
    assert ("attention", ("attn.qkv",), "attn.proj") in _pairs(graph)
    assert graph.tp_styles["layers.*"]["attn.qkv"] == f"colwise_qkv_global:{HEADS},{HEADS}"
    assert graph.blocks[0].kv_heads == HEADS


def test_multihead_attention_is_split_by_heads_as_one_module():
    graph = _trace(MHABlock)
    assert graph.tp_unsplit == []
    styles = graph.tp_styles["layers.*"]
    assert styles["attn"] == f"mha_heads:{HEADS},{HEADS}"
    assert styles["mlp.fc1"] == "colwise" and styles["mlp.fc2"] == "rowwise"
    block = graph.blocks[0]
    assert (block.heads, block.kv_heads) == (HEADS, HEADS)
    # its projections are GEMMs and only QK^T and AV attention: 4 * tokens * seq * hidden
    tokens, seq = block.gemm_shapes[0][0], graph.seq_len
    assert block.attention_flops == 4 * tokens * seq * HIDDEN
    assert "layers.0.attn" in graph.context_parallel


class KVDimBlock(MHABlock):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True, kdim=HIDDEN // 2, vdim=HIDDEN // 2)

    def forward(self, x):
        h = self.norm1(x)
        kv = h[..., : HIDDEN // 2]
        x = x + self.attn(h, kv, kv, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def test_multihead_attention_with_its_own_key_width_is_left_unsplit_with_its_reason():
    graph = _trace(KVDimBlock)
    assert graph.tensor_parallel == []
    reasons = {(u["block"], u["module"]): u["reason"] for u in graph.tp_unsplit}
    assert "kdim/vdim" in reasons[("layers", "attn")]


def test_fused_gate_up_is_split_per_rank_and_counts_one_ffn_half():
    graph = _trace(FusedGateUpBlock)
    assert graph.tp_unsplit == []
    assert ("mlp", ("mlp.gate_up",), "mlp.down") in _pairs(graph)
    assert graph.tp_styles["layers.*"]["mlp.gate_up"] == "colwise_gate_up"
    assert graph.blocks[0].ffn == FFN  # what tp must divide: the width of gate (and of up)


class HalvesByShapeGateUp(FusedGateUp):
    """A gate/up projection cut into unequal slices: not two halves the runtime can split."""

    def forward(self, x):
        h = self.gate_up(x)
        gate, up = h[..., :FFN - 8], h[..., FFN - 8:]
        return self.down(torch.cat([F.silu(gate) * up[..., :FFN - 8], up[..., FFN - 8:FFN]], -1))


def test_fused_gate_up_cut_unevenly_is_left_unsplit():
    graph = _trace(lambda: _with_mlp(FusedGateUpBlock(), HalvesByShapeGateUp()))
    assert graph.tensor_parallel == []
    reasons = {u["module"]: u["reason"] for u in graph.tp_unsplit}
    assert "fused projection" in reasons["mlp.gate_up"]


def _with_mlp(block: nn.Module, mlp: nn.Module) -> nn.Module:
    block.mlp = mlp
    return block


def test_moe_layer_of_a_block_class_runs_on_sequence_shards():
    from autoplan.models import build_model

    config = dict(model_type="mixtral", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                  num_local_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        model = build_model(config)
    graph = trace_model(model, (torch.zeros(1, 16, dtype=torch.long, device="meta"),))
    # without it a tp>1 job feeds the router a sequence-sharded DTensor and fails in step 1
    assert graph.tp_styles["layers.*"]["mlp"] == "moe"
    assert graph.tp_styles["layers.*"]["self_attn.o_proj"] == "rowwise"


ATTN = ("attention", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.o_proj")
SWIGLU = ("mlp", ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj")
T5_SELF = ("attention", ("layer.0.SelfAttention.q", "layer.0.SelfAttention.k", "layer.0.SelfAttention.v"),
           "layer.0.SelfAttention.o")
T5_CROSS = ("attention", ("layer.1.EncDecAttention.q", "layer.1.EncDecAttention.k",
                          "layer.1.EncDecAttention.v"), "layer.1.EncDecAttention.o")
# corpus model -> (exact TP pairs over all block classes, modules left unsplit with a reason)
CORPUS_PAIRS = {
    "llama": ({ATTN, SWIGLU}, set()),
    "gemma": ({ATTN, SWIGLU}, set()),  # one KV head (MQA)
    # its sliding-window KV cache slices the concatenated keys and values for nothing after
    "mistral": ({ATTN, SWIGLU}, set()),
    "mixtral": ({ATTN}, set()),  # fused 3-D experts: EP shards them, TP does not
    "qwen2_moe": ({ATTN}, set()),  # the MoE layer (shared expert too) runs whole on sequence shards
    "bert": ({("attention", ("attention.self.query", "attention.self.key", "attention.self.value"),
               "attention.output.dense"), ("mlp", ("intermediate.dense",), "output.dense")}, set()),
    "t5": ({T5_SELF, T5_CROSS, ("mlp", ("layer.1.DenseReluDense.wi",), "layer.1.DenseReluDense.wo"),
            ("mlp", ("layer.2.DenseReluDense.wi",), "layer.2.DenseReluDense.wo")}, set()),
    "moe_loop": ({("attention", ("attn.q", "attn.k", "attn.v"), "attn.o")}, set()),  # experts: EP
    # query_key_value viewed as (..., heads, 3 * head_dim): a row slice holds whole heads
    "gpt_neox": ({("attention", ("attention.query_key_value",), "attention.dense"),
                  ("mlp", ("mlp.dense_h_to_4h",), "mlp.dense_4h_to_h")}, set()),
    # one qkv_proj cut into [all q | all k | all v] and one gate_up_proj into [gate | up]:
    # each rank holds its share of every part (runtime/fused_projection.py)
    "phi3": ({("attention", ("self_attn.qkv_proj",), "self_attn.o_proj"),
              ("mlp", ("mlp.gate_up_proj",), "mlp.down_proj")}, set()),
    # transformers' Conv1D (a transposed linear); c_attn cut by width into [q | k | v]
    "gpt2": ({("attention", ("attn.c_attn",), "attn.c_proj"), ("mlp", ("mlp.c_fc",), "mlp.c_proj")}, set()),
    # timm's qkv viewed as (..., 3, heads, head_dim): colwise_qkv_global (runtime/global_attention.py)
    "vit_b16": ({("attention", ("attn.qkv",), "attn.proj"), ("mlp", ("mlp.fc1",), "mlp.fc2")}, set()),
    "swin_t": ({("attention", ("attn.qkv",), "attn.proj"), ("mlp", ("mlp.fc1",), "mlp.fc2")}, set()),
    # nn.MultiheadAttention: a pair by itself, split by heads (runtime/mha_parallel.py)
    "transformer_encoder": ({("attention", ("self_attn",), "self_attn"),
                             ("mlp", ("linear1",), "linear2")}, set()),
}


@pytest.mark.parametrize("name", sorted(CORPUS_PAIRS))
def test_corpus_models_have_exactly_the_expected_pairs(name):
    from tests import corpus

    entry = corpus.ENTRIES[name]
    with torch.device("meta"):
        model = entry.build("tiny")
    graph = trace_model(model, entry.example_inputs("tiny", batch=1, seq=32), probe_runtime=False)
    pairs, unsplit = CORPUS_PAIRS[name]
    assert {(p["kind"], tuple(p["column"]), p["row"]) for p in graph.tensor_parallel} == pairs
    assert {u["module"] for u in graph.tp_unsplit} == unsplit


# tiny corpus MoE models: (heads, kv_heads) their attention pair must divide
MOE_HEADS = {"mixtral": (4, 2), "qwen2_moe": (4, 4)}
MOE_BLOCK_STYLES = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise", "self_attn": "prepare_input",
    "input_layernorm": "sequence_parallel", "post_attention_layernorm": "sequence_parallel",
    "mlp": "moe"}


@pytest.mark.parametrize("name", sorted(MOE_HEADS))
def test_moe_models_given_positional_ids_get_the_attention_pair(name):
    # `autoplan plan hf:config.json` traces with the token ids as a positional argument. The
    # *ForCausalLM root states the expert count (for its load-balancing loss); taken for the
    # MoE layer, its decoder layers passed for experts and no linear was left to pair.
    from autoplan.trace.capability import probe_plans
    from tests import corpus

    with torch.device("meta"):
        model = corpus.ENTRIES[name].build("tiny")
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    heads, kv_heads = MOE_HEADS[name]
    assert [(p["kind"], tuple(p["column"]), p["row"], p["divides"]) for p in graph.tensor_parallel] \
        == [(*ATTN, {"heads": heads, "kv_heads": kv_heads})]
    # grouped K/V heads (fewer than q heads) name their counts: tp may exceed them
    kv_style = "colwise" if kv_heads == heads else f"colwise_kv:{heads},{kv_heads}"
    assert graph.tp_styles["model.layers.*"] == dict(
        MOE_BLOCK_STYLES, **{"self_attn.k_proj": kv_style, "self_attn.v_proj": kv_style})
    assert graph.tp_unsplit == []
    linears = [d["op"] for _, d in graph.graph.nodes(data=True) if ".self_attn." in d["op"].name
               and d["op"].target == "Linear"]
    assert linears and all(op.kind == "linear" for op in linears)
    # the runtime applied those styles at tp=2 on the fake process group
    assert "tp" in probe_plans(graph, 32, {"model.layers.0", "model.layers.1"}) and graph.refused == {}


def test_gpt2_conv1d_attention_is_split_per_rank_and_the_runtime_applies_it():
    # Conv1D holds its weight as (in, out); c_attn's output is cut by `split_size` into
    # [all q | all k | all v], so each rank takes its share of every part (fused_projection.py)
    from autoplan.trace.capability import probe_plans
    from tests import corpus

    with torch.device("meta"):
        model = corpus.ENTRIES["gpt2"].build("tiny")
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    heads = model.config.n_head
    styles = graph.tp_styles["transformer.h.*"]
    assert {k: styles[k] for k in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")} == {
        "attn.c_attn": f"colwise_qkv:{heads},{heads}", "attn.c_proj": "rowwise",
        "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}
    assert graph.tp_styles[""]["lm_head"] == "vocab_head" and graph.tp_unsplit == []
    # ln_f hands on the whole sequence's shape: GPT2Model's view(-1, seq, hidden) follows it
    assert graph.tp_styles[""]["transformer.ln_f"] == "final_norm"
    blocks = {f"transformer.h.{i}" for i in range(model.config.n_layer)}
    assert "tp" in probe_plans(graph, 32, blocks) and "tp" not in graph.refused
    # pipeline stages under TP + SP: GPT2Model's closing view(-1, seq, hidden) meets the first
    # stage's sequence shard, so the planner offers pp with tp no longer
    from autoplan.solve.space import pp_reason

    assert "reshape with -1" in graph.refused["pp_tp"] and "pp" not in graph.refused
    assert "tensor parallelism" in pp_reason(graph, 2, 1, tp=2) and pp_reason(graph, 2, 1) is None


def test_the_shared_expert_mlp_of_qwen2_moe_is_no_pair():
    # Its gate/up -> down data flow looks like a SwiGLU pair; inside the MoE layer, which the
    # runtime runs whole on each rank's sequence shard, a colwise gate would meet a
    # sequence-sharded input: the pair must not be offered.
    from tests import corpus

    with torch.device("meta"):
        model = corpus.ENTRIES["qwen2_moe"].build("tiny")
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    modules = {m for p in graph.tensor_parallel for m in (*p["column"], p["row"])}
    assert modules and not any(m.startswith("mlp.") for m in modules)
    assert not any(path.startswith("mlp.") for path in graph.tp_styles["model.layers.*"])


def _hf_meta(config_name: str, model_name: str, **fields):
    import transformers

    config = getattr(transformers, config_name)(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
        **fields)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return getattr(transformers, model_name)(config)


def test_per_head_q_k_norms_are_sharded_with_their_heads():
    # Qwen3: q_norm/k_norm over head_dim on (batch, seq, heads, head_dim) read one head each
    graph = trace_model(_hf_meta("Qwen3Config", "Qwen3ForCausalLM", head_dim=16),
                        (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    attention = [p for p in graph.tensor_parallel if p["kind"] == "attention"]
    assert [(tuple(p["column"]), p["row"], p["divides"]) for p in attention] == \
        [(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.o_proj",
          {"heads": 4, "kv_heads": 2})]
    styles = graph.tp_styles["model.layers.*"]
    assert styles["self_attn.q_norm"] == styles["self_attn.k_norm"] == "head_norm"
    assert styles["input_layernorm"] == "sequence_parallel" and graph.tp_unsplit == []
    assert graph.tp_styles[""]["model.norm"] == "final_norm"  # after the last block
    assert "tp" not in graph.refused  # the runtime applied them at tp=2 on the fake process group


def test_q_k_norms_after_the_head_transpose_and_a_window_mask_get_tp_without_sp():
    # Gemma-3: q_norm/k_norm on (batch, heads, seq, head_dim); local layers with a window of 8
    from dataclasses import replace

    from autoplan.solve.space import cp_reason, sequence_parallel

    model = _hf_meta("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention"])
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    styles = graph.tp_styles["model.layers.*"]
    assert styles["self_attn.q_norm"] == styles["self_attn.k_norm"] == "head_norm"
    assert graph.tp_unsplit == [] and "tp" not in graph.refused
    # the model builds the window mask from the length it sees: no sequence shard may see it
    assert graph.attention_window == 8 and not sequence_parallel(graph, 2)
    assert "sliding-window" in cp_reason(graph, 2, 1, 32, 8)
    shorter = replace(graph, seq_len=4)  # a sequence within the window: no mask is built
    assert sequence_parallel(shorter, 2) and cp_reason(shorter, 2, 1, 4, 8) is None


def test_a_head_major_qkv_viewed_by_the_modules_head_count_gets_the_ranks_count():
    # Persimmon: query_key_value viewed as (batch, seq, self.num_heads, 3, head_dim)
    import transformers

    config = transformers.PersimmonConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, vocab_size=256, pad_token_id=0)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.PersimmonForCausalLM(config)
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    styles = graph.tp_styles["model.layers.*"]
    assert styles["self_attn.query_key_value"] == "colwise_heads:4,4" and styles["self_attn.dense"] == "rowwise"
    assert styles["self_attn.q_layernorm"] == styles["self_attn.k_layernorm"] == "head_norm"
    assert graph.tp_unsplit == [] and "tp" not in graph.refused


def test_a_model_whose_code_cannot_take_a_sequence_shard_gets_tp_without_sp():
    # OPT flattens its tokens by the full width between attention and MLP: the probe runs TP
    # with SP, which fails, then without, which runs
    from autoplan.solve.space import sequence_parallel, tp_reason

    model = _hf_meta("OPTConfig", "OPTForCausalLM", ffn_dim=128, word_embed_proj_dim=64, pad_token_id=0,
                     dropout=0.0)
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    assert "tp" not in graph.refused and "with SP" in graph.refused["sp"]
    assert tp_reason(graph, 2, 4) is None and not sequence_parallel(graph, 2)


def test_a_transformer_at_a_short_sequence_has_no_sequence_loop():
    graph = trace_model(_hf_meta("Qwen3Config", "Qwen3ForCausalLM", head_dim=16),
                        (torch.zeros(1, 16, dtype=torch.long, device="meta"),))
    assert graph.sequence_loops == []


def test_q_k_norms_over_all_heads_are_sharded_with_their_statistic_summed():
    # OLMo2: q_norm/k_norm over the whole projection, before the view into heads
    graph = trace_model(_hf_meta("Olmo2Config", "Olmo2ForCausalLM"),
                        (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    attention = [p for p in graph.tensor_parallel if p["kind"] == "attention"]
    assert [(tuple(p["column"]), p["row"], p["divides"]) for p in attention] == \
        [(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.o_proj",
          {"heads": 4, "kv_heads": 2})]
    styles = graph.tp_styles["model.layers.*"]
    assert styles["self_attn.q_norm"] == styles["self_attn.k_norm"] == "sharded_rms_norm"
    assert styles["self_attn.k_proj"] == "colwise"  # no K/V head replication: a sum over all heads
    assert graph.tp_unsplit == [] and "tp" not in graph.refused  # applied on the fake group


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is an offset from 1."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def test_q_k_norms_over_all_heads_that_are_no_plain_rms_norm_are_left_unsplit():
    model = _hf_meta("Olmo2Config", "Olmo2ForCausalLM")
    for layer in model.model.layers:
        with torch.device("meta"):
            layer.self_attn.q_norm, layer.self_attn.k_norm = OffsetRMSNorm(64), OffsetRMSNorm(32)
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),), probe_runtime=False)
    assert not [p for p in graph.tensor_parallel if p["kind"] == "attention"]
    reasons = {u["module"]: u["reason"] for u in graph.tp_unsplit}
    assert set(reasons) == {"self_attn.q_norm", "self_attn.k_norm"}
    assert all("over all heads" in reason for reason in reasons.values())


def test_mla_attention_is_split_by_heads_after_its_down_projections():
    from autoplan.trace.tracer import graph_for_config

    config = dict(model_type="deepseek_v3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
                  kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=256,
                  max_position_embeddings=128)
    graph = graph_for_config(config, 1, 64)
    assert graph.tp_unsplit == [] and "tp" not in graph.refused  # applied on the fake group
    styles = graph.tp_styles["layers.0"]
    # every rank computes the down-projections (and the rotary key all heads share) whole
    assert {k for k, v in styles.items() if v == "replicated"} == {
        "self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm"}
    assert styles["self_attn.q_b_proj"] == styles["self_attn.kv_b_proj"] == "colwise_local"
    assert styles["self_attn.o_proj"] == "rowwise"
    attention = [p for p in graph.tensor_parallel if p["kind"] == "attention"]
    assert attention[0]["divides"]["heads"] == 4


MAMBA = dict(model_type="mamba", hidden_size=64, num_hidden_layers=2, vocab_size=256, state_size=8,
             expand=2, conv_kernel=4, time_step_rank=8)


@pytest.mark.parametrize("tied", [False, True])
def test_a_state_space_model_is_dense_and_pipelined_tied_or_not(tied):
    # Mamba's mixer holds a depthwise conv1d (channels x 1 x width, 3-D like stacked expert
    # weights): it is no MoE layer with 256 experts, and EP is not offered. transformers'
    # Mamba has no SDPA path: it is built with eager attention (it has no attention at all).
    from autoplan.models.hf import build_transformers_model

    with torch.device("meta"):
        model = build_transformers_model(dict(MAMBA, tie_word_embeddings=tied), "config.json")
    assert model.config._attn_implementation == "eager"
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    assert [b.kind for b in graph.blocks] == ["dense"] and graph.blocks[0].count == 2
    assert graph.expert_parallel == [] and "ep" not in graph.refused
    assert graph.context_parallel == []
    # the reference scan (no mamba-ssm kernels) loops over the tokens: said, not hidden
    assert [loop["module"] for loop in graph.sequence_loops] == ["backbone.layers.0.mixer"]
    assert graph.sequence_loops[0]["ops"] > 2 * 32
    # tied, the embedding on stage 0 is the head on the last one: a copy on each
    assert "pp" not in graph.refused, graph.refused.get("pp")


def test_a_stacked_parameter_with_a_width_one_side_is_no_expert_stack():
    from autoplan.trace.fallback import moe_facts

    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.n_experts = 8  # a routing-like attribute beside a depthwise kernel
            self.kernel = nn.Parameter(torch.zeros(8, 1, 4))
            self.conv = nn.Conv1d(8, 8, 4, groups=8)

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_experts, self.top_k = 8, 2
            self.w = nn.Parameter(torch.zeros(8, 16, 32))

    assert moe_facts(Mixer()) == (0, 0)
    assert moe_facts(Experts()) == (8, 2)


class LearnedActivation(nn.Module):
    """An activation with learned scalars (Apertus's xIELU): applied to a rank's columns, each
    rank's gradient of them is its columns' share of the sum."""

    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return F.silu(x) * F.softplus(self.alpha)


class LearnedActivationMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(HIDDEN, FFN), LearnedActivation(), nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class InlineScaleMLP(LearnedActivationMLP):
    """The scalar held by the module that also holds the linears: it cannot be computed whole
    apart from them."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.down(F.silu(self.up(x)) * self.scale)


class MLPBlock(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.norm, self.attn, self.mlp = PlainRMSNorm(HIDDEN), GQAAttention(), mlp()

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp(self.norm(x))


@pytest.mark.parametrize("model", ["fx", "hf"])
def test_a_parameter_read_between_column_and_row_is_computed_whole_and_summed(model):
    if model == "fx":  # a plain-torch block (fx), the parameter fetched by get_attr
        graph, block, act = _trace(lambda: MLPBlock(LearnedActivationMLP)), "layers.*", "mlp.act"
    else:  # transformers' Apertus (run and recorded), xIELU's alpha_p and alpha_n
        graph = trace_model(_hf_meta("ApertusConfig", "ApertusForCausalLM", head_dim=16),
                            (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
        block, act = "model.layers.*", "mlp.act_fn"
    assert graph.tp_unsplit == []
    assert graph.tp_styles[block][act] == "replicated"  # tensor_parallel: gradients summed over tp
    assert any(p["kind"] == "mlp" for p in graph.tensor_parallel)
    assert "tp" not in graph.refused


def test_a_parameter_of_a_module_holding_the_linears_leaves_the_pair_unsplit():
    graph = _trace(lambda: MLPBlock(InlineScaleMLP))
    assert graph.tensor_parallel == []
    assert [(u["module"], "reads a parameter" in u["reason"]) for u in graph.tp_unsplit] == [("mlp", True)]


class ResidualScaleBlock(PlainNormBlock):
    """A learned scale on the residual stream, held by the block itself."""

    def __init__(self):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.scale * self.ffn(self.ffn_norm(x))


class RootMeanSquare(PlainRMSNorm):
    """The same norm under a name that does not say so: its ops are elementwise work."""


class UnnamedNormBlock(PlainNormBlock):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.ffn_norm = RootMeanSquare(HIDDEN), RootMeanSquare(HIDDEN)


@pytest.mark.parametrize("block,parameter", [(UnnamedNormBlock, "layers.0.attn_norm.weight"),
                                             (ResidualScaleBlock, "layers.0.scale")])
def test_a_parameter_no_style_shards_read_on_the_residual_stream_rules_out_sequence_parallelism(block, parameter):
    # under SP each rank would read it on its own tokens, and nothing sums its gradient's shares
    graph = _trace(block)
    assert graph.tensor_parallel and not graph.sequence_shardable
    assert graph.sp_problem.startswith(parameter) and graph.refused["sp"] == graph.sp_problem


def test_norm_modules_sharded_by_sequence_parallelism_leave_it_offered():
    class NormModuleBlock(PlainNormBlock):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.ffn_norm = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)

    for block in (NormModuleBlock, PlainNormBlock):  # an nn.RMSNorm, a hand-written PlainRMSNorm
        graph = _trace(block)
        assert graph.tp_styles["layers.*"]["attn_norm"] == "sequence_parallel"
        assert graph.sp_problem == "" and graph.sequence_shardable


def test_a_family_named_for_a_norm_holds_modules_not_norms():
    # RoBERTa-PreLayerNorm's Embeddings, SelfOutput, Layer and LMHead classes carry "LayerNorm"
    # in their names: their own ops (the residual adds) are no norm, and a module that holds
    # others takes no sequence parallel style (torch's SequenceParallel re-registers its
    # parameters by dotted name, a KeyError that refused TP for the whole family)
    import transformers

    from autoplan.trace.capability import probe_plans

    config = transformers.RobertaPreLayerNormConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        vocab_size=256, max_position_embeddings=128, attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.RobertaPreLayerNormForMaskedLM(config)
    graph = trace_model(model, (torch.zeros(1, 32, dtype=torch.long, device="meta"),))
    leaves = {path for path, sub in model.named_modules() if not list(sub.children())}
    gathers = {"prepare_input"}  # a holder of column linears gathers their input
    for key, styles in graph.tp_styles.items():
        prefix = key.replace("*", "0") + "." if key else ""
        held = {path: style for path, style in styles.items() if prefix + path not in leaves}
        assert set(held.values()) <= gathers, (key, held)
    assert graph.tp_styles[""]["roberta_prelayernorm.LayerNorm"] == "final_norm"
    blocks = {f"roberta_prelayernorm.encoder.layer.{i}" for i in range(2)}
    assert "tp" in probe_plans(graph, 32, blocks) and "tp" not in graph.refused, graph.refused


@pytest.mark.parametrize("name,norm", [
    ("LlamaRMSNorm", True), ("NemotronLayerNorm1P", True), ("LayerNorm2d", True),
    ("Qwen3NextRMSNormGated", True), ("DetrFrozenBatchNorm2d", True), ("T5LayerNorm", True),
    ("RobertaPreLayerNormEmbeddings", False), ("RobertaPreLayerNormSelfOutput", False),
    ("Wav2Vec2LayerNormConvLayer", False), ("InklingNormedEmbedding", False)])
def test_a_norm_module_is_named_for_the_norm_it_ends_in(name, norm):
    from autoplan.trace.ops import is_norm_type

    assert is_norm_type(name) is norm
