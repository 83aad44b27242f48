"""Dry-run (`autoplan check`) vs cost-model memory per rank, for small variants of the tiny
plan (one a two-stage pipeline with ZeRO-2 over two micro-batches, one with CPU offload,
whose host memory is a row of its own), Llama 3.1 8B plans on 8 H100 at 8K tokens where
activations dominate (each made by `autoplan plan` with the axis or mode fixed: context
parallelism, selective and full recomputation, TP + SP over ZeRO-1 and ZeRO-3, CPU offload),
and the 8B, 70B and Mixtral-8x7B example plans (MoE routed balanced): each category's
dry-run maximum, the cost model's, their ratio, the category at the rank's worst moment,
and the wall time of each check. Then, per case and rank, each collective kind and dtype:
the dry run's bytes, the cost model's (autoplan.cost.volume, over the same window) and their
ratio; the tiny MoE plan with expert parallelism over two pipeline stages is a case here too.

    python benchmarks/check_vs_model.py [PLAN ...]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from autoplan.commands.check import check_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "generated" / "tiny-gpt-4xcpu" / "plan.json"
VARIANTS = {"zero0": {"zero_stage": 0}, "zero2": {"zero_stage": 2}, "zero3": {"zero_stage": 3},
            "zero2 offload": {"zero_stage": 2, "offload": "both"},
            "pp2 zero2": {"zero_stage": 2, "pp": 2, "dp": 2,
                          "stages": [["layers.0"], ["layers.1"]]},
            "pp2 zero0": {"zero_stage": 0, "pp": 2, "dp": 2,
                          "stages": [["layers.0"], ["layers.1"]]}}
EXAMPLES = ["llama3.1-8b-8xh100-sxm-80gb", "llama3.1-70b-64xh100-sxm-80gb",
            "mixtral-8x7b-32xh100-sxm-80gb"]
LLAMA_8B = ["llama3.1-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "32", "--seq-len", "8192"]
FIXED_8B = {"8B dp4 cp2": "cp=2 pp=1 tp=1",
            "8B dp8 selective": "recompute=selective pp=1 tp=1 cp=1 offload=none",
            "8B dp8 full mb2": "recompute=full pp=1 tp=1 cp=1 micro-batch=2 offload=none",
            "8B dp4 tp2 sp zero1": "tp=2 pp=1 cp=1 zero=1",
            "8B dp4 tp2 sp zero3": "tp=2 pp=1 cp=1 zero=3 micro-batch=1",
            "8B dp8 offload": "offload=both pp=1 cp=1"}
TINY_MOE = ["tiny-moe", "--gpu", "cpu", "--gpus", "4", "--global-batch", "8", "--seq-len", "64",
            "--fix", "ep=2", "--fix", "zero=0"]


def variant_files(directory: Path) -> list[tuple[str, str]]:
    data = json.loads(TINY.read_text())
    files = []
    for name, changes in VARIANTS.items():
        path = directory / f"tiny-{name.replace(' ', '-')}.json"
        path.write_text(json.dumps({**data, **changes}))
        files.append((f"tiny-gpt {name}", str(path)))
    return files


def planned_files(directory: Path) -> list[tuple[str, str]]:
    files = []
    for name, fixes in FIXED_8B.items():
        path = directory / f"{name.replace(' ', '-')}.json"
        args = [arg for fix in fixes.split() for arg in ("--fix", fix)]
        subprocess.run([sys.executable, "-m", "autoplan", "plan", *LLAMA_8B, *args, "-o", str(path)],
                       check=True, capture_output=True)
        files.append((name, str(path)))
    path = directory / "tiny-moe-ep2.json"
    subprocess.run([sys.executable, "-m", "autoplan", "plan", *TINY_MOE, "-o", str(path)],
                   check=True, capture_output=True)
    return files + [("tiny-moe ep2 zero0", str(path))]


def main(argv: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(p, p) for p in argv] or variant_files(Path(tmp)) + planned_files(Path(tmp)) + [
            (name, str(ROOT / "generated" / name)) for name in EXAMPLES]
        print(f"{'case':30} {'rank':>4} {'in flight':>9} {'category':18} {'dry GiB':>9} "
              f"{'model GiB':>9} {'ratio':>6} {'at peak':>9}  wall s")
        collectives = []
        for name, path in cases:
            report = check_plan(path, workers=2)
            for rank in report["ranks"]:
                for row in rank["memory"]:
                    print(_line(name, rank, row, report["wall_s"]))
                collectives += [_collective_line(name, rank, row) for row in rank["collectives"]]
            sys.stdout.flush()
        print(f"\n{'case':30} {'rank':>4} {'kind':15} {'dtype':9} {'count':>5} {'dry bytes':>14} "
              f"{'model bytes':>14} {'ratio':>6}")
        print("\n".join(collectives))


def _line(name: str, rank: dict, row: dict, wall_s: float) -> str:
    model = "" if row["model_gib"] is None else f"{row['model_gib']:.4f}"
    ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
    return (f"{name:30} {rank['rank']:>4} {rank['in_flight_microbatches']:9g} {row['category']:18} "
            f"{row['dry_run_gib']:9.4f} {model:>9} {ratio:>6} {row['at_peak_gib']:9.4f}  "
            f"{wall_s:.0f}")


def _collective_line(name: str, rank: dict, row: dict) -> str:
    model = "" if row["model_bytes"] is None else f"{row['model_bytes']:.0f}"
    ratio = "" if row["ratio"] is None else f"{row['ratio']:.3f}"
    return (f"{name:30} {rank['rank']:>4} {row['kind']:15} {row['dtype']:9} {row['count']:5d} "
            f"{row['bytes']:14d} {model:>14} {ratio:>6}")


if __name__ == "__main__":
    main(sys.argv[1:])
