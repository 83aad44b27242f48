"""MoE layers the trace must find whatever their experts' layout, and a model around them it
must not take for one.

DBRX keeps its experts' matrices stacked along dim 0 of 2-D parameters ((experts x ffn,
hidden): w1, v1, w2) and loops over the experts a one-hot of experts + 1 classes says were
hit; its DbrxForCausalLM states the experts' count and top-k for its auxiliary loss. Before
the trace knew the layout, the whole model was costed as one routing module: its blocks had no
FLOPs (a plan of 0.0012 s a step) and its head -61,824 parameters, planned with exit 0.
"""

from __future__ import annotations

import json

import pytest
import torch.nn as nn

from autoplan.trace.load import load_graph
from autoplan.trace.tracer import trace_model

SEQ = 32
DBRX = {"model_type": "dbrx", "d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 128,
        "vocab_size": 256, "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}}


def dbrx_flops_per_token(c: dict, seq: int) -> float:
    """Written from the architecture: fused Wqkv (q, then k and v of kv_n_heads), out_proj,
    the router, top-k experts of three (ffn, hidden) matrices, attention's QK^T and AV over
    every one of `seq` keys (the trace counts attention non-causal)."""
    h, ffn = c["d_model"], c["ffn_config"]["ffn_hidden_size"]
    kv = c["attn_config"]["kv_n_heads"] * h // c["n_heads"]
    experts, top_k = c["ffn_config"]["moe_num_experts"], c["ffn_config"]["moe_top_k"]
    linears = h * (h + 2 * kv) + h * h + h * experts + top_k * 3 * h * ffn
    return 2.0 * (linears + 2 * seq * h)


@pytest.fixture(scope="module")
def dbrx(tmp_path_factory):
    path = tmp_path_factory.mktemp("dbrx") / "config.json"
    path.write_text(json.dumps(DBRX))
    return load_graph(f"hf:{path}", SEQ)[0]


def test_dbrx_blocks_are_moe_layers_costed_by_the_hand_formula(dbrx):
    (block,) = [b for b in dbrx.blocks if b.kind == "moe"]
    ffn = DBRX["ffn_config"]
    assert (block.experts, block.top_k) == (ffn["moe_num_experts"], ffn["moe_top_k"])
    assert block.expert_parameters == ffn["moe_num_experts"] * 3 * DBRX["d_model"] * ffn["ffn_hidden_size"]
    # every hit expert once, not the "no expert" slot of the one-hot too (5/4 of the experts):
    # norms and RoPE are not FLOPs to FlopCounterMode, so 1% covers what is left
    tokens = dbrx.batch_size * dbrx.seq_len
    assert block.forward_flops / tokens == pytest.approx(dbrx_flops_per_token(DBRX, SEQ), rel=0.01)
    assert all(segment.parameters >= 0 for segment in dbrx.segments)


def test_dbrx_experts_are_not_offered_expert_parallelism(dbrx):
    """The runtime shards experts of transformers' fused layout or stacked by expert alone;
    DBRX's are neither, so EP is refused at plan time, naming the module."""
    assert "transformer.blocks.0.ffn" in dbrx.refused["ep"]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(self.up(x).relu())


class _DenseStatingExperts(nn.Module):
    """Dense blocks under a model that states an expert count and top-k (as a model with a
    load-balancing loss does) while no layer of it routes tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = 4, 2
        self.embed, self.layers, self.head = nn.Embedding(64, 32), nn.ModuleList(_Block() for _ in range(4)), \
            nn.Linear(32, 64)

    def forward(self, ids):
        x = self.embed(ids[:, :int(ids.shape[1])])  # shape arithmetic fx cannot trace: run
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_the_model_around_its_blocks_is_never_taken_for_an_moe_layer():
    import torch

    with torch.device("meta"):
        model = _DenseStatingExperts()
    graph = trace_model(model, (torch.zeros(1, SEQ, dtype=torch.long),), probe_runtime=False)
    (block,) = graph.blocks
    assert block.kind == "dense" and block.experts == 0
    assert block.forward_flops == pytest.approx(2 * 2 * 32 * 64 * SEQ, rel=0.01)
    assert all(segment.parameters >= 0 for segment in graph.segments)


def test_a_trace_that_leaves_a_block_uncosted_is_refused_not_planned(monkeypatch):
    """Whatever layout fools the MoE test next: a model taken whole for one routing module
    (what the guard above prevents) leaves its blocks without FLOPs, and is refused."""
    import torch

    from autoplan.errors import UserError
    from autoplan.trace import recorder
    from autoplan.trace.fallback import routes_tokens

    monkeypatch.setattr(recorder.ModuleStack, "_routes", lambda self, module: routes_tokens(module))
    with torch.device("meta"):
        model = _DenseStatingExperts()
    with pytest.raises(UserError, match=r"could not attribute its costs to its parts \(post, layers:"):
        trace_model(model, (torch.zeros(1, SEQ, dtype=torch.long),), probe_runtime=False)
