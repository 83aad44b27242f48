"""The corpus matrix: every model of tests/corpus.py (tiny size) x every parallel axis, run
end to end as a user runs it, against the same job on one rank.

    python benchmarks/corpus_matrix.py [--only NAME ...] [--axes dp4_zero3,tp2,...] [--jobs N]

For each model and axis it writes the model file (`corpus.model_file`, Hugging Face models
with dropout 0 so that ranks can repeat the one-rank losses), runs
`autoplan plan FILE --gpu cpu --gpus 4 --global-batch 8 --seq-len 32 --precision fp32
--fix <degrees>`, then `autoplan generate FILE --plan plan.json`, then the job's launch.sh
(torchrun, 4 gloo ranks, a few steps of synthetic tokens) and compares its losses with the
same model's one-rank job (planned with --gpus 1, the same global batch and seed).

Outcomes per cell:
  parity (max rel err X)      losses within RTOL of the one-rank job at every step
  refused at plan time: ...   `autoplan plan` exited 2 with a reason (the planner knew)
  refused by generate: ...    an image model that plans, but whose output is not class
                              scores (batch, classes), so `autoplan generate` writes no job
  n/a                         the axis has nothing to apply to (EP on a dense model,
                              CP on a model without attention)
  FAIL: ...                   anything else: plan exit 1 or a traceback, the plan has other
                              degrees than fixed, generate refused a plan that plan accepted,
                              the job failed at start-up or in training, a loss mismatch

Each cell runs in its own subprocess with a timeout (--timeout); its result is kept as JSON
in --work (default /tmp/corpus_matrix), so `--reuse` prints a table from finished cells and
runs only the missing ones. Writes the table, then one detail line per cell, to --out
(default benchmarks/results/corpus_matrix.txt) with the command and commit at the top.
Not part of the test suite: the full matrix is ~80 torchrun launches (about an hour on 2
cores).

    python benchmarks/corpus_matrix.py --combine OLD.txt NEWER.txt ... --out TABLE.txt

writes one table from earlier outputs: each cell's newest detail line wins (files and their
blocks in the order given), and every cell names the commit it ran at, with the share of
parity among the cells whose axis means something for the model (all but n/a).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import corpus  # noqa: E402

RTOL = 1e-4  # fp32: only the summation order differs from the one-rank job (issue's bound)
STEPS, SEED, GLOBAL_BATCH, SEQ_LEN, IMAGE_SIZE = 4, 7, 8, 32, 32
AXES = {  # axis -> the degrees a user fixes on 4 ranks
    "dp4_zero3": {"dp": 4, "zero": 3},
    "tp2": {"tp": 2, "dp": 2},
    "pp2": {"pp": 2, "dp": 2},
    "cp2": {"cp": 2, "dp": 2},
    "ep2": {"ep": 2, "dp": 4},
}
PLAN_KEYS = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "zero": "zero_stage"}


# ---------------------------------------------------------------- running commands

def run(cmd: list[str], *, timeout: float, cwd: Path | None = None) -> tuple[int, str]:
    """(exit status, stdout+stderr) of `cmd` in its own session; on timeout the whole
    process group is killed and the status is 124."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MAX_RESTARTS="0",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in ("RDZV_ENDPOINT", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NPROC_PER_NODE"):
        env.pop(name, None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return 124, out + f"\n[timed out after {timeout:.0f} s]"


# A Hugging Face model built with dropout draws its masks from each rank's generator, so
# 4 ranks cannot repeat the one-rank losses (GPT-2 at its default 0.1: 2e-3 relative at the
# first step). The model file builds the entry with every dropout probability at 0.
_DROPOUT_OFF = """
def build_model():
    import torch
    import transformers

    model_cls, config_cls, fields, tiny = corpus.HF_MODELS[ENTRY.name]
    defaults = vars(getattr(transformers, config_cls)())
    off = {key: 0.0 for key, value in defaults.items()
           if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value}
    torch.manual_seed(0)
    return corpus._hf_model(model_cls, config_cls, fields, {**tiny, **off}, "tiny")
"""


def model_file(name: str, folder: Path) -> Path:
    """The tiny entry's model file as `corpus.model_file` writes it, without dropout."""
    path = corpus.model_file(name, "tiny", folder)
    if corpus.ENTRIES[name].hf:
        path.write_text(path.read_text() + _DROPOUT_OFF)
    return path


def shape_args(name: str) -> list[str]:
    entry = corpus.ENTRIES[name]
    if entry.inputs == "image":
        return ["--image-size", str(IMAGE_SIZE)]
    return ["--seq-len", str(SEQ_LEN)]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "autoplan", *args]


