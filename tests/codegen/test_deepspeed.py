"""ds_config.json: DeepSpeed's documented key names and rules, from plans of every kind."""

from __future__ import annotations

import pytest

from autoplan.codegen.deepspeed import ds_config, ds_config_notes
from autoplan.config import ParallelConfig
from autoplan.plan import ModelRef, Plan

# Key names as documented in deepspeedai/DeepSpeed docs/_pages/config-json.md (top level,
# "ZeRO Optimizations", "FP16 training options", "BFLOAT16 training options") and the
# WarmupCosineLR signature in deepspeed/runtime/lr_schedules.py. Written out here, not
# imported from the code under test, so a misspelt key fails.
TOP_LEVEL = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "gradient_clipping", "zero_optimization", "optimizer", "scheduler", "fp16", "bf16"}
ZERO_KEYS = {"stage", "offload_optimizer", "offload_param"}
OFFLOAD_KEYS = {"device", "pin_memory"}
FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "min_loss_scale"}
COSINE_KEYS = {"total_num_steps", "warmup_num_steps", "warmup_type", "warmup_min_ratio",
               "cos_min_ratio"}


def make_plan(**changes) -> Plan:
    base = Plan(model=ModelRef("catalog", "tiny-gpt"), gpu="h100-sxm-80gb", world_size=16,
                gpus_per_node=8, parallel=ParallelConfig(global_batch=64, seq_len=128, dp=16, micro_batch=2))
    return base.with_(**changes)


def test_keys_are_deepspeeds():
    config = ds_config(make_plan(zero_stage=3, offload="both", precision="fp16"))
    assert set(config) <= TOP_LEVEL
    assert set(config["zero_optimization"]) <= ZERO_KEYS
    assert set(config["zero_optimization"]["offload_optimizer"]) == OFFLOAD_KEYS
    assert set(config["zero_optimization"]["offload_param"]) == OFFLOAD_KEYS
    assert set(config["fp16"]) == FP16_KEYS
    assert config["optimizer"]["type"] == "AdamW"
    assert config["scheduler"]["type"] == "WarmupCosineLR"
    assert set(config["scheduler"]["params"]) == COSINE_KEYS


@pytest.mark.parametrize("dp,micro,global_batch,tp", [(16, 2, 64, 1), (4, 1, 32, 2), (2, 4, 64, 4)])
def test_batch_identity(dp, micro, global_batch, tp):
    # DeepSpeed: train_batch_size = micro * accumulation * data-parallel GPUs
    plan = make_plan(dp=dp, tp=tp, pp=16 // (dp * tp), micro_batch=micro, global_batch=global_batch)
    config = ds_config(plan)
    assert config["train_batch_size"] == global_batch
    assert config["train_micro_batch_size_per_gpu"] == micro
    assert config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * dp \
        == config["train_batch_size"]


@pytest.mark.parametrize("stage,offload,has_opt,has_param", [
    (0, "none", False, False), (2, "none", False, False),
    (1, "optimizer", True, False), (2, "optimizer", True, False), (3, "both", True, True),
    (3, "params", False, True), (2, "params", False, False),  # offload_param needs stage 3
    (0, "optimizer", False, False),  # offload_optimizer needs stage >= 1
])
def test_zero_stage_and_offload(stage, offload, has_opt, has_param):
    plan = make_plan(zero_stage=stage, offload=offload)
    zero = ds_config(plan)["zero_optimization"]
    assert zero["stage"] == stage
    assert ("offload_optimizer" in zero) == has_opt
    assert ("offload_param" in zero) == has_param
    dropped = (offload in ("optimizer", "both") and not has_opt) or (offload in ("params", "both") and not has_param)
    assert any("left out" in note for note in ds_config_notes(plan)) == dropped


@pytest.mark.parametrize("precision,fp16,bf16", [("fp16", True, False), ("bf16", False, True),
                                                 ("fp8", False, True), ("fp32", False, False)])
def test_precision(precision, fp16, bf16):
    config = ds_config(make_plan(precision=precision))
    assert config["fp16"]["enabled"] is fp16 and config["bf16"]["enabled"] is bf16
    if fp16:
        assert config["fp16"]["loss_scale"] == 0  # 0 = dynamic loss scaling in DeepSpeed


def test_optimizer_and_clipping_follow_the_plan():
    opt = {"name": "adamw", "lr": 1e-3, "betas": [0.8, 0.99], "weight_decay": 0.05,
           "warmup_steps": 7, "max_steps": 70, "grad_clip": 0.5}
    config = ds_config(make_plan(optimizer=opt))
    assert config["gradient_clipping"] == 0.5
    assert config["optimizer"]["params"] == {"lr": 1e-3, "betas": [0.8, 0.99], "weight_decay": 0.05}
    params = config["scheduler"]["params"]
    assert (params["warmup_num_steps"], params["total_num_steps"]) == (7, 70)


def test_notes_name_what_deepspeed_config_cannot_say():
    plan = make_plan(dp=2, tp=2, pp=2, cp=2, ep=2, blocks=("layers.0",), recompute="full")
    notes = " ".join(ds_config_notes(plan))
    assert "tp=2" in notes and "ep=2" in notes and "recomputation" in notes
    assert ds_config_notes(make_plan()) == []
