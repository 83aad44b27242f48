"""The dry run's processes: one host process, spawned fresh, and the processes forked from it.

The host imports torch and the runtime once and runs no torch op itself (so it holds no torch
threads or process group to fork); everything that runs torch (loading and tracing the model,
each rank's step) runs in a process forked from it, which starts with the imports done. The
caller's process never imports torch: `autoplan check` pays for torch's import once, in the
host, and gets back plain values. Since nothing a dry run does changes the host, a process that
checks several plans keeps one host for all of them. This module imports no torch.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from autoplan.errors import UserError


class RankFailed(Exception):
    """A forked process's failure as plain text: "Type: message" of what it raised (an
    exception holding torch objects does not pickle back to the parent process)."""


class WorkerTraceback(Exception):
    """The traceback of a failure in a forked process, as text (chained for --debug)."""


_hosts: dict[tuple, ProcessPoolExecutor] = {}
# set anew for every test by pytest; nothing a dry run reads
_UNREAD_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})


def _host() -> ProcessPoolExecutor:
    """This process's host, spawned on first use and kept while the working directory, the
    environment and sys.path it was spawned with are this process's (a host started under others
    would resolve paths and settings differently); ended with the process (concurrent.futures
    joins its workers at exit)."""
    environment = tuple(sorted(item for item in os.environ.items() if item[0] not in _UNREAD_VARIABLES))
    key = (os.getcwd(), environment, tuple(sys.path))
    if key not in _hosts:
        _end_host()
        context = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
        _hosts[key] = ProcessPoolExecutor(max_workers=1, mp_context=context)
    return _hosts[key]


def _end_host() -> None:
    for host in _hosts.values():
        host.shutdown(wait=False)
    _hosts.clear()


def run_in_host(fn: Callable, *args):
    """`fn(*args)` in the host process; a UserError it raises is raised here."""
    try:
        return _host().submit(fn, *args).result()
    except BrokenProcessPool as exc:
        _end_host()  # the next dry run spawns a fresh host
        raise UserError("the dry run's host process ended without a result (was it killed, "
                        "or out of memory?)") from exc


def _send(conn, fn: Callable, args: tuple) -> None:
    try:
        message = ("ok", fn(*args))
    except UserError as exc:  # bad input found in the child: the user's paragraph as it is
        message = ("user", str(exc), traceback.format_exc())
    except RankFailed as exc:
        message = ("failed", str(exc), traceback.format_exc())
    except Exception as exc:  # noqa: BLE001 - a bug: its type and text, for the caller to raise
        message = ("failed", f"{type(exc).__name__}: {exc}", traceback.format_exc())
    try:
        conn.send(message)
    except Exception as exc:  # a result that does not pickle: nothing was sent yet
        conn.send(("failed", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    conn.close()


class Forked:
    """`fn(*args)` in a process forked from this one (the host, which runs no torch op);
    `result()` as a Future's: the value, or what the child raised as UserError or RankFailed."""

    def __init__(self, fn: Callable, *args) -> None:
        context = multiprocessing.get_context("fork")
        self._conn, child_end = context.Pipe(duplex=False)
        self._process = context.Process(target=_send, args=(child_end, fn, args), daemon=True)
        self._process.start()
        child_end.close()

    def result(self):
        try:
            message = self._conn.recv()  # before join: a large result fills the pipe
        except EOFError:
            message = ("failed", "", "")  # the process ended without sending
        self._conn.close()
        self._process.join()
        kind, *rest = message
        if kind == "ok":
            return rest[0]
        cause = WorkerTraceback(rest[1]) if rest[1] else None
        raise (UserError if kind == "user" else RankFailed)(rest[0]) from cause
