"""Sweep arithmetic, the Pareto frontier and recommendations (the arguments: test_arguments.py)."""

from __future__ import annotations

import math

import pytest

from autoplan.report import sweep as sw
from tests.report.conftest import BATCH, PRICES, SEQ, TOKENS


def test_rows_priced_consistently(small_sweep):
    rows = [r for r in small_sweep.rows if r.fits]
    assert len(rows) == 4
    for r in rows:
        steps = math.ceil(TOKENS / (BATCH * SEQ))  # 1e11 / 131,072 tokens per step
        assert r.run.steps == steps == 762940
        assert r.run.goodput.training_s == pytest.approx(steps * r.estimate["step_time_s"])
        assert r.run.time_s > r.run.goodput.training_s  # checkpoints and interruptions cost time
        assert r.run.gpu_hours == pytest.approx(r.run.time_s * r.num_gpus / 3600)
        assert r.run.cost_usd == pytest.approx(r.run.gpu_hours * PRICES[r.gpu])
        assert r.run.time_range_s == pytest.approx((0.8 * r.run.time_s, 1.2 * r.run.time_s))  # the 20% test band
        assert r.headroom_gib == pytest.approx(80.0 - r.estimate["memory_gib_per_gpu"], abs=0.5)


def _row(gpu, n, time_s, cost):
    from autoplan.report.goodput import Goodput

    g = Goodput(training_s=time_s, checkpoint_bytes=0, checkpoint_write_s=0, job_mtbf_s=1e9, interval_s=1,
                interval_steps=1, wall_s=time_s, expected_interruptions=0, checkpoints=0, lost_s_per_interruption=0)
    run = sw.RunCost(steps=1, goodput=g, gpu_hours=0, cost_usd=cost, time_range_s=(time_s, time_s),
                     cost_range_usd=(cost, cost))
    return sw.Row(gpu=gpu, gpu_name=gpu, num_gpus=n, capacity_gib=80, usd_per_gpu_hour=1, plan=object(), run=run)


def test_pareto_frontier_drops_dominated():
    a, b, c, d = _row("x", 8, 10, 100), _row("x", 16, 6, 120), _row("y", 8, 8, 130), _row("y", 16, 6, 125)
    front = sw.pareto_frontier([a, b, c, d])
    assert front == [b, a]  # c is slower and dearer than b; d ties b on time but costs more


def test_recommendations_under_budget_and_deadline(small_sweep):
    import dataclasses

    fast = min((r for r in small_sweep.rows if r.fits), key=lambda r: r.run.time_s)
    cheap = min((r for r in small_sweep.rows if r.fits), key=lambda r: r.run.cost_usd)
    recs = sw.recommendations(small_sweep)
    assert recs["fastest"][0] is fast and recs["cheapest"][0] is cheap
    tight = dataclasses.replace(small_sweep, budget_usd=cheap.run.cost_usd * 0.5,
                                deadline_days=fast.run.time_s / 86400 / 2)
    recs = sw.recommendations(tight)
    assert recs["fastest under budget"][0] is None and "cheapest is" in recs["fastest under budget"][1]
    assert recs["cheapest under deadline"][0] is None and "fastest takes" in recs["cheapest under deadline"][1]
    loose = dataclasses.replace(small_sweep, budget_usd=cheap.run.cost_usd, deadline_days=fast.run.time_s / 86400)
    recs = sw.recommendations(loose)
    assert recs["fastest under budget"][0].run.cost_usd <= cheap.run.cost_usd
    within = recs["cheapest under deadline"][0]
    assert within.run.time_s <= fast.run.time_s and within.run.cost_usd <= fast.run.cost_usd


def test_cluster_where_nothing_fits_is_a_row_not_an_error(graph8b):
    from autoplan.hardware import load_gpu

    # llama3.1-8b on one 40 GB A100: 16 B/param of model states alone is 119 GiB
    graph, ref, seq = graph8b
    row = sw.plan_row(graph, ref, load_gpu("a100-sxm4-40gb"), 1, seq_len=seq, global_batch=BATCH, tokens=TOKENS,
                      precision="bf16", usd_per_gpu_hour=2.5, assumptions=sw.GoodputAssumptions(), error=None)
    assert not row.fits and row.run is None
    assert "no configuration fits in 40.0 GiB" in row.reason


def test_memory_headroom_is_left_free_on_every_cluster(graph8b):
    from autoplan.hardware import load_gpu

    graph, ref, seq = graph8b
    gpu = load_gpu("a100-sxm4-40gb")
    common = dict(seq_len=seq, global_batch=BATCH, tokens=TOKENS, precision="bf16", usd_per_gpu_hour=2.5,
                  assumptions=sw.GoodputAssumptions(), error=None)
    full = sw.plan_row(graph, ref, gpu, 8, **common)
    kept = sw.plan_row(graph, ref, gpu, 8, **common, memory_headroom_gib=8.0)
    assert full.headroom_gib < 8.0 <= kept.headroom_gib  # it binds, and it is honoured
    assert kept.estimate["step_time_s"] >= full.estimate["step_time_s"]


def test_parallel_sweep_has_the_serial_rows_in_order(graph8b):
    from autoplan.hardware import load_gpu

    # 12 GPUs do not fill 8-GPU nodes: make_cluster's UserError must come back as that row's reason
    graph, ref, seq = graph8b
    gpus = [load_gpu("h100"), load_gpu("a100-sxm4-80gb")]
    kwargs = dict(seq_len=seq, global_batch=BATCH, tokens=TOKENS, prices=PRICES, error=None)
    calls = []
    parallel = sw.run_sweep(graph, ref, gpus, [8, 12], workers=2, progress=lambda *call: calls.append(call),
                            **kwargs)
    serial = sw.run_sweep(graph, ref, gpus, [8, 12], workers=1, **kwargs)
    assert [r.label for r in parallel.rows] == ["8 x h100-sxm-80gb", "12 x h100-sxm-80gb",
                                                "8 x a100-sxm4-80gb", "12 x a100-sxm4-80gb"]
    for p, s in zip(parallel.rows, serial.rows):
        assert (p.label, p.reason, p.solver_status, p.estimate) == (s.label, s.reason, s.solver_status, s.estimate)
        assert (p.run and (p.run.time_s, p.run.cost_usd)) == (s.run and (s.run.time_s, s.run.cost_usd))
        assert p.frontier == s.frontier
    assert parallel.rows[0].fits and not parallel.rows[1].fits and "12" in parallel.rows[1].reason
    assert calls[0][:2] == (0, 4) and calls[-1] == (4, 4, "done")
    assert [c[0] for c in calls[1:-1]] == [1, 2, 3, 4]  # one call as each cluster arrives


def test_default_workers():
    assert sw.default_workers(1) == 1
    assert 1 <= sw.default_workers(32) <= 32
