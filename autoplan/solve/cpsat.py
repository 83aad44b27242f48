"""CP-SAT model of one outer configuration: layer-to-stage partition and recomputation per stage.

Decision variables (K = pp * vpp pipeline chunks; chunk k runs on rank k mod pp):
    cut[k]          first block of chunk k (cut[0] = 0, cut[K] = L, each chunk >= 1 block)
    n[k, g]         blocks of group g in chunk k (groups are contiguous runs of identical
                    blocks, so n[k, g] = clamp_g(cut[k+1]) - clamp_g(cut[k]); a "block" here is
                    a unit of tables.block_units: a block, or a period of a periodic stack)
    full[k, g], sel[k, g]   of those, blocks recomputed fully / selectively
Constraints:
    add_partition_constraints()   contiguous, non-empty chunks covering all blocks
    add_memory_constraints()      per rank: states + in-flight x activations + fixed <= capacity
Objective (add_time_objective()):
    minimise  slots * T_max + D_max    with  T_max >= per-micro-batch time of each rank,
    D_max >= non-overlapped per-rank step-end time (DP sync, optimizer), slots = m + bubble.
All coefficients come from `Tables`, computed by `autoplan.cost` in Python before the
model is built (integers: nanoseconds and KiB). The solver derives no cost formula.
One group of identical blocks (a plain transformer) is solved exactly without CP-SAT by
`homogeneous.py`; the per-rank CP-SAT model `_solve_homogeneous` remains for tables outside
that solver's assumptions and as its cross-check in tests/solve.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a model is built: a plan of identical blocks never needs it
    from ortools.sat.python import cp_model

MODES = ("none", "selective", "full")
TIME_UNIT_S = 1e-9  # objective and times in nanoseconds
MEMORY_UNIT_B = 1024  # memory in KiB


@dataclass(frozen=True)
class GroupTable:
    """Per-block coefficients of one group of identical blocks (one rank's share)."""

    name: str
    lo: int  # first block index of the group's run
    hi: int  # one past the last
    time_ns: dict[str, int]  # per micro-batch, by recompute mode
    state_kib: int  # parameters + gradients + optimizer states on the rank
    activation_kib: dict[str, int]  # per micro-batch in flight, by recompute mode
    sync_ns: int = 0  # non-overlapped step-end time this block adds (DP sync, optimizer)


@dataclass(frozen=True)
class Tables:
    """Everything the CP-SAT model of one outer configuration needs."""

    num_layers: int
    pp: int
    vpp: int
    groups: list[GroupTable]
    slots: float  # micro-batches + bubble, in units of one rank's per-micro-batch time
    in_flight: list[float]  # per rank: micro-batches of activations held at peak
    capacity_kib: int
    fixed_time_ns: list[int]  # per chunk: pre (chunk 0) / post (last chunk) time per micro-batch
    fixed_state_kib: list[int]  # per rank: pre/post states, buffers, overhead
    fixed_activation_kib: list[int]  # per rank: pre/post activations per micro-batch in flight
    fixed_sync_ns: list[int] = field(default_factory=list)  # per rank
    modes: tuple[str, ...] = MODES
    # per rank r and block count n (0..num_layers): the step-end time (DP sync + optimizer,
    # >= 0) of rank r holding n blocks, where it is not linear in n; one group only
    # (homogeneous.py; indexable rows, tables.RankTails computes them on demand)
    tail_ns: tuple | None = None
    # per unit the solver places (num_layers of them), the blocks it stands for, by index in
    # execution order (tables.block_units); () when each unit is the block of its index
    unit_blocks: tuple[tuple[int, ...], ...] = ()

    @property
    def chunks(self) -> int:
        return self.pp * self.vpp


@dataclass(frozen=True)
class Partition:
    """A solution: blocks per chunk and, per chunk and group, recomputed block counts."""

    cuts: tuple[int, ...]  # K + 1 boundaries
    full: tuple[tuple[int, ...], ...]  # [chunk][group]
    selective: tuple[tuple[int, ...], ...]
    objective_ns: float
    status: str


def _count(tables: Tables, cut_lo: int, cut_hi: int, group: GroupTable) -> int:
    lo, hi = max(cut_lo, group.lo), min(cut_hi, group.hi)
    return max(0, hi - lo)


def objective_scale(tables: Tables) -> int:
    """slots is fractional (bubble (p-1)/v or (p-1)/3): the integer objective is scaled by this."""
    return 12 * tables.vpp


def memory_coefficients(tables: Tables, rank: int, group: GroupTable) -> tuple[int, int, int]:
    """KiB per block on `rank`: (per block, extra per fully recomputed, extra per selective)."""
    inflight, a = tables.in_flight[rank], group.activation_kib
    return (group.state_kib + round(inflight * a["none"]), round(inflight * (a["full"] - a["none"])),
            round(inflight * (a["selective"] - a["none"])))


def fixed_memory_kib(tables: Tables, rank: int) -> int:
    return tables.fixed_state_kib[rank] + round(tables.in_flight[rank] * tables.fixed_activation_kib[rank])


def objective_ns(tables: Tables, cuts, full, selective) -> float:
    """The objective of a given partition, computed from the tables (used by the exhaustive
    cross-check and to report a fixed partition); equal to the CP-SAT objective.
    Infinite when the partition does not fit in memory."""
    times = [0] * tables.pp
    syncs = list(tables.fixed_sync_ns or [0] * tables.pp)
    mems = [fixed_memory_kib(tables, r) for r in range(tables.pp)]
    for k in range(tables.chunks):
        rank = k % tables.pp
        times[rank] += tables.fixed_time_ns[k]
        for g, group in enumerate(tables.groups):
            n = _count(tables, cuts[k], cuts[k + 1], group)
            f, s = full[k][g], selective[k][g]
            if f + s > n:
                return float("inf")
            t = group.time_ns
            times[rank] += n * t["none"] + f * (t["full"] - t["none"]) + s * (t["selective"] - t["none"])
            syncs[rank] += n * group.sync_ns
            per_block, per_full, per_sel = memory_coefficients(tables, rank, group)
            mems[rank] += n * per_block + f * per_full + s * per_sel
    if any(m > tables.capacity_kib for m in mems):
        return float("inf")
    if tables.tail_ns:
        syncs = [d + _tail(tables, r, cuts) for r, d in enumerate(syncs)]
    scale = objective_scale(tables)
    return (round(tables.slots * scale) * max(times) + scale * max(syncs)) / scale


def _tail(tables: Tables, rank: int, cuts) -> int:
    """The tabled step-end time of `rank` under `cuts`: by its block count for one group (a
    sequence indexed by n), by its blocks per group otherwise (tables.RankTails.of)."""
    counts = [sum(_count(tables, cuts[k], cuts[k + 1], group) for k in range(rank, tables.chunks, tables.pp))
              for group in tables.groups]
    row = tables.tail_ns[rank]
    return row.of(tuple(counts)) if hasattr(row, "of") else row[sum(counts)]


def solve_partition(tables: Tables, time_limit_s: float = 10.0, workers: int = 1,
                    hint: Partition | None = None) -> Partition | None:
    """Best partition and recomputation for one outer configuration, or None if nothing fits.
    Tables with a step-end tail outside the direct solver's reach are solved without it: the
    partition is then only FEASIBLE (its objective, with the tail, is not proven least)."""
    from dataclasses import replace

    from autoplan.solve import homogeneous, runs

    if homogeneous.applies(tables):  # one group of identical blocks: exact, no MIP needed
        return homogeneous.solve_identical(tables)
    if runs.applies(tables):  # one long run and a few other blocks: exact too
        return runs.solve_runs(tables)
    if tables.tail_ns:
        part = solve_partition(replace(tables, tail_ns=None), time_limit_s, workers, hint)
        return part and replace(part, status="FEASIBLE",
                                objective_ns=objective_ns(tables, part.cuts, part.full, part.selective))
    if len(tables.groups) == 1:
        return _solve_homogeneous(tables, time_limit_s, workers)
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    v = _add_variables(model, tables)
    add_partition_constraints(model, tables, v)
    add_memory_constraints(model, tables, v)
    add_time_objective(model, tables, v)
    if hint is not None:
        for k, value in enumerate(hint.cuts):
            model.add_hint(v["cut"][k], value)
    solver, status = _solve(model, time_limit_s, workers)
    if solver is None:
        return None
    K, G = tables.chunks, len(tables.groups)
    return Partition(
        cuts=tuple(solver.value(v["cut"][k]) for k in range(K + 1)),
        full=tuple(tuple(solver.value(v["full"][k, g]) for g in range(G)) for k in range(K)),
        selective=tuple(tuple(solver.value(v["sel"][k, g]) for g in range(G)) for k in range(K)),
        objective_ns=round(solver.objective_value) / objective_scale(tables),
        status=solver.status_name(status),
    )


def _solve(model: cp_model.CpModel, time_limit_s: float, workers: int):
    """(solver, status) of a reproducible run; (None, status) when nothing was found."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    # The limit is CP-SAT's deterministic time, so the same tables give the same answer on a
    # loaded machine as on an idle one; the wall-clock limit is only a backstop.
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.max_time_in_seconds = 10 * time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = 0
    _fast_small_model(solver)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, status
    return solver, status


def _fast_small_model(solver: cp_model.CpSolver) -> None:
    """These models have a few dozen variables: symmetry detection costs more than it saves.
    Presolve stays on: without it a 12-block, 2-stage model ran into the time limit with a
    solution 23% worse than the optimum (the min/max clamps leave a weak relaxation)."""
    solver.parameters.symmetry_level = 0


def _add_variables(model: cp_model.CpModel, tables: Tables) -> dict:
    K, L = tables.chunks, tables.num_layers
    v: dict = {"cut": {}, "n": {}, "full": {}, "sel": {}}
    for k in range(K + 1):
        v["cut"][k] = model.new_int_var(0, L, f"cut_{k}")
    for k in range(K):
        for g, group in enumerate(tables.groups):
            size = group.hi - group.lo
            v["n"][k, g] = model.new_int_var(0, size, f"n_{k}_{g}")
            allow_full = "full" in tables.modes
            allow_sel = "selective" in tables.modes
            v["full"][k, g] = model.new_int_var(0, size if allow_full else 0, f"full_{k}_{g}")
            v["sel"][k, g] = model.new_int_var(0, size if allow_sel else 0, f"sel_{k}_{g}")
    return v


def _clamp(model: cp_model.CpModel, x, lo: int, hi: int, top: int, name: str):
    low = model.new_int_var(lo, max(lo, top), f"{name}_lo")
    model.add_max_equality(low, [x, lo])
    clamped = model.new_int_var(lo, hi, name)
    model.add_min_equality(clamped, [low, hi])
    return clamped


def add_partition_constraints(model: cp_model.CpModel, tables: Tables, v: dict) -> None:
    # contiguous chunks of at least one block, covering blocks 0..L-1 in order
    K, L = tables.chunks, tables.num_layers
    model.add(v["cut"][0] == 0)
    model.add(v["cut"][K] == L)
    for k in range(K):
        model.add(v["cut"][k + 1] >= v["cut"][k] + 1)
    for g, group in enumerate(tables.groups):
        clamped = [_clamp(model, v["cut"][k], group.lo, group.hi, L, f"c_{k}_{g}")
                   for k in range(K + 1)]
        for k in range(K):
            model.add(v["n"][k, g] == clamped[k + 1] - clamped[k])
            model.add(v["full"][k, g] + v["sel"][k, g] <= v["n"][k, g])
            if tables.modes == ("full",):
                model.add(v["full"][k, g] == v["n"][k, g])
            if tables.modes == ("selective",):
                model.add(v["sel"][k, g] == v["n"][k, g])


def _rank_chunks(tables: Tables, rank: int) -> list[int]:
    return [k for k in range(tables.chunks) if k % tables.pp == rank]


def add_memory_constraints(model: cp_model.CpModel, tables: Tables, v: dict) -> None:
    # per rank: states of its blocks + in-flight micro-batches x their activations + fixed
    for rank in range(tables.pp):
        terms = []
        for k in _rank_chunks(tables, rank):
            for g, group in enumerate(tables.groups):
                per_block, per_full, per_sel = memory_coefficients(tables, rank, group)
                terms += [v["n"][k, g] * per_block, v["full"][k, g] * per_full,
                          v["sel"][k, g] * per_sel]
        model.add(sum(terms) + fixed_memory_kib(tables, rank) <= tables.capacity_kib)


def add_time_objective(model: cp_model.CpModel, tables: Tables, v: dict) -> None:
    # minimise slots * (slowest rank's time per micro-batch) + slowest rank's step-end time
    bound = sum(max(g.time_ns.values()) * (g.hi - g.lo) for g in tables.groups) + sum(tables.fixed_time_ns)
    t_max = model.new_int_var(0, bound, "t_max")
    sync_bound = sum(g.sync_ns * (g.hi - g.lo) for g in tables.groups) + max(tables.fixed_sync_ns or [0])
    d_max = model.new_int_var(0, sync_bound, "d_max")
    for rank in range(tables.pp):
        time_terms, sync_terms = [], []
        for k in _rank_chunks(tables, rank):
            time_terms.append(tables.fixed_time_ns[k])
            for g, group in enumerate(tables.groups):
                t = group.time_ns
                time_terms.append(v["n"][k, g] * t["none"])
                time_terms.append(v["full"][k, g] * (t["full"] - t["none"]))
                time_terms.append(v["sel"][k, g] * (t["selective"] - t["none"]))
                sync_terms.append(v["n"][k, g] * group.sync_ns)
        model.add(t_max >= sum(time_terms))
        fixed_sync = tables.fixed_sync_ns[rank] if tables.fixed_sync_ns else 0
        model.add(d_max >= sum(sync_terms) + fixed_sync)
    scale = objective_scale(tables)
    model.minimize(round(tables.slots * scale) * t_max + scale * d_max)


def _solve_homogeneous(tables: Tables, time_limit_s: float, workers: int) -> Partition | None:
    """All blocks identical: only how many blocks (and recomputed blocks) each rank holds
    matters, not which of its chunks holds them. Variables per rank instead of per chunk;
    chunks are filled afterwards (at least one block each). Same objective and memory as
    the general model (exhaustive cross-check in tests/solve)."""
    from ortools.sat.python import cp_model

    group, pp, vpp, L = tables.groups[0], tables.pp, tables.vpp, tables.num_layers
    model = cp_model.CpModel()
    n = [model.new_int_var(vpp, L, f"n_{r}") for r in range(pp)]
    full = [model.new_int_var(0, L if "full" in tables.modes else 0, f"full_{r}") for r in range(pp)]
    sel = [model.new_int_var(0, L if "selective" in tables.modes else 0, f"sel_{r}") for r in range(pp)]
    model.add(sum(n) == L)
    t = group.time_ns
    bound = max(t.values()) * L + sum(tables.fixed_time_ns)
    t_max = model.new_int_var(0, bound, "t_max")
    d_max = model.new_int_var(0, group.sync_ns * L + max(tables.fixed_sync_ns or [0]), "d_max")
    for r in range(pp):
        model.add(d_max >= n[r] * group.sync_ns + (tables.fixed_sync_ns[r] if tables.fixed_sync_ns else 0))
        model.add(full[r] + sel[r] <= n[r])
        if tables.modes == ("full",):
            model.add(full[r] == n[r])
        if tables.modes == ("selective",):
            model.add(sel[r] == n[r])
        per_block, per_full, per_sel = memory_coefficients(tables, r, group)
        model.add(n[r] * per_block + full[r] * per_full + sel[r] * per_sel
                  + fixed_memory_kib(tables, r) <= tables.capacity_kib)
        fixed = sum(tables.fixed_time_ns[k] for k in _rank_chunks(tables, r))
        model.add(t_max >= n[r] * t["none"] + full[r] * (t["full"] - t["none"])
                  + sel[r] * (t["selective"] - t["none"]) + fixed)
    scale = objective_scale(tables)
    model.minimize(round(tables.slots * scale) * t_max + scale * d_max)
    solver, status = _solve(model, time_limit_s, workers)
    if solver is None:
        return None
    return fill_chunks(tables, [solver.value(x) for x in n], [solver.value(x) for x in full],
                       [solver.value(x) for x in sel], objective_ns=round(solver.objective_value) / scale,
                       status=solver.status_name(status))


def fill_chunks(tables: Tables, blocks: list[int], full: list[int], selective: list[int], *,
                objective_ns: float, status: str) -> Partition:
    """One group: blocks and recomputed blocks per rank -> a Partition, each rank's blocks spread
    evenly over its chunks (earlier chunks get the extra ones), fully recomputed blocks first."""
    counts = [0] * tables.chunks
    fulls = [[0] for _ in range(tables.chunks)]
    sels = [[0] for _ in range(tables.chunks)]
    for r in range(tables.pp):
        chunks = _rank_chunks(tables, r)
        base, extra = divmod(blocks[r], len(chunks))
        f_left, s_left = full[r], selective[r]
        for i, k in enumerate(chunks):
            counts[k] = base + (1 if i < extra else 0)
            fulls[k][0] = min(f_left, counts[k])
            f_left -= fulls[k][0]
            sels[k][0] = min(s_left, counts[k] - fulls[k][0])
            s_left -= sels[k][0]
    cuts = [0]
    for count in counts:
        cuts.append(cuts[-1] + count)
    return Partition(cuts=tuple(cuts), full=tuple(tuple(f) for f in fulls),
                     selective=tuple(tuple(x) for x in sels), objective_ns=objective_ns, status=status)
