"""Fake matmuls promote mixed dtypes where ATen's real kernels refuse them; the dry run
refuses them too (dryrun/kernels.py MatmulDtypes)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autoplan.dryrun.kernels import MatmulDtypes


def test_a_real_kernel_refuses_what_a_fake_one_runs():
    a, b = torch.randn(4, 4), torch.randn(4, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="same dtype"):
        a @ b
    with FakeTensorMode():
        assert (torch.randn(4, 4) @ torch.randn(4, 4, dtype=torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("op", ["mm", "linear", "bmm"])
def test_the_dry_run_refuses_mixed_matmuls_and_runs_matching_ones(op):
    with FakeTensorMode(), MatmulDtypes():
        shape = (2, 4, 4) if op == "bmm" else (4, 4)
        x, w = torch.randn(shape), torch.randn(shape)
        call = {"mm": torch.mm, "linear": torch.nn.functional.linear, "bmm": torch.bmm}[op]
        assert call(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="float32"):
            call(x.bfloat16(), w)
