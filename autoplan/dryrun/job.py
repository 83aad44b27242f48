"""Dry-run a whole plan: the ranks that differ, each in a fresh process.

A fresh process per rank (a pool worker runs one rank and exits: a reused worker would
hold the previous rank's world) because torch keeps process-group names and mesh state across
`destroy_process_group` (a second fake world in one process fails with "Could not resolve
the process group registered under the name ..."), and so the caller's process keeps no
fake group or patched DeviceMesh. Pipeline rank 0 runs first: what its first stage hands
on is the input every later stage is fed. The other ranks then run side by side.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import Future, ProcessPoolExecutor

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
    ranks = representative_ranks(plan)
    context = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(ranks))), mp_context=context,
                             max_tasks_per_child=1) as pool:
        first = _result(pool.submit(_run_in_worker, plan.to_dict(), ranks[0], []), plan, ranks[0])
        rest = {rank: pool.submit(_run_in_worker, plan.to_dict(), rank, first[0].boundary)
                for rank in ranks[1:]}
        return [first] + [_result(future, plan, rank) for rank, future in rest.items()]


def _result(future: Future, plan: Plan, rank: int) -> tuple[RankRun, float]:
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
