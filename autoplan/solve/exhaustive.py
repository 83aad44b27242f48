"""Brute force over the same space as the CP-SAT model, for the optimality cross-check.

Every contiguous partition of the blocks into pp * vpp chunks; for each, every rank picks
its per-chunk recomputation counts independently (the objective is monotone in each rank's
time and memory is per rank), minimising its time within its memory.
"""

from __future__ import annotations

import itertools

from autoplan.solve.cpsat import Tables, _count, fixed_memory_kib, memory_coefficients, objective_ns


def _rank_options(tables: Tables, cuts: tuple[int, ...], rank: int):
    """All (full, selective) assignments of this rank's chunks: yields {chunk: (f tuple, s tuple)}."""
    chunks = [k for k in range(tables.chunks) if k % tables.pp == rank]
    per_cell = []
    for k in chunks:
        for g, group in enumerate(tables.groups):
            n = _count(tables, cuts[k], cuts[k + 1], group)
            cells = [(f, s) for f in range(n + 1) for s in range(n + 1 - f)
                     if _allowed(tables, n, f, s)]
            per_cell.append(((k, g), cells))
    for combo in itertools.product(*(cells for _, cells in per_cell)):
        yield {key: value for (key, _), value in zip(per_cell, combo)}


def _allowed(tables: Tables, n: int, f: int, s: int) -> bool:
    if tables.modes == ("none",):
        return f == s == 0
    if tables.modes == ("full",):
        return f == n and s == 0
    if tables.modes == ("selective",):
        return s == n and f == 0
    return True


def best_objective_ns(tables: Tables) -> float:
    """Minimum objective over every partition and recomputation (inf if nothing fits)."""
    K, L, G = tables.chunks, tables.num_layers, len(tables.groups)
    best = float("inf")
    for inner in itertools.combinations(range(1, L), K - 1):
        cuts = (0, *inner, L)
        full = [[0] * G for _ in range(K)]
        sel = [[0] * G for _ in range(K)]
        feasible = True
        for rank in range(tables.pp):
            rank_best, rank_choice = float("inf"), None
            for choice in _rank_options(tables, cuts, rank):
                for (k, g), (f, s) in choice.items():
                    full[k][g], sel[k][g] = f, s
                value = _rank_time_if_fits(tables, cuts, full, sel, rank)
                if value < rank_best:
                    rank_best, rank_choice = value, dict(choice)
            if rank_choice is None:
                feasible = False
                break
            for (k, g), (f, s) in rank_choice.items():
                full[k][g], sel[k][g] = f, s
        if feasible:
            best = min(best, objective_ns(tables, cuts, full, sel))
    return best


def _rank_time_if_fits(tables: Tables, cuts, full, sel, rank: int) -> float:
    time, memory = 0, fixed_memory_kib(tables, rank)
    for k in range(tables.chunks):
        if k % tables.pp != rank:
            continue
        time += tables.fixed_time_ns[k]
        for g, group in enumerate(tables.groups):
            n = _count(tables, cuts[k], cuts[k + 1], group)
            f, s = full[k][g], sel[k][g]
            t = group.time_ns
            time += n * t["none"] + f * (t["full"] - t["none"]) + s * (t["selective"] - t["none"])
            per_block, per_full, per_sel = memory_coefficients(tables, rank, group)
            memory += n * per_block + f * per_full + s * per_sel
    return time if memory <= tables.capacity_kib else float("inf")
