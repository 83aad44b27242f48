"""The wheel holds every package and data file; the README quickstart matches .ci/run."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    command = next(line for line in ci if line.startswith("python3 -m venv"))
    assert command in (REPO / "README.md").read_text()


def test_every_package_is_listed_in_pyproject():
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "autoplan").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject packages: {sorted(found - listed)}"


@pytest.mark.slow
def test_wheel_contains_data_files(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(REPO)], check=True)
    wheel = next(tmp_path.glob("autoplan-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in (REPO / "cost_models").rglob("*.toml"):
        assert "autoplan/_cost_models/" + data.relative_to(REPO / "cost_models").as_posix() in names
    for data in (REPO / "cost_models" / "models").glob("*.json"):
        assert "autoplan/_cost_models/models/" + data.name in names
    for template in (REPO / "templates").glob("*.j2"):
        assert "autoplan/_templates/" + template.name in names
