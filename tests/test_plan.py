"""Plan files: the per-block-class TP style table, recompute runs, and version-1 and -2 files
still read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoplan.config import ParallelConfig
from autoplan.plan import FORMAT_VERSION, ModelRef, Plan, PlanFormatError, expand_runs, recompute_runs

V2_FILE = Path(__file__).resolve().parent / "data" / "plan_v2_llama3.1-70b.json"  # written by version 2

BASE = {"model": {"source": "catalog", "name": "tiny-llama"}, "gpu": "cpu", "world_size": 2,
        "gpus_per_node": 2, "global_batch": 4, "seq_len": 16, "tp": 2}


def test_version_1_flat_styles_read_as_model_level_entries():
    flat = {"layers.0.self_attn.q_proj": "colwise", "lm_head": "vocab_head"}
    plan = Plan.from_dict(dict(BASE, format_version=1, tp_styles=flat))
    assert plan.tp_styles == {"": flat}
    assert plan.format_version == FORMAT_VERSION == 3


def test_version_2_table_round_trips():
    table = {"": {"lm_head": "vocab_head"}, "layers.*": {"mlp.down_proj": "rowwise"}}
    plan = Plan.from_dict(dict(BASE, format_version=2, tp_styles=table))
    assert Plan.from_dict(plan.to_dict()).tp_styles == table


def test_version_2_flat_styles_are_a_format_error():
    with pytest.raises(PlanFormatError, match="tp_styles"):
        Plan.from_dict(dict(BASE, format_version=2, tp_styles={"lm_head": "vocab_head"}))


def test_version_2_file_reads_with_its_per_path_recompute_and_writes_runs():
    data = json.loads(V2_FILE.read_text())
    plan = Plan.from_dict(data)
    assert plan.recompute == data["recompute"] and plan.stages == data["stages"]
    assert (plan.dp, plan.tp, plan.pp, plan.zero_stage) == (4, 4, 4, 2)
    assert plan.parallel.stage_layers == (19, 20, 21, 20)
    assert plan.parallel.layer_recompute[:6] == ("full",) * 5 + ("selective",)
    written = plan.to_dict()
    assert written["recompute"] == {"layers.0-4": "full", "layers.5-17": "selective", "layers.18": "none",
                                    "layers.19-43": "selective", "layers.44-79": "none"}
    assert written["format_version"] == 3
    # every other key is the version-2 file's, in its order, and `compile` (newer than the
    # file) with its default
    assert written.pop("compile") is False and list(written) == list(data)
    assert {k: v for k, v in written.items() if k not in ("recompute", "format_version")} == \
        {k: v for k, v in data.items() if k not in ("recompute", "format_version")}
    assert Plan.from_dict(written) == plan


def test_version_2_keys_that_look_like_runs_are_paths():
    data = dict(BASE, tp=1, world_size=1, format_version=2, recompute={"blocks.0-1": "full"})
    assert Plan.from_dict(data).recompute == {"blocks.0-1": "full"}


@pytest.mark.parametrize("per_block,runs", [
    ({}, {}),
    ({"layers.0": "full"}, {"layers.0": "full"}),
    ({"0": "full", "1": "full", "2": "none"}, {"0-1": "full", "2": "none"}),
    ({"a.layers.0": "none", "a.layers.1": "none", "b.layers.2": "none"}, {"a.layers.0-1": "none", "b.layers.2": "none"}),
    ({"layers.1": "full", "layers.3": "full"}, {"layers.1": "full", "layers.3": "full"}),  # not consecutive
    ({"embed": "full", "layers.0": "full", "layers.01": "full"}, {"embed": "full", "layers.0": "full", "layers.01": "full"}),
])
def test_recompute_runs_join_consecutive_blocks_of_one_mode(per_block, runs):
    assert recompute_runs(per_block) == runs
    assert expand_runs(runs) == per_block


@pytest.mark.parametrize("runs,message", [
    ({"layers.4-2": "full"}, "must go from a lower block index"),
    ({"layers.0-2": "full", "layers.2": "none"}, "names block 'layers.2' twice"),
])
def test_bad_recompute_runs_are_format_errors(runs, message):
    with pytest.raises(PlanFormatError, match=message):
        expand_runs(runs)


def test_recompute_outside_the_stages_is_a_format_error():
    data = dict(BASE, tp=1, world_size=1, format_version=3, stages=[["layers.0"]], recompute={"layers.1": "full"})
    with pytest.raises(PlanFormatError, match="recompute names blocks no stage lists"):
        Plan.from_dict(data)


def test_plan_degrees_are_its_configs():
    config = ParallelConfig(global_batch=8, seq_len=16, dp=2, tp=2, layer_recompute=("full", "none"),
                            stage_layers=(2,))
    plan = Plan(model=ModelRef("catalog", "tiny-gpt"), gpu="cpu", world_size=4, gpus_per_node=4,
                parallel=config, blocks=("layers.0", "layers.1"))
    assert (plan.dp, plan.tp, plan.global_batch, plan.num_microbatches) == (2, 2, 8, 4)
    assert plan.stages == [["layers.0", "layers.1"]]
    assert plan.recompute == {"layers.0": "full", "layers.1": "none"}
    assert plan.with_(dp=1, world_size=2).parallel == config.with_(dp=1)
    flat = plan.to_dict()
    assert "parallel" not in flat and "blocks" not in flat and flat["dp"] == 2
    assert Plan.from_dict(flat) == plan
