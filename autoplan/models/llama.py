"""Decoder-only transformer of the Llama family: llama, mistral, qwen2, mixtral, qwen2_moe, qwen3_moe.

Pre-norm blocks of RMSNorm -> grouped-query attention with RoPE -> RMSNorm -> SwiGLU MLP
(or a mixture of experts). Module names follow Hugging Face so that TP styles and
checkpoints read naturally. Attention reshapes with -1 heads so tensor parallelism can
shard q/k/v column-wise without touching this code; RoPE tables are a buffer
(`rope_cos`/`rope_sin`, one row per position) that context parallelism may replace
with the rows of this rank's positions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.models.common import init_standard_, refill_rope_
from autoplan.models.moe import MoE
from autoplan.models.registry import ConfigError, require_divides, require_positive


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_tables(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); cos/sin: (seq, head_dim // 2). Rotate-half form."""
    first, second = x.chunk(2, dim=-1)
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)
        self.kv_repeat = heads // kv_heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # grouped K/V heads go in unexpanded (enable_gqa): attention kernels save them at
        # kv_heads size and context parallelism sends them around the ring at that size
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=self.kv_repeat > 1,
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, attention: nn.Module, mlp: nn.Module, eps: float) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.self_attn = attention
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderLM(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, config: dict[str, Any], blocks: list[nn.Module], head_dim: int) -> None:
        super().__init__()
        self.config = dict(config)
        dim, vocab = config["hidden_size"], config["vocab_size"]
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(dim, eps=config.get("rms_norm_eps", 1e-5))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.tie_weights()
        self.head_dim = head_dim
        cos, sin = rope_tables(head_dim, config.get("max_position_embeddings", 4096),
                               float(config.get("rope_theta", 10000.0)))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

    def tie_weights(self) -> None:
        """Share the output head with the token embedding when the config ties them. Called
        again by init_weights() because Module.to_empty() unties shared parameters; a no-op
        when already tied (so it does not re-register parameters a sharding wrapper manages)."""
        if self.config.get("tie_word_embeddings", False) and self.lm_head.weight is not self.embed_tokens.weight:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Deterministic under torch.manual_seed; recomputes the RoPE tables (lost on meta)."""
        self.tie_weights()
        init_standard_(self, std)
        refill_rope_(self, *rope_tables(self.head_dim, self.rope_cos.shape[0],
                                        float(self.config.get("rope_theta", 10000.0))))

def _moe_settings(config: dict[str, Any]) -> tuple[int, int, int, int, set[int]]:
    """(experts, top_k, expert ffn, shared ffn, dense layer indices) from the family's keys."""
    model_type = config["model_type"]
    layers = config["num_hidden_layers"]
    if model_type == "mixtral":
        experts = config.get("num_local_experts", 8)
        return experts, config.get("num_experts_per_tok", 2), config["intermediate_size"], 0, set()
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step = config.get("decoder_sparse_step", 1) or 1
        dense = set(config.get("mlp_only_layers", []) or [])
        dense |= {i for i in range(layers) if (i + 1) % step}
        shared = config.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
        return (config["num_experts"], config.get("num_experts_per_tok", 2),
                config["moe_intermediate_size"], shared, dense)
    return 0, 0, 0, 0, set()


def build_llama(config: dict[str, Any]) -> DecoderLM:
    require_positive(config, "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "vocab_size")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    require_positive({"num_key_value_heads": kv_heads}, "num_key_value_heads")
    head_dim = config.get("head_dim") or dim // heads
    if not config.get("head_dim"):
        require_divides("num_attention_heads", heads, "hidden_size", dim)
    require_divides("num_key_value_heads", kv_heads, "num_attention_heads", heads)
    if head_dim % 2:
        raise ConfigError(f"head dimension {head_dim} must be even for RoPE")
    experts, top_k, expert_ffn, shared_ffn, dense_layers = _moe_settings(config)
    if experts:
        require_positive({"experts": experts, "top_k": top_k}, "experts", "top_k")
        if top_k > experts:
            raise ConfigError(f"num_experts_per_tok={top_k} exceeds the {experts} experts")
    qkv_bias = bool(config.get("attention_bias", config["model_type"] == "qwen2"))
    eps = config.get("rms_norm_eps", 1e-5)
    blocks = []
    for index in range(config["num_hidden_layers"]):
        attention = Attention(dim, heads, kv_heads, head_dim, qkv_bias)
        if experts and index not in dense_layers:
            mlp: nn.Module = MoE(dim, expert_ffn, experts, top_k, shared_ffn,
                                 config.get("norm_topk_prob", config["model_type"] != "qwen2_moe"))
        else:
            mlp = SwiGLU(dim, config["intermediate_size"])
        blocks.append(DecoderBlock(dim, attention, mlp, eps))
    return DecoderLM(config, blocks, head_dim)


