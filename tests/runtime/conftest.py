"""THE fixture for launching ranks: `torchrun(script, nproc, *args, timeout=..., ...)`.

One torchrun launch costs 5-9 s here (imports x N on 2 cores), so the parity tests run
many plans inside one launch per world size. Every launch has a timeout, so a hang fails
the test instead of stalling CI.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from multirank import torchrun as _torchrun

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]  # test models import `tests.corpus`, whatever PYTHONPATH the run has


def launch(script: str, nproc: int, *args: str, timeout: float = 240.0,
           torchrun_args: tuple[str, ...] = (), env: dict[str, str] | None = None):
    """Run `script` (a path, or a file name in tests/runtime) under torchrun on gloo."""
    path = Path(script) if Path(script).is_absolute() else HERE / script
    return _torchrun(path, nproc, *args, timeout=timeout, torchrun_args=torchrun_args, env=env,
                     pythonpath=(HERE, REPO))


@pytest.fixture(scope="session")
def torchrun():
    return launch