def one_line(text: str) -> str:
    return " ".join(text.split())


def error_of(output: str) -> str:
    """The part of a failed command's output that says why: a traceback's last lines, an
    autoplan error paragraph, else the tail."""
    lines = [line for line in output.splitlines() if line.strip()]
    for marker in ("Error:", "error:", "Traceback"):
        hits = [i for i, line in enumerate(lines) if marker in line]
        if hits:
            start = hits[-1] if marker != "Traceback" else max(hits[-1], len(lines) - 4)
            return one_line(" ".join(lines[start:start + 6]))
    return one_line(" ".join(lines[-6:]))


# ---------------------------------------------------------------- one job

def plan_and_run(name: str, gpus: int, fixes: dict[str, int], folder: Path, timeout: float) -> dict:
    """Plan, generate and launch one job; the outcome as a dict (stage, status, losses...)."""
    shutil.rmtree(folder, ignore_errors=True)  # metrics.jsonl of an earlier run would be appended to
    folder.mkdir(parents=True)
    model = model_file(name, folder)
    cluster = ["--gpu", "cpu", "--gpus", str(gpus), "--gpus-per-node", str(gpus),
               "--global-batch", str(GLOBAL_BATCH), "--precision", "fp32", *shape_args(name)]
    fix = [arg for key, value in fixes.items() for arg in ("--fix", f"{key}={value}")]
    plan_path, job, run_dir = folder / "plan.json", folder / "job", folder / "run"
    code, out = run(cli("plan", str(model), *cluster, *fix, "-o", str(plan_path), "--force"),
                    timeout=timeout)
    if code != 0:
        return {"stage": "plan", "code": code, "output": out[-6000:]}
    plan = json.loads(plan_path.read_text())
    wrong = {k: plan.get(PLAN_KEYS[k]) for k, v in fixes.items() if plan.get(PLAN_KEYS[k]) != v}
    if wrong:
        return {"stage": "plan degrees", "code": 0, "output": f"fixed {fixes}, plan has {wrong}"}
    code, out = run(cli("generate", str(model), "--plan", str(plan_path), "-o", str(job), "--force"),
                    timeout=timeout)
    if code != 0:
        return {"stage": "generate", "code": code, "output": out[-6000:]}
    code, out = run(["bash", str(job / "launch.sh"), "--steps", str(STEPS), "--seed", str(SEED),
                     "--run-dir", str(run_dir), "--log-every", "1"], timeout=timeout, cwd=folder)
    if code != 0:
        return {"stage": "launch", "code": code, "output": out[-6000:]}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"stage": "done", "code": 0, "losses": [m["loss"] for m in metrics],
            "plan": {k: plan.get(k) for k in ("dp", "tp", "pp", "cp", "ep", "zero_stage", "micro_batch",
                                              "schedule", "sequence_parallel")}}


