"""CPU seconds of the front door: plan, analyze, report, check, --help and models, as a user
runs them (a fresh process each), and where a plan's seconds go.

    python benchmarks/plan_speed.py [--repeat 3] [--skip-check]

Each command runs `--repeat` times; "cold" runs start with an empty graph cache (trace,
capability probe), "warm" runs find the graph a first run stored (trace/store.py), as a
second `plan` of the same model does. CPU seconds are user + sys of the process and its
children (report plans clusters in child processes), median over the repeats: this machine
is shared, so wall time says little. The phase table runs the plan command's own steps in a
fresh process, timed with process_time: import (the modules the command loads), load (graph
from the cache, or model build + trace + probe), of which probe (the runtime capability
probe), search (plan_job), output (explanation and rendering).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLAN_405B = ["plan", "llama3.1-405b", "--gpu", "h100", "--gpus", "16384", "--global-batch", "2048",
             "--seq-len", "8192"]
PLAN_DSV3 = ["plan", "deepseek-v3", "--gpu", "h100", "--gpus", "2048", "--global-batch", "15360",
             "--seq-len", "4096"]  # DeepSeek-V3's own cluster size, final batch and length (arXiv:2412.19437)
REPORT = ["report", "llama3.1-8b", "--tokens", "1T", "--seq-len", "4096", "--global-batch", "256",
          "--gpu", "h100-sxm-80gb,a100-sxm4-80gb,h200-sxm-141gb,mi300x", "--gpus", "8,16,32,64",
          "--budget", "60000", "--deadline", "30"]  # the README's sweep
CHECK_70B = ["check", str(REPO / "generated" / "llama3.1-70b-64xh100-sxm-80gb"), "--json"]
CASES = [  # (label, arguments, target CPU seconds, warm: measured with the graph cached)
    ("--help", ["--help"], 0.3, False),
    ("models", ["models"], 0.3, False),
    ("analyze llama3.1-70b", ["analyze", "llama3.1-70b"], 1.0, True),
    ("plan llama3.1-405b 16384 H100", PLAN_405B, 2.0, True),
    ("plan deepseek-v3 2048 H100", PLAN_DSV3, 10.0, True),
    ("report README sweep (16 clusters)", REPORT, 8.0, True),
    ("  the same, --format html (charts)", [*REPORT, "--format", "html"], 8.0, True),
    ("check 70B example (64 ranks)", CHECK_70B, 30.0, False),
]

PHASES = r"""
import json, sys, time
cpu = time.process_time
t0 = cpu()
import autoplan.cli, autoplan.commands.plan, autoplan.solve.api, autoplan.solve.explain, autoplan.trace.load
import rich.console
out = {"import": cpu() - t0}
from autoplan.hardware import resolve_cluster
from autoplan.solve.api import plan_job
from autoplan.solve.explain import explain, render_job
from autoplan.trace.load import load_graph
model, gpu, gpus, batch, seq = json.loads(sys.argv[1])
probe = [0.0]
t = cpu()
if sys.argv[2] == "cold":  # imports torch, as a cold load does anyway (counted in load)
    from autoplan.trace import tracer
    inner = tracer.add_capability_facts
    def timed(*a, **k):
        start = cpu(); inner(*a, **k); probe[0] += cpu() - start
    tracer.add_capability_facts = timed
graph, ref, seq = load_graph(model, seq); out["load"] = cpu() - t; out["probe"] = probe[0]
cluster = resolve_cluster(gpu, None, gpus, None)
t = cpu(); job = plan_job(graph, ref, cluster, global_batch=batch, seq_len=seq); out["search"] = cpu() - t
t = cpu(); render_job(job, explain(job), rich.console.Console(file=open("/dev/null", "w"), width=100))
out["output"] = cpu() - t
r = job.result
out.update(status=r.status, searched=r.configurations_searched, total=r.configurations_considered)
print(json.dumps(out))
"""


def cpu_seconds(args: list[str], env: dict) -> float:
    """user + sys of one `autoplan ARGS` process and everything it waited for."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"autoplan {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def environment(cache: Path) -> dict:
    return {**os.environ, "AUTOPLAN_CACHE": "1", "AUTOPLAN_CACHE_DIR": str(cache)}


def measure(args: list[str], warm: bool, repeat: int) -> tuple[float, float | None]:
    """(median cold CPU s, median warm CPU s or None)."""
    cold, hot = [], []
    for _ in range(repeat):
        cache = Path(tempfile.mkdtemp(prefix="autoplan-speed-"))
        try:
            cold.append(cpu_seconds(args, environment(cache)))
            if warm:
                hot.append(cpu_seconds(args, environment(cache)))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return statistics.median(cold), (statistics.median(hot) if hot else None)


def phases(model: str, gpu: str, gpus: int, batch: int, seq: int, repeat: int) -> dict[str, dict]:
    """Median CPU seconds per phase of a plan, cold and warm."""
    spec = json.dumps([model, gpu, gpus, batch, seq])
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    for _ in range(repeat):
        cache = Path(tempfile.mkdtemp(prefix="autoplan-speed-"))
        try:
            for mode in ("cold", "warm"):
                proc = subprocess.run([sys.executable, "-c", PHASES, spec, mode], capture_output=True, text=True,
                                      env=environment(cache), check=True)
                runs[mode].append(json.loads(proc.stdout))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return {mode: {key: (statistics.median(r[key] for r in rows) if isinstance(rows[0][key], float) else rows[0][key])
                   for key in rows[0]} for mode, rows in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-check", action="store_true", help="leave out the 70B check (about 30 CPU-s a run)")
    args = parser.parse_args()
    print(f"{'command':36} {'cold CPU s':>10} {'warm CPU s':>10} {'target':>7}")
    for label, argv, target, warm in CASES:
        if args.skip_check and argv[0] == "check":
            continue
        cold, hot = measure(argv, warm, args.repeat)
        judged = hot if hot is not None else cold
        print(f"{label:36} {cold:>10.2f} {'-' if hot is None else f'{hot:.2f}':>10} {target:>7.1f}  "
              f"{'OK' if judged <= target else 'MISS'}")
    print()
    print(f"{'plan phases, CPU s':36} {'import':>7} {'load':>7} {'probe':>7} {'search':>7} {'output':>7}  status")
    for label, spec in (("llama3.1-405b 16384 H100", ("llama3.1-405b", "h100", 16384, 2048, 8192)),
                        ("deepseek-v3 2048 H100", ("deepseek-v3", "h100", 2048, 15360, 4096))):
        for mode, p in phases(*spec, args.repeat).items():
            print(f"{label + ' ' + mode:36} {p['import']:>7.2f} {p['load']:>7.2f} {p['probe']:>7.2f} "
                  f"{p['search']:>7.2f} {p['output']:>7.2f}  {p['status']}, searched {p['searched']} of {p['total']}")


if __name__ == "__main__":
    main()
