"""`autoplan check` dry-runs a plan on the runtime with fake tensors (one process, fake group).

Collective bytes are checked against numbers computed by hand from the model's parameters:
ZeRO-0 all-reduces every fp32 gradient once; ZeRO-3 (FSDP2) reduce-scatters every fp32
gradient once and all-gathers every bf16 parameter in the forward and again the blocks'
in the backward (the root module keeps its parameters gathered after the forward).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from autoplan.cli import cli
from autoplan.commands.check import check_plan
from autoplan.models.sources import build_from_ref
from autoplan.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "generated" / "tiny-gpt-4xcpu" / "plan.json"


def _plan_file(tmp_path: Path, **changes) -> str:
    data = json.loads(TINY.read_text())
    data.update(changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


def _param_counts() -> tuple[int, int]:
    """(all parameters, parameters inside the blocks) of the tiny model."""
    model = build_from_ref(Plan.load(str(TINY)).model, verify=False)
    named = dict(model.named_parameters())
    return sum(p.numel() for p in named.values()), \
        sum(p.numel() for name, p in named.items() if name.startswith("layers."))


def _bytes(rank: dict, kind: str, dtype: str) -> int:
    return sum(r["bytes"] for r in rank["collectives"] if (r["kind"], r["dtype"]) == (kind, dtype))


@pytest.fixture(scope="module")
def counts():
    return _param_counts()


def test_zero0_all_reduces_every_fp32_gradient_once(tmp_path, counts):
    report = check_plan(_plan_file(tmp_path, zero_stage=0), workers=1)
    rank = report["ranks"][0]
    assert _bytes(rank, "all_reduce", "float32") == 4 * counts[0]
    categories = {row["category"]: row for row in rank["memory"]}
    assert categories["parameters"]["dry_run_gib"] * 2**30 == pytest.approx(4 * counts[0])
    assert categories["optimizer"]["dry_run_gib"] > categories["parameters"]["dry_run_gib"]
    assert categories["activations"]["dry_run_gib"] > 0
    assert report["fits"] and report["spare_gib"] > 0


def test_zero3_gathers_parameters_and_scatters_gradients(tmp_path, counts):
    total, blocks = counts
    rank = check_plan(_plan_file(tmp_path, zero_stage=3), workers=1)["ranks"][0]
    assert _bytes(rank, "reduce_scatter", "float32") == 4 * total
    assert _bytes(rank, "all_gather", "bfloat16") == 2 * total + 2 * blocks
    assert not _bytes(rank, "all_reduce", "float32")


def test_command_prints_the_comparison_and_json(tmp_path):
    path = _plan_file(tmp_path, zero_stage=2)
    text = CliRunner().invoke(cli, ["check", path])
    assert text.exit_code == 0, text.output
    assert "dry run" in text.output and "cost model" in text.output and "this job fits" in text.output
    out = CliRunner().invoke(cli, ["check", path, "--json"])
    report = json.loads(out.output)
    assert {row["category"] for row in report["ranks"][0]["memory"]} >= {
        "parameters", "gradients", "optimizer", "activations", "total at peak"}
    assert all(row["model_gib"] is not None for row in report["ranks"][0]["memory"][:4])
