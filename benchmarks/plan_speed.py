"""Planner speed targets: wall time of `plan` from a traced graph to a proven plan.

    python benchmarks/plan_speed.py [--repeat 3]

Prints one row per case: median wall seconds over the repeats (search only, and with the
model analysis; every repeat is a search with its own, empty cost cache, as one `autoplan
plan` is), solver status, configurations enumerated / solved, the plan and target.
This machine is shared and noisy: quote medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

from autoplan.solve.api import plan_job, resolve_cluster
from autoplan.trace.load import load_graph

CASES = [  # (model, gpu, gpus, global batch, seq, target seconds)
    ("llama3.1-70b", "h100", 64, 256, 8192, 2.0),
    ("mixtral-8x22b", "h100", 256, 1024, 4096, 10.0),
    ("llama3.1-405b", "h100", 16384, 2048, 8192, 10.0),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"{'model':16} {'GPUs':>6} {'analyze s':>9} {'search s':>9} {'target':>7} {'status':9} "
          f"{'configs':>8} {'solved':>6}  plan")
    for model, gpu, gpus, batch, seq, target in CASES:
        t0 = time.perf_counter()
        graph, ref, seq = load_graph(model, seq)
        analyze_s = time.perf_counter() - t0
        cluster = resolve_cluster(gpu, None, gpus, None)
        walls, job = [], None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            job = plan_job(graph, ref, cluster, global_batch=batch, seq_len=seq)
            walls.append(time.perf_counter() - t0)
        c = job.result.best.config
        wall = statistics.median(walls)
        print(f"{model:16} {gpus:>6} {analyze_s:>9.2f} {wall:>9.2f} {target:>7.1f} {job.result.status:9} "
              f"{job.result.configurations_considered:>8} {job.result.configurations_solved:>6}  "
              f"dp{c.dp} tp{c.tp} pp{c.pp} cp{c.cp} ep{c.ep} z{c.zero_stage} mb{c.micro_batch} "
              f"{c.schedule} v{c.vpp}  search {'OK' if wall <= target else 'SLOW'}, with analysis {analyze_s + wall:.1f} s")


if __name__ == "__main__":
    main()
