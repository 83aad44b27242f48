"""Search: enumerate outer configurations, bound, solve the partition exactly, rank.

Branch and bound over the outer configurations (degrees, ZeRO, offload, micro-batch,
schedule, precision). A family (same degrees, micro-batch and precision) is bounded by
perfect stage balance without recomputation at its smallest bubble; families are visited
in bound order and the search stops when the bound reaches the K-th best step time found,
so every configuration left out provably cannot enter the top K. Within a configuration
`solve_partition` (a direct solver for identical blocks, CP-SAT otherwise: cpsat.py) places
blocks on stages and chooses recomputation per stage; the step time of each solved
candidate is then computed exactly by `cost.estimate`.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable

from autoplan.config import ParallelConfig
from autoplan.errors import UserError
from autoplan.cost import CostCache, Estimate, estimate_partition, hw
from autoplan.trace.graph import ModelGraph
from autoplan.solve.cpsat import MEMORY_UNIT_B, Partition, Tables, solve_partition
from autoplan.solve.preference import mechanisms, preference_key, within_band
from autoplan.solve.space import Request, outer_configs
from autoplan.solve.tables import (build_tables, least_memory_kib, lower_bound_ns,
                                   memory_lower_bound_kib, pipeline_slots, time_lower_bound_ns)

GIB_KIB = 2**20


def rounding_s(slots: float, layers: int) -> float:
    """How far a bound from the tables can exceed the exact one: every per-block and fixed
    time is rounded to the nearest ns (at most 0.5 ns each, blocks plus embedding, head and
    pipeline transfers), and a rank's time counts `slots` times. A configuration is pruned
    only when its bound, less this, reaches the best step time."""
    return slots * (layers + 3) * 0.5e-9 * 2


def capacity_kib(cluster) -> int:
    return round(hw.usable_memory_bytes(cluster) / MEMORY_UNIT_B)


@dataclass(frozen=True)
class Candidate:
    config: ParallelConfig  # with stage_layers and layer_recompute from the solver
    estimate: Estimate
    status: str  # CP-SAT status of its partition

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s

    @property
    def signature(self) -> tuple:
        """What makes two plans meaningfully different (not only the micro-batch)."""
        c = self.config
        return (c.tp, c.pp, c.cp, c.ep, c.zero_stage, c.schedule, c.vpp, c.offload, c.precision)


@dataclass
class SearchResult:
    best: Candidate | None
    alternatives: list[Candidate]
    status: str  # OPTIMAL | FEASIBLE | INFEASIBLE
    wall_s: float
    configurations_considered: int
    configurations_solved: int
    least_memory_gib: float  # least memory per GPU any configuration could need (lower bound)
    infeasible_by_memory: int = 0
    notes: list[str] = field(default_factory=list)
    fastest: Candidate | None = None  # the proven fastest plan; `best` may be a simpler one
    band: float = 0.0  # relative step-time difference treated as equivalent (preference.py)
    # configurations the search covered: solved, ruled out, or proven slower than the best;
    # less than configurations_considered only when the time limit stopped it
    configurations_searched: int = 0
    time_limit_s: float = 0.0

    @property
    def time_limited(self) -> bool:
        return self.configurations_searched < self.configurations_considered

    def search_json(self) -> dict:
        """How far the search went: {"status", "searched", "total", "time_limited", "time_limit_s"}."""
        return {"status": self.status, "searched": self.configurations_searched,
                "total": self.configurations_considered, "time_limited": self.time_limited,
                "time_limit_s": self.time_limit_s}


def partition_to_config(config: ParallelConfig, part: Partition, tables: Tables) -> ParallelConfig:
    """Solver output -> blocks per chunk and a recompute mode per block. In each chunk, a
    group's first units recompute fully, the next selectively; a unit's blocks share its mode
    (Tables.unit_blocks)."""
    units = tables.unit_blocks or tuple((i,) for i in range(tables.num_layers))
    unit_mode: dict[int, str] = {}
    for k in range(len(part.cuts) - 1):
        for g, group in enumerate(tables.groups):
            held = range(max(part.cuts[k], group.lo), min(part.cuts[k + 1], group.hi))
            f, s = part.full[k][g], part.selective[k][g]
            for i, unit in enumerate(held):
                unit_mode[unit] = "full" if i < f else "selective" if i < f + s else "none"
    modes = [""] * sum(len(blocks) for blocks in units)
    for unit, mode in unit_mode.items():
        for block in units[unit]:
            modes[block] = mode
    counts = tuple(sum(len(units[u]) for u in range(a, b)) for a, b in zip(part.cuts, part.cuts[1:]))
    return replace(config, stage_layers=counts, layer_recompute=tuple(modes), stage_recompute=None)


def estimate_candidate(graph: ModelGraph, config: ParallelConfig, cluster,
                       cache: CostCache | None = None) -> Estimate:
    """Exact estimate of a solved configuration: its blocks per stage and recompute per block."""
    blocks = graph.layer_blocks()
    modes = list(config.layer_recompute or [config.recompute] * len(blocks))
    stages, start = [], 0
    for count in config.stage_layers or [len(blocks)]:
        stages.append(list(zip(blocks[start:start + count], modes[start:start + count])))
        start += count
    return estimate_partition(graph, config, cluster, stages, cache=cache)


def _family(c: ParallelConfig) -> tuple:
    return (c.tp, c.cp, c.pp, c.dp, c.ep, c.micro_batch, c.precision)


def search(graph: ModelGraph, cluster, request: Request, top: int = 3,
           progress: Callable[[int, int], None] | None = None, time_limit_s: float = 60.0,
           cache: CostCache | None = None) -> SearchResult:
    """The best plans of `request` on `cluster`. The search costs the same blocks under the
    same fields many times: it keeps them in `cache`, a new one unless the caller passes its
    own (a sweep planning one graph on many clusters shares one)."""
    cache = CostCache() if cache is None else cache
    start = time.perf_counter()
    objective_per_step(request.objective, 1.0, request.num_gpus)  # UserError for an unknown objective
    configs = list(outer_configs(graph, request))
    families: dict[tuple, list[ParallelConfig]] = defaultdict(list)
    for c in configs:
        families[_family(c)].append(c)
    fixed_rc = request.fixed.get("recompute")
    skipped_memory: list[tuple[float, int]] = []
    bounds = []
    for key, members in families.items():
        # per ZeRO/offload variant of the family at its least pipeline memory and time (1F1B,
        # one chunk per rank): neither ZeRO nor offload saves memory or time in every case
        # (ZeRO-3 in a pipeline holds gathered weights and gather buffers), so the family is
        # out only if every variant is, and its time bound is the least over variants
        variants = [replace(members[0], zero_stage=z, offload=o, schedule="1f1b", vpp=1)
                    for z, o in sorted({(m.zero_stage, m.offload) for m in members})]
        least = [least_memory_kib(graph, v, cache) for v in variants]
        fitting = [v for v, kib in zip(variants, least) if kib <= capacity_kib(cluster)]
        if not fitting:
            skipped_memory.append((min(least) / GIB_KIB, len(members)))
            continue
        slots = pipeline_slots(variants[0])
        per_slot = min(time_lower_bound_ns(graph, v, cluster, cache) / slots for v in fitting)
        bound = min(pipeline_slots(m) for m in members) * per_slot * 1e-9
        most_slots = max(pipeline_slots(m) for m in members) * max(m.vpp for m in members)
        slack = rounding_s(most_slots, graph.num_layers)
        bounds.append((bound - slack, key))
    bounds.sort()
    band = request.equivalence_band
    kept: dict[tuple, Candidate] = {}
    threshold = float("inf")
    solved, infeasible, all_optimal = 0, sum(n for _, n in skipped_memory), True
    least_mem = min((m for m, _ in skipped_memory), default=float("inf"))
    done, completed, edge_resolved = 0, True, 0
    unvisited = 0  # configurations of the families the time limit left out
    for index, (bound, key) in enumerate(bounds):
        if bound >= threshold * (1 + band):
            break
        if time.perf_counter() - start > time_limit_s:
            completed = False
            unvisited = sum(len(families[k]) for _, k in bounds[index:])
            break
        # every plan left is at least `bound`: kept plans within the band of it stay within the
        # band of the fastest, whatever is found later
        preferred = _preferred_key(kept.values(), min(threshold, bound), band)
        members = families[key]
        for config in members:
            done += 1
            if not _worth_solving(bound, config, threshold, band, preferred):
                continue
            tables = build_tables(graph, config, cluster, fixed_rc, cache=cache)
            mem_lb = memory_lower_bound_kib(tables)
            least_mem = min(least_mem, mem_lb / GIB_KIB)
            if mem_lb > tables.capacity_kib:
                infeasible += 1
                continue
            lower_s = lower_bound_ns(tables) * 1e-9 - rounding_s(tables.slots * tables.vpp, graph.num_layers)
            if not _worth_solving(lower_s, config, threshold, band, preferred):
                continue
            solved += 1
            cand, proven, lowered = _solve_fitting(graph, tables, config, cluster,
                                                   max(1.0, time_limit_s / 10), cache)
            all_optimal &= proven
            edge_resolved += lowered
            if cand is None:
                infeasible += 1
                continue
            if cand.signature not in kept or cand.step_time_s < kept[cand.signature].step_time_s:
                kept[cand.signature] = cand
            # the bound proves the fastest plan; runners-up are the best found on the way
            threshold = min(threshold, cand.step_time_s)
        if progress:
            progress(done, len(configs))
    fastest, best, alternatives = choose(list(kept.values()), band, top)
    status = "INFEASIBLE" if best is None else ("OPTIMAL" if all_optimal and completed else "FEASIBLE")
    searched = len(configs) - unvisited
    return SearchResult(
        best=best, alternatives=alternatives, status=status,
        wall_s=time.perf_counter() - start, configurations_considered=len(configs),
        configurations_solved=solved, least_memory_gib=least_mem, infeasible_by_memory=infeasible,
        fastest=fastest, band=band,
        notes=_time_limit_notes(searched, len(configs), time_limit_s, best) + _edge_notes(edge_resolved),
        configurations_searched=searched, time_limit_s=time_limit_s,
    )


def _time_limit_notes(searched: int, total: int, limit_s: float, best) -> list[str]:
    if searched >= total:
        return []
    found = ("the best found is shown; a configuration not searched might be faster"
             if best is not None else "none of them fits; one not searched might")
    return [f"the {limit_s:g} s time limit stopped the search: searched {searched} of {total} "
            f"configurations; {found} (--time-limit SECONDS searches longer)"]


OBJECTIVES = ("time", "cost")


def objective_per_step(objective: str, step_s: float, num_gpus: int) -> float:
    """What the search minimises: step seconds ("time") or GPU-seconds per step ("cost": the
    price per GPU-hour is the same for every plan of one cluster, so it is left out). On one
    cluster both order plans alike; they differ across clusters (`autoplan report`)."""
    if objective not in OBJECTIVES:
        raise UserError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    return step_s * (num_gpus if objective == "cost" else 1)


def _preferred_key(kept, floor_s: float, band: float) -> tuple:
    """Preference key of the plan preferred so far among those sure to stay within the band."""
    return min((preference_key(c.step_time_s, c.config) for c in kept
                if within_band(c.step_time_s, floor_s, band)), default=(float("inf"),))


EDGE_RETRIES = 3


def _edge_notes(count: int) -> list[str]:
    if not count:
        return []
    return [f"{count} configuration(s) sat at the memory edge: the solver rounds memory to the KiB, "
            "so their partitions were solved again with slightly less memory; a partition inside that "
            "margin might be faster, so the result is labelled FEASIBLE, not OPTIMAL"]


def _solve_fitting(graph: ModelGraph, tables: Tables, config: ParallelConfig, cluster,
                   time_limit_s: float, cache: CostCache) -> tuple[Candidate | None, bool, bool]:
    """The solver's best partition, estimated exactly. The tables round each memory term to
    the KiB, so at the capacity edge the solver may pick a partition the estimate finds a few
    KiB too large: it is solved again with the capacity lowered by that excess. Such a plan
    is labelled FEASIBLE (a partition inside the excess might have been faster); OPTIMAL
    also needs the tables to carry the step-end tail the estimate adds. Returns the
    candidate (None when nothing fits), whether that outcome is proven, and whether the
    capacity was lowered."""
    usable_kib = hw.usable_memory_bytes(cluster) / MEMORY_UNIT_B
    lowered = False
    for _ in range(EDGE_RETRIES + 1):
        part = solve_partition(tables, time_limit_s=time_limit_s)
        if part is None:
            return None, not lowered, lowered
        cand_config = partition_to_config(config, part, tables)
        est = estimate_candidate(graph, cand_config, cluster, cache)
        if est.feasible:
            exact = part.status == "OPTIMAL" and tables.tail_ns is not None and not lowered
            return Candidate(cand_config, est, "OPTIMAL" if exact else "FEASIBLE"), exact, lowered
        excess_kib = max(s["memory_gib"] for s in est.per_stage) * GIB_KIB - usable_kib
        if excess_kib <= 0:  # the GPUs fit; what does not (host memory under offload) a partition cannot fix
            return None, not lowered, lowered
        tables = replace(tables, capacity_kib=tables.capacity_kib - max(1, math.ceil(excess_kib)))
        lowered = True
    return None, False, True


def _worth_solving(lower_s: float, config: ParallelConfig, threshold: float, band: float,
                   preferred: tuple) -> bool:
    """Could a configuration whose step time is at least `lower_s` be the fastest plan, or a
    plan within the band preferred to the one preferred so far?"""
    if lower_s < threshold:
        return True
    return within_band(lower_s, threshold, band) and preference_key(lower_s, config) < preferred


def choose(candidates: list[Candidate], band: float, top: int) -> tuple:
    """(fastest, preferred, runners-up): the preferred plan is the one with the fewest
    unvalidated mechanisms within the band of the fastest (preference.py); runners-up by step
    time, one of each set tied to the microsecond with the same memory to 0.1 GiB."""
    if not candidates:
        return None, None, []
    ranked = sorted(candidates, key=rank_key)
    fastest = ranked[0]
    best = min((c for c in ranked if within_band(c.step_time_s, fastest.step_time_s, band)),
               key=lambda c: (preference_key(c.step_time_s, c.config), rank_key(c)))
    seen, alternatives = {_tie(best)}, []
    for c in ranked:
        if c is not best and _tie(c) not in seen:
            seen.add(_tie(c))
            alternatives.append(c)
    return fastest, best, alternatives[:top]


def _tie(c: Candidate) -> tuple:
    return (round(c.step_time_s, 6), round(c.estimate.memory_gib_per_gpu, 1))


OFFLOAD_ORDER = {"none": 0, "optimizer": 1, "params": 2, "both": 3}


def rank_key(c: Candidate) -> tuple:
    """Fastest first; among plans equally fast (to 1 us), the simpler one: fewer unvalidated
    mechanisms, no offload, lower ZeRO stage, less model parallelism."""
    cfg = c.config
    return (round(c.step_time_s, 6), len(mechanisms(cfg)), OFFLOAD_ORDER[cfg.offload], cfg.zero_stage,
            cfg.tp * cfg.pp * cfg.cp, cfg.vpp)
