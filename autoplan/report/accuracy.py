"""How sure: the cost model's measured error, turned into a range on time and cost.

`autoplan validate` on the repo's copy of the published runs takes tens of seconds, too long
for every report, so its summary is stored in cost_models/validation/accuracy_summary.json
with a fingerprint of what it depends on (the runs file, the cost model's code, the GPU data).
Regenerate it with `python -m autoplan.report.accuracy`; tests/report checks it is fresh.

The error of a run is predicted / measured - 1 of tokens/s per GPU (autoplan.validate.published), so
the true time of a predicted time T is T x (1 + error): the range is T x (1 -+ e) for the
90th percentile e of |error|, taken over the runs of the runtime family autoplan's own jobs
belong to (validate.families: FSDP2/DTensor, the torchtitan family), not over every runtime.
An `ErrorBand` is the one place a report takes its error from; a calibration can supply another.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from autoplan.paths import cost_models_dir
from autoplan.validate.families import autoplan_runtime_family

SUMMARY_NAME = "accuracy_summary.json"
RUNS_NAME = "published_runs.json"
FAMILIES_NAME = "runtime_families.toml"


@dataclass(frozen=True)
class ErrorBand:
    """A relative error applied to predicted times and costs, with where it comes from."""

    relative: float  # |predicted / measured - 1| bound used for the range (e.g. its 90th percentile)
    median: float  # median |error|, for the sentence in the report
    runs: int  # how many runs it was measured on
    source: str  # one line: what was measured
    stale: bool = False  # the cost model changed since it was measured
    family: str = ""  # runtime family of the runs it was measured on (validate.families)

    def range(self, value: float) -> tuple[float, float]:
        """(low, high) of a predicted time or cost."""
        return value * max(0.0, 1.0 - self.relative), value * (1.0 + self.relative)


def _summary_path() -> Path:
    return cost_models_dir() / "validation" / SUMMARY_NAME


def dependency_files() -> list[Path]:
    """What the measured error depends on: runs file, cost code, validation code, GPU data."""
    package = Path(__file__).resolve().parents[1]
    cost_dir = package / "cost"
    return ([cost_models_dir() / "validation" / RUNS_NAME, package / "validate" / "published.py",
             package / "validate" / "families.py", cost_models_dir() / "validation" / FAMILIES_NAME,
             cost_models_dir() / "allocator_reserve.toml", cost_models_dir() / "cpu_adam.toml"]
            + sorted(cost_dir.glob("*.py")) + sorted((cost_models_dir() / "gpus").glob("*.toml")))


def fingerprint() -> str:
    """sha256 over the names and contents of `dependency_files()`."""
    digest = hashlib.sha256()
    for path in dependency_files():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics (numpy 'linear')."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def build_summary(runs_path: Path | None = None) -> dict:
    """Run the validation (slow) and summarise |error| of tokens/s per GPU."""
    runs_path = runs_path or cost_models_dir() / "validation" / RUNS_NAME
    from autoplan.validate.published import validate_file  # torch: only when the summary is rebuilt

    report = validate_file(runs_path)

    errors = [abs(r["error"]["tokens_per_s_per_gpu"]) for r in report["runs"]
              if not r.get("skipped") and "tokens_per_s_per_gpu" in r["error"]]
    return {
        "what": "|predicted / measured - 1| of tokens/s per GPU over the published runs "
                "(autoplan.validate.published.validate_file)",
        "runs_file": f"cost_models/validation/{RUNS_NAME}",
        "runs": len(errors),
        "skipped": report["summary"]["skipped"],
        "median_abs_rel_error": statistics.median(errors),
        "p90_abs_rel_error": percentile(errors, 0.9),
        "max_abs_rel_error": max(errors),
        "by_family": {name: _error_stats([abs(r["error"]["tokens_per_s_per_gpu"]) for r in report["runs"]
                                          if r.get("family") == name and not r.get("skipped")
                                          and "tokens_per_s_per_gpu" in r["error"]])
                      for name in report["by_family"]},
        "autoplan_runtime_family": autoplan_runtime_family(),
        "fingerprint": fingerprint(),
        "regenerate": "python -m autoplan.report.accuracy",
    }


def _error_stats(errors: list[float]) -> dict:
    """runs, median, 90th percentile and max of a list of |error|."""
    return {"runs": len(errors), "median_abs_rel_error": statistics.median(errors),
            "p90_abs_rel_error": percentile(errors, 0.9), "max_abs_rel_error": max(errors)}


@functools.lru_cache(maxsize=1)
def published_runs_error() -> ErrorBand | None:
    """The stored measured error of the runtime family autoplan's jobs run on (None when no
    summary exists): a plan runs on autoplan's runtime, so the band is that family's, not the
    whole set's."""
    path = _summary_path()
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    family = data["autoplan_runtime_family"]
    stats = data["by_family"][family]
    return ErrorBand(relative=stats["p90_abs_rel_error"], median=stats["median_abs_rel_error"],
                     runs=stats["runs"],
                     source=f"cost model vs {stats['runs']} published {family} runs, the runtime family of "
                            f"autoplan's jobs (FSDP2/DTensor, {data['runs_file']}): "
                            f"median |error| {stats['median_abs_rel_error']:.0%}, "
                            f"90th percentile {stats['p90_abs_rel_error']:.0%} of tokens/s per GPU",
                     stale=data.get("fingerprint") != fingerprint(), family=family)


def main() -> None:
    """Write cost_models/validation/accuracy_summary.json (or print it with --print)."""
    summary = build_summary()
    text = json.dumps(summary, indent=2) + "\n"
    if "--print" in sys.argv:
        print(text)
        return
    _summary_path().write_text(text)
    family = summary["autoplan_runtime_family"]
    print(f"wrote {_summary_path()}: median {summary['median_abs_rel_error']:.1%}, "
          f"p90 {summary['p90_abs_rel_error']:.1%} over {summary['runs']} runs; {family} (autoplan's "
          f"runtime): median {summary['by_family'][family]['median_abs_rel_error']:.1%}, "
          f"p90 {summary['by_family'][family]['p90_abs_rel_error']:.1%}")


if __name__ == "__main__":
    main()
