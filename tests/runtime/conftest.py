"""THE fixture for launching ranks: `torchrun(script, nproc, *args, timeout=..., ...)`.

One torchrun launch costs 5-9 s here (imports x N on 2 cores), so the parity tests run
many plans inside one launch per world size. Every launch has a timeout, so a hang fails
the test instead of stalling CI.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def launch(script: str, nproc: int, *args: str, timeout: float = 240.0,
           torchrun_args: tuple[str, ...] = (), env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess:
    """Run `script` (a path, or a file name in tests/runtime) under torchrun on gloo."""
    path = Path(script) if Path(script).is_absolute() else HERE / script
    full_env = dict(os.environ, OMP_NUM_THREADS="1",
                    PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", *torchrun_args, str(path), *map(str, args)]
    # A new session, so a hung launch is killed with all its ranks (no stray processes).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun {path.name} x{nproc} hung for {timeout}s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="session")
def torchrun():
    return launch
