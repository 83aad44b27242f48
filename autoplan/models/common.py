"""Initialisation shared by the reference models (torch only)."""

from __future__ import annotations

import torch
import torch.nn as nn


@torch.no_grad()
def init_standard_(model: nn.Module, std: float) -> None:
    """normal(0, std) for linears, embeddings and grouped experts, zero biases, unit norms;
    in `model.modules()` order, so the result is deterministic under torch.manual_seed."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            if module.weight is not None:
                nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif hasattr(module, "w_gate"):  # grouped experts
            for weight in (module.w_gate, module.w_up, module.w_down):
                nn.init.normal_(weight, std=std)


@torch.no_grad()
def refill_rope_(model: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Copy freshly computed RoPE tables into the `rope_cos`/`rope_sin` buffers (meta tensors
    have no values, so the tables are recomputed after materialisation)."""
    model.rope_cos.copy_(cos.to(model.rope_cos.device))
    model.rope_sin.copy_(sin.to(model.rope_sin.device))
