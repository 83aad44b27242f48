"""How a run stops on a fault without ending with exit 0 and wrong or lost data.

Exit statuses of train.py (every rank; launch.sh and slurm.sbatch pass them on):
  0    done.
  2    bad input (the plan, the model, the data, the run directory, the checkpoints).
  3    a non-finite loss or gradient norm (NaN/inf): nothing from that step was applied or
       saved; the newest checkpoint is the last good state. `--skip-bad-steps N` skips up to
       N such steps instead (no optimizer step), each one logged, and stops at the next.
  4    a checkpoint could not be written: the disk (or quota) is full, or another OSError.
       The half-written step_*.tmp folder is removed; the previous checkpoints are untouched.
  143  preempted (SIGTERM or SIGUSR1): a checkpoint of the last finished step was saved, run
       again with --resume to continue. 143 is what a process ended by SIGTERM reports, so
       launchers that retry on 128-255 (Kubernetes' ExitCode restart policy) retry it.

A stopping run's rank 0 writes <run_dir>/exit.json ({"status", "reason", "step", "message"}):
torchrun's own exit status does not carry the workers' (it is 1 after a signal), so
launch.sh reads this file. Workers that torchrun restarts after such a stop (--max-restarts)
find the file and exit at once with the same status instead of replaying the steps.

Signals: torchrun forwards SIGTERM (and the signals in --signals-to-handle) to its workers
and sends SIGKILL --shutdown-timeout seconds later (30 by default; launch.sh asks for more).
The handlers here only set a flag; the ranks agree on it at the next step boundary (it rides
on the per-step all-reduce of the non-finite flags, so it costs no extra collective).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from autoplan.errors import UserError
from autoplan.files import write_file

EXIT_NON_FINITE = 3
EXIT_CHECKPOINT_WRITE = 4
EXIT_REQUEUE = 143
EXIT_FILE = "exit.json"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class RunStopped(Exception):
    """The run stops with `status`; rank 0 reports `message` (one paragraph)."""

    def __init__(self, status: int, reason: str, step: int, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.step, self.message = status, reason, step, message


class StopFlag:
    """Set by SIGTERM/SIGUSR1; read at step boundaries."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def _handler(self, signum, _frame) -> None:
        self.signum = signum

    def install(self) -> "StopFlag":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


STOP = StopFlag()


class StepVerdict:
    """What every rank agreed after one step's backward: which ranks' losses were not finite,
    whether the gradient norm was not finite, whether a stop signal arrived anywhere."""

    def __init__(self, flags: list[float], world: int) -> None:
        self.bad_ranks = [rank for rank in range(world) if flags[rank] > 0]
        self.bad_norm = flags[world] > 0
        self.stop = flags[world + 1] > 0

    @property
    def bad(self) -> bool:
        return bool(self.bad_ranks) or self.bad_norm

    def describe(self, step: int, grad_norm: float) -> str:
        if self.bad_ranks:
            ranks = ", ".join(map(str, self.bad_ranks))
            return f"step {step}: the loss is not finite (NaN or inf) on rank{'s' if len(self.bad_ranks) > 1 else ''} {ranks}"
        return f"step {step}: the gradient norm is not finite ({grad_norm}) on every rank"


