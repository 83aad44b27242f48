"""The dry run's host process: spawned once and kept for the process's later dry runs, unless
what it was spawned with (working directory, environment, sys.path) has changed or it died."""

from __future__ import annotations

import os

import pytest

from autoplan.dryrun import host
from autoplan.errors import UserError


def _die() -> None:
    os._exit(9)


def test_later_dry_runs_reuse_the_host():
    first = host.run_in_host(os.getpid)
    assert first != os.getpid()
    assert host.run_in_host(os.getpid) == first


def test_a_changed_environment_or_directory_gets_a_fresh_host(monkeypatch, tmp_path):
    before = host.run_in_host(os.getpid)
    monkeypatch.setenv("AUTOPLAN_DATA_DIR", str(tmp_path))
    fresh = host.run_in_host(os.getpid)
    assert fresh != before
    assert host.run_in_host(os.getenv, "AUTOPLAN_DATA_DIR") == str(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert host.run_in_host(os.getcwd) == str(tmp_path)
    assert host.run_in_host(os.getpid) != fresh


def test_a_host_that_died_is_one_user_error_and_the_next_dry_run_starts_another():
    before = host.run_in_host(os.getpid)
    with pytest.raises(UserError, match="host process ended without a result"):
        host.run_in_host(_die)
    after = host.run_in_host(os.getpid)
    assert after not in (before, os.getpid())
