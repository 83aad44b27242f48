"""Fixtures of the model-source tests."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# the repo keeps its own copy of the published runs; the shared one is a fallback
PUBLISHED_RUNS_CANDIDATES = (
    REPO / "cost_models" / "validation" / "published_runs.json",
    REPO / "tests" / "data" / "published_runs.json",
    REPO / "validation" / "published_runs.json",
    REPO.parent / "shared" / "validation" / "published_runs.json",
)


@pytest.fixture(scope="session")
def published_runs() -> list[dict]:
    for path in PUBLISHED_RUNS_CANDIDATES:
        if path.is_file():
            return json.loads(path.read_text())["runs"]
    pytest.skip("no copy of published_runs.json found")


@pytest.fixture
def write_file(tmp_path):
    """write_file(name, text) -> path of a dedented file in a fresh directory."""

    def write(name: str, text: str) -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return str(path)

    return write
