"""DeepSeek-V3's traced FLOPs against the hand formula, and the shapes its MoE GEMMs are costed at.

The formula is written from the architecture (DeepSeek-V3 tech report arXiv:2412.19437 §2.1;
MLA: DeepSeek-V2 arXiv:2405.04434 §2.1), independently of the model code: a linear of
(in, out) costs 2 x in x out FLOPs per token; attention as traced is non-causal, QK^T over
qk_nope + qk_rope and AV over v_head_dim for every one of `seq` keys.
"""

from __future__ import annotations

import json

import pytest

from autoplan.cost.profile import block_profile
from autoplan.paths import cost_models_dir
from autoplan.trace.tracer import graph_for_config

SEQ = 1024


@pytest.fixture(scope="module")
def v3():
    raw = json.loads((cost_models_dir() / "models" / "deepseek-v3.json").read_text())
    config = {k: v for k, v in raw.items() if not k.startswith("_")}
    return config, graph_for_config(config, 1, SEQ, probe_runtime=False)


def mla_flops_per_token(c: dict, seq: int) -> float:
    h, H = c["hidden_size"], c["num_attention_heads"]
    dn, dr, dv = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    qr, kvr = c["q_lora_rank"], c["kv_lora_rank"]
    projections = h * qr + qr * H * (dn + dr) + h * (kvr + dr) + kvr * H * (dn + dv) + H * dv * h
    core = seq * H * (dn + dr) + seq * H * dv  # QK^T and AV, one multiply-add each
    return 2.0 * (projections + core)


def moe_flops_per_token(c: dict) -> float:
    h, fe, E = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"]
    swiglu = 3 * h * fe  # gate, up, down
    return 2.0 * (c["num_experts_per_tok"] * swiglu + c["n_shared_experts"] * swiglu + h * E)


def dense_flops_per_token(c: dict) -> float:
    return 2.0 * 3 * c["hidden_size"] * c["intermediate_size"]


def _blocks(graph):
    return {b.kind: b for b in graph.blocks if b.kind in ("dense", "moe")}


def test_mla_moe_layer_flops_match_the_hand_formula(v3):
    config, graph = v3
    blocks = _blocks(graph)
    tokens = graph.batch_size * graph.seq_len
    attention = mla_flops_per_token(config, SEQ)
    moe = blocks["moe"].forward_flops / tokens
    dense = blocks["dense"].forward_flops / tokens
    # norms and RoPE are not counted as FLOPs (FlopCounterMode counts matmuls): 1% tolerance
    assert moe == pytest.approx(attention + moe_flops_per_token(config), rel=0.01)
    assert dense == pytest.approx(attention + dense_flops_per_token(config), rel=0.01)
    assert blocks["moe"].count == config["num_hidden_layers"] - config["first_k_dense_replace"]


def test_moe_gemms_costed_at_their_own_shapes(v3):
    config, graph = v3
    profile = block_profile(graph, _blocks(graph)["moe"])
    h, fe, E, k = (config["hidden_size"], config["moe_intermediate_size"],
                   config["n_routed_experts"], config["num_experts_per_tok"])
    tokens = graph.batch_size * graph.seq_len
    routed = [g for g in profile.gemms if g.expert]
    assert [(g.m, g.n, g.k) for g in routed] == [(tokens * k // E, fe, h)]  # one expert's GEMM
    others = sorted((g.m, g.n, g.k) for g in profile.gemms[profile.gemms.index(routed[0]) + 1:])
    # the router (hidden -> experts) and the shared expert's gate, up, down; nothing lumped
    assert others == sorted([(tokens, E, h), (tokens, fe, h), (tokens, fe, h), (tokens, h, fe)])
    total = sum(g.flops for g in profile.gemms) + profile.attention_flops
    assert total == pytest.approx(_blocks(graph)["moe"].forward_flops, rel=1e-6)
