"""Does `plan` beat (or match) every published configuration under the cost model?

For each run of the published-runs file: plan with the same GPU type, GPU count, global
batch, sequence length and precision, and compare the plan's predicted tokens/s per GPU
with the predicted tokens/s per GPU of the published configuration (its best reading when
the source leaves settings unstated), both under the same cost model.

    python benchmarks/plan_vs_published.py [--runs cost_models/validation/published_runs.json] [--limit N]

Prints one row per run and a summary; writes benchmarks/results/plan_vs_published.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from autoplan.cost import estimate
from autoplan.errors import UserError
from autoplan.solve.search import search
from autoplan.solve.space import Request
from autoplan.validate.published import _cluster_for_run, _graph_for_run, candidate_configs, load_runs

REPO = Path(__file__).resolve().parent.parent


def published_prediction(run, graph, cluster):
    best = None
    for config, _ in candidate_configs(run):
        est = estimate(graph, config, cluster)
        if est.feasible and (best is None or est.tokens_per_s_per_gpu > best[0].tokens_per_s_per_gpu):
            best = (est, config)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default=str(REPO / "cost_models/validation/published_runs.json"))
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args()
    runs = load_runs(args.runs)[: args.limit or None]
    rows, worse = [], 0
    print(f"{'run':58} {'GPUs':>6} {'published t/s/GPU':>17} {'plan t/s/GPU':>12} {'gain':>7} {'plan':>30} {'s':>5}")
    for run in runs:
        t0 = time.perf_counter()
        try:
            graph, cluster = _graph_for_run(run), _cluster_for_run(run)
            published = published_prediction(run, graph, cluster)
            request = Request(num_gpus=cluster.num_gpus, gpus_per_node=cluster.gpus_per_node,
                              global_batch=int(run["parallel"]["global_batch_seqs"]),
                              seq_len=int(run["model"]["seq_len"]), precisions=(run["precision_key"],))
            result = search(graph, cluster, request, top=0, time_limit_s=args.time_limit)
        except UserError as exc:
            print(f"{run['id'][:58]:58} skipped: {exc}")
            rows.append({"id": run["id"], "skipped": str(exc)})
            continue
        wall = time.perf_counter() - t0
        pub = published[0].tokens_per_s_per_gpu if published else 0.0
        plan = result.best.estimate.tokens_per_s_per_gpu if result.best else 0.0
        gain = plan / pub - 1 if pub else float("inf")
        worse += gain < -1e-9
        c = result.best.config if result.best else None
        desc = f"dp{c.dp} tp{c.tp} pp{c.pp} cp{c.cp} ep{c.ep} z{c.zero_stage} mb{c.micro_batch}" if c else "-"
        print(f"{run['id'][:58]:58} {cluster.num_gpus:>6} {pub:>17,.0f} {plan:>12,.0f} {gain:>+7.1%} {desc:>30} {wall:>5.1f}")
        rows.append({"id": run["id"], "published_tokens_per_s_per_gpu": pub, "plan_tokens_per_s_per_gpu": plan,
                     "gain": gain, "status": result.status, "wall_s": wall})
    print(f"\n{len(rows)} runs; plan slower than the published configuration in {worse}")
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_vs_published.json").write_text(json.dumps({"runs": rows, "slower": worse}, indent=1))


if __name__ == "__main__":
    main()
