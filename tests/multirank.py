"""The one way tests launch ranks: torchrun on gloo in its own process session, with a
timeout that kills every rank (a hang fails the test instead of stalling CI).

torchrun costs 5-9 s per launch on 2 cores, so tests run many configurations per launch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def run_killable(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
                 cwd: str | Path | None = None, unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run `cmd` in a new session; on timeout kill the whole process group and fail."""
    # PYTHONFAULTHANDLER: a rank that dies by a signal (SIGSEGV/SIGABRT inside torch or
    # gloo) prints its Python stack, so a rare native crash leaves evidence behind.
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    for name in unset:
        full_env.pop(name, None)
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))[:200]} hung for {timeout}s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(target: str | Path, nproc: int, *args, timeout: float = 240.0,
             torchrun_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
             cwd: str | Path | None = None, pythonpath: tuple[str | Path, ...] = ()
             ) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node nproc target args`; target is a script path
    or "-m module"."""
    full_env = dict(env or {})
    if pythonpath:
        full_env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), os.environ.get("PYTHONPATH", "")])
    target_args = str(target).split(" ", 1) if str(target).startswith("-m ") else [str(target)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *torchrun_args, *target_args, *map(str, args)]
    return run_killable(cmd, timeout=timeout, env=full_env, cwd=cwd)
