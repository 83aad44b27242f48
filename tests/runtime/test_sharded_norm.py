"""Which norms the runtime may run on each rank's columns with the statistic summed: plain
RMSNorms only, whatever class computes them (checked on the module's own code)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoplan.runtime.sharded_norm import is_plain_rms_norm


class OffsetRMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.eps, self.weight = 1e-6, nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _hf_norm(name: str):
    import importlib

    pytest.importorskip("transformers")
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    return getattr(module, {"olmo2": "Olmo2RMSNorm", "gemma": "GemmaRMSNorm"}[name])(32, eps=1e-6)


@pytest.mark.parametrize("make,plain", [
    (lambda: nn.RMSNorm(32, eps=1e-5), True),
    (lambda: nn.RMSNorm(32), True),  # eps None: the input dtype's own
    (lambda: _hf_norm("olmo2"), True),
    (lambda: _hf_norm("gemma"), False),  # (1 + weight)
    (lambda: OffsetRMSNorm(32), False),
    (lambda: nn.LayerNorm(32), False),  # a bias, and the mean taken out
    (lambda: nn.RMSNorm(32, elementwise_affine=False), False),  # no weight to shard
])
def test_only_plain_rms_norms_are_split(make, plain):
    with torch.device("meta"):  # as the trace holds them
        module = make()
    assert is_plain_rms_norm(module) is plain
