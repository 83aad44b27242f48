"""Dry-run (`autoplan check`) vs cost-model memory per rank, for the example plans and small
variants of the tiny one: the ratio per category and the wall time of each check.

    python benchmarks/check_vs_model.py [PLAN ...]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from autoplan.commands.check import check_plan

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "generated" / "tiny-gpt-4xcpu" / "plan.json"
VARIANTS = {"zero0": {"zero_stage": 0}, "zero2": {"zero_stage": 2}, "zero3": {"zero_stage": 3}}


def variant_files(directory: Path) -> list[tuple[str, str]]:
    data = json.loads(TINY.read_text())
    files = []
    for name, changes in VARIANTS.items():
        path = directory / f"tiny-{name}.json"
        path.write_text(json.dumps({**data, **changes}))
        files.append((f"tiny-gpt {name}", str(path)))
    return files


def main(argv: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(p, p) for p in argv] or variant_files(Path(tmp))
        print(f"{'case':28} {'rank':>4} {'category':14} {'dry GiB':>9} {'model GiB':>9} {'ratio':>6}  wall s")
        for name, path in cases:
            report = check_plan(path, workers=2)
            for rank in report["ranks"]:
                for row in rank["memory"]:
                    model = "" if row["model_gib"] is None else f"{row['model_gib']:.4f}"
                    ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
                    print(f"{name:28} {rank['rank']:>4} {row['category']:14} {row['dry_run_gib']:9.4f} "
                          f"{model:>9} {ratio:>6}  {report['wall_s']:.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
