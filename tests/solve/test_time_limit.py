"""A search the time limit stops says so: FEASIBLE, how many configurations it searched of how
many, on the terminal and in the JSON; a search that finishes says it searched them all."""

from __future__ import annotations

import json
import importlib

import pytest

ARGS = ["plan", "tiny-gpt", "--gpu", "cpu", "--gpus", "4", "--global-batch", "8", "--seq-len", "64"]


class StoppedClock:
    """perf_counter for the search: 0 s at its start and at its first family, then past any
    limit, so that the time limit stops it after one family, whatever the machine's speed."""

    def __init__(self):
        self.calls = 0

    def perf_counter(self) -> float:
        self.calls += 1
        return 0.0 if self.calls <= 2 else 1e6


@pytest.fixture
def stopped_search(monkeypatch):
    search_module = importlib.import_module("autoplan.solve.search")
    monkeypatch.setattr(search_module, "time", StoppedClock())
    # every family within the band: the search would visit them all but for the time limit
    monkeypatch.setattr("autoplan.solve.preference.equivalence_band", lambda: 10.0)


def test_a_time_limited_search_says_how_far_it_went_in_json(run_cli, stopped_search):
    code, out, err = run_cli(*ARGS, "--json")
    assert code == 0, err
    data = json.loads(out)
    search = data["search"]
    assert search["status"] == "FEASIBLE" and search["time_limited"] is True
    assert 0 < search["searched"] < search["total"], search
    assert any(f"searched {search['searched']} of {search['total']} configurations" in note
               and "the best found is shown" in note for note in data["solver"]["notes"])


def test_a_time_limited_search_says_so_on_the_terminal(run_cli, stopped_search):
    code, out, err = run_cli(*ARGS)
    text = " ".join(out.split())
    assert code == 0, err
    assert "FEASIBLE" in text and "the best found is shown" in text
    assert "time limit stopped the search" in text


def test_a_finished_search_searched_every_configuration(run_cli):
    code, out, err = run_cli(*ARGS, "--json")
    assert code == 0, err
    search = json.loads(out)["search"]
    assert search["time_limited"] is False and search["searched"] == search["total"] > 1
    assert search["status"] == "OPTIMAL"