def cell_outcome(name: str, axis: str, work: Path, timeout: float) -> dict:
    """Run one cell (and, once per model, the one-rank reference it compares with)."""
    entry = corpus.ENTRIES[name]
    if axis.startswith("ep") and not entry.moe:
        return {"verdict": "n/a", "detail": "dense model: no routed experts"}
    if axis.startswith("cp") and not entry.attention:
        return {"verdict": "n/a", "detail": "no attention to shard the sequence of"}
    started = time.perf_counter()
    got = plan_and_run(name, 4, AXES[axis], work / name / axis, timeout)
    result = {"seconds": 0.0, **got}
    if got["stage"] == "plan" and got["code"] == 2:
        result.update(verdict="refused", detail="refused at plan time: " + one_line(got["output"]))
    elif got["stage"] == "generate" and got["code"] == 2 and "takes images" in got["output"]:
        # the runtime trains image models as classifiers only
        result.update(verdict="refused", detail="refused by generate: " + one_line(got["output"]))
    elif got["stage"] != "done":
        result.update(verdict="FAIL", detail=f"{got['stage']} exit {got['code']}: {error_of(got['output'])}")
    else:
        ref = reference(name, work, timeout)
        if ref["stage"] != "done":
            result.update(verdict="FAIL", detail=f"one-rank reference {ref['stage']} exit {ref['code']}: "
                                                 f"{error_of(ref['output'])}")
        else:
            compare(result, got["losses"], ref["losses"])
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def reference(name: str, work: Path, timeout: float) -> dict:
    """The model's one-rank job, run once per model (a lock keeps parallel cells to one run)."""
    import fcntl

    path = work / name / "reference.json"
    with open(work / name / "reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            path.write_text(json.dumps(plan_and_run(name, 1, {}, work / name / "one_rank", timeout)))
    return json.loads(path.read_text())


def compare(result: dict, losses: list[float], ref: list[float]) -> None:
    result["reference_losses"] = ref
    if len(losses) != len(ref) or not all(map(math.isfinite, losses)):
        result.update(verdict="FAIL", detail=f"losses {losses} vs one-rank {ref}")
        return
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    result["max_rel_err"] = worst
    if worst <= RTOL:
        result.update(verdict="parity", detail=f"max rel err {worst:.1e} over {len(ref)} steps")
    else:
        result.update(verdict="FAIL", detail=f"loss mismatch: max rel err {worst:.2e} > {RTOL:g}; "
                                             f"losses {losses} vs one-rank {ref}")


# ---------------------------------------------------------------- the matrix

def run_cell_subprocess(name: str, axis: str, work: Path, timeout: float) -> dict:
    """One cell in its own interpreter: an import-time crash or hang stays in its cell."""
    path = work / name / f"{axis}.json"
    code, out = run([sys.executable, __file__, "--cell", name, axis, "--work", str(work),
                     "--timeout", str(timeout)], timeout=4 * timeout)
    if path.exists():
        return json.loads(path.read_text())
    return {"verdict": "FAIL", "detail": f"cell process exit {code}: {error_of(out)}"}


def label(result: dict) -> str:
    verdict = result["verdict"]
    if verdict == "parity":
        return f"parity {result['max_rel_err']:.0e}"
    return verdict


def _head_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def render(names: list[str], axes: list[str], results: dict, command: str) -> str:
    import torch

    lines = [f"# {command}  (commit {_head_commit()}, {time.strftime('%Y-%m-%d')}, torch {torch.__version__} CPU, gloo, 4 ranks vs 1 rank, "
             f"fp32, {STEPS} steps, global batch {GLOBAL_BATCH} x seq {SEQ_LEN} / image {IMAGE_SIZE}; "
             f"parity = losses within {RTOL:g} relative)",
             f"{'model':<20}" + "".join(f"{axis:<15}" for axis in axes)]
    for name in names:
        cells = [label(results[name, a]) if (name, a) in results else "missing" for a in axes]
        lines.append(f"{name:<20}" + "".join(f"{c:<15}" for c in cells))
    counts: dict[str, int] = {}
    for result in results.values():
        counts[result["verdict"]] = counts.get(result["verdict"], 0) + 1
    lines += ["", "cells: " + ", ".join(f"{v} {n}" for v, n in sorted(counts.items())), "", "details:"]
    for name in names:
        for axis in axes:
            result = results.get((name, axis))
            if result is None:
                lines.append(f"{name} {axis}: missing (not run)")
                continue
            detail = result["detail"]
            plan = result.get("plan")
            extra = f"  [{result.get('seconds', 0):.0f} s]" if "seconds" in result else ""
            if plan:
                extra += "  plan " + " ".join(f"{k}={v}" for k, v in plan.items())
            lines.append(f"{name} {axis}: {result['verdict']}: {detail}{extra}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- combining earlier runs

def combined_cells(paths: list[Path]) -> dict[tuple[str, str], tuple[str, str, str]]:
    """(model, axis) -> (verdict, detail line, commit) from corpus_matrix outputs; a later
    block (a header line naming its command and commit) overrides an earlier one."""
    import re

    cells, commit, in_details = {}, "?", False
    for path in paths:
        for line in path.read_text().splitlines():
            if line.startswith("# python benchmarks/corpus_matrix.py"):
                found = re.search(r"commit (\w+)", line)
                commit, in_details = (found.group(1) if found else "?"), False
            elif line == "details:":
                in_details = True
            elif in_details and ": " in line and not line.startswith("#"):
                head, rest = line.split(": ", 1)
                name, _, axis = head.partition(" ")
                if axis in AXES and not rest.startswith("missing"):
                    cells[name, axis] = (rest.split(":", 1)[0], line, commit)
    return cells


def render_combined(cells: dict, sources: list[Path]) -> str:
    names = list(dict.fromkeys([n for n in corpus.ENTRIES] + [n for n, _ in cells]))
    lines = ["# combined by: python benchmarks/corpus_matrix.py --combine " + " ".join(map(str, sources))
             + f"  (on {time.strftime('%Y-%m-%d')} at commit {_head_commit()})",
             "# each cell as last run (its commit in the details); parity = losses within "
             f"{RTOL:g} relative of the one-rank job, 4 ranks, fp32, {STEPS} steps",
             f"{'model':<20}" + "".join(f"{axis:<15}" for axis in AXES)]
    counts: dict[str, int] = {}
    for name in names:
        row = [cells.get((name, a), ("missing",))[0] for a in AXES]
        for verdict in row:
            counts[verdict] = counts.get(verdict, 0) + 1
        lines.append(f"{name:<20}" + "".join(f"{v:<15}" for v in row))
    meaningful = sum(n for v, n in counts.items() if v not in ("n/a", "missing"))
    share = counts.get("parity", 0) / meaningful if meaningful else 0.0
    lines += ["", f"models {len(names)}; cells: " + ", ".join(f"{v} {n}" for v, n in sorted(counts.items())),
              f"parity in {counts.get('parity', 0)} of {meaningful} meaningful cells ({share:.0%})",
              "", "details (commit: line):"]
    lines += [f"{cells[n, a][2]}: {cells[n, a][1]}" for n in names for a in AXES if (n, a) in cells]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(corpus.ENTRIES), help="models to run")
    parser.add_argument("--axes", default=",".join(AXES), help=f"comma-separated, of {','.join(AXES)}")
    parser.add_argument("--work", type=Path, default=Path("/tmp/corpus_matrix"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "corpus_matrix.txt")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per command of a cell")
    parser.add_argument("--jobs", type=int, default=1, help="cells run at once")
    parser.add_argument("--reuse", action="store_true", help="keep finished cells' results from --work")
    parser.add_argument("--combine", nargs="+", type=Path, metavar="OUTPUT",
                        help="write one table from earlier outputs (later ones win) and exit")
    parser.add_argument("--cell", nargs=2, metavar=("NAME", "AXIS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.combine:
        text = render_combined(combined_cells(args.combine), args.combine)
        args.out.write_text(text)
        print(text)
        return
    if args.cell:
        name, axis = args.cell
        result = cell_outcome(name, axis, args.work, args.timeout)
        (args.work / name).mkdir(parents=True, exist_ok=True)
        (args.work / name / f"{axis}.json").write_text(json.dumps(result))
        return
    names = args.only or list(corpus.ENTRIES)
    axes = [a for a in args.axes.split(",") if a]
    unknown = set(axes) - set(AXES)
    if unknown:
        parser.error(f"unknown axes {sorted(unknown)}; choose from {','.join(AXES)}")
    results = {}
    todo = []
    for axis in axes:  # axis-major: the cheap dp cells (and each model's reference) first
        for name in names:
            saved = args.work / name / f"{axis}.json"
            if args.reuse and saved.exists():
                results[name, axis] = json.loads(saved.read_text())
            else:
                saved.unlink(missing_ok=True)
                todo.append((name, axis))

    def one(cell):
        result = run_cell_subprocess(*cell, args.work, args.timeout)
        print(f"{cell[0]:<20} {cell[1]:<10} {label(result):<15} {result['detail'][:150]}", flush=True)
        return cell, result

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for cell, result in pool.map(one, todo):
            results[cell] = result
    command = "python benchmarks/corpus_matrix.py " + " ".join(sys.argv[1:])
    text = render(names, axes, results, command.strip())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
