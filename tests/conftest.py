"""Shared fixtures. Multi-rank launching lives in tests/runtime/conftest.py (one fixture)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Traced graphs are not kept on disk across tests (trace/store.py): a test that patches the
# tracer must see its patch, not a graph another test stored; tests/trace/test_store.py
# turns the cache on in a folder of its own.
os.environ["AUTOPLAN_CACHE"] = "0"

# Property tests draw the same examples on every run, so CI's verdict does not depend on the
# draw; cases that random exploration found are pinned with @example. No example database
# is written into the checkout.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("autoplan", derandomize=True, database=None)
_hypothesis_settings.load_profile("autoplan")


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def run_cli():
    """Run the autoplan CLI in-process: returns (exit_code, stdout, stderr)."""
    from click.testing import CliRunner

    from autoplan.cli import main

    def _run(*args: str) -> tuple[int, str, str]:
        runner = CliRunner()
        result = runner.invoke(_entry, list(args), catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr

    import click

    @click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @click.pass_context
    def _entry(ctx):
        main(ctx.args)

    return _run


def pytest_collection_modifyitems(config, items):
    """Multi-process files first, the one with the most such tests first: under
    `pytest -n 2 --dist loadfile` files are handed to workers in this order, so the long
    torchrun files start at once instead of leaving one worker busy at the end."""
    slow: dict = {}
    for item in items:
        if item.get_closest_marker("slow"):
            slow[item.path] = slow.get(item.path, 0) + 1
    items.sort(key=lambda item: -slow.get(item.path, 0))  # stable: file order kept otherwise
