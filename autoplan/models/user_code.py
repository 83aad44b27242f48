"""Running the user's model code (import, build_model(), example_inputs(), the traced forward)
so that whatever it does, the command still answers in one paragraph.

`user_code(phase)` is the one guard: a time limit (`--load-timeout`, default 120 s), a
`sys.exit()` in the file turned into a UserError, and what the code prints held back so that
a failure's message stays one paragraph (on success it is printed as the code printed it).

The limit is SIGALRM-based, so it works in the main thread of a process (every command runs
there) and interrupts Python code only: a C call that never returns to the interpreter (a
native extension looping, a blocking read in C) cannot be interrupted, and off the main thread
there is no limit. After the first alarm it repeats every second, so user code that catches
the interruption and loops on is interrupted again.
"""

from __future__ import annotations

import io
import math
import signal
import sys
import threading
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from typing import Iterator

from autoplan.errors import UserError

DEFAULT_LOAD_TIMEOUT_S = 120.0
USER_MODULE_PREFIX = "autoplan_user_model_"  # the module a model file is executed as
_REPEAT_S = 1.0
_limit_s = DEFAULT_LOAD_TIMEOUT_S
_phases: list[str] = []  # the phases in progress, innermost last


class _OutOfTime(BaseException):
    """Raised into the user's code by the alarm; a BaseException so `except Exception` in that
    code does not swallow it."""


def set_load_timeout(seconds: float) -> None:
    """The time limit of each phase of user code; UserError unless a positive finite number."""
    global _limit_s
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise UserError(f"--load-timeout must be a positive number of seconds, got {seconds}")
    _limit_s = float(seconds)


def _can_alarm() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _on_alarm(signum, frame) -> None:
    raise _OutOfTime()


@contextmanager
def _time_limit() -> Iterator[None]:
    """The limit around the outermost phase; inner phases run under it."""
    if len(_phases) > 1 or not _can_alarm():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, _limit_s, _REPEAT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def user_code(phase: str) -> Iterator[None]:
    """Run the user's code of `phase` ("importing m.py", "build_model() in m.py", ...)."""
    _phases.append(phase)
    out, err = io.StringIO(), io.StringIO()
    failed = True
    try:
        with _time_limit(), redirect_stdout(out), redirect_stderr(err):
            yield
        failed = False
    except _OutOfTime:
        raise UserError(f"{_phases[-1]} did not finish within {_limit_s:g} s (--load-timeout): look for a "
                        "loop or a very slow step there, or give it longer with --load-timeout SECONDS") from None
    except SystemExit as exc:
        raise UserError(f"{_phases[-1]} called sys.exit({exc.code!r}); a model file must not exit the "
                        "process: raise an exception or return the model instead") from None
    finally:
        _phases.pop()
        if not failed:
            sys.stdout.write(out.getvalue())
            sys.stderr.write(err.getvalue())
