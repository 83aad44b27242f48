"""Speed of a report sweep: llama3.1-70b on 4 GPU types x 8 cluster sizes (target: < 60 s).

Traces the model once, plans every cluster on that graph (as `autoplan report` does) and prints
one line per cluster (search wall time and status, step time, time to train 2T tokens, cost)
and the totals. Usage: python benchmarks/report_sweep.py [--time-limit SECONDS] [--gpus 64,128]
"""

from __future__ import annotations

import argparse
import time

GPUS = "h100,a100-sxm4-80gb,h200,mi300x"
COUNTS = "64,128,256,512,1024,2048,4096,8192"


def main() -> None:
    from autoplan.hardware import load_prices
    from autoplan.report.accuracy import published_runs_error
    from autoplan.report.formatting import duration, usd
    from autoplan.report.arguments import gpu_prices, parse_counts, parse_gpus
    from autoplan.report.sweep import run_sweep
    from autoplan.trace.load import load_graph

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3.1-70b")
    parser.add_argument("--gpu", default=GPUS)
    parser.add_argument("--gpus", default=COUNTS)
    parser.add_argument("--global-batch", type=int, default=1024)  # 4M tokens, Llama 3 70B's batch
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--time-limit", type=float, default=None, help="search limit per cluster (s)")
    args = parser.parse_args()

    start = time.perf_counter()
    graph, ref, seq = load_graph(args.model, args.seq_len)
    traced = time.perf_counter() - start
    gpus, counts = parse_gpus(args.gpu), parse_counts(args.gpus)
    prices = gpu_prices(gpus, load_prices())
    lines = []

    def progress(done: int, total: int, label: str) -> None:
        lines.append((time.perf_counter(), label))

    sweep = run_sweep(graph, ref, gpus, counts, seq_len=seq, global_batch=args.global_batch, tokens=2 * 10**12,
                      prices=prices, error=published_runs_error(), time_limit_s=args.time_limit, progress=progress)
    total = time.perf_counter() - start
    print(f"{'cluster':26s} {'search s':>9s} {'status':>10s} {'step':>9s} {'train 2T':>11s} {'cost':>9s}")
    for row in sweep.rows:
        if row.fits:
            print(f"{row.label:26s} {row.solver_wall_s:9.1f} {row.solver_status:>10s} "
                  f"{duration(row.estimate['step_time_s']):>9s} {duration(row.run.time_s):>11s} "
                  f"{usd(row.run.cost_usd):>9s}")
        else:
            print(f"{row.label:26s} {row.solver_wall_s:9.1f} {'no fit':>10s}  {row.reason[:60]}")
    optimal = sum(r.solver_status == "OPTIMAL" for r in sweep.rows)
    print(f"\ntrace {traced:.1f} s (once); {len(sweep.rows)} clusters planned in {sweep.wall_s:.1f} s "
          f"({optimal} proven optimal); total {total:.1f} s (target < 60 s)")


if __name__ == "__main__":
    main()
