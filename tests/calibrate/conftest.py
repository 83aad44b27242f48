"""torchrun launcher for calibrate tests (own copy: fixtures are per directory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest


@pytest.fixture
def torchrun():
    def _run(nproc: int, *args: str, cwd=None, timeout: float = 240.0) -> subprocess.CompletedProcess:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "autoplan", *args]
        # own session: a hung launch is killed with all its ranks
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=cwd, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"torchrun autoplan {' '.join(args)} x{nproc} hung:\n{out[-2000:]}\n{err[-2000:]}")
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    return _run
