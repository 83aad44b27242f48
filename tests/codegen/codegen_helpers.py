"""Helpers shared by the codegen tests (generate in-process, run generated scripts)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--gpu", "cpu", "--gpus-per-node", "4", "--global-batch", "8", "--seq-len", "64"]


def generate(*args: str) -> tuple[int, str, str]:
    """`autoplan generate ARGS` in-process: (exit code, stdout, stderr)."""
    from click.testing import CliRunner

    from autoplan.cli import main

    import click

    @click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @click.pass_context
    def entry(ctx):
        main(ctx.args)

    result = CliRunner().invoke(entry, ["generate", *args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def run_script(script: Path, *args: str, cwd: Path, timeout: float = 300.0,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a generated shell script with the venv's torchrun on PATH (tests/multirank.py)."""
    from multirank import run_killable

    full_env = dict(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    full_env.update(env or {})
    return run_killable(["bash", str(script), *map(str, args)], timeout=timeout, cwd=cwd, env=full_env,
                        unset=("RDZV_ENDPOINT", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NPROC_PER_NODE"))


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pattern_tokens(path: Path) -> Path:
    """A uint16 token file repeating 0..15: a pattern the tiny model learns within a few steps."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.arange(16, dtype=torch.int16).repeat(4096).numpy().tofile(path)
    return path


@pytest.fixture(scope="session")
def tiny_job(tmp_path_factory) -> Path:
    """tiny-gpt generated for 4 CPU ranks (the planner's choice)."""
    out = tmp_path_factory.mktemp("jobs") / "tiny"
    code, stdout, stderr = generate("tiny-gpt", *TINY, "--gpus", "4", "-o", str(out))
    assert code == 0, stdout + stderr
    return out


@pytest.fixture(scope="session")
def two_rank_job(tmp_path_factory) -> Path:
    """tiny-gpt generated for 2 CPU ranks: the planner's DDP with one micro-batch a step, as at
    4 ranks, for tests that launch it many times (a 4-rank launch costs twice the CPU)."""
    out = tmp_path_factory.mktemp("jobs") / "tiny2"
    code, stdout, stderr = generate("tiny-gpt", *TINY, "--gpus", "2", "--gpus-per-node", "2", "-o", str(out))
    assert code == 0, stdout + stderr
    return out


@pytest.fixture
def shellcheck() -> str:
    path = shutil.which("shellcheck")
    if path is None:
        pytest.skip("shellcheck is not installed")
    return path
