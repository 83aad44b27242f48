"""Why this plan: the binding constraint, why the obvious alternatives lose, and sensitivity."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autoplan.config import ParallelConfig, schedule_label
from autoplan.cost import hw
from autoplan.cost.stages import stage_layer_counts
from autoplan.hardware import GIB, with_num_gpus
from autoplan.solve import space
from autoplan.solve.cpsat import solve_partition
from autoplan.solve.preference import equivalence_band_family, mechanisms, within_band
from autoplan.solve.search import Candidate, estimate_candidate, partition_to_config
from autoplan.solve.tables import build_tables

LINKS = {"tp": "TP all-reduce/all-gather", "cp": "CP ring K/V exchange", "ep": "EP all-to-all",
         "zero3": "ZeRO-3 parameter gathers", "zero2": "ZeRO-2 gradient reduce-scatters", "pp": "pipeline send/recv", "dp": "DP gradient sync"}


def solve_config(job, config: ParallelConfig, capacity_extra_kib: int = 0) -> Candidate | str:
    """Best partition of one configuration, or the reason it does not fit."""
    tables = build_tables(job.graph, config, job.cluster, job.request.fixed.get("recompute"), cache=job.cache)
    if capacity_extra_kib:
        tables = replace(tables, capacity_kib=tables.capacity_kib + capacity_extra_kib)
    part = solve_partition(tables, time_limit_s=5)
    if part is None:
        return "does not fit in memory"
    cand_config = partition_to_config(config, part, tables)
    est = estimate_candidate(job.graph, cand_config, job.cluster, job.cache)
    if capacity_extra_kib:
        return Candidate(cand_config, est, part.status)
    return Candidate(cand_config, est, part.status) if est.feasible else est.reason


def _pct(new: float, old: float) -> str:
    return f"{(new / old - 1) * 100:+.0f}%"


def _main_cause(new, old) -> str:
    """The time component (or comm kind) that grew the most."""
    deltas = {k: new.time_breakdown_s.get(k, 0) - old.time_breakdown_s.get(k, 0) for k in old.time_breakdown_s}
    comm = {k: new.comm_breakdown_s.get(k, 0) - old.comm_breakdown_s.get(k, 0)
            for k in set(new.comm_breakdown_s) | set(old.comm_breakdown_s)}
    kind, value = max(deltas.items(), key=lambda kv: kv[1])
    if kind == "exposed_comm" and comm:
        ckind, cvalue = max(comm.items(), key=lambda kv: kv[1])
        return f"{LINKS.get(ckind, ckind)} {_pct(old.step_time_s + cvalue, old.step_time_s)}"
    return f"{kind.replace('_', ' ')} {_pct(old.step_time_s + value, old.step_time_s)}"


def _neighbours(c: ParallelConfig, n: int, sequence_shardable: bool = True) -> list[tuple[str, ParallelConfig]]:
    out = []
    for key in ("tp", "pp", "cp"):
        for value in (getattr(c, key) * 2, getattr(c, key) // 2):
            if value < 1 or value == getattr(c, key):
                continue
            degrees = {"tp": c.tp, "pp": c.pp, "cp": c.cp, key: value}
            rest = degrees["tp"] * degrees["pp"] * degrees["cp"]
            if n % rest:
                continue
            dp = n // rest
            mb = c.micro_batch if c.global_batch % (dp * c.micro_batch) == 0 else 1
            if c.global_batch % dp:
                continue
            vpp = c.vpp if degrees["pp"] > 1 else 1
            schedule = c.schedule if degrees["pp"] > 1 else "1f1b"
            ep = c.ep if (dp * degrees["cp"]) % c.ep == 0 else 1
            out.append((f"{key}={value}", replace(c, dp=dp, micro_batch=mb, vpp=vpp, schedule=schedule,
                                                  ep=ep, stage_layers=None, layer_recompute=None,
                                                  sequence_parallel=degrees["tp"] > 1 and sequence_shardable,  # space.py
                                                  **degrees)))
    if c.dp > 1:
        for zero in (0, 1, 2, 3):
            if zero != c.zero_stage:
                out.append((f"zero={zero}", replace(c, zero_stage=zero, stage_layers=None, layer_recompute=None,
                                                    offload=c.offload if zero >= 2 else "none")))
    return out


def _illegal(job, c: ParallelConfig) -> str | None:
    g, r = job.graph, job.request
    return (space.tp_reason(g, c.tp, r.gpus_per_node) or space.cp_reason(g, c.cp, c.tp, r.seq_len, r.gpus_per_node)
            or space.pp_reason(g, c.pp, c.vpp) or space.ep_reason(g, c.ep, c.dp, c.cp))


# above this fraction of what the estimate may fill, explain suggests --memory-headroom
FULL_FRACTION = 0.95


def explain(job) -> list[str]:
    best = job.result.best
    e, c = best.estimate, best.config
    lines = []
    capacity = job.cluster.gpu.memory_bytes / GIB
    asked = job.cluster.memory_headroom_bytes / GIB
    worst = e.worst_rank_stage
    recomputed = sum(1 for m in (c.layer_recompute or ()) if m != "none")
    lines.append(
        f"memory: {f'pipeline stage {worst} is the fullest rank' if c.pp > 1 else 'each GPU holds'} "
        f"{'at ' if c.pp > 1 else ''}{e.memory_gib_per_gpu:.1f} of "
        f"{capacity:.1f} GiB ({(1 - e.memory_gib_per_gpu / capacity) * 100:.0f}% free"
        + (f", at least the {asked:g} GiB of --memory-headroom" if asked else "") + ")"
        + (f"; {recomputed} of {len(c.layer_recompute)} blocks recompute to fit" if recomputed else ""))
    lines += _preference(job.result)
    if job.request.objective == "cost":
        lines.append(f"objective cost: a step costs its time x {c.world_size} GPUs x the price per GPU-hour, "
                     "the same price for every plan on this cluster, so the cheapest plan is the fastest; "
                     "`autoplan report` compares clusters, where the two objectives differ")
    if not asked and e.memory_gib_per_gpu > FULL_FRACTION * hw.usable_memory_bytes(job.cluster) / GIB:
        lines.append("memory: the plan fills the GPU to the estimate; allocator fragmentation and "
                     "spikes need room it does not count: --memory-headroom GIB keeps some free")
    if e.comm_breakdown_s:
        kind, seconds = max(e.comm_breakdown_s.items(), key=lambda kv: kv[1])
        lines.append(f"communication: {LINKS.get(kind, kind)} is the largest exposed communication, "
                     f"{seconds:.3g} s per step ({seconds / e.step_time_s * 100:.0f}% of the step)")
    if e.bubble_fraction:
        lines.append(f"pipeline bubble: {e.bubble_fraction * 100:.1f}% of the step ({c.schedule}, "
                     f"{c.num_microbatches} micro-batches over {c.pp} stages)")
    for label, neighbour in _neighbours(c, c.world_size, job.graph.sequence_shardable):
        reason = _illegal(job, neighbour)
        if reason is None:
            solved = solve_config(job, neighbour)
            if isinstance(solved, str):
                reason = solved
            else:
                lines.append(f"{label} instead: {_pct(solved.step_time_s, e.step_time_s)} step time "
                             f"(mostly {_main_cause(solved.estimate, e)})")
                continue
        lines.append(f"{label} instead: not possible, {reason}")
    lines += _sensitivity(job)
    return lines


def _preference(r) -> list[str]:
    """Why this plan and not the fastest, when they differ (preference.py)."""
    fastest, best = r.fastest, r.best
    if fastest is None or fastest is best:
        return []
    used = mechanisms(fastest.config)
    left = [m for m in used if m not in mechanisms(best.config)]
    return [f"preferred to the fastest plan ({fastest.step_time_s:.3f} s, "
            f"{_pct(fastest.step_time_s, best.step_time_s)}, with {', '.join(used)}): within the cost "
            f"model's error band of {r.band:.1%} (its median |error| over the published "
            f"{equivalence_band_family() or 'validation'} runs, the runtime family of autoplan's jobs) the two "
            f"are equivalent, and this one does without "
            f"{', '.join(left)}, which the model has not been validated on"]


def equivalent(r, cand: Candidate) -> bool:
    """A runner-up the cost model cannot tell from the fastest plan."""
    return r.fastest is not None and within_band(cand.step_time_s, r.fastest.step_time_s, r.band)


def _sensitivity(job) -> list[str]:
    best = job.result.best
    c, e = best.config, best.estimate
    lines = []
    more = solve_config(job, replace(c, stage_layers=None, layer_recompute=None), capacity_extra_kib=2**20)
    if isinstance(more, Candidate) and more.step_time_s < e.step_time_s * 0.999:
        lines.append(f"one more GiB per GPU: {_pct(more.step_time_s, e.step_time_s)} step time "
                     f"(less recomputation)")
    else:
        lines.append("one more GiB per GPU: no change (memory is not what limits the step time)")
    n2 = c.world_size + job.cluster.gpus_per_node
    rest = c.tp * c.pp * c.cp
    if n2 % rest == 0 and c.global_batch % (n2 // rest) == 0:
        bigger = replace(job, cluster=with_num_gpus(job.cluster, n2))
        config = replace(c, dp=n2 // rest, micro_batch=1, stage_layers=None, layer_recompute=None,
                         ep=c.ep if ((n2 // rest) * c.cp) % c.ep == 0 else 1)
        solved = solve_config(bigger, config)
        if isinstance(solved, Candidate):
            lines.append(f"one more node ({n2} GPUs, dp={config.dp}): {_pct(solved.step_time_s, e.step_time_s)} "
                         f"step time, {_pct(solved.estimate.tokens_per_s_per_gpu, e.tokens_per_s_per_gpu)} tokens/s per GPU")
    else:
        lines.append(f"one more node ({n2} GPUs): the global batch of {c.global_batch} does not split over it")
    return lines


def infeasible_report(job) -> str:
    """Nothing fits: the numbers, the limit that binds (GPU memory per rank, host memory per
    node under CPU offload), the first doubled GPU count on which a plan fits, and what would help."""
    r = job.result
    capacity = job.cluster.gpu.memory_bytes / GIB
    headroom = job.cluster.memory_headroom_bytes / GIB
    usable = hw.usable_memory_bytes(job.cluster) / GIB
    has = (f"the GPU has {capacity:.1f} GiB" + (f", less the {headroom:g} GiB of --memory-headroom"
                                                if headroom else "")
           + f", and a plan's estimate may fill {usable:.1f} GiB of it (the estimate's measured "
             f"error kept free)")
    lines = [f"No plan fits: {_searched(r).split(';')[0]} on {job.cluster.num_gpus} x {job.cluster.gpu.key}."]
    lines += [note for note in r.notes if "time limit" in note]
    frugal = _most_frugal_estimates(job)
    on_gpu = min(frugal.values(), key=lambda f: f[1].memory_gib_per_gpu, default=None)
    fixed = job.request.fixed
    if fixed and r.least_memory_gib <= usable and (on_gpu is None or on_gpu[1].feasible):
        # the search's bound and a frugal layout fit, so the fixed choices are what does not
        choices = " ".join(f"--fix {key.replace('_', '-')}={value}" for key, value in fixed.items())
        lines.append(f"No configuration with {choices} fits; {has}. The search's lower bound "
                     f"({r.least_memory_gib:.1f} GiB) and the most frugal layout fit, so it is "
                     f"the fixed choices together that do not: drop or change a --fix (a "
                     f"smaller micro-batch, more recomputation or a higher ZeRO stage each "
                     f"needs less).")
    elif frugal:
        lines += _binding_limits(frugal, usable, has)
    else:
        lines.append(f"The least memory per GPU any configuration needs is at least "
                     f"{r.least_memory_gib:.1f} GiB; {has}.")
    lines += _smallest_fitting_count(job)
    host_binds = any(e.memory_gib_per_gpu <= usable and not e.feasible for _, e in frugal.values())
    offload = ("" if host_binds else "--fix offload=both with ZeRO-3 (parameters and optimizer in CPU "
               "memory), ")
    lines.append(f"Options that reduce memory: {offload}--precision fp8 where the GPU has it, a shorter "
                 "--seq-len, a smaller global batch per GPU, more GPUs, or a GPU with more memory.")
    return "\n".join(lines)


def _binding_limits(frugal: dict, usable_gib: float, has: str) -> list[str]:
    """The limit each of the most frugal layouts (without, then with CPU offload) runs into."""
    lines = []
    for offloads, (layout, est) in sorted(frugal.items()):
        kind = "with CPU offload" if offloads else "without CPU offload"
        gpu = est.memory_gib_per_gpu
        if gpu > usable_gib:
            lines.append(f"GPU memory per rank is the limit {kind}: the most memory-frugal configuration "
                         f"({layout}, every block recomputed) needs {gpu:.1f} GiB per GPU; {has}.")
        elif not est.feasible:  # the GPUs fit: host memory per node is what does not
            lines.append(f"Host memory per node is the limit {kind}: the most memory-frugal configuration "
                         f"({layout}, every block recomputed) fits the GPUs at {gpu:.1f} GiB; "
                         f"{est.reason}.")
    return lines


def _frugal_configs(job, request) -> list[ParallelConfig]:
    """Micro-batch 1, the highest ZeRO stage, the most model parallelism first; the 12 most
    frugal without CPU offload, then the 12 most frugal with it."""
    configs = [c for c in space.outer_configs(job.graph, request) if c.micro_batch == 1]
    configs.sort(key=lambda c: (-c.zero_stage, c.offload != "both", -(c.tp * c.pp * c.cp)))
    return ([c for c in configs if c.offload == "none"][:12]
            + [c for c in configs if c.offload != "none"][:12])


def _most_frugal_estimates(job) -> dict[bool, tuple[str, Any]]:
    """{offloads: (layout, Estimate)} of the configuration needing the least GPU memory among
    the most frugal few without and with CPU offload, every block fully recomputed, blocks
    split evenly over the stages."""
    best: dict[bool, tuple[str, Any]] = {}
    for config in _frugal_configs(job, job.request):
        full = replace(config, stage_layers=tuple(stage_layer_counts(job.graph.num_layers, config)),
                       layer_recompute=("full",) * job.graph.num_layers)
        est = estimate_candidate(job.graph, full, job.cluster, job.cache)
        offloads = config.offload != "none"
        if offloads not in best or est.memory_gib_per_gpu < best[offloads][1].memory_gib_per_gpu:
            best[offloads] = (f"dp={config.dp} tp={config.tp} pp={config.pp} cp={config.cp} ep={config.ep}, "
                              f"ZeRO-{config.zero_stage}, offload {config.offload}", est)
    return best


def _smallest_fitting_count(job) -> list[str]:
    """Search the doubled GPU count (the same global batch and --fix choices) until a plan
    fits: that count and its plan, and the counts before it on which nothing fits."""
    from autoplan.solve.search import search

    n, tried = job.cluster.num_gpus, []
    for _ in range(8):
        n *= 2
        try:
            cluster = with_num_gpus(job.cluster, n)
        except Exception:
            return []
        request = replace(job.request, num_gpus=n)
        result = search(job.graph, cluster, request, top=0, cache=job.cache,
                        time_limit_s=min(SMALLEST_COUNT_LIMIT_S, job.result.time_limit_s or SMALLEST_COUNT_LIMIT_S))
        if result.best is not None:
            c = result.best.config
            before = f" (on {', '.join(map(str, tried))} no plan fits)" if tried else ""
            return [f"Doubling the GPU count, the first on which a plan fits is {n} x {job.cluster.gpu.key}"
                    f"{before}: dp={c.dp} tp={c.tp} pp={c.pp} cp={c.cp} ep={c.ep}, ZeRO-{c.zero_stage}, "
                    f"offload {c.offload}, {result.best.estimate.memory_gib_per_gpu:.1f} GiB per GPU "
                    f"(`autoplan plan ... --gpus {n}`)."]
        if result.time_limited:
            return [f"On {n} GPUs the search found no plan within {result.time_limit_s:g} s "
                    f"({result.configurations_searched} of {result.configurations_considered} configurations)"
                    + (f"; on {', '.join(map(str, tried))} no plan fits" if tried else "") + "."]
        tried.append(n)
    return []


# seconds for each doubled count's search in the "nothing fits" report
SMALLEST_COUNT_LIMIT_S = 20.0


def _float8_note(c) -> str:
    """An fp8 plan's recipe, and its float8 weight all-gather where ZeRO-3 uses it."""
    if c.precision != "fp8":
        return ""
    return f" ({c.float8_recipe}" + (", weights all-gathered in float8)" if c.float8_all_gather else ")")


