"""Cost tables of one outer configuration, computed by `autoplan.cost` for the CP-SAT model.

Per group of identical blocks and recompute mode: time per micro-batch (compute,
recomputation, exposed TP/CP/EP/ZeRO-3 communication) from `layer_cost`; states and
activations per rank. Fixed terms: the embedding on chunk 0, the head and fp32 logits on
the last chunk, pipeline send/recv per chunk, buffers and runtime overhead per rank, and
the step-end tail (DP sync, optimizer) of the even partition, which the partition barely
moves. The exact numbers of the chosen plan always come from `cost.estimate`.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.config import ParallelConfig
from autoplan.cost import CostCache, layer_cost
from autoplan.cost.cache import or_no_cache
from autoplan.cost import memory as cost_memory
from autoplan.cost import pipeline as cost_pipeline
from autoplan.cost.layers import DEFAULT_RUNTIME, activation_bytes, layer_states
from autoplan.cost.stages import (StageCost, last_stage_loss_bytes, num_virtual_stages, partition,
                                  pp_p2p_s, stage_cost)
from autoplan.cost.step import dp_sync_s, optimizer_s, step_time_s
from autoplan.cost import hw as cost_hw
from autoplan.trace.graph import ModelGraph
from autoplan.solve.cpsat import MODES, GroupTable, Tables, TIME_UNIT_S, MEMORY_UNIT_B


def _ns(seconds: float) -> int:
    return round(seconds / TIME_UNIT_S)


def _kib(nbytes: float) -> int:
    return round(nbytes / MEMORY_UNIT_B)


@dataclass(frozen=True)
class Units:
    """What the partition solver places, in its order: `runs` (lo, hi, unit) of identical units,
    lo and hi counted in units, a unit named by its blocks' segment names; and per unit the
    indices (in execution order) of the blocks it stands for."""

    runs: tuple[tuple[int, int, tuple[str, ...]], ...]
    blocks: tuple[tuple[int, ...], ...]


MANY_RUNS = 4  # CP-SAT's model grows with every run; more than these, a periodic stack is placed by periods


def block_units(graph: ModelGraph, cache: CostCache | None = None, chunks: int = 1) -> Units:
    """The units of a pipeline of `chunks` chunks (kept in a search's `cache`: every table of
    the search asks). With one chunk there is nothing to cut: each block is a unit, and blocks
    of one kind form one run wherever they sit, so a stack that interleaves its kinds (Jamba's
    Mamba and attention layers, Llama-4's dense and MoE layers) is as small a model as one that
    does not. With more, units are the blocks in execution order, or the periods of a stack
    that interleaves its kinds periodically in more than MANY_RUNS runs: the solver then cuts
    stages only between periods (if there are at least `chunks` of them), and the blocks of a
    period share one recomputation mode."""
    names = [name for _, name in graph.layer_order]
    return or_no_cache(cache).get(("block_units", id(graph), chunks), lambda: _block_units(names, chunks), graph)


def pipeline_units(graph: ModelGraph) -> int:
    """How many units a pipeline's search cuts between: the blocks, or a periodic stack's periods."""
    if "pipeline_units" not in graph.memo:
        graph.memo["pipeline_units"] = len(block_units(graph, chunks=2).blocks)
    return graph.memo["pipeline_units"]


def _block_units(names: list[str], chunks: int) -> Units:
    singles = [(i,) for i in range(len(names))]
    if chunks == 1:
        first: dict[str, int] = {}
        for index, name in enumerate(names):
            first.setdefault(name, index)
        singles.sort(key=lambda unit: first[names[unit[0]]])
    elif len(_runs([(name,) for name in names])) > MANY_RUNS:
        period = _period(names)
        if period and len(names) // period >= chunks:
            periods = [tuple(range(i, i + period)) for i in range(0, len(names), period)]
            return Units(_runs([tuple(names[b] for b in unit) for unit in periods]), tuple(periods))
    return Units(_runs([(names[unit[0]],) for unit in singles]), tuple(singles))


def _runs(units: list[tuple[str, ...]]) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
    runs: list[tuple[int, int, tuple[str, ...]]] = []
    for index, unit in enumerate(units):
        if runs and runs[-1][2] == unit and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1, unit)
        else:
            runs.append((index, index + 1, unit))
    return tuple(runs)


def _period(names: list[str]) -> int:
    """The shortest p < len(names) such that `names` is its first p repeated; 0 if none."""
    for p in range(1, len(names) // 2 + 1):
        if len(names) % p == 0 and names == names[:p] * (len(names) // p):
            return p
    return 0


def _unit_costs(graph: ModelGraph, config: ParallelConfig, cluster, unit: tuple[str, ...], mode: str,
                cache: CostCache | None) -> list:
    return [layer_cost(graph.segment(name), graph, config, cluster, mode, cache=cache) for name in unit]


def allowed_modes(config: ParallelConfig, fixed_recompute: str | None) -> tuple[str, ...]:
    return (fixed_recompute,) if fixed_recompute else MODES


def _group_tables(graph: ModelGraph, config: ParallelConfig, cluster,
                  cache: CostCache | None) -> tuple[list[GroupTable], float]:
    """Per run of identical units: its table, and the largest ZeRO-3 gather of any block."""
    groups = []
    largest_gather = 0.0
    for lo, hi, unit in block_units(graph, cache, num_virtual_stages(config)).runs:
        costs = {mode: _unit_costs(graph, config, cluster, unit, mode, cache) for mode in MODES}
        largest_gather = max([largest_gather, *(c.zero3_gather_params for c in costs["none"])])
        groups.append(GroupTable(
            name="+".join(unit), lo=lo, hi=hi,
            time_ns={m: sum(_ns(c.time_s) for c in cs) for m, cs in costs.items()},
            state_kib=sum(_kib(c.state_bytes) for c in costs["none"]),
            activation_kib={m: sum(_kib(c.activation_bytes) for c in cs) for m, cs in costs.items()},
        ))
    return groups, largest_gather


def _fixed_time_s(graph: ModelGraph, config: ParallelConfig, cluster, pre, post,
                  cache: CostCache | None) -> list[float]:
    """Per chunk: pipeline send/recv, plus the embedding on chunk 0 and the head on the last."""
    p2p = pp_p2p_s(graph, config, cluster, cache)
    fixed_time = [p2p] * num_virtual_stages(config)
    fixed_time[0] += pre.time_s
    fixed_time[-1] += post.time_s
    return fixed_time


def build_tables(graph: ModelGraph, config: ParallelConfig, cluster,
                 fixed_recompute: str | None = None, with_tail: bool = False,
                 tail_table: bool = True, cache: CostCache | None = None) -> Tables:
    """The tables of one configuration. `with_tail`: the even partition's step-end time as a
    fixed term (a fixed partition's report); else, with `tail_table`, the step-end time per
    rank and block count (`rank_tail_ns`) that the search minimises with the step. `cache`:
    the search's (cost.CostCache)."""
    modes = allowed_modes(config, fixed_recompute)
    groups, largest_gather = _group_tables(graph, config, cluster, cache)
    pre = layer_cost(graph.pre, graph, config, cluster, "none", cache=cache)
    post = layer_cost(graph.post, graph, config, cluster, "none", cache=cache)
    chunks = num_virtual_stages(config)
    fixed_time = _fixed_time_s(graph, config, cluster, pre, post, cache)
    fixed_state, fixed_act = _fixed_memory_bytes(graph, config, (pre.state_bytes, pre.activation_bytes),
                                                 (post.state_bytes, post.activation_bytes),
                                                 max(largest_gather, pre.zero3_gather_params, post.zero3_gather_params))
    in_flight = _in_flight(config)
    tail = _even_partition_tail_s(graph, config, cluster, cache) if with_tail else 0.0
    units = block_units(graph, cache, chunks)
    return Tables(
        num_layers=len(units.blocks), pp=config.pp, vpp=chunks // config.pp, groups=groups,
        slots=pipeline_slots(config),
        in_flight=in_flight, capacity_kib=_kib(cost_hw.usable_memory_bytes(cluster)),
        fixed_time_ns=[_ns(t) for t in fixed_time], fixed_state_kib=[_kib(b) for b in fixed_state],
        fixed_activation_kib=[_kib(b) for b in fixed_act], fixed_sync_ns=[_ns(tail)] * config.pp,
        modes=modes,
        tail_ns=None if with_tail or not tail_table else rank_tail_ns(graph, config, cluster, pre, post, cache),
        unit_blocks=units.blocks,
    )


def _fixed_memory_bytes(graph: ModelGraph, config: ParallelConfig, pre: tuple[float, float],
                        post: tuple[float, float], largest_gather: float) -> tuple[list[float], list[float]]:
    """Per rank: (states, activations per micro-batch in flight) outside the blocks: runtime
    overhead and buffers everywhere, the embedding's (`pre`: states, activations) on rank 0,
    the head's and the loss on the rank holding the last chunk."""
    chunks = num_virtual_stages(config)
    buffers = (cost_memory.pipeline_buffer_bytes(graph, config)
               + cost_memory.zero3_buffer_bytes(largest_gather, config))
    fixed_state = [cost_memory.runtime_overhead_bytes() + buffers * (chunks // config.pp)
                   for _ in range(config.pp)]
    fixed_act = [0.0] * config.pp
    fixed_state[0] += pre[0]
    fixed_act[0] += pre[1]
    last_rank = (chunks - 1) % config.pp
    loss = last_stage_loss_bytes(graph, config, DEFAULT_RUNTIME)
    fixed_state[last_rank] += post[0] + sum(loss.values())
    fixed_act[last_rank] += post[1]
    return fixed_state, fixed_act


def _in_flight(config: ParallelConfig) -> list[float]:
    m = config.num_microbatches
    return [cost_pipeline.microbatches_in_flight(config.schedule, config.pp, r, m, config.vpp)
            for r in range(config.pp)]


def least_memory_kib(graph: ModelGraph, config: ParallelConfig, cache: CostCache | None = None) -> float:
    """`memory_lower_bound_kib(build_tables(graph, config, cluster))`, the same number, from
    the memory terms alone: the search bounds every ZeRO/offload variant of every family by
    it, and most are ruled out before any time is costed."""
    groups, largest_gather = [], 0.0
    for lo, hi, unit in block_units(graph, cache, num_virtual_stages(config)).runs:
        blocks = [graph.segment(name) for name in unit]
        states = [layer_states(block, graph, config, DEFAULT_RUNTIME, cache) for block in blocks]
        largest_gather = max([largest_gather, *(s.zero3_gather_params for s in states)])
        least_act = min(sum(_kib(activation_bytes(block, graph, config, mode, True, DEFAULT_RUNTIME, cache))
                            for block in blocks) for mode in MODES)
        groups.append((hi - lo, sum(_kib(s.state_bytes) for s in states), least_act))
    ends = []
    for block in (graph.pre, graph.post):
        states = layer_states(block, graph, config, DEFAULT_RUNTIME, cache)
        act = activation_bytes(block, graph, config, "none", True, DEFAULT_RUNTIME, cache)
        largest_gather = max(largest_gather, states.zero3_gather_params)
        ends.append((states.state_bytes, act))
    fixed_state, fixed_act = _fixed_memory_bytes(graph, config, ends[0], ends[1], largest_gather)
    return _least_kib(groups, [_kib(b) for b in fixed_state], [_kib(b) for b in fixed_act],
                      _in_flight(config), config.pp)


def rank_tail_ns(graph: ModelGraph, config: ParallelConfig, cluster, pre,
                 post, cache: CostCache | None = None) -> tuple[RankTails, ...] | None:
    """Per rank, by units held of each run (`RankTails`): the step-end time (exposed DP sync +
    optimizer, `cost.step`) of the rank. These read only the rank's parameter counts and
    backward time, which recomputation does not change (checked: None otherwise)."""
    units = []
    for _, _, unit in block_units(graph, cache, num_virtual_stages(config)).runs:
        costs = [_unit_costs(graph, config, cluster, unit, mode, cache) for mode in MODES]
        if len({tuple((c.bwd_s, c.dense_params, c.expert_params) for c in cs) for cs in costs}) != 1:
            return None
        units.append(costs[0])
    chunks = num_virtual_stages(config)
    last_rank = (chunks - 1) % config.pp
    rows: dict[tuple, RankTails] = {}
    for rank in range(config.pp):
        key = (rank == 0, rank == last_rank)
        if key not in rows:
            ends = tuple(c for c, here in zip((pre, post), key) if here)
            rows[key] = RankTails(lambda counts, ends=ends: _ns(_tail_s(config, cluster, units, counts, ends)))
    return tuple(rows[(rank == 0, rank == last_rank)] for rank in range(config.pp))


class RankTails:
    """One rank's step-end time by blocks held per run (`of`; `[n]` for a model of one run),
    computed when first asked (the solver asks for a few counts near L / pp; most
    configurations are pruned before it asks at all)."""

    def __init__(self, tail_ns):
        self.tail_ns = tail_ns
        self.memo: dict[tuple[int, ...], int] = {}

    def of(self, counts: tuple[int, ...]) -> int:
        if counts not in self.memo:
            self.memo[counts] = self.tail_ns(counts)
        return self.memo[counts]

    def __getitem__(self, n: int) -> int:
        return self.of((n,))


def _tail_s(config: ParallelConfig, cluster, units: list[list], counts: tuple[int, ...], ends: tuple) -> float:
    """`step.dp_sync_s + step.optimizer_s` of a rank with counts[g] units like units[g] (the
    layer costs of a unit's blocks) and the embedding/head `ends`: they read only the sums of
    parameters and backward time, and the largest layer."""
    held = [(unit, n) for unit, n in zip(units, counts) if n]
    layers = [c for unit, _ in held for c in unit] + list(ends)

    def total(field: str) -> float:
        return sum(n * getattr(c, field) for unit, n in held for c in unit) + sum(getattr(c, field) for c in ends)

    stage = StageCost(
        stage_index=0, physical_stage=0, layers=(), fwd_s=0.0,
        bwd_s=total("bwd_s"), recompute_s=0.0, comm_s={},
        comm_total_s={}, in_flight=0.0, memory_bytes={}, model_flops=0.0, hardware_flops=0.0,
        dense_params=total("dense_params"), expert_params=total("expert_params"),
        largest_block_params=max((c.dense_params + c.expert_params for c in layers), default=0.0))
    return dp_sync_s([stage], config, cluster) + optimizer_s([stage], config, cluster)


def pipeline_slots(config: ParallelConfig) -> float:
    """Micro-batches plus the schedule's bubble, in units of one stage's time per micro-batch."""
    return config.num_microbatches + cost_pipeline.bubble_stage_times(config.schedule, config.pp, config.vpp)


def time_lower_bound_ns(graph: ModelGraph, config: ParallelConfig, cluster,
                        cache: CostCache | None = None) -> float:
    """`lower_bound_ns(build_tables(graph, config, cluster), memory_aware=False)`, the same
    number, without the memory terms it does not read (the search bounds every family by it)."""
    groups, _ = _group_tables(graph, config, cluster, cache)
    pre = layer_cost(graph.pre, graph, config, cluster, "none", cache=cache)
    post = layer_cost(graph.post, graph, config, cluster, "none", cache=cache)
    fixed_time_ns = [_ns(t) for t in _fixed_time_s(graph, config, cluster, pre, post, cache)]
    return _balanced_ns(pipeline_slots(config), config.pp, groups, fixed_time_ns, 0.0, [_ns(0.0)] * config.pp)


def _even_partition_tail_s(graph: ModelGraph, config: ParallelConfig, cluster,
                           cache: CostCache | None) -> float:
    """DP sync + optimizer at the end of the step, for the even partition."""
    stages = [stage_cost(graph, config, cluster, i, layers, cache=cache)
              for i, layers in enumerate(partition(graph, config))]
    step = step_time_s(stages, config, cluster, graph)
    return step.dp_sync_s + step.optimizer_s


def lower_bound_ns(tables: Tables, memory_aware: bool = True) -> float:
    """No partition beats perfect balance with the least recomputation memory forces.

    Memory: all ranks together must hold every block's states and activations; what does
    not fit in pp x capacity must be saved by recomputing, at best at the cheapest
    time per KiB saved (a continuous knapsack, each block counted with the most in-flight
    micro-batches any rank has, so the saving is overestimated and the bound stays valid).
    Infinite when even recomputing everything cannot fit.
    """
    extra = _forced_recompute_ns(tables) if memory_aware else 0.0
    return _balanced_ns(tables.slots, tables.pp, tables.groups, tables.fixed_time_ns, extra, tables.fixed_sync_ns)


def _balanced_ns(slots: float, pp: int, groups: list[GroupTable], fixed_time_ns: list[int], extra: float,
                 fixed_sync_ns: list[int]) -> float:
    base = sum(min(g.time_ns.values()) * (g.hi - g.lo) for g in groups) + sum(fixed_time_ns)
    return slots * (base + extra) / pp + min(fixed_sync_ns or [0])


def _forced_recompute_ns(tables: Tables) -> float:
    low, high = min(tables.in_flight), max(tables.in_flight)
    need = (sum(g.state_kib * (g.hi - g.lo) for g in tables.groups)
            + low * sum(g.activation_kib["none"] * (g.hi - g.lo) for g in tables.groups)
            + sum(tables.fixed_state_kib) + low * sum(tables.fixed_activation_kib)
            - tables.pp * tables.capacity_kib)
    if need <= 0:
        return 0.0
    options = []  # (ns per KiB saved, KiB saved per block, blocks)
    for g in tables.groups:
        t0 = min(g.time_ns.values())
        for mode in tables.modes:
            saved = high * (g.activation_kib["none"] - g.activation_kib[mode])
            if saved > 0:
                options.append((max(0, g.time_ns[mode] - t0) / saved, saved, g.hi - g.lo))
    extra = 0.0
    for rate, saved, blocks in sorted(options):
        take = min(need, saved * blocks)
        extra += rate * take
        need -= take
        if need <= 0:
            return extra
    return float("inf")


def memory_lower_bound_kib(tables: Tables) -> float:
    """Least memory the fullest rank can need: states and fixed terms spread perfectly,
    every block at its smallest activation footprint."""
    groups = [(g.hi - g.lo, g.state_kib, min(g.activation_kib.values())) for g in tables.groups]
    return _least_kib(groups, tables.fixed_state_kib, tables.fixed_activation_kib, tables.in_flight, tables.pp)


def _least_kib(groups: list[tuple[int, int, int]], fixed_state_kib: list[int], fixed_activation_kib: list[int],
               in_flight: list[float], pp: int) -> float:
    """memory_lower_bound_kib of (blocks, state KiB, least activation KiB) per group."""
    states = sum(n * state for n, state, _ in groups)
    acts = sum(n * act for n, _, act in groups)
    fixed = sum(fixed_state_kib) + sum(f * a for f, a in zip(in_flight, fixed_activation_kib))
    return (states + min(in_flight) * acts + fixed) / pp
