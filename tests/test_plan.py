"""Plan files: the per-block-class TP style table, and version-1 files still read."""

from __future__ import annotations

import pytest

from autoplan.plan import FORMAT_VERSION, Plan, PlanFormatError

BASE = {"model": {"source": "catalog", "name": "tiny-llama"}, "gpu": "cpu", "world_size": 2,
        "gpus_per_node": 2, "global_batch": 4, "seq_len": 16, "tp": 2}


def test_version_1_flat_styles_read_as_model_level_entries():
    flat = {"layers.0.self_attn.q_proj": "colwise", "lm_head": "vocab_head"}
    plan = Plan.from_dict(dict(BASE, format_version=1, tp_styles=flat))
    assert plan.tp_styles == {"": flat}
    assert plan.format_version == FORMAT_VERSION == 2


def test_version_2_table_round_trips():
    table = {"": {"lm_head": "vocab_head"}, "layers.*": {"mlp.down_proj": "rowwise"}}
    plan = Plan.from_dict(dict(BASE, format_version=2, tp_styles=table))
    assert Plan.from_dict(plan.to_dict()).tp_styles == table


def test_version_2_flat_styles_are_a_format_error():
    with pytest.raises(PlanFormatError, match="tp_styles"):
        Plan.from_dict(dict(BASE, format_version=2, tp_styles={"lm_head": "vocab_head"}))
