"""GPT-2 / GPT-3 family (HF `model_type: gpt2`): learned positions, pre-LayerNorm, GELU MLP.

Config keys (HF GPT2Config): n_embd, n_layer, n_head, n_inner (None -> 4 * n_embd),
vocab_size, n_positions, layer_norm_epsilon, activation_function, tie_word_embeddings
(default True, as GPT-2 and GPT-3 tie the LM head to the token embedding).

Module names follow HF GPT-2 (wte, wpe, h.N.ln_1 / attn / ln_2 / mlp.c_fc / mlp.c_proj,
ln_f, lm_head) with one deliberate difference: HF fuses q/k/v into one `c_attn` Conv1D;
here they are three nn.Linear (`attn.q_proj`, `attn.k_proj`, `attn.v_proj`, output
`attn.c_proj`) so tensor parallelism can shard each column-wise without re-ordering a
fused weight. The parameter count is the same as HF's. Positions are looked up through a
`position_ids` buffer (one row per position) so context parallelism can replace it with
the positions of its shard, as it does with RoPE tables in the Llama family.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.models.registry import ConfigError, require_divides, require_positive

ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
    "silu": F.silu,
}


def activation(name: str) -> Any:
    """The activation function of an HF `activation_function` / `hidden_act` name."""
    if name not in ACTIVATIONS:
        raise ConfigError(
            f"unsupported activation {name!r}; use one of {', '.join(sorted(ACTIVATIONS))}"
        )
    return ACTIVATIONS[name]


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, bias: bool = True) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        self.k_proj = nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.c_proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them.
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, act: str) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, ffn_dim)
        self.c_proj = nn.Linear(ffn_dim, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn_dim: int, eps: float, act: str) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=eps)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, ffn_dim, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2LM(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        dim, vocab = config["n_embd"], config["vocab_size"]
        positions = config["n_positions"]
        ffn_dim = config.get("n_inner") or 4 * dim
        eps = config.get("layer_norm_epsilon", 1e-5)
        act = config.get("activation_function", "gelu_new")
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(positions, dim)
        self.h = nn.ModuleList(
            GPT2Block(dim, config["n_head"], ffn_dim, eps, act) for _ in range(config["n_layer"])
        )
        self.ln_f = nn.LayerNorm(dim, eps=eps)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.tie_weights()
        self.register_buffer("position_ids", torch.arange(positions), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(self.position_ids[:seq])
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def tie_weights(self) -> None:
        """Share the output head with the token embedding when the config ties them. Called
        again by init_weights() because Module.to_empty() unties shared parameters; a no-op
        when already tied (so it does not re-register parameters a sharding wrapper manages)."""
        if self.config.get("tie_word_embeddings", True) and self.lm_head.weight is not self.wte.weight:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Deterministic under torch.manual_seed; GPT-2 scheme (normal(0, std), zero biases,
        output projections scaled by 1/sqrt(2 * n_layer)). Refills `position_ids` (lost on meta)."""
        self.tie_weights()
        out_std = std / (2 * len(self.h)) ** 0.5
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=out_std if name.endswith("c_proj") else std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        self.position_ids.copy_(torch.arange(self.position_ids.shape[0], device=self.position_ids.device))


def build_gpt2(config: dict[str, Any]) -> GPT2LM:
    require_positive(config, "n_embd", "n_layer", "n_head", "vocab_size", "n_positions")
    if config.get("n_inner") is not None:
        require_positive(config, "n_inner")
    require_divides("n_head", config["n_head"], "n_embd", config["n_embd"])
    activation(config.get("activation_function", "gelu_new"))
    return GPT2LM(config)
