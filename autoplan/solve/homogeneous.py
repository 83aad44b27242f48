"""Exact partition of identical blocks without a MIP solver (the usual case: one group).

When every block is the same, a rank's cost depends only on how many blocks it holds (n)
and how many of them it recomputes fully (f) or selectively (s), as in the homogeneous
CP-SAT model (`cpsat._solve_homogeneous`), whose objective this solver minimises exactly:

    round(slots * scale) * max_r time_r + scale * max_r sync_r

1. Per rank and n: the least time within the rank's memory, by enumerating f (the least
   s that fits then follows, since recomputing costs time). Call it g_r(n).
2. g_r is nondecreasing in n (dropping a block never costs time or memory, see `applies`),
   so the least max_r g_r(n_r) with sum n_r = L is reached greedily: every rank starts at
   vpp blocks (one per chunk) and each further block goes to the rank whose time grows
   to the least value. Its max is the (L - pp * vpp)-th smallest increment, which no
   assignment can undercut (each rank's increments are nondecreasing).
3. sync_r = n_r * sync + fixed_r trades against time when sync > 0: every attainable
   max sync is tried as a cap on the blocks per rank (the time part only gets worse as the
   cap tightens); with sync = 0 (the search's tables) there is a single cap.

Coefficients outside `applies` (negative times, a block whose removal costs memory) break
step 2's monotonicity; `solve_partition` then uses CP-SAT.
"""

from __future__ import annotations

import heapq

from autoplan.solve.cpsat import (Partition, Tables, fill_chunks, fixed_memory_kib, memory_coefficients,
                                  objective_scale)


def applies(tables: Tables) -> bool:
    """One group whose g_r(n) is nondecreasing in n: times and sync are non-negative and
    removing a block, recomputed or not, frees memory (so n - 1 fits wherever n does)."""
    if len(tables.groups) != 1:
        return False
    group = tables.groups[0]
    if min(group.time_ns.values()) < 0 or group.sync_ns < 0:
        return False
    t = group.time_ns
    if t["full"] < t["none"] or t["selective"] < t["none"]:
        return False
    for rank in range(tables.pp):
        per_block, per_full, per_sel = memory_coefficients(tables, rank, group)
        if min(per_block, per_block + per_full, per_block + per_sel) < 0:
            return False
    return True


