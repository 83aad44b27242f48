"""Which plans to measure: the cost model cannot rank plans closer than its own error."""

from __future__ import annotations

from autoplan.solve.search import Candidate, SearchResult


def layout(candidate: Candidate) -> tuple[int, int, int, int]:
    """The parallel layout that changes what a run measures: (tp, pp, cp, ep)."""
    c = candidate.config
    return c.tp, c.pp, c.cp, c.ep


def pick_candidates(result: SearchResult, band: float, count: int) -> list[Candidate]:
    """Up to `count` plans, fastest predicted first: the planner's choice, every plan predicted
    within `band` (relative step time) of the fastest, then the fastest plan of each layout the
    list does not hold yet."""
    if result.best is None:
        return []
    ranked = sorted([result.best, *result.alternatives], key=lambda c: c.step_time_s)
    fastest = ranked[0].step_time_s
    chosen = [result.best]
    chosen += [c for c in ranked if c is not result.best and c.step_time_s <= fastest * (1 + band)]
    layouts = {layout(c) for c in chosen}
    for c in ranked:
        if layout(c) not in layouts:
            layouts.add(layout(c))
            chosen.append(c)
    return sorted(chosen[:count], key=lambda c: c.step_time_s)
