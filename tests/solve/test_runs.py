"""The exact solver for one long run with a few other blocks around it (solve/runs.py) finds
the brute-force optimum, step-end tail included.

Random tables: up to three blocks of one or two other groups before the run and up to two
after it, recomputation allowed or fixed, uneven micro-batches in flight, interleaved
chunks, and a step-end tail per rank that is an arbitrary (non-monotone) function of the
blocks held per group, as tables.RankTails gives it.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from autoplan.solve.cpsat import MODES, GroupTable, Tables, objective_ns, solve_partition
from autoplan.solve.exhaustive import best_objective_ns
from autoplan.solve.runs import applies, layouts, solve_runs


class Tail:
    """A rank's step-end time by blocks per group: an arbitrary function, as RankTails.of."""

    def __init__(self, weights: tuple[int, ...], wobble: int):
        self.weights, self.wobble = weights, wobble

    def of(self, counts: tuple[int, ...]) -> int:
        return sum(w * n for w, n in zip(self.weights, counts)) + self.wobble * (sum(counts) % 3)


def _group(draw, name: str, lo: int, hi: int) -> GroupTable:
    t_none = draw(st.integers(1_000, 50_000))
    a_none = draw(st.integers(100, 5_000))
    return GroupTable(
        name=name, lo=lo, hi=hi,
        time_ns={"none": t_none, "selective": t_none + draw(st.integers(0, 5_000)),
                 "full": t_none + draw(st.integers(0, 30_000))},
        state_kib=draw(st.integers(0, 10_000)),
        activation_kib={"none": a_none, "selective": draw(st.sampled_from([a_none, a_none // 2])),
                        "full": draw(st.integers(0, a_none // 4))},
        sync_ns=draw(st.sampled_from([0, draw(st.integers(1, 2_000))])),
    )


@st.composite
def runs_tables(draw, max_run: int = 6) -> Tables:
    before = draw(st.integers(0, 3))
    run = draw(st.integers(1, max_run))
    after = draw(st.integers(0, 2 if before + run < 8 else 0))
    if before + after == 0:
        before = 1
    layers = before + run + after
    bounds = []
    if before:
        split = draw(st.integers(0, before - 1))  # one or two groups before the run
        bounds += [(0, split), (split, before)] if split else [(0, before)]
    bounds.append((before, before + run))
    if after:
        bounds.append((before + run, layers))
    groups = [_group(draw, f"g{i}", lo, hi) for i, (lo, hi) in enumerate(bounds)]
    pp = draw(st.sampled_from([p for p in (1, 2, 3, 4) if p <= layers]))
    vpp = draw(st.sampled_from([v for v in (1, 2) if pp * v <= layers and (v == 1 or pp > 1)]))
    chunks = pp * vpp
    m = draw(st.integers(1, 8))
    in_flight = [draw(st.sampled_from([min(m, pp - r), m, 1 + r / 3])) * 1.0 for r in range(pp)]
    per_block = max(g.state_kib + g.activation_kib["none"] * max(in_flight) for g in groups)
    capacity = draw(st.integers(0, 2 * per_block * layers // pp + 10_000))
    tails = None
    if draw(st.booleans()):
        tails = tuple(Tail(tuple(draw(st.integers(-500, 3_000)) for _ in groups), draw(st.integers(0, 4_000)))
                      for _ in range(pp))
        # a tail is a time: never negative for any counts the ranks can hold
        tails = tuple(t if all(w >= 0 for w in t.weights) else Tail(tuple(abs(w) for w in t.weights), t.wobble)
                      for t in tails)
    return Tables(num_layers=layers, pp=pp, vpp=vpp, groups=groups, slots=m + (pp - 1) / vpp,
                  in_flight=in_flight, capacity_kib=capacity,
                  fixed_time_ns=[draw(st.integers(0, 20_000)) if k in (0, chunks - 1) else 0 for k in range(chunks)],
                  fixed_state_kib=[draw(st.integers(0, 2_000)) for _ in range(pp)],
                  fixed_activation_kib=[draw(st.integers(0, 500)) for _ in range(pp)],
                  fixed_sync_ns=[draw(st.integers(0, 3_000)) for _ in range(pp)],
                  modes=draw(st.sampled_from([MODES, MODES, ("none",), ("full",), ("selective",)])),
                  tail_ns=tails)


@settings(max_examples=300, deadline=None)
@given(runs_tables())
def test_runs_match_brute_force(t: Tables):
    assert applies(t)
    reference = best_objective_ns(t)
    direct = solve_runs(t)
    if math.isinf(reference):
        assert direct is None
        return
    assert direct is not None and direct.status == "OPTIMAL"
    assert direct.objective_ns == reference
    assert objective_ns(t, direct.cuts, direct.full, direct.selective) == reference
    assert direct.cuts[0] == 0 and direct.cuts[-1] == t.num_layers
    assert len(direct.cuts) == t.chunks + 1 and all(b > a for a, b in zip(direct.cuts, direct.cuts[1:]))


@settings(max_examples=100, deadline=None)
@given(runs_tables())
def test_solve_partition_takes_the_exact_solver(t: Tables):
    assert solve_partition(t) == solve_runs(t)


def test_layouts_are_every_placement_of_the_minor_blocks():
    """Two blocks before a run of three, two chunks: the boundary falls after block 0, at the
    run's start, or inside the run (one layout: where inside is the solver's choice)."""
    t = Tables(num_layers=5, pp=2, vpp=1, groups=[], slots=1.0, in_flight=[1.0, 1.0], capacity_kib=0,
               fixed_time_ns=[0, 0], fixed_state_kib=[0, 0], fixed_activation_kib=[0, 0])
    found = sorted((layout.pieces, layout.major_chunks) for layout in layouts(t, 2, 5))
    assert found == sorted([
        (((0, 1), (1, 2)), (1,)),  # [0] [1 | run]
        (((0, 2), (0, 0)), (1,)),  # [0 1] [run]
        (((0, 2), (0, 0)), (0, 1)),  # [0 1 | run...] [...run]
    ])


def test_many_blocks_outside_the_run_go_to_cpsat():
    group = {"time_ns": {"none": 10, "selective": 12, "full": 20}, "state_kib": 1,
             "activation_kib": {"none": 2, "selective": 1, "full": 0}}
    t = Tables(num_layers=30, pp=2, vpp=1, slots=3.0, in_flight=[2.0, 1.0], capacity_kib=10_000,
               groups=[GroupTable("a", 0, 10, **group), GroupTable("b", 10, 30, **group)],
               fixed_time_ns=[0, 0], fixed_state_kib=[0, 0], fixed_activation_kib=[0, 0])
    assert not applies(t)
