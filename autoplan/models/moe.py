"""Mixture-of-experts layer: router, top-k, routed experts, optional shared experts.

Expert parallelism: when `ep_group` is set (by autoplan.runtime), this rank holds only
`num_local_experts` experts and tokens travel to their experts' ranks with
`all_to_all_single` (dispatch) and back (combine). Without it all experts are local.
Capacity policy: dropless. Every routed token is computed; no capacity factor.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts as stacked weights (E, ...), so EP can slice dim 0."""

    def __init__(self, dim: int, ffn_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_gate = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w_up = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))

    def expert_forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(x @ self.w_gate[index].t()) * (x @ self.w_up[index].t())
        return hidden @ self.w_down[index].t()

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: tokens sorted by local expert; counts: tokens per local expert."""
        outputs = [self.expert_forward(i, chunk) for i, chunk in enumerate(torch.split(x, counts))]
        return torch.cat(outputs) if outputs else x[:0]


class MoE(nn.Module):
    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        num_experts: int,
        top_k: int,
        shared_ffn_dim: int = 0,
        norm_topk_prob: bool = True,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, ffn_dim, num_experts)
        self.shared_experts = None
        if shared_ffn_dim:
            from autoplan.models.llama import SwiGLU

            self.shared_experts = SwiGLU(dim, shared_ffn_dim)
        self.ep_group = None  # set by autoplan.runtime for expert parallelism

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softmax(self.gate(tokens), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(tokens.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts = self.route(tokens)
        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        token_of_slot = order // self.top_k
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        expert_out = self.experts(tokens[token_of_slot], counts)
        combined = torch.zeros_like(tokens)
        combined.index_add_(0, token_of_slot, expert_out * weights.reshape(-1)[order, None])
        if self.shared_experts is not None:
            combined = combined + self.shared_experts(tokens)
        return combined.reshape(shape)
