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

from autoplan.models.llama import SwiGLU, apply_rope, rope_tables
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


class DeepseekBlock(nn.Module):
    def __init__(self, dim: int, attention: nn.Module, mlp: nn.Module, eps: float) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.self_attn = attention
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekLM(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, config: dict[str, Any], blocks: list[nn.Module]) -> None:
        super().__init__()
        self.config = dict(config)
        dim, vocab = config["hidden_size"], config["vocab_size"]
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(dim, eps=config.get("rms_norm_eps", 1e-6))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.tie_weights()
        cos, sin = self._tables(config.get("max_position_embeddings", 4096))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.config["qk_rope_head_dim"], positions,
                           float(self.config.get("rope_theta", 10000.0)))

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
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif hasattr(module, "w_gate"):  # grouped experts
                for weight in (module.w_gate, module.w_up, module.w_down):
                    nn.init.normal_(weight, std=std)
        cos, sin = self._tables(self.rope_cos.shape[0])
        self.rope_cos.copy_(cos.to(self.rope_cos.device))
        self.rope_sin.copy_(sin.to(self.rope_sin.device))


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
        blocks.append(DeepseekBlock(dim, MLAttention(config), mlp, eps))
    return DeepseekLM(config, blocks)
