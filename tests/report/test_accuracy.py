"""The stored measured error: fresh, and applied as a range."""

from __future__ import annotations

import json

import pytest

from autoplan.paths import cost_models_dir
from autoplan.report import accuracy


def test_summary_is_fresh():
    data = json.loads((cost_models_dir() / "validation" / accuracy.SUMMARY_NAME).read_text())
    assert data["fingerprint"] == accuracy.fingerprint(), (
        "the cost model, its GPU data or the published runs changed since the measured error was stored; "
        "regenerate it with `python -m autoplan.report.accuracy` (about a minute)")
    assert 0 < data["median_abs_rel_error"] <= data["p90_abs_rel_error"] <= data["max_abs_rel_error"]
    assert data["runs"] > 50


def test_band_range():
    band = accuracy.ErrorBand(relative=0.25, median=0.1, runs=3, source="x")
    assert band.range(100.0) == (75.0, 125.0)
    assert accuracy.ErrorBand(relative=1.5, median=1, runs=1, source="x").range(10.0) == (0.0, 25.0)


def test_percentile_interpolates():
    # numpy 'linear': position (n-1) q = 0.9 * 9 = 8.1 between the 9th (9) and 10th (10) values
    assert accuracy.percentile(list(range(1, 11)), 0.9) == pytest.approx(9.1)
    assert accuracy.percentile([3.0], 0.9) == 3.0


def _summary(tmp_path):
    """A stored summary whose torchtitan family errs far more than the whole set."""
    data = {"runs_file": "runs.json", "runs": 100, "median_abs_rel_error": 0.07, "p90_abs_rel_error": 0.2,
            "max_abs_rel_error": 0.5, "autoplan_runtime_family": "torchtitan", "fingerprint": "x",
            "by_family": {"torchtitan": {"runs": 8, "median_abs_rel_error": 0.13, "p90_abs_rel_error": 0.45,
                                         "max_abs_rel_error": 0.6},
                          "megatron": {"runs": 80, "median_abs_rel_error": 0.06, "p90_abs_rel_error": 0.15,
                                       "max_abs_rel_error": 0.3}}}
    (tmp_path / "validation").mkdir()
    (tmp_path / "validation" / accuracy.SUMMARY_NAME).write_text(json.dumps(data))
    return tmp_path


def test_band_is_that_of_autoplans_runtime_family(tmp_path, monkeypatch):
    root = _summary(tmp_path)
    monkeypatch.setattr(accuracy, "_summary_path", lambda: root / "validation" / accuracy.SUMMARY_NAME)
    accuracy.published_runs_error.cache_clear()
    try:
        band = accuracy.published_runs_error()
    finally:
        accuracy.published_runs_error.cache_clear()
    assert (band.relative, band.median, band.runs, band.family) == (0.45, 0.13, 8, "torchtitan")
    assert "torchtitan" in band.source and "8 published" in band.source


def test_search_preference_band_is_the_family_median(tmp_path, monkeypatch):
    from autoplan.solve import preference

    root = _summary(tmp_path)
    monkeypatch.setattr(preference, "cost_models_dir", lambda: root)
    assert preference.equivalence_band() == 0.13
    assert preference.equivalence_band_family() == "torchtitan"


def test_stored_summary_has_the_family_of_autoplans_runtime():
    from autoplan.validate.families import autoplan_runtime_family

    data = json.loads((cost_models_dir() / "validation" / accuracy.SUMMARY_NAME).read_text())
    family = data["by_family"][data["autoplan_runtime_family"]]
    assert data["autoplan_runtime_family"] == autoplan_runtime_family() == "torchtitan"
    assert family["runs"] == 8
    assert 0 < family["median_abs_rel_error"] <= family["p90_abs_rel_error"] <= family["max_abs_rel_error"]
