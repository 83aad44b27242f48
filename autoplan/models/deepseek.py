"""DeepSeek-V2/V3 family (HF `model_type: deepseek_v3`, `deepseek_v2`): MLA attention + MoE.

Multi-head latent attention (DeepSeek-V2 paper, arXiv:2405.04434 section 2.1): queries go
through a low-rank bottleneck (`q_a_proj` -> RMSNorm -> `q_b_proj`, or one `q_proj` when
q_lora_rank is null/0); keys and values share a compressed latent of kv_lora_rank values plus
one rotary key of qk_rope_head_dim shared by all heads (`kv_a_proj_with_mqa` -> RMSNorm ->
`kv_b_proj`). Each head attends with a qk_nope_head_dim + qk_rope_head_dim query/key and a
v_head_dim value. Layers 0..first_k_dense_replace-1 have a dense SwiGLU MLP of
intermediate_size; the rest an autoplan.models.moe.MoE with n_routed_experts experts of
moe_intermediate_size, num_experts_per_tok per token and a shared SwiGLU of
n_shared_experts * moe_intermediate_size.

Simplifications (no effect on parameter count, shapes or FLOPs to first order): routing is
softmax top-k (V3 uses sigmoid scores with a bias and group-limited top-k, scaled by
routed_scaling_factor); RoPE is rotate-half without YaRN scaling (attention scale is
1/sqrt(qk head dim) without the YaRN mscale); the multi-token-prediction module
(num_nextn_predict_layers) is not built. Module names follow HF DeepSeek-V3.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.models.llama import DecoderBlock, DecoderLM, SwiGLU, apply_rope
from autoplan.models.moe import MoE
from autoplan.models.registry import ConfigError, require_positive


class MLAttention(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        dim, heads = config["hidden_size"], config["num_attention_heads"]
        eps = config.get("rms_norm_eps", 1e-6)
        bias = bool(config.get("attention_bias", False))
        self.nope_dim, self.rope_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
        self.v_dim, self.kv_rank = config["v_head_dim"], config["kv_lora_rank"]
        qk_dim = self.nope_dim + self.rope_dim
        q_rank = config.get("q_lora_rank") or 0
        if q_rank:
            self.q_a_proj = nn.Linear(dim, q_rank, bias=bias)
            self.q_a_layernorm = nn.RMSNorm(q_rank, eps=eps)
            self.q_b_proj = nn.Linear(q_rank, heads * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(dim, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, self.kv_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_rank, eps=eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, dim, bias=bias)
        self.q_lora = bool(q_rank)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        # -1 heads: under tensor parallelism q_b_proj / kv_b_proj / o_proj hold heads / tp.
        q = q.view(batch, seq, -1, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, seq, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        heads = q.shape[2]
        k_rope = apply_rope(k_rope.view(batch, seq, 1, self.rope_dim), cos, sin)
        q = torch.cat((q_nope, apply_rope(q_rope, cos, sin)), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(batch, seq, heads, self.rope_dim)), dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class DeepseekLM(DecoderLM):
    """Token ids (batch, seq) -> logits (batch, seq, vocab): the Llama-family decoder with MLA
    attention blocks; its RoPE tables span MLA's decoupled rope dimension."""

    def __init__(self, config: dict[str, Any], blocks: list[nn.Module]) -> None:
        super().__init__(config, blocks, head_dim=config["qk_rope_head_dim"])


def _validate(config: dict[str, Any]) -> None:
    require_positive(config, "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "vocab_size", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim")
    if config.get("q_lora_rank"):
        require_positive(config, "q_lora_rank")
    if config["qk_rope_head_dim"] % 2:
        raise ConfigError(f"config field 'qk_rope_head_dim'={config['qk_rope_head_dim']} must be "
                          "even for RoPE")
    dense = config.get("first_k_dense_replace", 0)
    if not isinstance(dense, int) or dense < 0:
        raise ConfigError(f"config field 'first_k_dense_replace' must be an integer >= 0, got {dense!r}")
    if config.get("n_routed_experts") and dense < config["num_hidden_layers"]:
        require_positive(config, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
        if config["num_experts_per_tok"] > config["n_routed_experts"]:
            raise ConfigError(
                f"config field 'num_experts_per_tok'={config['num_experts_per_tok']} exceeds "
                f"n_routed_experts={config['n_routed_experts']}; choose at most that many per token"
            )
    shared = config.get("n_shared_experts") or 0
    if not isinstance(shared, int) or shared < 0:
        raise ConfigError(f"config field 'n_shared_experts' must be an integer >= 0, got {shared!r}")


def build_deepseek(config: dict[str, Any]) -> DeepseekLM:
    _validate(config)
    dim = config["hidden_size"]
    eps = config.get("rms_norm_eps", 1e-6)
    experts = config.get("n_routed_experts") or 0
    dense = config.get("first_k_dense_replace", 0)
    blocks = []
    for index in range(config["num_hidden_layers"]):
        if experts and index >= dense:
            ffn = config["moe_intermediate_size"]
            mlp: nn.Module = MoE(dim, ffn, experts, config["num_experts_per_tok"],
                                 shared_ffn_dim=(config.get("n_shared_experts") or 0) * ffn,
                                 norm_topk_prob=bool(config.get("norm_topk_prob", True)))
        else:
            mlp = SwiGLU(dim, config["intermediate_size"])
        blocks.append(DecoderBlock(dim, MLAttention(config), mlp, eps))
    return DeepseekLM(config, blocks)
