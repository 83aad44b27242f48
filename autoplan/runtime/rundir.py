"""The run directory belongs to one job at a time, and its metrics hold each step once.

A job holds an exclusive `flock` on `<dir>/.autoplan.lock` in its run directory and in its
checkpoint directory (rank 0, from before the process group starts until it exits); the
kernel drops the lock when the process dies, so a crashed job never leaves a stale lock.
Every rank's writes (metrics, checkpoint shards) come after rank 0 took the locks, since no
rank passes the process group's rendezvous before rank 0 joins it. Ranks on other nodes take
no lock: a flock is seen across nodes only on a shared file system that supports it (NFSv4,
Lustre mounted with -o flock), and there rank 0's lock covers them too.

Two jobs' directories must not nest: a directory is refused when it, any directory above it,
or any directory below it holds another job's lock (a checkpoint directory inside another
job's run directory would replace that job's checkpoints). A job takes its own locks first
and looks for other jobs' locks after, so of two jobs starting at once at least one sees the
other (both may stop; neither writes).

torchrun restarts every worker when one fails, rank 0 refused by the lock included; a
restarted rank 0 therefore takes a directory only when its lock file names this run's id
(torchrun's run id, one per launch), so a refused launch never takes over the directory
once the first job has ended.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from autoplan.errors import UserError
from autoplan.files import open_no_follow, refuse_link

LOCK_NAME = ".autoplan.lock"
METRICS_NAME = "metrics.jsonl"
_RETRIES = 5  # another job's look at a lock holds it for microseconds: try again briefly


def _read_holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        holder = json.loads(os.read(fd, 4096).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _holder_text(holder: dict) -> str:
    if not holder:
        return "another job"
    return f"job pid {holder.get('pid')} on {holder.get('host')} (run id {holder.get('run_id') or '-'})"


def _refusal(directory: Path, holder: dict, locked: Path | None = None) -> UserError:
    where = "" if locked in (None, directory) else f" (its lock is on {locked})"
    return UserError(f"the directory {directory} is in use by {_holder_text(holder)}{where}; two "
                     "jobs in one directory, or in directories inside one another, would interleave "
                     "metrics.jsonl and replace each other's checkpoints. Wait for that job to end, or "
                     "give this one its own --run-dir (and --checkpoint-dir) outside that job's.")


def _taken_over(directory: Path, holder: dict) -> UserError:
    return UserError(f"the directory {directory} was held by {_holder_text(holder)}, not by this "
                     "launch, whose first attempt was refused; its restarted workers do not take "
                     "that job's directory over (they would resume from its checkpoints and append "
                     "to its metrics). Give this job its own --run-dir (and --checkpoint-dir), or "
                     "launch it again.")


def _try_flock(fd: int, how: int) -> bool:
    for attempt in range(_RETRIES):
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt + 1 < _RETRIES:
                time.sleep(0.01)
    return False


class DirectoryLock:
    """An exclusive lock on a directory, held until `release` or process exit."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self.directory / LOCK_NAME

    def acquire(self, run_id: str = "", restarted: bool = False) -> "DirectoryLock":
        """Take the lock; UserError when another job holds it or, for a restarted worker
        (`restarted`), when the lock file names another run (this run never held it)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        if not _try_flock(fd, fcntl.LOCK_EX):
            holder = _read_holder(fd)
            os.close(fd)
            raise _refusal(self.directory, holder)
        holder = _read_holder(fd)
        if restarted and holder and holder.get("run_id") != run_id:
            os.close(fd)
            raise _taken_over(self.directory, holder)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "run_id": run_id}).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def lock_job(directories: list[Path], run_id: str = "", restarted: bool = False) -> list[DirectoryLock]:
    """Lock every directory of a job, then refuse when another job holds a lock above or below
    one of them; on refusal nothing stays locked. (Looked for first as well, so that a refused
    job leaves no lock file in another job's directories.)"""
    for directory in directories:
        check_unlocked(directory)
    locks: list[DirectoryLock] = []
    try:
        for directory in directories:
            locks.append(DirectoryLock(directory).acquire(run_id, restarted))
        own = {lock.path.resolve() for lock in locks}
        for directory in directories:
            _refuse_nested(directory, own, run_id="")
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


def check_unlocked(directory: str | Path, run_id: str = "") -> None:
    """UserError when another job holds `directory`, a directory above it or one below it (a
    holder with our non-empty run id is this job's own rank 0 on another node)."""
    _refuse_nested(Path(directory), set(), run_id)


def _refuse_nested(directory: Path, own: set[Path], run_id: str) -> None:
    real = directory.resolve()
    candidates = [parent / LOCK_NAME for parent in (real, *real.parents)]
    if real.is_dir():
        candidates += [Path(top) / LOCK_NAME for top, _dirs, files in os.walk(real)
                       if LOCK_NAME in files and Path(top) != real]
    for path in candidates:
        if path in own or not os.path.lexists(path):
            continue
        holder = _held_by(path)
        if holder is not None and not (run_id and holder.get("run_id") == run_id):
            raise _refusal(directory, holder, path.parent)


def _held_by(path: Path) -> dict | None:
    """The holder of the lock file at `path`, or None when no process holds it."""
    refuse_link(path)
    try:
        fd = open_no_follow(path, os.O_RDONLY)
    except OSError:  # unreadable (another user's directory): not ours to judge
        return None
    try:
        if _try_flock(fd, fcntl.LOCK_SH):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        return _read_holder(fd)
    finally:
        os.close(fd)


def refuse_linked_run_files(run_dir: str | Path) -> None:
    """UserError when metrics.jsonl is a link: found before any rank starts, not at step 0."""
    refuse_link(Path(run_dir) / METRICS_NAME)


def job_directories(run_dir: str, checkpoint_dir: str) -> list[Path]:
    """The run directory, and the checkpoint directory when it lies outside it."""
    run, ckpt = Path(run_dir).resolve(), Path(checkpoint_dir).resolve()
    return [run] if ckpt == run or run in ckpt.parents else [run, ckpt]


def drop_metrics_from(path: str | Path, first_step: int) -> int:
    """Remove rows with step >= first_step (steps about to be replayed) and a torn last line;
    returns how many rows were removed."""
    path = Path(path)
    refuse_link(path)
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
        if os.path.lexists(tmp):
            os.unlink(tmp)  # a link is removed, not followed
        with os.fdopen(open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as fh:
            fh.write("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped
