"""A plan as a DeepSpeed configuration (the ds_config.json of a generated job).

For users who train with DeepSpeed instead of autoplan.runtime. Key names and rules follow
DeepSpeed's configuration reference (deepspeedai/DeepSpeed, docs/_pages/config-json.md):

- train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * data-parallel
  GPUs ("Batch Size Related Parameters");
- zero_optimization.stage 0-3; offload_optimizer is "valid for ZeRO stage 1, 2, 3", offload_param
  is "valid only with stage 3";
- fp16.loss_scale 0 means dynamic loss scaling, starting at 2**initial_scale_power; bf16 needs
  no loss scaling and cannot be combined with fp16;
- gradient_clipping; optimizer {"type": "AdamW", "params"}; scheduler WarmupCosineLR
  (deepspeed/runtime/lr_schedules.py: total_num_steps, warmup_num_steps, warmup_type,
  warmup_min_ratio, cos_min_ratio).

What DeepSpeed's config cannot say (tensor/pipeline/context/expert parallelism, recomputation,
offload at a ZeRO stage that does not allow it) is listed by `ds_config_notes`.
"""

from __future__ import annotations

from typing import Any

from autoplan.plan import Plan

# DeepSpeed's documented defaults for dynamic fp16 loss scaling (config-json.md, "FP16 training
# options"): initial scale 2**16, raised after 1000 overflow-free steps, hysteresis 2, floor 1.
_FP16_DYNAMIC = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
_OFFLOAD_CPU = {"device": "cpu", "pin_memory": True}
# autoplan.runtime.lr_at decays the cosine to 10% of the peak learning rate.
_COS_MIN_RATIO = 0.1


def ds_config(plan: Plan) -> dict[str, Any]:
    """The DeepSpeed config for `plan`'s batch, ZeRO stage, offload, clipping, precision and AdamW."""
    opt = plan.optimizer
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.num_microbatches,
        "gradient_clipping": float(opt.get("grad_clip", 0.0) or 0.0),
        "zero_optimization": _zero_section(plan),
        "optimizer": {"type": "AdamW", "params": {
            "lr": float(opt.get("lr", 3e-4)), "betas": list(opt.get("betas", [0.9, 0.95])),
            "weight_decay": float(opt.get("weight_decay", 0.0))}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": int(opt.get("max_steps", 1000)),
            "warmup_num_steps": int(opt.get("warmup_steps", 0)),
            "warmup_type": "linear", "warmup_min_ratio": 0.0, "cos_min_ratio": _COS_MIN_RATIO}},
    }
    config.update(_precision_sections(plan.precision))
    return config


def zero_stage(plan: Plan) -> int:
    """The stage written: DeepSpeed's pipeline engine refuses ZeRO-2 and -3 (deepspeed/runtime/
    pipe/engine.py asserts stage < 2), so a pipelined plan gets ZeRO-1, the nearest it runs."""
    return min(plan.zero_stage, 1) if plan.pp > 1 else plan.zero_stage


def _zero_section(plan: Plan) -> dict[str, Any]:
    stage = zero_stage(plan)
    section: dict[str, Any] = {"stage": stage}
    if plan.offload in ("optimizer", "both") and stage >= 1:
        section["offload_optimizer"] = dict(_OFFLOAD_CPU)
    if plan.offload in ("params", "both") and stage == 3:
        section["offload_param"] = dict(_OFFLOAD_CPU)
    return section


def _precision_sections(precision: str) -> dict[str, Any]:
    if precision == "fp16":
        return {"fp16": dict(_FP16_DYNAMIC), "bf16": {"enabled": False}}
    if precision in ("bf16", "fp8"):  # fp8 in DeepSpeed goes through Transformer Engine in user code
        return {"fp16": {"enabled": False}, "bf16": {"enabled": True}}
    return {"fp16": {"enabled": False}, "bf16": {"enabled": False}}  # fp32


def ds_config_notes(plan: Plan) -> list[str]:
    """What of `plan` the DeepSpeed config does not express, one sentence each."""
    notes = []
    model_parallel = plan.tp * plan.pp * plan.cp
    if model_parallel > 1:
        notes.append(
            f"tp={plan.tp}, pp={plan.pp}, cp={plan.cp} are not DeepSpeed config keys: train_batch_size "
            f"assumes {plan.dp} data-parallel ranks, so the model code (e.g. Megatron-DeepSpeed) must "
            f"form the tensor/pipeline/sequence groups of the other {model_parallel}x.")
    if plan.ep > 1:
        notes.append(f"ep={plan.ep}: DeepSpeed sets expert parallelism in the model code "
                     f"(deepspeed.moe.layer.MoE(ep_size={plan.ep})), not in this file.")
    if plan.dp_replicate > 1:
        notes.append(f"dp_replicate={plan.dp_replicate} (HSDP) has no exact DeepSpeed equivalent; "
                     "ZeRO shards over all data-parallel ranks.")
    stage = zero_stage(plan)
    if stage != plan.zero_stage:
        notes.append(f"ZeRO-{plan.zero_stage} with pipeline parallelism: DeepSpeed's pipeline engine runs "
                     "ZeRO stage 0 or 1 only; stage 1 is written (gradients stay whole on each "
                     "data-parallel rank, more memory than the plan's estimate).")
    if plan.offload in ("optimizer", "both") and stage < 1:
        notes.append("the plan offloads the optimizer at ZeRO stage 0, which DeepSpeed does not "
                     "allow (offload_optimizer needs stage 1-3); offload_optimizer is left out.")
    if plan.offload in ("params", "both") and stage != 3:
        notes.append("the plan offloads parameters below ZeRO stage 3, which DeepSpeed does not "
                     "allow (offload_param needs stage 3); offload_param is left out.")
    if any(mode != "none" for mode in plan.recompute.values()):
        notes.append("activation recomputation is chosen per block in the model code "
                     "(deepspeed.checkpointing), not in this file; see plan.json `recompute`.")
    if plan.precision == "fp8":
        notes.append("fp8 is written as bf16: DeepSpeed runs fp8 matmuls through Transformer Engine "
                     "modules in the model code.")
    return notes
