"""Cost model vs published training runs: per-run table and summary (issue 3 targets).

Reads the repo's copy cost_models/validation/published_runs.json (or a path given as the
first argument) and prints predicted and measured tokens/s per GPU, the relative error,
what was assumed for unstated settings, then the summary and the wall time.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from autoplan.validation import load_runs, summarize, validate_run

DEFAULT = Path(__file__).resolve().parent.parent / "cost_models" / "validation" / "published_runs.json"


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT
    start = time.perf_counter()
    results = [validate_run(run) for run in load_runs(path)]
    print(f"{'run':58s} {'pred':>9s} {'meas':>9s} {'error':>7s} {'GiB':>6s}  assumed")
    for r in results:
        if r.skipped:
            print(f"{r.id[:58]:58s} skipped: {r.skipped}")
            continue
        p = r.predicted
        flag = "" if p["feasible"] else " OOM"
        print(f"{r.id[:58]:58s} {p['tokens_per_s_per_gpu']:9.1f} {r.measured['tokens_per_s_per_gpu']:9.1f} "
              f"{r.error['tokens_per_s_per_gpu']:+7.1%} {p['memory_gib_per_gpu']:6.1f}{flag}  "
              + ", ".join(f"{k}={v}" for k, v in r.assumed.items()))
    s = summarize(results)
    print()
    print(f"runs {s['count']}, skipped {s['skipped']}, predicted infeasible {s['predicted_infeasible']}")
    print(f"median |error| {s['median_abs_rel_error']:.1%} (target <= 10%), max {s['max_abs_rel_error']:.1%}, "
          f"within 25%: {s['within_25pct_fraction']:.0%} (target >= 90%)")
    print(f"wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
