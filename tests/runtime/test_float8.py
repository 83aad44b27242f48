"""The runtime's fp8 conversion is torchao's own: the same linears swapped, the same numbers."""

from __future__ import annotations

import copy

import pytest
import torch

from autoplan.errors import UserError
from autoplan.runtime.float8 import apply_float8, require_torchao
from runtime_models import builder, float8_reference

pytest.importorskip("torchao.float8", reason="torchao is not installed (the test extra installs it)")


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = builder("llama")()
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def test_the_runtime_converts_the_blocks_linears_as_torchao_does():
    ours, theirs = _llama(), None
    theirs = copy.deepcopy(ours)
    apply_float8(ours, [f"layers.{i}" for i in range(4)])
    float8_reference(theirs)
    kinds = lambda m: [(name, type(mod).__name__) for name, mod in m.named_modules()]  # noqa: E731
    assert kinds(ours) == kinds(theirs)
    assert sum(kind == "Float8Linear" for _, kind in kinds(ours)) == 28  # 7 per block
    assert type(ours.lm_head).__name__ == "Linear"  # the head stays in 16 bits
    ids = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = ours(ids), theirs(ids)
    assert torch.equal(a, b)
    a.float().square().mean().backward()
    b.float().square().mean().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters()))


def test_only_the_listed_blocks_are_converted():
    model = _llama()
    apply_float8(model, ["layers.1"])
    converted = {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert converted and all(name.startswith("layers.1.") for name in converted)


def test_a_node_without_torchao_is_told_how_to_get_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(UserError, match="pip install torchao"):
        require_torchao()
