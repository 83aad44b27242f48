"""The trace runs a 16-bit plan's forward as torch.autocast does (trace/autocast.py)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.trace.autocast import MetaAutocast
from autoplan.trace.tracer import trace_model


class _Attention(nn.Module):
    """Rotary computed in fp32 in forward (as transformers' rotary classes do) and applied
    to q and k in fp32; `cast_back` casts them to v's dtype before SDPA, as most models do,
    else autocast's cast of SDPA's inputs is what makes the dtypes agree."""

    def __init__(self, dim: int, heads: int, cast_back: bool) -> None:
        super().__init__()
        self.heads, self.cast_back = heads, cast_back
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = (p(x).view(b, t, -1, hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
        angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        half = lambda u: torch.cat([-u[..., hd // 2:], u[..., : hd // 2]], -1)  # noqa: E731
        q, k = q.float() * cos + half(q.float()) * sin, k.float() * cos + half(k.float()) * sin
        if self.cast_back:
            q, k = q.to(v.dtype), k.to(v.dtype)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class _LM(nn.Module):
    def __init__(self, cast_back: bool, vocab: int = 256, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Attention(dim, heads, cast_back) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _trace(model: nn.Module):
    return trace_model(model, (torch.zeros(2, 32, dtype=torch.long),), name="lm")


def test_a_model_relying_on_autocast_for_sdpa_traces_as_the_job_runs_it():
    # plain bf16 (no autocast) refused this model: SDPA got fp32 q/k and bf16 v. Under
    # autocast its cost is that of the same model casting q/k back itself
    graph, cast_back = _trace(_LM(cast_back=False)), _trace(_LM(cast_back=True))
    assert graph.parameters == cast_back.parameters
    assert graph.forward_flops() == cast_back.forward_flops() > 0
    assert graph.context_parallel == cast_back.context_parallel == ["blocks.0", "blocks.1"]
    assert graph.tensor_parallel and "tp" not in graph.refused, graph.refused


def _ops(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """A chain of ops, some on autocast's lower-precision list, some not."""
    h = F.linear(x, w)
    s = h @ h.transpose(-1, -2)
    p = torch.softmax(s.float(), -1)
    m = torch.bmm(p, h.float())
    a = F.scaled_dot_product_attention(m[:, None].float(), m[:, None], m[:, None].float())
    return [h, s, p, m, a, m.float() + 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_casts_are_torch_autocasts_on_the_ops_both_lists_share(dtype):
    # the reference: torch.autocast on real CPU tensors; these ops sit on the lower-precision
    # list of both CPU and CUDA autocast, so their dtypes are what a GPU job computes in
    x, w = torch.randn(2, 8, 16), torch.randn(16, 16)
    with torch.autocast("cpu", dtype=dtype):
        expected = [t.dtype for t in _ops(x, w)]
    with MetaAutocast(dtype):
        got = [t.dtype for t in _ops(x.to("meta"), w.to("meta"))]
    assert got == expected
    assert dtype in got and torch.float32 in got  # both kinds occur: the check can tell them apart