def candidate_json(cand: Candidate, best: Candidate | None = None) -> dict[str, Any]:
    c = cand.config
    out = {"dp": c.dp, "tp": c.tp, "pp": c.pp, "cp": c.cp, "ep": c.ep, "zero_stage": c.zero_stage,
           "offload": c.offload, "micro_batch": c.micro_batch, "num_microbatches": c.num_microbatches,
           "schedule": c.schedule, "vpp": c.vpp, "precision": c.precision, "compile": c.compile,
           **({"async_tp": True} if c.async_tp else {}),
           **({"float8_recipe": c.float8_recipe, "float8_all_gather": c.float8_all_gather}
              if c.precision == "fp8" else {}),
           "stage_layers": list(c.stage_layers or []),
           "recompute": {m: sum(1 for x in (c.layer_recompute or ()) if x == m) for m in ("none", "selective", "full")},
           "step_time_s": cand.step_time_s, "mfu": cand.estimate.mfu,
           "memory_gib_per_gpu": cand.estimate.memory_gib_per_gpu, "solver_status": cand.status,
           "time_breakdown_s": dict(cand.estimate.time_breakdown_s)}
    if c.offload != "none":
        out["host_memory_gib_per_gpu"] = cand.estimate.host_memory_gib_per_gpu
    if best is not None:
        out["slower_than_best"] = cand.step_time_s / best.step_time_s - 1
    return out


