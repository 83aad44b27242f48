"""The simulated pipeline schedules reproduce the bubble formulas the cost model uses."""

from __future__ import annotations

import pytest

from autoplan.cost.pipeline import bubble_stage_times, microbatches_in_flight
from autoplan.report.timeline import makespan_s, rank_order, simulate


@pytest.mark.parametrize("schedule,vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4)])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_makespan_is_m_plus_bubble_stage_times(schedule, vpp, pp, m):
    # equal stages of 3 s per micro-batch: step = (m + bubble) x 3 s (Narayanan et al. 2021 §2.2)
    ops = simulate(schedule, pp, m, [3.0] * pp, vpp)
    assert makespan_s(ops) == pytest.approx((m + bubble_stage_times(schedule, pp, vpp)) * 3.0)


@pytest.mark.parametrize("schedule,vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_every_op_once_and_dependencies_respected(schedule, vpp):
    pp, m = 4, 8
    ops = simulate(schedule, pp, m, [1.0, 2.0, 1.5, 1.0], vpp)
    assert len(ops) == 2 * pp * m * vpp
    end = {(o.kind, o.microbatch, o.chunk, o.rank): o.end_s for o in ops}
    for o in ops:
        if o.kind == "F" and o.rank > 0:
            assert o.start_s >= end[("F", o.microbatch, o.chunk, o.rank - 1)] - 1e-12
        if o.kind == "B" and o.rank < pp - 1:
            assert o.start_s >= end[("B", o.microbatch, o.chunk, o.rank + 1)] - 1e-12
    for r in range(pp):  # a rank runs one op at a time
        mine = sorted((o for o in ops if o.rank == r), key=lambda o: o.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:]))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_peak_in_flight_matches_cost_model(schedule):
    pp, m = 4, 8
    for rank in range(pp):
        live = peak = 0
        for kind, _, _ in rank_order(schedule, pp, rank, m):
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak == microbatches_in_flight(schedule, pp, rank, m)
