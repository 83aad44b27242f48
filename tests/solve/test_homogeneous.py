"""The direct solver for identical blocks finds the homogeneous CP-SAT model's optimum.

Random one-group tables (recomputation allowed or fixed, uneven micro-batches in flight,
per-rank fixed time, memory and sync); the direct objective must equal CP-SAT's exactly and
the partition it returns must evaluate to it; on small ones also brute force.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from autoplan.solve.cpsat import MODES, GroupTable, Tables, _solve_homogeneous, objective_ns, solve_partition
from autoplan.solve.exhaustive import best_objective_ns
from autoplan.solve.homogeneous import applies, solve_identical


@st.composite
def identical_blocks(draw, max_layers: int = 40) -> Tables:
    layers = draw(st.integers(1, max_layers))
    pp = draw(st.sampled_from([p for p in (1, 2, 3, 4, 8) if p <= layers]))
    vpp = draw(st.sampled_from([v for v in (1, 2, 4) if pp * v <= layers and (v == 1 or pp > 1)]))
    t_none = draw(st.integers(1_000, 50_000))
    a_none = draw(st.integers(100, 5_000))
    group = GroupTable(
        name="block", lo=0, hi=layers,
        time_ns={"none": t_none, "selective": t_none + draw(st.integers(0, 5_000)),
                 "full": t_none + draw(st.integers(0, 30_000))},
        state_kib=draw(st.integers(0, 10_000)),
        # selective saving nothing is the usual case (flash attention keeps no s^2 scores)
        activation_kib={"none": a_none, "selective": draw(st.sampled_from([a_none, draw(st.integers(0, a_none))])),
                        "full": draw(st.integers(0, a_none // 4))},
        sync_ns=draw(st.sampled_from([0, 0, draw(st.integers(1, 2_000))])),
    )
    chunks = pp * vpp
    m = draw(st.integers(1, 16))
    in_flight = [draw(st.sampled_from([min(m, pp - r), m, 1 + r / 3])) * 1.0 for r in range(pp)]
    per_block = group.state_kib + a_none * max(in_flight)
    capacity = draw(st.integers(0, 2 * per_block * layers // pp + 10_000))
    fixed_time = [draw(st.integers(0, 20_000)) if k in (0, chunks - 1) else 0 for k in range(chunks)]
    return Tables(num_layers=layers, pp=pp, vpp=vpp, groups=[group],
                  slots=m + (pp - 1) / vpp, in_flight=in_flight, capacity_kib=capacity,
                  fixed_time_ns=fixed_time,
                  fixed_state_kib=[draw(st.integers(0, 2_000)) for _ in range(pp)],
                  fixed_activation_kib=[draw(st.integers(0, 500)) for _ in range(pp)],
                  fixed_sync_ns=[draw(st.integers(0, 3_000)) for _ in range(pp)],
                  modes=draw(st.sampled_from([MODES, MODES, ("none",), ("full",), ("selective",)])))


def check(t: Tables, reference: float) -> None:
    assert applies(t)
    direct = solve_identical(t)
    if math.isinf(reference):
        assert direct is None
        return
    assert direct is not None and direct.status == "OPTIMAL"
    assert direct.objective_ns == reference
    assert objective_ns(t, direct.cuts, direct.full, direct.selective) == reference
    assert len(direct.cuts) == t.chunks + 1 and all(b > a for a, b in zip(direct.cuts, direct.cuts[1:]))


@settings(max_examples=150, deadline=None)
@given(identical_blocks())
def test_direct_matches_cpsat(t: Tables):
    cpsat = _solve_homogeneous(t, time_limit_s=20, workers=1)
    assert cpsat is None or cpsat.status == "OPTIMAL"
    check(t, cpsat.objective_ns if cpsat else math.inf)


@settings(max_examples=60, deadline=None)
@given(identical_blocks(max_layers=7))
def test_direct_matches_brute_force(t: Tables):
    check(t, best_objective_ns(t))


def test_one_group_goes_to_the_direct_solver():
    t = Tables(num_layers=4, pp=2, vpp=1, slots=5.0, in_flight=[2.0, 1.0], capacity_kib=10_000,
               groups=[GroupTable("b", 0, 4, {"none": 10, "selective": 12, "full": 20}, 1_000,
                                  {"none": 2_000, "selective": 1_000, "full": 100})],
               fixed_time_ns=[5, 5], fixed_state_kib=[0, 0], fixed_activation_kib=[0, 0])
    assert applies(t)
    assert solve_partition(t) == solve_identical(t)


@settings(max_examples=400, deadline=None)
@given(identical_blocks(max_layers=12))
def test_least_time_per_rank_is_brute_force(t: Tables):
    from autoplan.solve.cpsat import fixed_memory_kib, memory_coefficients
    from autoplan.solve.homogeneous import RankTime

    group, times = t.groups[0], t.groups[0].time_ns
    for rank in range(t.pp):
        least = RankTime(t, rank).least
        per_block, per_full, per_sel = memory_coefficients(t, rank, group)
        budget = t.capacity_kib - fixed_memory_kib(t, rank)
        for n in range(t.num_layers + 1):
            only = {"none": (0, 0), "full": (n, 0), "selective": (0, n)}[t.modes[0]]  # one mode fixed
            extra = [f * (times["full"] - times["none"]) + s * (times["selective"] - times["none"])
                     for f in range(n + 1) for s in range(n + 1 - f)
                     if n * per_block + f * per_full + s * per_sel <= budget
                     and (t.modes == MODES or (f, s) == only)]
            got = least(n)
            assert (got is None) == (not extra)
            if extra:
                fixed = sum(t.fixed_time_ns[k] for k in range(rank, t.chunks, t.pp))
                assert got[0] == n * times["none"] + fixed + min(extra)
                assert n * per_block + got[1] * per_full + got[2] * per_sel <= budget
