"""torchrun launcher for calibrate tests: `torchrun(nproc, *autoplan_args)` (tests/multirank.py)."""

from __future__ import annotations

import pytest
from multirank import torchrun as _torchrun


@pytest.fixture
def torchrun():
    def _run(nproc: int, *args: str, cwd=None, timeout: float = 240.0):
        return _torchrun("-m autoplan", nproc, *args, cwd=cwd, timeout=timeout)

    return _run
