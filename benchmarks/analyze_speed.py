"""`autoplan analyze` wall time and peak RSS (targets: Llama-3-70B-shaped < 5 s and
< 2 GiB, Llama 3.1 405B < 10 s), each measured as a fresh process like a user runs it.

    python benchmarks/analyze_speed.py [--repeat 3]

Prints the median wall seconds and the max RSS over the repeats.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

CASES = [("llama3.1-70b", 4096, 5.0), ("llama3.1-405b", 8192, 10.0), ("deepseek-v3", 4096, 10.0)]


def run_once(model: str, seq: int) -> tuple[float, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "autoplan", "analyze", model, "--seq-len", str(seq), "--json"],
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(proc.stderr)
    rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB, max over children
    return wall, rss_gib


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"{'model':16} {'seq':>6} {'median wall s':>13} {'max RSS GiB':>11} {'target s':>8}")
    for model, seq, target in CASES:
        results = [run_once(model, seq) for _ in range(args.repeat)]
        wall = statistics.median(r[0] for r in results)
        rss = max(r[1] for r in results)
        print(f"{model:16} {seq:>6} {wall:>13.2f} {rss:>11.2f} {target:>8.1f}  {'OK' if wall <= target and rss < 2 else 'MISS'}")


if __name__ == "__main__":
    main()
