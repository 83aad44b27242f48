"""Cost model vs published training runs: per-run table and summary.

Reads the repo's copy cost_models/validation/published_runs.json (or a path given as the
first argument) and prints predicted and measured tokens/s per GPU, the relative error,
what was assumed for unstated settings, then the summary, one line per source (the README's
"By source" table), one line per runtime family (validate.families) and the wall time.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from autoplan.validate.families import by_family
from autoplan.validate.published import load_runs, summarize, validate_run

DEFAULT = Path(__file__).resolve().parent.parent / "cost_models" / "validation" / "published_runs.json"


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT
    start = time.perf_counter()
    runs = load_runs(path)
    results = [validate_run(run) for run in runs]
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
    print()
    by_source: dict[str, list[float]] = defaultdict(list)
    for run, r in zip(runs, results):
        if not r.skipped:
            by_source[run.get("source_key") or run.get("source", "?")].append(r.error["tokens_per_s_per_gpu"])
    print(f"{'source':24s} {'runs':>4s} {'median |err|':>12s} {'within 25%':>10s} {'median err':>10s}")
    for source, errors in sorted(by_source.items(), key=lambda kv: -len(kv[1])):
        absolute = [abs(e) for e in errors]
        print(f"{source[:24]:24s} {len(errors):4d} {statistics.median(absolute):12.1%} "
              f"{sum(e <= 0.25 for e in absolute):>5d}/{len(errors):<4d} {statistics.median(errors):+10.1%}")
    print()
    print(f"{'runtime family':24s} {'runs':>4s} {'median |err|':>12s} {'within 25%':>10s} {'OOM':>4s} "
          f"{'median |mem err|':>16s}")
    for family, f in by_family([r.to_dict() for r in results]).items():
        mem = "-" if f["memory_median_abs_rel_error"] is None else \
            f"{f['memory_median_abs_rel_error']:.1%} ({f['memory_compared']})"
        print(f"{family:24s} {f['count']:4d} {f['median_abs_rel_error']:12.1%} {f['within_25pct_fraction']:10.0%} "
              f"{f['predicted_infeasible']:4d} {mem:>16s}")
    print(f"wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