class _RankTime:
    """g_r(n): the least time per micro-batch of rank r holding n blocks, within memory."""

    def __init__(self, tables: Tables, rank: int):
        group = tables.groups[0]
        t = group.time_ns
        self.none, self.d_full, self.d_sel = t["none"], t["full"] - t["none"], t["selective"] - t["none"]
        self.per_block, self.per_full, self.per_sel = memory_coefficients(tables, rank, group)
        self.budget = tables.capacity_kib - fixed_memory_kib(tables, rank)
        self.fixed = sum(tables.fixed_time_ns[k] for k in range(rank, tables.chunks, tables.pp))
        self.modes = tables.modes
        self.memo: dict[int, tuple[int, int, int, int] | None] = {}

    def least(self, n: int) -> tuple[int, int, int, int] | None:
        """(time, full, selective, KiB used minus capacity) of the fastest recomputation that
        fits; None if none does."""
        if n not in self.memo:
            best = self._least(n)
            self.memo[n] = best and (*best, self.over_capacity_kib(n, best[1], best[2]))
        return self.memo[n]

    def over_capacity_kib(self, n: int, full: int, selective: int) -> int:
        return n * self.per_block + full * self.per_full + selective * self.per_sel - self.budget

    def _least(self, n: int) -> tuple[int, int, int] | None:
        base = n * self.none + self.fixed
        excess = n * self.per_block - self.budget  # KiB recomputation must save
        if self.modes == ("none",):
            return (base, 0, 0) if excess <= 0 else None
        if self.modes == ("full",):
            return (base + n * self.d_full, n, 0) if excess + n * self.per_full <= 0 else None
        if self.modes == ("selective",):
            return (base + n * self.d_sel, 0, n) if excess + n * self.per_sel <= 0 else None
        best = None
        # full recomputation only pays when it saves memory; both extra times are >= 0, so for
        # each f the least s that fits is the fastest
        fulls = range(n + 1 if self.per_full < 0 else 1)
        if self.per_full < 0 <= self.per_sel and excess > 0:  # only full saves: start where it fits
            fulls = range(min(n + 1, -(-excess // -self.per_full)), n + 1)
        for f in fulls:
            left = excess + f * self.per_full
            if left <= 0:
                s = 0
            elif self.per_sel < 0:
                s = -(-left // -self.per_sel)  # ceil(left / saving per selective block)
            else:
                continue
            if f + s > n:
                continue
            time = base + f * self.d_full + s * self.d_sel
            if best is None or time < best[0]:
                best = (time, f, s)
            if s == 0:
                break  # more full recomputation still needs no selective: it only adds time
        return best


def _least_max_time(ranks: list[_RankTime], vpp: int, layers: int, cap: list[int]) -> list[int] | None:
    """Blocks per rank (vpp <= n_r <= cap_r, sum = layers) minimising max_r g_r(n_r); None if
    nothing fits. Greedy: the next block goes to the rank whose time grows to the least value;
    among equal times, to the rank that then uses the least memory (a lower peak for the same
    step time; later 1F1B stages hold fewer micro-batches)."""
    counts = [vpp] * len(ranks)
    if any(r.least(vpp) is None or vpp > c for r, c in zip(ranks, cap)):
        return None
    heap = []
    for i, rank in enumerate(ranks):
        nxt = rank.least(vpp + 1) if vpp + 1 <= cap[i] else None
        if nxt is not None:
            heap.append((nxt[0], nxt[3], i))
    heapq.heapify(heap)
    for _ in range(layers - vpp * len(ranks)):
        if not heap:
            return None
        *_, i = heapq.heappop(heap)
        counts[i] += 1
        nxt = ranks[i].least(counts[i] + 1) if counts[i] + 1 <= cap[i] else None
        if nxt is not None:
            heapq.heappush(heap, (nxt[0], nxt[3], i))
    return counts


def solve_identical(tables: Tables) -> Partition | None:
    """Best partition of one group of identical blocks (see the module docstring), or None if
    nothing fits. Call only where `applies(tables)`."""
    pp, vpp, L = tables.pp, tables.vpp, tables.num_layers
    if pp * vpp > L:
        return None
    ranks = [_RankTime(tables, r) for r in range(pp)]
    sync = tables.groups[0].sync_ns
    fixed_sync = list(tables.fixed_sync_ns or [0] * pp)
    scale = objective_scale(tables)
    slot_weight = round(tables.slots * scale)

    def objective(counts: list[int]) -> int:
        times = max(ranks[r].least(n)[0] for r, n in enumerate(counts))
        return slot_weight * times + scale * max(n * sync + d for n, d in zip(counts, fixed_sync))

    if sync == 0:
        caps = [(max(fixed_sync), [L] * pp)]
    else:  # every attainable max sync, tightest first, and the blocks per rank it allows
        levels = sorted({n * sync + d for d in fixed_sync for n in range(vpp, L + 1)})
        caps = [(level, [(level - d) // sync for d in fixed_sync]) for level in levels]
    best, best_value = None, None
    for level, cap in caps:
        if best_value is not None and scale * level >= best_value:
            break  # every later cap costs at least its own max sync
        counts = _least_max_time(ranks, vpp, L, cap)
        if counts is not None and (best_value is None or objective(counts) < best_value):
            best, best_value = counts, objective(counts)
    if best is None:
        return None
    choice = [ranks[r].least(n) for r, n in enumerate(best)]
    return fill_chunks(tables, best, [c[1] for c in choice], [c[2] for c in choice],
                       objective_ns=best_value / scale, status="OPTIMAL")
