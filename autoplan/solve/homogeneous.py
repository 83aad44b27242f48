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
3. sync_r(n_r) (the step-end DP sync and optimizer, tabled per block count: it is not
   monotone in n_r, since more blocks also lengthen the backward that hides the sync) is
   added exactly: for every level G of the time part, from the least up, each rank may
   hold the blocks whose time stays within G, and the least max sync over those counts is
   found by a binary search on sync levels with a reachable-sums check. Levels stop when
   slot_weight * G alone reaches the best objective found.

Coefficients outside `applies` (negative times, a block whose removal costs memory) break
step 2's monotonicity; `solve_partition` then uses CP-SAT.
"""

from __future__ import annotations

import heapq

from autoplan.solve.cpsat import (GroupTable, Partition, Tables, fill_chunks, fixed_memory_kib,
                                  memory_coefficients, objective_scale)


def applies(tables: Tables) -> bool:
    """One group whose g_r(n) is nondecreasing in n (`monotone`)."""
    return len(tables.groups) == 1 and monotone(tables, tables.groups[0])


def monotone(tables: Tables, group: GroupTable) -> bool:
    """The group's times and sync and the fixed sync are non-negative, recomputing never saves
    time, and removing a block, recomputed or not, frees memory on every rank (so n - 1 fits
    wherever n does): what makes g_r(n) nondecreasing."""
    t = group.time_ns
    if min(t.values()) < 0 or group.sync_ns < 0 or min(tables.fixed_sync_ns or [0]) < 0:
        return False
    if t["full"] < t["none"] or t["selective"] < t["none"]:
        return False
    for rank in range(tables.pp):
        per_block, per_full, per_sel = memory_coefficients(tables, rank, group)
        if min(per_block, per_block + per_full, per_block + per_sel) < 0:
            return False
    return True


class RankTime:
    """g_r(n): the least time per micro-batch of rank r holding n blocks of `group`, and
    `minors` (fixed counts of other groups' blocks, each with its own recomputation), within
    memory. With no minors, the identical-blocks case."""

    def __init__(self, tables: Tables, rank: int, group: GroupTable | None = None,
                 minors: tuple[tuple[GroupTable, int], ...] = ()):
        group = group or tables.groups[0]
        t = group.time_ns
        self.none, self.d_full, self.d_sel = t["none"], t["full"] - t["none"], t["selective"] - t["none"]
        self.per_block, self.per_full, self.per_sel = memory_coefficients(tables, rank, group)
        self.budget = tables.capacity_kib - fixed_memory_kib(tables, rank)
        self.fixed = sum(tables.fixed_time_ns[k] for k in range(rank, tables.chunks, tables.pp))
        self.modes = tables.modes
        self.options = _minor_options(tables, rank, minors)
        self.memo: dict[int, tuple | None] = {}

    def least(self, n: int) -> tuple[int, int, int, int, tuple] | None:
        """(time, full, selective, KiB used minus capacity, the minors' (full, selective)) of
        the fastest recomputation that fits; None if none does."""
        if n not in self.memo:
            best = None
            for extra_ns, extra_kib, choice in self.options:
                found = self._least(n, self.budget - extra_kib)
                if found is not None and (best is None or found[0] + extra_ns < best[0]):
                    best = (found[0] + extra_ns, found[1], found[2], extra_kib, choice)
            self.memo[n] = best and (best[0], best[1], best[2],
                                     self.over_capacity_kib(n, best[1], best[2]) + best[3], best[4])
        return self.memo[n]

    def over_capacity_kib(self, n: int, full: int, selective: int) -> int:
        return n * self.per_block + full * self.per_full + selective * self.per_sel - self.budget

    def _least(self, n: int, budget: int) -> tuple[int, int, int] | None:
        base = n * self.none + self.fixed
        excess = n * self.per_block - budget  # KiB recomputation must save
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


def _minor_options(tables: Tables, rank: int, minors) -> list[tuple[int, int, tuple]]:
    """(time, KiB, ((full, selective) per minor group)) of every recomputation of the fixed
    minor blocks the modes allow, less those another option beats in both time and memory."""
    options = [(0, 0, ())]
    for group, count in minors:
        t = group.time_ns
        per_block, per_full, per_sel = memory_coefficients(tables, rank, group)
        cells = [(f, s) for f in range(count + 1) for s in range(count + 1 - f) if allowed(tables.modes, count, f, s)]
        options = [(time + count * t["none"] + f * (t["full"] - t["none"]) + s * (t["selective"] - t["none"]),
                    kib + count * per_block + f * per_full + s * per_sel, (*choice, (f, s)))
                   for time, kib, choice in options for f, s in cells]
    kept, least_kib = [], None
    for option in sorted(options):
        if least_kib is None or option[1] < least_kib:
            kept.append(option)
            least_kib = option[1]
    return kept


def allowed(modes: tuple[str, ...], n: int, f: int, s: int) -> bool:
    """Whether n blocks with f fully and s selectively recomputed obey a fixed recompute mode."""
    if modes == ("none",):
        return f == s == 0
    if modes == ("full",):
        return f == n and s == 0
    if modes == ("selective",):
        return s == n and f == 0
    return True


def _least_max_time(ranks: list[RankTime], lows: list[int], total: int, cap: list[int]) -> list[int] | None:
    """Blocks per rank (lows_r <= n_r <= cap_r, sum = total) minimising max_r g_r(n_r); None
    if nothing fits. Greedy: the next block goes to the rank whose time grows to the least
    value; among equal times, to the rank that then uses the least memory (a lower peak for
    the same step time; later 1F1B stages hold fewer micro-batches)."""
    counts = list(lows)
    if any(r.least(low) is None or low > c for r, low, c in zip(ranks, lows, cap)):
        return None
    heap = []
    for i, rank in enumerate(ranks):
        nxt = rank.least(lows[i] + 1) if lows[i] + 1 <= cap[i] else None
        if nxt is not None:
            heap.append((nxt[0], nxt[3], i))
    heapq.heapify(heap)
    for _ in range(total - sum(lows)):
        if not heap:
            return None
        *_, i = heapq.heappop(heap)
        counts[i] += 1
        nxt = ranks[i].least(counts[i] + 1) if counts[i] + 1 <= cap[i] else None
        if nxt is not None:
            heapq.heappush(heap, (nxt[0], nxt[3], i))
    return counts


def _rank_sync(tables: Tables, rank: int, n: int) -> int:
    """Step-end time of `rank` holding n identical blocks: linear sync plus the tabled tail."""
    tail = tables.tail_ns[rank][n] if tables.tail_ns else 0
    fixed = tables.fixed_sync_ns[rank] if tables.fixed_sync_ns else 0
    return n * tables.groups[0].sync_ns + fixed + tail


def _sums_to(allowed: list[list[int]], total: int) -> list[int] | None:
    """One count per rank from its allowed counts summing to `total`, or None: reachable sums
    as bit sets, then back from the total."""
    mask = (1 << (total + 1)) - 1
    reach = [1]
    for options in allowed:
        bits = 0
        for n in options:
            bits |= reach[-1] << n
        reach.append(bits & mask)
    if not reach[-1] >> total & 1:
        return None
    counts, left = [], total
    for r in range(len(allowed) - 1, -1, -1):
        n = next(n for n in allowed[r] if n <= left and reach[r] >> (left - n) & 1)
        counts.append(n)
        left -= n
    return counts[::-1]


def _least_max_sync(sync, lows: list[int], total: int, caps: list[int]) -> tuple[int, list[int]] | None:
    """(least max_r sync(r, n_r), counts) over counts lows_r <= n_r <= caps_r summing to
    `total`: a binary search over the attainable sync levels (sync need not be monotone in
    n_r: more blocks also lengthen the backward that hides the DP sync)."""
    lows = [max(low, total - (sum(caps) - cap)) for low, cap in zip(lows, caps)]  # the others hold at most their caps
    syncs = [[(n, sync(r, n)) for n in range(low, cap + 1)] for r, (low, cap) in enumerate(zip(lows, caps))]
    levels = sorted({d for rank in syncs for _, d in rank})
    best = None
    lo, hi = 0, len(levels) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        counts = _sums_to([[n for n, d in rank if d <= levels[mid]] for rank in syncs], total)
        if counts is None:
            lo = mid + 1
        else:
            best, hi = (levels[mid], counts), mid - 1
    return best


def _times_below(rank: RankTime, low: int, high: int, limit: float) -> list[tuple[int, int]]:
    """(n, g_r(n)) for n = low..high while the time stays below `limit` (g_r is nondecreasing:
    larger counts only reach levels the search never tries)."""
    out = []
    for n in range(low, high + 1):
        least = rank.least(n)
        if least is None or least[0] >= limit:
            break
        out.append((n, least[0]))
    return out


def least_counts(ranks: list[RankTime], lows: list[int], highs: list[int], total: int, sync,
                 slot_weight: int, scale: int, bound: float = float("inf")) -> tuple[int, list[int]] | None:
    """(objective, counts): blocks per rank (lows_r <= n_r <= highs_r, sum = total)
    minimising slot_weight * max_r g_r(n_r) + scale * max_r sync(r, n_r), if below `bound`.

    Every level G of the time part, from the least upwards, caps each rank's blocks at the
    most whose time stays within G; the least max sync under those caps completes the
    objective. Levels stop once slot_weight * G alone reaches the best objective found, so
    the result is exact."""
    def objective(counts: list[int]) -> int:
        times = max(ranks[r].least(n)[0] for r, n in enumerate(counts))
        return slot_weight * times + scale * max(sync(r, n) for r, n in enumerate(counts))

    greedy = _least_max_time(ranks, lows, total, highs)
    if greedy is None:
        return None
    least_time = max(ranks[r].least(n)[0] for r, n in enumerate(greedy))
    if slot_weight * least_time >= bound:
        return None
    best, best_value = greedy, objective(greedy)
    times = [_times_below(rank, low, high, best_value / slot_weight) for rank, low, high in zip(ranks, lows, highs)]
    for level in sorted({t for rank in times for _, t in rank if t >= least_time}):
        if slot_weight * level >= best_value:
            break
        caps = [max((n for n, t in rank if t <= level), default=low - 1) for rank, low in zip(times, lows)]
        found = _least_max_sync(sync, lows, total, caps)
        if found is not None and objective(found[1]) < best_value:
            best, best_value = found[1], objective(found[1])
    return (best_value, best) if best_value < bound else None


def solve_identical(tables: Tables) -> Partition | None:
    """Best partition of one group of identical blocks (see the module docstring), or None if
    nothing fits. Call only where `applies(tables)`."""
    pp, vpp, L = tables.pp, tables.vpp, tables.num_layers
    if pp * vpp > L:
        return None
    ranks = [RankTime(tables, r) for r in range(pp)]
    scale = objective_scale(tables)
    found = least_counts(ranks, [vpp] * pp, [L] * pp, L, lambda r, n: _rank_sync(tables, r, n),
                         round(tables.slots * scale), scale)
    if found is None:
        return None
    value, best = found
    choice = [ranks[r].least(n) for r, n in enumerate(best)]
    return fill_chunks(tables, best, [c[1] for c in choice], [c[2] for c in choice],
                       objective_ns=value / scale, status="OPTIMAL")
