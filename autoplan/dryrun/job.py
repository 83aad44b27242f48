"""Dry-run a whole plan: the ranks that differ, each in a fresh process.

A fresh process per rank (one process runs one rank and exits: a reused one would hold the
previous rank's world) because torch keeps process-group names and mesh state across
`destroy_process_group` (a second fake world in one process fails with "Could not resolve
the process group registered under the name ..."), and so the caller's process keeps no
fake group or patched DeviceMesh. The ranks' processes are forked from one host process,
spawned fresh, that imports torch and the runtime once and runs no torch op (so it holds no
torch threads or process group to fork): each rank starts with the imports done, which a
spawned process per rank paid again. Pipeline rank 0 runs first: what its first stage hands
on is the input every later stage is fed. The other ranks then run side by side.
"""

from __future__ import annotations

import gc
import multiprocessing
import time
import traceback
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from torch._subclasses.fake_tensor import DynamicOutputShapeException

from autoplan.dryrun.rank import Boundary, RankRun, representative_ranks, run_rank
from autoplan.errors import UserError
from autoplan.models.sources import build_from_ref
from autoplan.plan import Plan


class RankFailed(Exception):
    """A rank's failure as plain text: "Type: message" of what the worker raised (an exception
    holding torch objects does not pickle back to the parent process)."""


def _run_in_worker(plan_dict: dict, rank: int, boundary: Boundary) -> tuple[RankRun, float]:
    start = time.perf_counter()
    plan = Plan.from_dict(plan_dict)
    build = lambda: build_from_ref(plan.model, seq_len=plan.seq_len, verify=False)  # noqa: E731
    try:
        return run_rank(plan, build, build(), rank, boundary), time.perf_counter() - start
    except DynamicOutputShapeException as exc:
        raise RankFailed(
            f"the model computes a tensor's shape from its values ({exc.func}), which fake "
            "tensors cannot run (the dry run makes only autoplan's MoE routing counts "
            "concrete, balanced), so `autoplan check` cannot dry-run this model; `autoplan "
            "estimate` gives the cost model's memory") from exc
    except Exception as exc:
        raise RankFailed(f"{type(exc).__name__}: {exc}") from exc


def dry_run(plan: Plan, workers: int = 2) -> list[tuple[RankRun, float]]:
    """(RankRun, seconds) for each representative rank, in rank order."""
    context = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as host:
        try:
            return host.submit(_run_ranks, plan.to_dict(), workers).result()
        except BrokenProcessPool as exc:
            raise UserError("the dry run's host process ended without a result (was it killed, "
                            "or out of memory?)") from exc


def _run_ranks(plan_dict: dict, workers: int) -> list[tuple[RankRun, float]]:
    """In the host process: each representative rank in a process forked from it, at most
    `workers` at a time after pipeline rank 0."""
    plan = Plan.from_dict(plan_dict)
    ranks = representative_ranks(plan)
    gc.freeze()  # the host's objects stay out of the ranks' collections (and their pages shared)
    try:
        first = _result(_ForkedRank(plan_dict, ranks[0], []), plan, ranks[0])
        running: dict[int, _ForkedRank] = {}
        results = {}
        for rank in ranks[1:]:
            if len(running) == workers:  # the oldest makes room
                oldest = next(iter(running))
                results[oldest] = _result(running.pop(oldest), plan, oldest)
            running[rank] = _ForkedRank(plan_dict, rank, first[0].boundary)
        results.update({rank: _result(forked, plan, rank) for rank, forked in running.items()})
    finally:
        gc.unfreeze()  # collectable again when the host exits
    return [first] + [results[rank] for rank in ranks[1:]]


class _WorkerTraceback(Exception):
    """The traceback of a rank's failure in its process, as text (chained for --debug)."""


def _send_run(conn, plan_dict: dict, rank: int, boundary: Boundary) -> None:
    try:
        message = ("ok", _run_in_worker(plan_dict, rank, boundary))
    except RankFailed as exc:
        message = ("failed", str(exc), traceback.format_exc())
    try:
        conn.send(message)
    except Exception as exc:  # a result that does not pickle: nothing was sent yet
        conn.send(("failed", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    conn.close()


class _ForkedRank:
    """One rank's dry run in a process forked from this one; `result()` as a Future's."""

    def __init__(self, plan_dict: dict, rank: int, boundary: Boundary) -> None:
        context = multiprocessing.get_context("fork")  # from the host, which runs no torch op
        self._conn, child_end = context.Pipe(duplex=False)
        self._process = context.Process(target=_send_run, args=(child_end, plan_dict, rank, boundary),
                                        daemon=True)
        self._process.start()
        child_end.close()

    def result(self) -> tuple[RankRun, float]:
        try:
            message = self._conn.recv()  # before join: a large result fills the pipe
        except EOFError:
            message = ("failed", "", "")  # the process ended without sending
        self._conn.close()
        self._process.join()
        if message[0] == "failed":
            raise RankFailed(message[1]) from (_WorkerTraceback(message[2]) if message[2] else None)
        return message[1]


def _result(future: Future | _ForkedRank, plan: Plan, rank: int) -> tuple[RankRun, float]:
    """The rank's run, or a UserError naming the rank and the cause (the worker's traceback
    stays on the chain for --debug)."""
    try:
        return future.result()
    except Exception as exc:
        cause = " ".join(str(exc).split()).rstrip(".") or "its worker process ended without a result"
        if len(cause) > 400:
            cause = cause[:400] + " ..."
        raise UserError(
            f"the dry run of rank {rank} (pipeline rank {rank // (plan.world_size // plan.pp)} "
            f"of {plan.pp}) failed: {_named(exc, cause)}. It was raised while the "
            f"plan's runtime ran one step on fake tensors (a bug of the plan, of the runtime or "
            f"of the dry run itself); `autoplan --debug check PLAN` shows the traceback.") from exc


def _named(exc: Exception, cause: str) -> str:
    return cause if isinstance(exc, RankFailed) else f"{type(exc).__name__}: {cause}"
