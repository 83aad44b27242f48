"""The run directory belongs to one job at a time, and its metrics hold each step once.

A job holds an exclusive `flock` on `<dir>/.autoplan.lock` (rank 0, for the run directory and
the checkpoint directory) from before the process group starts until it exits; the kernel
drops the lock when the process dies, so a restarted or crashed job never leaves a stale
lock behind. A second job finds the lock taken and stops with the holder named.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

from autoplan.errors import UserError

LOCK_NAME = ".autoplan.lock"


def _holder_text(fh) -> str:
    fh.seek(0)
    try:
        holder = json.loads(fh.read() or "{}")
    except ValueError:
        holder = {}
    if not holder:
        return "another job"
    return f"job pid {holder.get('pid')} on {holder.get('host')} (run id {holder.get('run_id') or '-'})"


def _refusal(directory: Path, holder: str) -> UserError:
    return UserError(f"the run directory {directory} is in use by {holder}; two jobs in one "
                     "directory would interleave metrics.jsonl and replace each other's "
                     "checkpoints. Wait for that job to end, or give this one its own --run-dir "
                     "(and --checkpoint-dir).")


class DirectoryLock:
    """An exclusive lock on a directory, held until `release` or process exit."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._fh = None

    def acquire(self, run_id: str = "") -> "DirectoryLock":
        self.directory.mkdir(parents=True, exist_ok=True)
        fh = open(self.directory / LOCK_NAME, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(fh)
            fh.close()
            raise _refusal(self.directory, holder) from None
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id}))
        fh.flush()
        self._fh = fh
        return self

    def release(self) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


def check_unlocked(directory: str | Path, run_id: str = "") -> None:
    """UserError when another job holds `directory` (a holder with our non-empty run id is
    this job's own rank 0 on another node)."""
    path = Path(directory) / LOCK_NAME
    if not path.is_file():
        return
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            try:
                holder_id = json.loads(fh.read() or "{}").get("run_id", "")
            except ValueError:
                holder_id = ""
            if run_id and holder_id == run_id:
                return
            raise _refusal(Path(directory), _holder_text(fh)) from None
        fcntl.flock(fh, fcntl.LOCK_UN)


def job_directories(run_dir: str, checkpoint_dir: str) -> list[Path]:
    """The run directory, and the checkpoint directory when it lies outside it."""
    run, ckpt = Path(run_dir).resolve(), Path(checkpoint_dir).resolve()
    return [run] if ckpt == run or run in ckpt.parents else [run, ckpt]


def drop_metrics_from(path: str | Path, first_step: int) -> int:
    """Remove rows with step >= first_step (steps about to be replayed) and a torn last line;
    returns how many rows were removed."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            keep = isinstance(row, dict) and int(row.get("step", -1)) < first_step
        except (ValueError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped
