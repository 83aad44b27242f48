"""Pipeline schedules: bubble fractions and micro-batches in flight (Narayanan et al. 2021)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import Runtime, estimate, pipeline


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (8, 32), (16, 16)])
def test_1f1b_bubble_fraction(p, m):
    assert pipeline.bubble_fraction("1f1b", p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert pipeline.bubble_fraction("gpipe", p, m) == pytest.approx((p - 1) / (m + p - 1))


def test_interleaved_divides_bubble_by_v():
    # Narayanan §2.2.2: (1/v)(p-1)/m relative to the ideal time
    p, m, v = 8, 16, 4
    bubble = pipeline.bubble_stage_times("interleaved-1f1b", p, v)
    assert bubble / m == pytest.approx((p - 1) / (v * m))


def test_zero_bubble_leaves_a_third():
    assert pipeline.bubble_stage_times("zero-bubble", 4) == pytest.approx(1.0)
    assert pipeline.bubble_fraction("1f1b", 1, 8) == 0.0


def test_in_flight_microbatches():
    assert pipeline.microbatches_in_flight("gpipe", 4, 0, 16) == 16
    assert [pipeline.microbatches_in_flight("1f1b", 4, i, 16) for i in range(4)] == [4, 3, 2, 1]
    assert pipeline.microbatches_in_flight("1f1b", 4, 0, 2) == 2  # never more than m
    # interleaved, rank 0: Korthikanti et al. 2022 §4.2.3 factor 1 + (p-1)/(p v) on p
    p, v = 4, 2
    got = pipeline.microbatches_in_flight("interleaved-1f1b", p, 0, 64, v)
    assert got == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_estimate_bubble_matches_1f1b_formula(make_gpt_graph, h100_cluster):
    # dp = 1: no gradient sync, so the only idle time is the pipeline bubble; the optimizer
    # step (memory-bound; a fused AdamW's single pass, < 1% of the step here) is the only
    # other term, hence rel 2%. The head is untied (a tied one adds the all-reduce of its
    # gradient between the first and last stage, test_estimate.py)
    tied = make_gpt_graph(layers=8, hidden=1024, heads=16, seq=1024)
    head = replace(tied.post, parameters=tied.post.parameters + tied.vocab * 1024)
    graph = replace(tied, segments=[tied.pre, *tied.blocks, head])
    p, m = 4, 12
    config = ParallelConfig(global_batch=m, seq_len=1024, dp=1, pp=p, tp=2, micro_batch=1)
    est = estimate(graph, config, h100_cluster(8), runtime=Runtime(optimizer_kernels="fused"))
    assert est.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=0.02)
