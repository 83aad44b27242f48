"""GPT-NeoX family (HF `model_type: gpt_neox`) and its Nemotron relative (`model_type: nemotron`).

Both are LayerNorm transformers with a non-gated MLP and rotary embeddings on a fraction of
each head (`rotary_pct` / `partial_rotary_factor`).
- gpt_neox: parallel residual by default (x + attn(ln1(x)) + mlp(ln2(x))), biases everywhere,
  multi-head attention, GELU, rotary_pct 0.25, untied output `embed_out`.
- nemotron: sequential residual, no biases in linears, grouped-query attention
  (num_key_value_heads, optional head_dim), squared-ReLU (`relu2`), partial_rotary_factor 0.5.
  HF's LayerNorm1P (weight stored as w - 1) has the parameters of a LayerNorm; plain
  LayerNorm is used here.

Module names follow HF GPT-NeoX (embed_in, layers.N.input_layernorm, attention, mlp
.dense_h_to_4h / .dense_4h_to_h, post_attention_layernorm, final_layer_norm, embed_out), also
for nemotron, with one difference: HF fuses q/k/v into `attention.query_key_value` with the
heads interleaved; here they are `attention.q_proj`, `k_proj`, `v_proj` (output
`attention.dense`) so tensor parallelism shards each column-wise. Same parameter count.
RoPE tables are buffers `rope_cos`/`rope_sin` (one row per position, rotary dims / 2 columns).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.models.common import init_standard_, refill_rope_
from autoplan.models.gpt2 import activation
from autoplan.models.llama import apply_rope, rope_tables
from autoplan.models.registry import ConfigError, require_divides, require_positive


class PartialRotaryAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, rotary_dims: int,
                 bias: bool) -> None:
        super().__init__()
        self.head_dim, self.rotary_dims = head_dim, rotary_dims
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=bias)
        self.dense = nn.Linear(heads * head_dim, dim, bias=bias)
        self.kv_repeat = heads // kv_heads

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.rotary_dims:
            return x
        rotary, passthrough = x[..., : self.rotary_dims], x[..., self.rotary_dims:]
        return torch.cat((apply_rope(rotary, cos, sin), passthrough), dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self._rotate(self.q_proj(x).view(batch, seq, -1, self.head_dim), cos, sin)
        k = self._rotate(self.k_proj(x).view(batch, seq, -1, self.head_dim), cos, sin)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        # grouped K/V heads go in unexpanded (enable_gqa): attention kernels save them at
        # kv_heads size and context parallelism sends them around the ring at that size
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=self.kv_repeat > 1,
        )
        return self.dense(out.transpose(1, 2).reshape(batch, seq, -1))


class NeoXMLP(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, act: str, bias: bool) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(dim, ffn_dim, bias=bias)
        self.dense_4h_to_h = nn.Linear(ffn_dim, dim, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class NeoXBlock(nn.Module):
    def __init__(self, dim: int, attention: nn.Module, mlp: nn.Module, eps: float,
                 parallel_residual: bool) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(dim, eps=eps)
        self.attention = attention
        self.post_attention_layernorm = nn.LayerNorm(dim, eps=eps)
        self.mlp = mlp
        self.parallel_residual = parallel_residual

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = self.attention(self.input_layernorm(x), cos, sin)
        if self.parallel_residual:
            return x + attn + self.mlp(self.post_attention_layernorm(x))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class NeoXLM(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, config: dict[str, Any], blocks: list[nn.Module], rotary_dims: int) -> None:
        super().__init__()
        self.config = dict(config)
        dim, vocab = config["hidden_size"], config["vocab_size"]
        self.embed_in = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(blocks)
        self.final_layer_norm = nn.LayerNorm(dim, eps=_eps(config))
        self.embed_out = nn.Linear(dim, vocab, bias=False)
        self.tie_weights()
        self.rotary_dims = rotary_dims
        cos, sin = rope_tables(max(rotary_dims, 2), config.get("max_position_embeddings", 2048),
                               _rope_base(config))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed_in(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.embed_out(self.final_layer_norm(x))

    def tie_weights(self) -> None:
        """Share the output head with the token embedding when the config ties them. Called
        again by init_weights() because Module.to_empty() unties shared parameters; a no-op
        when already tied (so it does not re-register parameters a sharding wrapper manages)."""
        if self.config.get("tie_word_embeddings", False) and self.embed_out.weight is not self.embed_in.weight:
            self.embed_out.weight = self.embed_in.weight

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Deterministic under torch.manual_seed; recomputes the RoPE tables (lost on meta)."""
        self.tie_weights()
        init_standard_(self, std)
        refill_rope_(self, *rope_tables(max(self.rotary_dims, 2), self.rope_cos.shape[0],
                                        _rope_base(self.config)))

def _eps(config: dict[str, Any]) -> float:
    return float(config.get("layer_norm_eps", config.get("norm_eps", 1e-5)))


def _rope_base(config: dict[str, Any]) -> float:
    return float(config.get("rotary_emb_base", config.get("rope_theta", 10000.0)))


def _family_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """Keys whose HF defaults differ between gpt_neox and nemotron."""
    if config["model_type"] == "nemotron":
        return {"rotary": config.get("partial_rotary_factor", 0.5), "act": config.get("hidden_act", "relu2"),
                "parallel": False, "bias": bool(config.get("attention_bias", False))}
    return {"rotary": config.get("rotary_pct", config.get("partial_rotary_factor", 0.25)),
            "act": config.get("hidden_act", "gelu"),
            "parallel": bool(config.get("use_parallel_residual", True)),
            "bias": bool(config.get("attention_bias", True))}


def build_gpt_neox(config: dict[str, Any]) -> NeoXLM:
    require_positive(config, "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "vocab_size")
    dim, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    require_positive({"num_key_value_heads": kv_heads}, "num_key_value_heads")
    require_divides("num_key_value_heads", kv_heads, "num_attention_heads", heads)
    head_dim = config.get("head_dim") or dim // heads
    if not config.get("head_dim"):
        require_divides("num_attention_heads", heads, "hidden_size", dim)
    family = _family_defaults(config)
    if not 0.0 <= float(family["rotary"]) <= 1.0:
        raise ConfigError(f"rotary fraction {family['rotary']!r} must lie in [0, 1] (rotary_pct / "
                          "partial_rotary_factor)")
    rotary_dims = int(head_dim * float(family["rotary"]))
    if rotary_dims % 2:
        raise ConfigError(f"rotary dims {rotary_dims} (head_dim {head_dim} x rotary fraction) must "
                          "be even; change rotary_pct / partial_rotary_factor")
    activation(family["act"])
    mlp_bias = bool(config.get("mlp_bias", family["bias"]))
    blocks = [
        NeoXBlock(dim, PartialRotaryAttention(dim, heads, kv_heads, head_dim, rotary_dims, family["bias"]),
                  NeoXMLP(dim, config["intermediate_size"], family["act"], mlp_bias),
                  _eps(config), family["parallel"])
        for _ in range(config["num_hidden_layers"])
    ]
    return NeoXLM(config, blocks, rotary_dims)