def agree_on_step(local_loss: torch.Tensor | None, grad_norm: float, scaler_skipped: bool,
                  device: torch.device) -> StepVerdict:
    """One all-reduce (MAX) of this rank's flags. An fp16 overflow step that the loss scaler
    skips has an infinite gradient norm by design and is not a bad step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    flags = torch.zeros(world + 2)
    if local_loss is not None and not bool(torch.isfinite(local_loss.detach().float()).all()):
        flags[rank] = 1.0
    if not scaler_skipped and not torch.isfinite(torch.tensor(grad_norm)):
        flags[world] = 1.0
    flags[world + 1] = 1.0 if STOP.signum else 0.0
    flags = flags.to(device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return StepVerdict(flags.cpu().tolist(), world)


def non_finite_stop(step: int, verdict: StepVerdict, grad_norm: float, skipped: int,
                    newest: Path | None) -> RunStopped:
    allowed = f" after skipping {skipped} such step{'s' if skipped != 1 else ''} (--skip-bad-steps)" \
        if skipped else ""
    resume = (f"the newest checkpoint, {newest}, holds the last good state: run again with --resume "
              "(a lower lr or --skip-bad-steps N may get past it)" if newest else
              "no checkpoint was written before it; --skip-bad-steps N skips up to N such steps")
    return RunStopped(EXIT_NON_FINITE, "non-finite", step,
                      f"{verdict.describe(step, grad_norm)}{allowed}. The job stops before the "
                      f"optimizer step: nothing from step {step} was applied or saved, and "
                      f"{resume}.")


def is_no_space(exc: BaseException) -> bool:
    return any(getattr(e, "errno", None) in NO_SPACE for e in causes(exc))


def causes(exc: BaseException) -> list[BaseException]:
    """`exc`, its causes and contexts, and the per-rank failures a DCP CheckpointException holds."""
    seen, todo = [], [exc]
    while todo:
        current = todo.pop()
        if current is None or any(current is e for e in seen):
            continue
        seen.append(current)
        todo += [current.__cause__, current.__context__]
        for failure in (getattr(current, "failures", None) or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return seen


def checkpoint_write_stop(step: int, directory: str, failures: list[str], no_space: bool,
                          needed_bytes: int) -> RunStopped:
    try:
        free_bytes = _free_bytes(directory)
        free = f"{_gib(free_bytes)} free"
        # torch.save's zip writer reports a full disk as "file write failed", without errno
        no_space = no_space or free_bytes < needed_bytes
    except OSError:
        free = "free space unknown"
    what = "the disk (or the quota) is full" if no_space else "writing failed"
    return RunStopped(EXIT_CHECKPOINT_WRITE, "checkpoint-write", step,
                      f"the checkpoint of step {step} could not be written to {directory}: {what} "
                      f"({'; '.join(failures[:4])}). It needs about {_gib(needed_bytes)} "
                      f"({needed_bytes:,} bytes) and the filesystem has {free}. The unfinished "
                      "step folder was removed and the previous checkpoints are intact; free space "
                      "(or choose another --checkpoint-dir) and run again with --resume.")


def _free_bytes(directory: str) -> int:
    import shutil

    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _gib(count: int) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def preempted_stop(step: int, signum: int, path: Path | None) -> RunStopped:
    name = signal.Signals(signum).name if signum else "a stop signal"
    return RunStopped(EXIT_REQUEUE, "preempted", step,
                      f"{name} received: saved the checkpoint {path} after step {step} and stopped "
                      f"(exit status {EXIT_REQUEUE}: requeue). Run again with --resume to continue.")


def write_exit_file(run_dir: str, stopped: RunStopped) -> None:
    """Rank 0: the record launch.sh reads. A full disk must not hide the real error."""
    try:
        path = Path(run_dir) / EXIT_FILE
        tmp = path.with_name(path.name + ".tmp")
        if tmp.is_symlink():
            tmp.unlink()
        write_file(tmp, (json.dumps({"status": stopped.status, "reason": stopped.reason, "step": stopped.step,
                                     "message": stopped.message}) + "\n").encode())
        os.replace(tmp, path)  # replaces a link named exit.json, never writes through it
    except (OSError, UserError):
        pass


def earlier_stop(run_dir: str) -> dict | None:
    """The stop recorded by an earlier attempt of this torchrun launch, if any."""
    try:
        record = json.loads((Path(run_dir) / EXIT_FILE).read_text())
        return record if isinstance(record, dict) and int(record["status"]) > 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_exit_file(run_dir: str) -> None:
    (Path(run_dir) / EXIT_FILE).unlink(missing_ok=True)
