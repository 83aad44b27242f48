"""Dry-run a whole plan: the ranks that differ, each in a fresh process.

A fresh process per rank (one process runs one rank and exits: a reused one would hold the
previous rank's world) because torch keeps process-group names and mesh state across
`destroy_process_group` (a second fake world in one process fails with "Could not resolve
the process group registered under the name ..."), and so the caller's process keeps no
fake group or patched DeviceMesh. The ranks' processes are forked from the dry run's host
process (autoplan.dryrun.host), so each starts with torch and the runtime imported. Pipeline
rank 0 runs first: what its first stage hands
on is the input every later stage is fed. The other ranks then run side by side.
"""

from __future__ import annotations

import gc
import time
from concurrent.futures import Future

from torch._subclasses.fake_tensor import DynamicOutputShapeException

from autoplan.dryrun.rank import Boundary, RankRun, representative_ranks, run_rank
from autoplan.dryrun.host import Forked, RankFailed, run_in_host
from autoplan.errors import UserError
from autoplan.models.sources import build_from_ref
from autoplan.plan import Plan


def _run_in_worker(plan_dict: dict, rank: int, boundary: Boundary) -> tuple[RankRun, float]:
    # A rank's process runs one step and exits, which frees its cycles; the collector's passes
    # over the step's many short-lived objects cost about 7% of its CPU time.
    gc.disable()
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
    return run_in_host(run_ranks, plan.to_dict(), workers)


def run_ranks(plan_dict: dict, workers: int) -> list[tuple[RankRun, float]]:
    """In the host process: each representative rank in a process forked from it, at most
    `workers` at a time after pipeline rank 0."""
    plan = Plan.from_dict(plan_dict)
    ranks = representative_ranks(plan)
    gc.freeze()  # the host's objects stay out of the ranks' collections (and their pages shared)
    try:
        first = _result(Forked(_run_in_worker, plan_dict, ranks[0], []), plan, ranks[0])
        running: dict[int, Forked] = {}
        results = {}
        for rank in ranks[1:]:
            if len(running) == workers:  # the oldest makes room
                oldest = next(iter(running))
                results[oldest] = _result(running.pop(oldest), plan, oldest)
            running[rank] = Forked(_run_in_worker, plan_dict, rank, first[0].boundary)
        results.update({rank: _result(forked, plan, rank) for rank, forked in running.items()})
    finally:
        gc.unfreeze()  # collectable again when the host exits
    return [first] + [results[rank] for rank in ranks[1:]]


def _result(future: Future | Forked, plan: Plan, rank: int) -> tuple[RankRun, float]:
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
