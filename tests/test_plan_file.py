"""plan.json fields are checked on load (autoplan.plan_schema.field_problems), every wrong one named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoplan.plan import Plan, PlanFormatError

EXAMPLE = json.loads((Path(__file__).resolve().parents[1] / "generated" / "tiny-gpt-4xcpu"
                      / "plan.json").read_text())


@pytest.mark.parametrize("changes,message", [
    ({"zero_stage": 7}, "zero_stage must be 0, 1, 2 or 3, got 7"),
    ({"zero_stage": True}, "zero_stage must be 0, 1, 2 or 3, got True"),
    ({"recompute": "full"}, "recompute must map block paths"),
    ({"recompute": {"layers.0": "most"}}, "recompute must map block paths"),
    ({"dp": "4"}, "dp must be a positive integer, got '4'"),
    ({"micro_batch": 0}, "micro_batch must be a positive integer, got 0"),
    ({"world_size": 4_000_000, "dp": 4_000_000}, "world_size 4,000,000 is above autoplan's limit"),
    ({"precision": "int4"}, "precision must be one of"),
    ({"schedule": None}, "schedule must be one of"),
    ({"memory_headroom_gib": -1}, "memory_headroom_gib must be a number >= 0"),
    ({"stages": [["layers.0", 1]]}, "stages must be a list of lists"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr must be a finite number > 0"),
    ({"model": {"source": "web", "name": "x"}}, "model.source must be one of"),
])
def test_wrong_fields_are_named(changes, message):
    with pytest.raises(PlanFormatError, match=message.replace("(", r"\(").replace("{", r"\{")):
        Plan.from_dict({**EXAMPLE, **changes})


def test_every_wrong_field_is_reported_at_once():
    with pytest.raises(PlanFormatError) as exc:
        Plan.from_dict({**EXAMPLE, "zero_stage": 9, "offload": "disk", "tp": -1})
    assert all(name in str(exc.value) for name in ("zero_stage", "offload", "tp"))


def test_the_example_plan_loads():
    assert Plan.from_dict(EXAMPLE).world_size == 4
