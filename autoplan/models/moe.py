"""Mixture-of-experts layer: router, top-k, routed experts, optional shared experts.

Expert parallelism: when `ep_group` is set (by autoplan.runtime), this rank holds only
`num_experts // ep` experts (the stacked weights become DTensors sharded on dim 0 over the
ep group) and tokens travel to their experts' ranks with `all_to_all_single` (dispatch)
and back (combine); both are autograd-aware, so the backward sends gradients the same way.
Without it all experts are local.
Capacity policy: dropless. Every routed token is computed; no capacity factor, so the
result does not depend on the EP degree (uneven all-to-all splits carry the imbalance).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _local(weight: torch.Tensor) -> torch.Tensor:
    # DTensor only exists once the runtime shards experts; importing it costs ~1 s, so
    # analysis (which never shards) duck-types instead of importing torch.distributed.tensor
    return weight.to_local() if hasattr(weight, "to_local") else weight


def compute_weight(weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """An expert weight as the expert matmuls take it: this rank's local tensor, unchanged
    when it is in the tokens' dtype already (fp32 training; FSDP's 16-bit gather at ZeRO-2/3)
    or when autocast casts each matmul's operands (16-bit training below ZeRO-2); else cast
    to the tokens' dtype."""
    weight = _local(weight)
    if weight.dtype == tokens.dtype or torch.is_autocast_enabled(tokens.device.type):
        return weight
    return weight.to(tokens.dtype)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts as stacked weights (E, ...), so EP can slice dim 0."""

    def __init__(self, dim: int, ffn_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_gate = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w_up = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: tokens sorted by (local) expert; counts: tokens per local expert."""
        w_gate, w_up, w_down = (compute_weight(w, x) for w in (self.w_gate, self.w_up, self.w_down))
        outputs = []
        for index, chunk in enumerate(torch.split(x, counts)):
            hidden = F.silu(chunk @ w_gate[index].t()) * (chunk @ w_up[index].t())
            outputs.append(hidden @ w_down[index].t())
        return torch.cat(outputs) if outputs else x[:0]


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    """Autograd all_to_all_single (the functional-collective version: correct backward on
    gloo, unlike a list-form all_to_all with uneven splits)."""
    from torch.distributed._functional_collectives import (all_to_all_single_autograd,
                                                           wait_tensor)

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group))


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
        counts = torch.bincount(flat_experts, minlength=self.num_experts)
        if self.ep_group is None:
            expert_out = self.experts(tokens[token_of_slot], counts.tolist())
        else:
            expert_out = self._expert_parallel(tokens[token_of_slot], counts)
        combined = torch.zeros_like(tokens)
        combined.index_add_(0, token_of_slot, expert_out * weights.reshape(-1)[order, None])
        if self.shared_experts is not None:
            combined = combined + self.shared_experts(tokens)
        return combined.reshape(shape)

    def _expert_parallel(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return dispatch_to_owners(routed, counts, self.ep_group, self.experts)


def dispatch_to_owners(routed: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup,
                       run_local) -> torch.Tensor:
    """Send expert-sorted tokens to the ranks owning their experts, run `run_local(tokens,
    counts_per_local_expert)` there, and bring the results back in the same order.

    routed: tokens sorted by global expert; counts: tokens per global expert (all experts)."""
    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    # counts_in[s, e]: tokens rank s sends to my local expert e.
    counts_in = torch.empty_like(counts)
    dist.all_to_all_single(counts_in, counts, group=group)
    counts_out = counts.view(ep, local)
    counts_in = counts_in.view(ep, local)
    send_splits = counts_out.sum(1).tolist()
    recv_splits = counts_in.sum(1).tolist()
    received = _all_to_all(routed, recv_splits, send_splits, group)
    # received is ordered (source rank, local expert); the experts want (expert, source).
    by_source = torch.arange(received.shape[0], device=received.device).split(
        counts_in.flatten().tolist())
    regroup = torch.cat([by_source[s * local + e] for e in range(local) for s in range(ep)])
    out = run_local(received[regroup], counts_in.sum(0).tolist())
    restored = torch.empty_like(out).index_copy(0, regroup, out)
    return _all_to_all(restored, send_splits, recv_splits, group)
