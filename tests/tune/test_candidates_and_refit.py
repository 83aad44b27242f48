"""Which plans `tune` measures, and the hardware file it fits to their runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from autoplan.config import ParallelConfig
from autoplan.hardware import load_hardware_file, make_cluster, load_gpu
from autoplan.plan import ModelRef, Plan
from autoplan.solve.search import SearchResult
from autoplan.tune.candidates import pick_candidates
from autoplan.tune.launch import Trial, _last_words
from autoplan.tune.refit import fit_factor, refit_cluster, write_refit


@dataclass
class FakeEstimate:
    step_time_s: float


@dataclass
class FakeCandidate:
    config: ParallelConfig
    estimate: FakeEstimate

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s


def cand(seconds: float, **degrees) -> FakeCandidate:
    return FakeCandidate(ParallelConfig(global_batch=8, seq_len=64, **degrees), FakeEstimate(seconds))


def result(best, *others) -> SearchResult:
    return SearchResult(best=best, alternatives=list(others), status="OPTIMAL", wall_s=0.0,
                        configurations_considered=1, configurations_solved=1, least_memory_gib=0.0)


def test_the_planners_choice_then_the_band_then_one_of_each_other_layout():
    best, close, slow_same, slow_tp, slower_tp = (cand(1.00, dp=4), cand(1.05, dp=4, micro_batch=2),
                                                  cand(1.50, dp=4, zero_stage=3), cand(1.30, dp=2, tp=2),
                                                  cand(1.40, dp=2, tp=2, micro_batch=2))
    chosen = pick_candidates(result(best, slower_tp, slow_same, close, slow_tp), band=0.10, count=5)
    assert chosen == [best, close, slow_tp]  # 1.50 shares the first layout, 1.40 the tp2 one
    assert pick_candidates(result(best, close, slow_tp), band=0.10, count=1) == [best]
    preferred = cand(1.02, dp=4, zero_stage=1)  # the planner may prefer a simpler plan in the band
    assert pick_candidates(result(preferred, best), band=0.10, count=1) == [preferred]


def trial(predicted: float, measured: float | None, ok: bool = True) -> Trial:
    plan = Plan(model=ModelRef("catalog", "tiny-gpt"), gpu="cpu", world_size=1, gpus_per_node=1,
                parallel=ParallelConfig(global_batch=1, seq_len=8), estimate={"step_time_s": predicted})
    return Trial(plan, Path("."), ok=ok, measured={"step_time_s": measured} if measured else {})


def test_the_fit_is_the_median_of_predicted_over_measured_of_finished_runs():
    trials = [trial(1.0, 2.0), trial(1.0, 1.0), trial(3.0, 4.0), trial(9.0, None, ok=False)]
    assert fit_factor(trials) == pytest.approx(0.75)
    assert fit_factor([trial(1.0, None, ok=False)]) is None


def test_refit_scales_the_device_fractions_and_caps_them_at_the_peak(tmp_path):
    cluster = make_cluster(load_gpu("h100"), 8)
    efficiency = cluster.gpu.to_table()["efficiency"]
    slower, notes = refit_cluster(cluster, 0.5, runs=2)
    scaled = slower.gpu.to_table()["efficiency"]
    assert scaled["hbm_fraction"] == pytest.approx(round(efficiency["hbm_fraction"] * 0.5, 4))
    assert scaled["matmul_fraction_16bit"] == [pytest.approx(round(v * 0.5, 4)) for v in efficiency["matmul_fraction_16bit"]]
    assert scaled["intra_node_busbw_fraction"] == efficiency["intra_node_busbw_fraction"]  # the network is kept
    assert notes == []
    _, capped = refit_cluster(cluster, 2.0, runs=1)
    assert "hbm_fraction" in capped[0]
    factor, _ = write_refit(cluster, [trial(1.0, 2.0)], tmp_path / "tuned.toml")
    loaded = load_hardware_file(tmp_path / "tuned.toml")
    assert factor == 0.5 and loaded.gpu.to_table()["efficiency"]["hbm_fraction"] == scaled["hbm_fraction"]
    assert "fitted by autoplan tune" in loaded.gpu.sources["efficiency.hbm_fraction"]


def test_a_failed_run_is_named_by_its_own_error_line():
    log = "step 0 ...\nTraceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of memory.\n"
    assert _last_words(log) == "torch.OutOfMemoryError: CUDA out of memory."
    assert _last_words("just this\n") == "just this"
