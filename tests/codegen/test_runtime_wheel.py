"""The wheel a job's cloud nodes install (autoplan/codegen/runtime_wheel.py): installable by path
with --no-deps, enough for the generated train.py on its own, none of the planner inside, the
same bytes for the same sources; and no generated file installs a package by a bare name."""

from __future__ import annotations

import base64
import hashlib
import re
import shlex
import subprocess
import sys
import zipfile
from io import BytesIO
from pathlib import Path

import pytest

from autoplan.codegen.runtime_wheel import runtime_wheel, wheel_name
from codegen_helpers import TINY, generate

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install pyyaml)")
PLANNER_PARTS = ("solve", "cost", "trace", "codegen", "commands", "report", "dryrun", "hardware",
                 "importers", "validate", "calibrate", "cli.py", "planfile.py")


@pytest.fixture(scope="module")
def cloud_job(tmp_path_factory) -> Path:
    """tiny-gpt for 1 CPU rank, with both cloud launch files."""
    out = tmp_path_factory.mktemp("cloud") / "job"
    code, stdout, stderr = generate("tiny-gpt", *TINY, "--gpus", "1", "--launcher", "skypilot",
                                    "--launcher", "k8s", "-o", str(out))
    assert code == 0, stdout + stderr
    return out


def test_wheel_is_deterministic_and_records_its_files():
    data = runtime_wheel()
    assert data == runtime_wheel()
    with zipfile.ZipFile(BytesIO(data)) as archive:
        names = archive.namelist()
        record = archive.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
        for line in record.splitlines():
            name, digest, size = line.rsplit(",", 2)
            if not digest:
                continue
            body = archive.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
            assert (digest, int(size)) == (f"sha256={want}", len(body)), name
    assert "autoplan/runtime/loop.py" in names and "autoplan/_cost_models/models/tiny-gpt.json" in names
    shipped = {name.split("/")[1] for name in names if name.startswith("autoplan/")}
    assert not shipped & set(PLANNER_PARTS), "the nodes' wheel holds planner code"


def test_train_py_runs_from_the_wheel_alone(cloud_job, tmp_path):
    """pip installs the wheel by path without dependencies; train.py then trains with autoplan
    imported from that install (not from this checkout)."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(site), str(cloud_job / wheel_name())], check=True, timeout=120)
    script = (f"import sys, runpy, autoplan; assert autoplan.__file__.startswith({str(site)!r}), "
              f"autoplan.__file__; sys.argv = ['train.py', '--steps', '2', '--run-dir', {str(tmp_path / 'run')!r}]; "
              f"runpy.run_path({str(cloud_job / 'train.py')!r}, run_name='__main__')")
    from multirank import run_killable

    done = run_killable([sys.executable, "-c", script], timeout=180, cwd=tmp_path,
                        env={"PYTHONPATH": str(site)}, unset=("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def _pip_specs(command: str, env: dict[str, str]) -> list[str]:
    """The requirement arguments of every `pip install` in a shell text, variables expanded."""
    specs = []
    for match in re.finditer(r"pip3? install ([^\n&;|]*)", command):
        words = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), m.group(0)), match.group(1)))
        specs += [w for w in words if not w.startswith("-")]
    return specs


def _is_pinned_or_path(spec: str) -> bool:
    return spec.startswith(("./", "/")) or re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.+-]*", spec) is not None


def test_no_generated_file_installs_a_bare_name(cloud_job):
    sky = yaml.safe_load((cloud_job / "sky.yaml").read_text())
    found = _pip_specs(sky["setup"] + "\n" + sky["run"], {k: str(v) for k, v in sky["envs"].items()})
    job = yaml.safe_load((cloud_job / "pytorchjob.yaml").read_text())
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = spec["template"]["spec"]["containers"]
        env = {item["name"]: item["value"] for item in container["env"]}
        found += _pip_specs(container["args"][0], env)
    for name in ("launch.sh", "slurm.sbatch", "README.md", "train.py"):
        found += _pip_specs((cloud_job / name).read_text(), {})
    assert f"./{wheel_name()}" in found and any(s.startswith("torch==") for s in found)
    assert [s for s in found if not _is_pinned_or_path(s)] == []
    assert (cloud_job / wheel_name()).is_file()


@pytest.mark.parametrize("spec,ok", [("autoplan", False), ("torch>=2.6", False), ("torch==2.13.0", True),
                                     ("./autoplan_runtime-0.1.0-py3-none-any.whl", True)])
def test_the_bare_name_rule_itself(spec, ok):
    assert _is_pinned_or_path(spec) is ok
