"""Experts stacked by expert in a layout of the model's own (runtime/expert_stack.py): expert
parallelism runs the module's own forward on each rank's experts once a cut copy shows that
running each expert alone gives what the whole module gives."""

from __future__ import annotations

import torch
import torch.nn as nn

from autoplan.runtime.expert_parallel import expert_parallel_supported


class StackedExperts(nn.Module):
    """Biased experts with a squared-ReLU, (E, H, I) / (E, I, H): no transformers layout."""

    def __init__(self, experts: int = 4, hidden: int = 16, inner: int = 32, renormalise: bool = False):
        super().__init__()
        self.num_experts, self.renormalise = experts, renormalise
        self.up = nn.Parameter(torch.randn(experts, hidden, inner) * 0.1)
        self.up_bias = nn.Parameter(torch.zeros(experts, inner))
        self.down = nn.Parameter(torch.randn(experts, inner, hidden) * 0.1)

    def forward(self, hidden_states, indices, weights):
        if self.renormalise:  # couples a token's experts: a rank holding one of them is wrong
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            rows, slots = torch.nonzero(indices == expert, as_tuple=True)
            y = torch.relu(hidden_states[rows] @ self.up[expert] + self.up_bias[expert]) ** 2
            out.index_add_(0, rows, (y @ self.down[expert]) * weights[rows, slots, None])
        return out


class Layer(nn.Module):
    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts


def test_stacked_experts_of_a_layout_of_their_own_are_run_by_their_own_forward():
    with torch.device("meta"):  # as the planner and the job see the model first
        layer = Layer(StackedExperts())
    assert expert_parallel_supported(layer) is None


def test_stacked_experts_whose_forward_couples_their_weights_are_refused():
    with torch.device("meta"):
        layer = Layer(StackedExperts(renormalise=True))
    assert "couples the experts or their weights" in expert_parallel_supported(layer)


def test_stacked_experts_holding_a_parameter_not_stacked_by_expert_are_refused():
    experts = StackedExperts()
    experts.scale = nn.Parameter(torch.ones(()))
    assert "stacked by expert" in expert_parallel_supported(Layer(experts))
