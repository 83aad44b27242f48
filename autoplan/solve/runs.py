"""Exact partition of one long run of identical blocks with a few other blocks before and
after it (dense layers before the MoE ones, as in DeepSeek-V3 and Mixtral variants).

The few blocks outside the long run ("minor" blocks, at most MAX_MINOR_BLOCKS) can sit in
chunks only a few ways: every set of chunk boundaries among them, and whether the chunk
holding the last one before the run (the first one after it) also holds blocks of the run,
is enumerated. Each way fixes, per rank, which minor blocks it holds and how many chunks of
the run it has (each holds at least one of its blocks); what is left is the identical-blocks
problem with per-rank fixed blocks and lower bounds, which `homogeneous.least_counts` solves
exactly (each rank choosing its minor blocks' recomputation with its own). The best over all
ways is the optimum of the CP-SAT model with the step-end tail; brute force checks it on small
cases (tests/solve/test_runs.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from autoplan.solve.cpsat import Partition, Tables, _count, objective_ns, objective_scale
from autoplan.solve.homogeneous import RankTime, least_counts, monotone

MAX_MINOR_BLOCKS = 8  # at most 2^8 ways to cut them; more goes to CP-SAT


def major_index(tables: Tables) -> int:
    """The group of the longest run."""
    return max(range(len(tables.groups)), key=lambda g: tables.groups[g].hi - tables.groups[g].lo)


def applies(tables: Tables) -> bool:
    """Several groups, one run holding all but a few blocks, every group `monotone` (so that
    g_r(n) of the long run is nondecreasing), and a step-end tail by blocks per group."""
    if len(tables.groups) < 2 or (tables.tail_ns is not None and not hasattr(tables.tail_ns[0], "of")):
        return False
    major = tables.groups[major_index(tables)]
    if tables.num_layers - (major.hi - major.lo) > MAX_MINOR_BLOCKS:
        return False
    return all(monotone(tables, group) for group in tables.groups)


@dataclass(frozen=True)
class Layout:
    """One way the minor blocks sit in chunks: the fixed (minor) part of each chunk as block
    ranges, and which chunks also hold blocks of the long run."""

    pieces: tuple[tuple[int, int], ...]  # per chunk: its minor blocks before the run, [a, b)
    tails: tuple[tuple[int, int], ...]  # per chunk: its minor blocks after the run
    major_chunks: tuple[int, ...]  # chunks holding blocks of the run, in order


def layouts(tables: Tables, lo: int, hi: int):
    """Every Layout of blocks [0, lo) and [hi, L) around the run [lo, hi) in tables.chunks chunks."""
    L, K = tables.num_layers, tables.chunks
    for before in _splits(0, lo):
        for after in _splits(hi, L):
            # before: pieces of [0, lo); its last piece may share a chunk with the run's start
            for joined_before in ((False, True) if before else (False,)):
                for joined_after in ((False, True) if after else (False,)):
                    pure_before = len(before) - joined_before
                    pure_after = len(after) - joined_after
                    run_chunks = K - pure_before - pure_after
                    if not 1 <= run_chunks <= hi - lo:
                        continue
                    empty = (0, 0)
                    pieces = [*before[:pure_before], *([before[-1]] if joined_before else [empty]),
                              *[empty] * (run_chunks - 1), *[empty] * pure_after]
                    tails = [*[empty] * pure_before, *[empty] * (run_chunks - 1),
                             *([after[0]] if joined_after else [empty]), *after[len(after) - pure_after:]]
                    yield Layout(tuple(pieces), tuple(tails),
                                 tuple(range(pure_before, pure_before + run_chunks)))


def _splits(a: int, b: int) -> list[tuple[tuple[int, int], ...]]:
    """Every way to cut [a, b) into consecutive non-empty pieces ([()] when a == b)."""
    if a == b:
        return [()]
    out = []
    for inner in itertools.product((False, True), repeat=b - a - 1):
        cuts = [a, *(a + 1 + i for i, cut in enumerate(inner) if cut), b]
        out.append(tuple(zip(cuts, cuts[1:])))
    return out


def solve_runs(tables: Tables) -> Partition | None:
    """Best partition (see the module docstring), or None if nothing fits. Call only where
    `applies(tables)`."""
    m = major_index(tables)
    major = tables.groups[m]
    scale = objective_scale(tables)
    slot_weight = round(tables.slots * scale)
    best = None
    for layout in layouts(tables, major.lo, major.hi):
        minor_counts = _minor_counts(tables, layout, m)
        ranks = [RankTime(tables, r, major, tuple((tables.groups[g], n) for g, n in minor_counts[r]))
                 for r in range(tables.pp)]
        lows = [sum(1 for k in layout.major_chunks if k % tables.pp == r) for r in range(tables.pp)]
        highs = [major.hi - major.lo if low else 0 for low in lows]

        def sync(r: int, n: int, minors=minor_counts) -> int:
            return _rank_sync(tables, r, m, n, minors[r])

        found = least_counts(ranks, lows, highs, major.hi - major.lo, sync, slot_weight, scale,
                             bound=best[0] if best else float("inf"))
        if found is not None:
            best = (found[0], found[1], layout, ranks, minor_counts)
    if best is None:
        return None
    value, counts, layout, ranks, minor_counts = best
    return _partition(tables, m, layout, counts, [ranks[r].least(n) for r, n in enumerate(counts)],
                      minor_counts, value / scale)


def _minor_counts(tables: Tables, layout: Layout, major: int) -> list[tuple[tuple[int, int], ...]]:
    """Per rank: (group, blocks) of the minor blocks it holds, groups in order."""
    per_rank = [[0] * len(tables.groups) for _ in range(tables.pp)]
    for k in range(tables.chunks):
        for a, b in (layout.pieces[k], layout.tails[k]):
            for g, group in enumerate(tables.groups):
                if g != major:
                    per_rank[k % tables.pp][g] += _count(tables, a, b, group)
    return [tuple((g, n) for g, n in enumerate(counts) if n) for counts in per_rank]


def _rank_sync(tables: Tables, rank: int, major: int, n: int, minors: tuple[tuple[int, int], ...]) -> int:
    """Step-end time of `rank` holding n blocks of the run and `minors`: linear sync plus the
    tabled tail by blocks per group."""
    counts = [0] * len(tables.groups)
    counts[major] = n
    for g, count in minors:
        counts[g] = count
    linear = sum(c * group.sync_ns for c, group in zip(counts, tables.groups))
    fixed = tables.fixed_sync_ns[rank] if tables.fixed_sync_ns else 0
    tail = tables.tail_ns[rank].of(tuple(counts)) if tables.tail_ns else 0
    return linear + fixed + tail


def _partition(tables: Tables, major: int, layout: Layout, counts: list[int], choices: list[tuple],
               minor_counts, objective: float) -> Partition:
    """Chunks of the layout with each rank's run blocks spread evenly over its run chunks
    (earlier ones get the extra), and each rank's recomputed blocks, per group, placed in its
    chunks in order."""
    K, pp, G = tables.chunks, tables.pp, len(tables.groups)
    run_blocks = [0] * K
    for r in range(pp):
        mine = [k for k in layout.major_chunks if k % pp == r]
        base, extra = divmod(counts[r], len(mine)) if mine else (0, 0)
        for i, k in enumerate(mine):
            run_blocks[k] = base + (1 if i < extra else 0)
    cuts = [0]
    for k in range(K):
        size = (layout.pieces[k][1] - layout.pieces[k][0]) + run_blocks[k] + (layout.tails[k][1] - layout.tails[k][0])
        cuts.append(cuts[-1] + size)
    full = [[0] * G for _ in range(K)]
    sel = [[0] * G for _ in range(K)]
    for r in range(pp):
        _, f_run, s_run, _, minor_choice = choices[r]
        wanted = {major: (f_run, s_run)}
        wanted.update({g: fs for (g, _), fs in zip(minor_counts[r], minor_choice)})
        for g, (f_left, s_left) in wanted.items():
            for k in range(r, K, pp):
                n = _count(tables, cuts[k], cuts[k + 1], tables.groups[g])
                full[k][g] = min(f_left, n)
                sel[k][g] = min(s_left, n - full[k][g])
                f_left, s_left = f_left - full[k][g], s_left - sel[k][g]
    full_t = tuple(tuple(row) for row in full)
    sel_t = tuple(tuple(row) for row in sel)
    assert objective_ns(tables, cuts, full_t, sel_t) == objective, "runs.py: partition and objective disagree"
    return Partition(cuts=tuple(cuts), full=full_t, selective=sel_t, objective_ns=objective, status="OPTIMAL")