def job_json(job, explanation: list[str]) -> dict[str, Any]:
    r = job.result
    return {
        "plan": job.plan.to_dict() if job.plan else None,
        "estimate": r.best.estimate.to_dict() if r.best else None,
        "alternatives": [{**candidate_json(a, r.best), "equivalent_within_error_band": equivalent(r, a)}
                         for a in r.alternatives],
        "fastest": candidate_json(r.fastest) if r.fastest else None,
        "search": r.search_json(),
        "solver": {"status": r.status, "wall_s": r.wall_s,
                   "configurations_considered": r.configurations_considered,
                   "configurations_solved": r.configurations_solved, "notes": list(r.notes)},
        "explanation": explanation,
    }


def _searched(r) -> str:
    """"581 configurations", or, when the time limit stopped the search, what it covered."""
    if r.time_limited:
        return (f"searched {r.configurations_searched} of {r.configurations_considered} configurations "
                f"in the {r.time_limit_s:g} s time limit; the best found is shown")
    return f"{r.configurations_considered} configurations"


def render_job(job, explanation: list[str], console) -> None:
    from rich.table import Table

    r, e, c = job.result, job.result.best.estimate, job.result.best.config
    head = Table(title=f"autoplan plan: {job.model.name} on {c.world_size} x {job.cluster.gpu.key} "
                       f"[{r.status}, {r.wall_s:.1f} s, {_searched(r)}]", show_header=False)
    head.add_row("degrees", f"dp={c.dp} tp={c.tp} pp={c.pp} cp={c.cp} ep={c.ep}")
    head.add_row("ZeRO / offload", f"{c.zero_stage} / {c.offload}")
    head.add_row("batching", f"micro-batch {c.micro_batch} x {c.num_microbatches} micro-batches, "
                             f"global {c.global_batch} x {c.seq_len} tokens")
    head.add_row("pipeline", "none (pp=1)" if c.pp == 1 else
                 f"{c.schedule} vpp={c.vpp}, blocks per stage {list(c.stage_layers or [])}")
    rc = {m: sum(1 for x in (c.layer_recompute or ()) if x == m) for m in ("selective", "full")}
    head.add_row("recompute", f"{rc['full']} blocks full, {rc['selective']} selective")
    head.add_row("precision", c.precision + _float8_note(c) + (", blocks under torch.compile" if c.compile else "")
                 + (", async TP (collectives pipelined with their matmuls)" if c.async_tp else ""))
    head.add_row("step time", f"{e.step_time_s:.3f} s")
    head.add_row("tokens/s per GPU", f"{e.tokens_per_s_per_gpu:,.0f}")
    head.add_row("MFU / HFU", f"{e.mfu * 100:.1f}% / {e.hfu * 100:.1f}%")
    head.add_row("memory per GPU", f"{e.memory_gib_per_gpu:.1f} GiB"
                 + (f" (worst stage {e.worst_rank_stage})" if c.pp > 1 else ""))
    console.print(head)
    if r.alternatives:
        alt = Table(title="Runners-up")
        for col in ("dp/tp/pp/cp/ep", "ZeRO", "offload", "mb", "schedule", "step s", "vs best", "GiB", "note"):
            alt.add_column(col)
        for a in r.alternatives:
            ac = a.config
            alt.add_row(f"{ac.dp}/{ac.tp}/{ac.pp}/{ac.cp}/{ac.ep}", str(ac.zero_stage), ac.offload, str(ac.micro_batch),
                        schedule_label(ac.pp, ac.schedule, ac.vpp), f"{a.step_time_s:.3f}",
                        _pct(a.step_time_s, e.step_time_s), f"{a.estimate.memory_gib_per_gpu:.1f}",
                        "equivalent within the error band" if equivalent(r, a) else "")
        console.print(alt)
    console.print("[bold]Why:[/]")
    why = Table.grid(padding=(0, 1))  # a wrapped line continues under its text, not under the dash
    why.add_column(no_wrap=True)
    why.add_column()
    for line in [*explanation, *r.notes]:
        why.add_row("  -", line)
    console.print(why)
