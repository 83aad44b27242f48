"""The dry run routes MoE tokens balanced on fake tensors (autoplan.dryrun.routing), and only
inside its own context: real routing is untouched."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

from autoplan.dryrun.routing import balanced_counts, balanced_routing
from autoplan.models import moe


def test_balanced_counts_split_the_slots_evenly():
    assert balanced_counts(512, 4) == [128] * 4
    assert balanced_counts(10, 4) == [3, 3, 2, 2]
    assert sum(balanced_counts(1001, 8)) == 1001


def test_a_moe_layer_runs_forward_and_backward_on_fake_tensors_with_balanced_counts(monkeypatch):
    tokens, dim, experts, top_k = 48, 16, 4, 2
    seen: list[list[int]] = []
    forward = moe.GroupedExperts.forward
    monkeypatch.setattr(moe.GroupedExperts, "forward",
                        lambda self, x, counts: seen.append(list(counts)) or forward(self, x, counts))
    with FakeTensorMode(), balanced_routing():
        layer = moe.MoE(dim, 32, experts, top_k)
        x = torch.randn(2, tokens // 2, dim, requires_grad=True)
        out = layer(x)
        out.sum().backward()
        assert out.shape == x.shape and x.grad.shape == x.shape
    assert seen == [[tokens * top_k // experts] * experts]


def test_without_the_context_fake_routing_is_refused_and_real_routing_counts_values():
    with FakeTensorMode(), pytest.raises(DynamicOutputShapeException):
        torch.bincount(torch.zeros(8, dtype=torch.long), minlength=4)
    with balanced_routing():  # outside a fake mode, real tensors: their own counts
        assert torch.bincount(torch.tensor([0, 0, 0, 3]), minlength=4).tolist() == [3, 0, 0, 1]
