"""Plan one training job on every (GPU type, count) and price each plan for a whole run.

The model is traced once by the caller (`trace.load.load_graph`); every cluster reuses that
graph. A cluster where nothing fits, or where the global batch does not split, is a row with
its reason, not an error. Time to train is the goodput wall time (checkpoints, interruptions,
restarts: `goodput.py`) of ceil(tokens / (global batch x seq len)) steps.
Clusters are planned in parallel processes forked from the caller (one per core), each
planning whole clusters exactly as the serial sweep does; the rows keep their order.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from autoplan.cost import CostCache, memory
from autoplan.errors import UserError
from autoplan.hardware import make_cluster, with_memory_headroom
from autoplan.report.arguments import check_positive
from autoplan.report.goodput import Goodput, GoodputAssumptions, checkpoint_bytes, goodput
from autoplan.solve.api import plan_job

if TYPE_CHECKING:  # accuracy stays importable as a script (python -m autoplan.report.accuracy)
    from autoplan.report.accuracy import ErrorBand

GIB = 2**30
HOUR_S = 3600.0
DAY_S = 86400.0
SEARCH_DEFAULT_LIMIT_S = 60.0  # solve.search.search's default time_limit_s


@dataclass
class RunCost:
    """A plan priced for a whole run: steps, goodput wall time, GPU-hours and cost with ranges."""

    steps: int
    goodput: Goodput
    gpu_hours: float
    cost_usd: float
    time_range_s: tuple[float, float]
    cost_range_usd: tuple[float, float]

    @property
    def time_s(self) -> float:
        return self.goodput.wall_s


def price_run(step_time_s: float, num_gpus: int, tokens: int, tokens_per_step: int, parameters: float,
              precision: str, usd_per_gpu_hour: float, assumptions: GoodputAssumptions,
              error: ErrorBand | None) -> RunCost:
    """Steps to train `tokens`, the goodput wall time, GPU-hours, cost and their error ranges."""
    steps = math.ceil(tokens / tokens_per_step)
    size = checkpoint_bytes(parameters, memory.weight_bytes_per_param(precision),
                            memory.optimizer_bytes_per_param(precision))
    g = goodput(steps * step_time_s, step_time_s, num_gpus, size, assumptions)
    gpu_hours = g.wall_s * num_gpus / HOUR_S
    cost = gpu_hours * usd_per_gpu_hour
    band = error.range if error else (lambda v: (v, v))
    return RunCost(steps=steps, goodput=g, gpu_hours=gpu_hours, cost_usd=cost,
                   time_range_s=band(g.wall_s), cost_range_usd=band(cost))


@dataclass
class Row:
    """One (GPU type, count): its best plan priced, or why nothing fits."""

    gpu: str
    gpu_name: str
    num_gpus: int
    capacity_gib: float
    usd_per_gpu_hour: float
    reason: str = ""  # why nothing fits ("" when a plan fits)
    plan: Any = None  # autoplan.plan.Plan
    estimate: dict = field(default_factory=dict)
    solver_status: str = ""
    solver_wall_s: float = 0.0
    search: dict = field(default_factory=dict)  # SearchResult.search_json(): whether a time limit cut it
    run: RunCost | None = None
    frontier: bool = False
    runners_up: list[dict] = field(default_factory=list)  # config, step time and memory of each

    @property
    def fits(self) -> bool:
        return self.plan is not None

    @property
    def label(self) -> str:
        return f"{self.num_gpus} x {self.gpu}"

    @property
    def headroom_gib(self) -> float:
        return self.capacity_gib - self.estimate["memory_gib_per_gpu"]


@dataclass
class Sweep:
    model: str
    tokens: int
    seq_len: int
    global_batch: int
    precision: str
    rows: list[Row]
    assumptions: GoodputAssumptions
    error: ErrorBand | None
    price_list: str
    budget_usd: float | None = None
    deadline_days: float | None = None
    wall_s: float = 0.0


def plan_row(graph, ref, gpu, num_gpus: int, *, seq_len: int, global_batch: int, tokens: int,
             precision: str, usd_per_gpu_hour: float, assumptions: GoodputAssumptions,
             error: ErrorBand | None, time_limit_s: float | None = None,
             memory_headroom_gib: float = 0.0, inter_node_bandwidth_gb_per_s: float | None = None,
             gpus_per_node: int | None = None, fixed: dict | None = None, top: int = 0,
             cache: CostCache | None = None) -> Row:
    """The best plan on `num_gpus` x `gpu` (the fastest, as `autoplan plan`, with the same
    `fixed` choices and `top` runners-up), priced. `cache`: the costs of `graph` computed for
    other clusters (solve.search)."""
    row = Row(gpu=gpu.key, gpu_name=gpu.name, num_gpus=num_gpus, capacity_gib=gpu.memory_bytes / GIB,
              usd_per_gpu_hour=usd_per_gpu_hour)
    try:
        cluster = with_memory_headroom(make_cluster(gpu, num_gpus, gpus_per_node, inter_node_bandwidth_gb_per_s),
                                       memory_headroom_gib)
        # top=0 (the default): only the best is needed; the search then prunes against it alone
        job = plan_job(graph, ref, cluster, global_batch=global_batch, seq_len=seq_len, precision=precision,
                       fixed=fixed, top=top, cache=cache,
                       time_limit_s=SEARCH_DEFAULT_LIMIT_S if time_limit_s is None else time_limit_s)
    except UserError as exc:  # the batch does not split, a partial node, ...: this cluster only
        row.reason = str(exc)
        return row
    row.solver_status, row.solver_wall_s = job.result.status, job.result.wall_s
    row.search = job.result.search_json()
    if job.plan is None and job.result.time_limited:
        row.reason = (f"no plan found within the search time limit ({job.result.time_limit_s:g} s, "
                      f"{job.result.configurations_searched} of {job.result.configurations_considered} "
                      "configurations searched); not proven not to fit: raise --time-limit")
        return row
    if job.plan is None:
        headroom_gib = cluster.memory_headroom_bytes / GIB
        kept = f" less {headroom_gib:g} GiB of headroom" if headroom_gib else ""
        row.reason = (f"no configuration fits in {row.capacity_gib:.1f} GiB per GPU{kept} "
                      f"({job.result.configurations_considered} searched; any needs at least "
                      f"{job.result.least_memory_gib:.1f} GiB)")
        return row
    row.plan, row.estimate = job.plan, job.result.best.estimate.to_dict()
    row.runners_up = [runner_up(c) for c in job.result.alternatives]
    row.run = price_run(row.estimate["step_time_s"], num_gpus, tokens, global_batch * seq_len,
                        graph.parameters, job.plan.precision, usd_per_gpu_hour, assumptions, error)
    return row


def runner_up(candidate) -> dict:
    """A runner-up of the search as plain data: its degrees and setup, step time and memory."""
    c = candidate.config
    return {"config": {"dp": c.dp, "tp": c.tp, "pp": c.pp, "cp": c.cp, "ep": c.ep, "zero_stage": c.zero_stage,
                       "offload": c.offload, "micro_batch": c.micro_batch, "schedule": c.schedule, "vpp": c.vpp,
                       "precision": c.precision},
            "step_time_s": candidate.estimate.step_time_s,
            "memory_gib_per_gpu": candidate.estimate.memory_gib_per_gpu}


def default_workers(clusters: int) -> int:
    """Processes for a sweep: one per usable core, at most one per cluster."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, clusters))


