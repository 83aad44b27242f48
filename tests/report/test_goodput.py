"""Goodput formulas pinned with hand-computed values, and checked against a simulation."""

from __future__ import annotations

import math
import random

import pytest

from autoplan.report import goodput as gp


def test_llama3_failure_rate_default():
    # 419 interruptions / (54 days * 24 h * 16,384 GPUs) = 419 / 21,233,664 GPU-hours
    assert gp.DEFAULT_FAILURES_PER_GPU_HOUR == pytest.approx(1.97328e-5, rel=1e-5)


def test_llama3_checkpoint_bandwidth_default():
    # 2 TB/s / 16,384 GPUs = 122.07 MB/s per GPU
    assert gp.DEFAULT_CHECKPOINT_WRITE_BYTES_PER_S_PER_GPU == pytest.approx(122.0703125e6)


def test_job_mtbf_divides_by_gpu_count():
    # 1,024 GPUs at 1e-4 failures per GPU-hour: 0.1024 failures per hour -> 3600 / 0.1024 s
    assert gp.job_mtbf_s(1024, 1e-4) == pytest.approx(35156.25)
    # the Llama 3 run itself: 54 days / 419 interruptions = 3.093 h between interruptions
    assert gp.job_mtbf_s(16384, gp.DEFAULT_FAILURES_PER_GPU_HOUR) / 3600 == pytest.approx(54 * 24 / 419)


def test_checkpoint_size_and_write_time():
    # 8e9 parameters, bf16 weights (2 B) + fp32 master and Adam moments (12 B): 112 GB
    assert gp.checkpoint_bytes(8e9, 2, 12) == pytest.approx(112e9)
    # 112 GB written by 64 GPUs at 1 GB/s each: 1.75 s
    assert gp.checkpoint_write_s(112e9, 64, 1e9) == pytest.approx(1.75)


def test_young_interval():
    # sqrt(2 * 50 s * 14,400 s) = sqrt(1.44e6) = 1,200 s
    assert gp.young_daly_interval_s(50.0, 14400.0) == pytest.approx(1200.0)


def test_expected_wall_time_by_hand():
    # T=1e5 s, C=50, tau=1200, M=14400, R=600: checkpoints add 1e5*50/1200 = 4,166.7 s;
    # each interruption costs 600 + (1200+50)/2 = 1,225 s, i.e. 1225/14400 = 8.507% of wall time:
    # W = 104,166.67 / (1 - 0.0850694) = 113,852.0 s
    wall = gp.expected_wall_time_s(1e5, 50.0, 1200.0, 14400.0, 600.0)
    assert wall == pytest.approx(113852.0, rel=1e-5)
    # the balance it solves: W = T (1 + C/tau) + (W / M) (R + lost work)
    assert wall == pytest.approx(1e5 * (1 + 50 / 1200) + wall / 14400 * (600 + 625))


def test_interruptions_outpacing_progress_never_finish():
    assert math.isinf(gp.expected_wall_time_s(1e5, 50.0, 1200.0, 1000.0, 600.0))


def test_goodput_rounds_interval_to_whole_steps():
    a = gp.GoodputAssumptions(failures_per_gpu_hour=1e-4, checkpoint_write_bytes_per_s_per_gpu=1e9, restart_s=600)
    g = gp.goodput(training_s=1e6, step_time_s=7.0, num_gpus=64, size_bytes=112e9, assumptions=a)
    # MTBF = 3600 / (64 * 1e-4) = 562,500 s; C = 1.75 s; Young: sqrt(2 * 1.75 * 562,500) = 1,403.1 s
    # -> 200 steps of 7 s = 1,400 s
    assert g.job_mtbf_s == pytest.approx(562500.0)
    assert g.interval_steps == 200 and g.interval_s == pytest.approx(1400.0)
    assert 0.99 < g.fraction < 1.0  # 0.1% checkpoint overhead and 0.2% interruptions


def _simulate_wall_s(training_s, write_s, interval_s, mtbf_s, restart_s, rng) -> float:
    """Checkpoint every interval, exponential failures (also during restarts), redo since last checkpoint."""
    clock, done = 0.0, 0.0
    while done < training_s:
        segment = min(interval_s, training_s - done)
        need = segment + write_s
        while True:
            failure_in = rng.expovariate(1.0 / mtbf_s)
            if failure_in >= need:
                clock += need
                break
            clock += failure_in  # the partial segment is lost
            while True:  # restart; a failure during it restarts again
                failure_in = rng.expovariate(1.0 / mtbf_s)
                if failure_in >= restart_s:
                    clock += restart_s
                    break
                clock += failure_in
        done += segment
    return clock


def test_first_order_model_matches_simulation():
    # tau << M, where the first-order model holds: the simulated mean of 20 runs lies within 2%
    # (the model drops O((tau/M)^2) terms, ~0.3% here; sampling noise of the mean ~0.2%)
    rng = random.Random(7)
    training, write, mtbf, restart = 2e5, 30.0, 20000.0, 300.0
    tau = gp.young_daly_interval_s(write, mtbf)
    predicted = gp.expected_wall_time_s(training, write, tau, mtbf, restart)
    simulated = sum(_simulate_wall_s(training, write, tau, mtbf, restart, rng) for _ in range(20)) / 20
    assert simulated == pytest.approx(predicted, rel=0.02)


def test_young_interval_minimises_wall_time():
    # the interval from the rule beats 0.5x and 2x of it in the model
    write, mtbf = 30.0, 20000.0
    tau = gp.young_daly_interval_s(write, mtbf)
    wall = lambda t: gp.expected_wall_time_s(1e6, write, t, mtbf, 300.0)  # noqa: E731
    assert wall(tau) < wall(0.5 * tau) and wall(tau) < wall(2 * tau)
