"""One call from a MODEL spec and a cluster to a ranked set of plans (used by plan, generate, report)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from autoplan.cost import CostCache
from autoplan.cost.profile import FUSED_SCAN_CLASSES
from autoplan.errors import UserError
from autoplan.trace.graph import ModelGraph, sequence_loop_notes
from autoplan.plan import ModelRef, Plan
from autoplan.solve import preference
from autoplan.solve.search import Candidate, SearchResult, estimate_candidate, search
from autoplan.solve.space import Request, async_tp_setting, check_fixed
from autoplan.solve.plan_build import to_plan


@dataclass
class PlanJob:
    plan: Plan | None  # the best plan, None when nothing fits
    result: SearchResult
    graph: ModelGraph
    model: ModelRef
    cluster: object
    request: Request
    cache: CostCache  # the search's cost cache, for explaining the plan against its neighbours


def precisions_for(precision: str, cluster) -> tuple[str, ...]:
    """--precision auto lets the solver choose bf16 or, where the GPU has it, fp8."""
    if precision == "auto":
        return ("bf16", "fp8") if cluster.gpu.supports("fp8") else ("bf16",)
    cluster.gpu.peak_flops(precision)  # UserError: fp8 on a GPU without it
    return (precision,)


def compile_gain_notes(graph: ModelGraph, best: Candidate, cluster, cache: CostCache) -> list[str]:
    """What `--compile` would gain on the best plan, by the cost model, when it is 1% or more:
    the same configuration with its blocks' kernels fused (cost.compute, torchtitan's
    apply_compile rows), and its TP collectives pipelined with their matmuls (async TP)."""
    c = best.config
    compiled = estimate_candidate(graph, c.with_(compile=True, async_tp=async_tp_setting(
        True, c.tp, c.sequence_parallel, cluster.gpu.key)), cluster, cache)
    gain = 1.0 - compiled.step_time_s / best.step_time_s
    if gain < 0.01:
        return []
    return [f"torch.compile per block (--compile) would take this plan's step from "
            f"{best.step_time_s:.3g} s to {compiled.step_time_s:.3g} s ({gain:.0%} faster) by the cost "
            "model; the job then compiles each block class once at start-up (minutes on a large model)"]


def plan_job(graph: ModelGraph, model: ModelRef, cluster, *, global_batch: int, seq_len: int,
             fixed: dict | None = None, precision: str = "bf16", objective: str = "time",
             top: int = 3, progress: Callable[[int, int], None] | None = None,
             time_limit_s: float = 60.0, equivalence_band: float | None = None,
             cache: CostCache | None = None, compile_blocks: bool = False) -> PlanJob:
    """Search the plan space of `graph` on `cluster`; the best as a Plan plus the ranked result.
    `cache`: costs to reuse (search), one per graph when planning it on many clusters.
    `compile_blocks`: every plan runs its blocks under torch.compile; without it, a note says
    what compiling would gain on the best plan."""
    if global_batch is None or global_batch < 1:
        raise UserError(f"--global-batch must be a positive number of sequences, got {global_batch}")
    request = Request(num_gpus=cluster.num_gpus, gpus_per_node=cluster.gpus_per_node,
                      global_batch=global_batch, seq_len=seq_len,
                      precisions=precisions_for(precision, cluster) if "precision" not in (fixed or {})
                      else (fixed["precision"],),
                      fixed=dict(fixed or {}), objective=objective,
                      equivalence_band=preference.equivalence_band() if equivalence_band is None
                      else equivalence_band, compile=compile_blocks, gpu=cluster.gpu.key)
    check_fixed(graph, request)
    cache = CostCache() if cache is None else cache
    result = search(graph, cluster, request, top=top, progress=progress, time_limit_s=time_limit_s,
                    cache=cache)
    if result.configurations_considered == 0:
        raise UserError(
            f"no configuration of {cluster.num_gpus} GPUs can split a global batch of {global_batch} "
            f"sequences of {seq_len} tokens into micro-batches"
            + (f" with --fix {' '.join(f'{k}={v}' for k, v in request.fixed.items())}" if request.fixed else "")
            + "; use a global batch that is a multiple of the data-parallel degree you want, or drop a --fix")
    fused = FUSED_SCAN_CLASSES if cluster.gpu.fused_library_kernels else ()
    result.notes.extend(sequence_loop_notes(graph.sequence_loops, graph.seq_len, fused))
    if result.best and not compile_blocks:
        result.notes.extend(compile_gain_notes(graph, result.best, cluster, cache))
    plan = to_plan(result.best, graph, model, cluster) if result.best else None
    return PlanJob(plan=plan, result=result, graph=graph, model=model, cluster=cluster, request=request,
                   cache=cache)
