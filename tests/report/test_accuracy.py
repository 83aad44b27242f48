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