def _plan_cluster(shared: dict, gpu_index: int, num_gpus: int) -> Row:
    """plan_row of one cluster of the sweep; the GPU by index, so that one GPU object (and the
    costs the sweep's cache keeps for it) serves all of its counts in a process."""
    gpu = shared["gpus"][gpu_index]
    return plan_row(shared["graph"], shared["ref"], gpu, num_gpus, **shared["kwargs"],
                    usd_per_gpu_hour=shared["prices"][gpu.key], cache=shared["cache"])


_WORKER: dict = {}  # a worker process's copy of what every cluster shares (set by fork, not pickled)


def _init_worker(shared: dict) -> None:
    _WORKER.update(shared)


def _plan_in_worker(gpu_index: int, num_gpus: int) -> Row:
    return _plan_cluster(_WORKER, gpu_index, num_gpus)


def run_sweep(graph, ref, gpus: list, counts: list[int], *, seq_len: int, global_batch: int, tokens: int,
              prices: dict[str, float], precision: str = "bf16",
              assumptions: GoodputAssumptions = GoodputAssumptions(), error: ErrorBand | None = None,
              price_list: str = "default", budget_usd: float | None = None,
              deadline_days: float | None = None, time_limit_s: float | None = None,
              memory_headroom_gib: float = 0.0, inter_node_bandwidth_gb_per_s: float | None = None,
              gpus_per_node: int | None = None, fixed: dict | None = None, top: int = 0,
              progress: Callable[[int, int, str], None] | None = None, workers: int | None = None) -> Sweep:
    """Every (GPU, count) planned on one traced graph; frontier marked. `progress(done, total, label)`
    with the label of a cluster being planned. Clusters are planned in `workers` processes
    (default_workers; 1: one after another here); rows keep the (GPU, count) order either way."""
    check_positive("--global-batch", global_batch)
    check_positive("--tokens", tokens)
    start = time.perf_counter()
    tasks = [(i, n) for i, gpu in enumerate(gpus) for n in counts]
    labels = [f"{n} x {gpus[i].key}" for i, n in tasks]
    kwargs = dict(seq_len=seq_len, global_batch=global_batch, tokens=tokens, precision=precision,
                  assumptions=assumptions, error=error, time_limit_s=time_limit_s,
                  memory_headroom_gib=memory_headroom_gib,
                  inter_node_bandwidth_gb_per_s=inter_node_bandwidth_gb_per_s, gpus_per_node=gpus_per_node,
                  fixed=fixed, top=top)
    shared = dict(graph=graph, ref=ref, gpus=gpus, prices=prices, kwargs=kwargs, cache=CostCache())
    workers = default_workers(len(tasks)) if workers is None else max(1, min(workers, len(tasks)))
    if "fork" not in multiprocessing.get_all_start_methods():
        workers = 1  # the workers get the graph by fork, not by pickling it
    report = progress or (lambda done, total, label: None)
    if workers == 1:
        rows = []
        for task, label in zip(tasks, labels):
            report(len(rows), len(tasks), label)
            rows.append(_plan_cluster(shared, *task))
    else:
        rows = _plan_in_processes(tasks, labels, shared, workers, report)
    report(len(tasks), len(tasks), "done")
    for row in pareto_frontier(rows):
        row.frontier = True
    return Sweep(model=ref.name, tokens=tokens, seq_len=seq_len, global_batch=global_batch,
                 precision=precision, rows=rows, assumptions=assumptions, error=error,
                 price_list=price_list, budget_usd=budget_usd, deadline_days=deadline_days,
                 wall_s=time.perf_counter() - start)


