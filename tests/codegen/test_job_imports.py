"""A training node needs torch and autoplan's runtime only: the generated train.py of every
committed example, loaded and asked to build its model, imports none of the planner's parts
(trace, cost, solve, codegen, report, hardware data) nor their dependencies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from autoplan.codegen.runtime_wheel import JOB_MODULES, JOB_PACKAGES

REPO = Path(__file__).resolve().parents[2]
# what a job may import from autoplan: what the wheel its cloud nodes install ships
JOB_PARTS = set(JOB_MODULES) | set(JOB_PACKAGES)
PLANNER_DEPENDENCIES = {"ortools", "networkx", "jinja2", "rich", "click", "hypothesis"}

_PROBE = """
import json, runpy, sys, torch
for path in sys.argv[1:]:
    namespace = runpy.run_path(path, run_name="not_main")
    with torch.device("meta"):
        namespace["build_model"]()
print(json.dumps(sorted(sys.modules)))
"""


def test_generated_jobs_import_only_the_runtime():
    jobs = sorted(str(p) for p in (REPO / "generated").glob("*/train.py"))
    assert len(jobs) >= 4
    out = subprocess.run([sys.executable, "-c", _PROBE, *jobs], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    modules = json.loads(out.splitlines()[-1])
    planner = sorted({m for m in modules if m.startswith("autoplan.")
                      and m.split(".")[1] not in JOB_PARTS})
    foreign = sorted({m.split(".")[0] for m in modules} & PLANNER_DEPENDENCIES)
    assert any(m.startswith("autoplan.runtime") for m in modules)  # the probe saw the job's imports
    assert planner == [] and foreign == [], (planner, foreign)
