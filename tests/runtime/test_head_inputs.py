"""The rank's heads of a tensor of every head a model hands its attention (head_inputs.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoplan.config import head_inputs_parts, tp_style_known
from autoplan.errors import UserError
from autoplan.runtime.head_inputs import (_own_heads, head_inputs_of, head_inputs_style, rank_heads,
                                         slice_head_inputs)

HEADS, BATCH, TP = 4, 3, 2


def _alibi_like(shape):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def test_a_mask_of_every_head_gives_each_rank_its_block_of_heads():
    mask = _alibi_like((BATCH, HEADS, 5, 5))  # Falcon: (batch, heads, q, k)
    parts = [rank_heads(mask, HEADS, BATCH, rank, TP) for rank in range(TP)]
    assert all(p.shape == (BATCH, HEADS // TP, 5, 5) for p in parts)
    assert torch.equal(torch.cat(parts, dim=1), mask)


@pytest.mark.parametrize("leading", [BATCH * HEADS, HEADS])  # BLOOM's (batch * heads, 1, k); MPT's (heads, 1, k)
def test_heads_folded_into_the_leading_dim_are_taken_batch_major(leading):
    bias = _alibi_like((leading, 1, 7))
    parts = [rank_heads(bias, HEADS, BATCH, rank, TP) for rank in range(TP)]
    n = leading // HEADS
    assert all(p.shape == (n * HEADS // TP, 1, 7) for p in parts)
    regrouped = torch.cat([p.unflatten(0, (n, HEADS // TP)) for p in parts], dim=1)
    assert torch.equal(regrouped.flatten(0, 1), bias)


def test_a_tensor_without_the_model_head_count_passes_as_it_is():
    for shape in [(BATCH, 1, 5, 5), (BATCH, HEADS // TP, 5, 5), (BATCH * HEADS // TP, 1, 7)]:
        value = _alibi_like(shape)
        assert rank_heads(value, HEADS, BATCH, 1, TP) is value


def test_a_per_head_input_carrying_a_gradient_is_refused():
    learned = _alibi_like((BATCH, HEADS, 5, 5)).requires_grad_()
    with pytest.raises(UserError, match="carries a gradient"):
        _own_heads(torch.nn.Identity(), "bias", learned, HEADS, BATCH, 0, TP)


def test_the_trace_names_only_gradient_free_inputs_of_the_head_count():
    inputs = [("alibi", (HEADS, 1, 32), False), ("attention_mask", (1, 1, 32, 32), False),
              ("position_bias", (1, HEADS, 32, 32), True), ("residual", (1, 32, 64), True)]
    assert head_inputs_of(inputs, HEADS, batch=1) == ["alibi"]


def test_the_style_round_trips_and_is_a_known_plan_style():
    style = head_inputs_style(HEADS, ["alibi", "attention_mask"])
    assert head_inputs_parts(style) == (HEADS, ["alibi", "attention_mask"])
    assert tp_style_known(style)
    for bad in ("head_inputs:4", "head_inputs:0:alibi", "head_inputs:x:alibi", "head_inputs:4:a-b"):
        assert not tp_style_known(bad) and head_inputs_parts(bad) is None


class _Mesh:
    def get_local_rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


def test_an_attention_whose_signature_cannot_be_read_is_refused():
    class Builtin(nn.Module):
        forward = staticmethod(max)  # a builtin: inspect finds no signature

    with pytest.raises(UserError, match="cannot read its forward's signature"):
        slice_head_inputs(Builtin(), 4, ["alibi"], _Mesh())