def _plan_in_processes(tasks: list[tuple[int, int]], labels: list[str], shared: dict, workers: int,
                       report: Callable[[int, int, str], None]) -> list[Row]:
    """Rows in task order, planned by forked workers; `report` as each one arrives, naming the
    first cluster still being planned. An error other than a cluster's UserError (which
    plan_row turns into the row's reason) is raised here, as in the serial sweep."""
    rows: list[Row | None] = [None] * len(tasks)
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_init_worker,
                             initargs=(shared,)) as pool:
        futures = {pool.submit(_plan_in_worker, *task): index for index, task in enumerate(tasks)}
        report(0, len(tasks), labels[0])
        try:
            for done, future in enumerate(as_completed(futures), 1):
                rows[futures[future]] = future.result()
                pending = next((labels[i] for i, row in enumerate(rows) if row is None), "done")
                report(done, len(tasks), pending)
        except BaseException:  # an unexpected error or Ctrl-C: do not plan the clusters left
            for future in futures:
                future.cancel()
            raise
    return rows


def pareto_frontier(rows: list[Row]) -> list[Row]:
    """Rows no other row beats on both time to train and cost (ties kept once), by time."""
    feasible = sorted((r for r in rows if r.fits and math.isfinite(r.run.time_s)),
                      key=lambda r: (r.run.time_s, r.run.cost_usd))
    frontier, best_cost = [], math.inf
    for row in feasible:
        if row.run.cost_usd < best_cost:
            frontier.append(row)
            best_cost = row.run.cost_usd
    return frontier


def recommendations(sweep: Sweep) -> dict[str, tuple[Row | None, str]]:
    """{objective: (row or None, why)} for fastest, cheapest, under --budget, under --deadline."""
    ok = [r for r in sweep.rows if r.fits and math.isfinite(r.run.time_s)]
    out: dict[str, tuple[Row | None, str]] = {}
    if not ok:
        return {"fastest": (None, "no cluster in the sweep fits the model")}
    out["fastest"] = (min(ok, key=lambda r: (r.run.time_s, r.run.cost_usd)), "shortest time to train")
    out["cheapest"] = (min(ok, key=lambda r: (r.run.cost_usd, r.run.time_s)), "lowest total cost")
    if sweep.budget_usd is not None:
        within = [r for r in ok if r.run.cost_usd <= sweep.budget_usd]
        out["fastest under budget"] = (
            (min(within, key=lambda r: r.run.time_s), f"fastest costing at most ${sweep.budget_usd:,.0f}")
            if within else (None, f"nothing costs ${sweep.budget_usd:,.0f} or less; the cheapest is "
                                  f"${out['cheapest'][0].run.cost_usd:,.0f}"))
    if sweep.deadline_days is not None:
        within = [r for r in ok if r.run.time_s <= sweep.deadline_days * DAY_S]
        out["cheapest under deadline"] = (
            (min(within, key=lambda r: r.run.cost_usd), f"cheapest finishing within {sweep.deadline_days:g} days")
            if within else (None, f"nothing finishes within {sweep.deadline_days:g} days; the fastest takes "
                                  f"{out['fastest'][0].run.time_s / DAY_S:.1f} days"))
    return out
