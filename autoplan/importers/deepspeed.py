"""DeepSpeed ds_config.json -> ParallelConfig (keys as documented at deepspeed.ai/docs/config-json).

DeepSpeed's config holds the batch (train_batch_size = micro x gradient accumulation x dp),
ZeRO stage and offload, precision and activation checkpointing. Tensor parallelism appears
only as `tensor_parallel.autotp_size`, sequence parallelism as `sequence_parallel_size`
(Ulysses); the pipeline degree lives in the training script (PipelineModule), so pp = 1.
"auto" values (Hugging Face Trainer fills them in) count as not given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autoplan.config import ParallelConfig
from autoplan.errors import UserError
from autoplan.textfile import read_text
from autoplan.importers import ImportedConfig, check_batch, data_parallel, finish_seq_len, pick, positive_int

NEUTRAL = {  # no effect on step time or memory per GPU
    "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients",
    "gradient_predivide_factor", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "scheduler",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "checkpoint", "aio",
    "memory_breakdown", "autotuning", "nebula", "data_efficiency", "curriculum_learning", "seed",
    "timers", "sparse_gradients", "disable_allgather", "use_node_local_storage", "load_universal_checkpoint",
    "communication_data_type", "seq_parallel_communication_data_type", "compile", "graph_harvesting",
    "use_data_before_expert_parallelism", "zero_optimization", "fp16", "bf16", "bfloat16", "optimizer",
    "activation_checkpointing", "train_batch_size", "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps", "tensor_parallel", "sequence_parallel_size", "data_types",
}
ZERO_TUNING = {  # zero_optimization keys that tune buckets and overlap (assumed as autoplan does it)
    "stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params", "allgather_partitions",
    "allgather_bucket_size", "overlap_comm", "reduce_scatter", "reduce_bucket_size", "contiguous_gradients",
    "round_robin_gradients", "sub_group_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters",
    "legacy_stage1", "memory_efficient_linear", "prefetch_bucket_size", "param_persistence_threshold",
    "model_persistence_threshold", "max_live_parameters", "max_reuse_distance", "stage3_module_granularity_threshold",
    "use_multi_rank_bucket_allreduce", "log_trace_cache_warnings", "zeropp_loco_param",
}
ZERO_UNSUPPORTED = {
    "zero_hpz_partition_size": "ZeRO++ hierarchical partitioning (hpZ)",
    "zero_quantized_weights": "ZeRO++ quantized weight all-gather (qwZ)",
    "zero_quantized_gradients": "ZeRO++ quantized gradients (qgZ)",
    "mics_shard_size": "MiCS sharding groups", "mics_hierarchical_params_gather": "MiCS hierarchical gather",
    "offload_param_fraction": "partial parameter offload", "offload_optimizer_fraction": "partial optimizer offload",
}
UNSUPPORTED = {
    "amp": "NVIDIA Apex AMP (modelled as the fp16/bf16 setting only)",
    "elasticity": "elastic training: the estimate is for this GPU count",
    "compression_training": "compression-aware training (quantization / pruning)",
    "sparse_attention": "block-sparse attention: attention is modelled dense",
    "pipeline": "pipeline settings: the pipeline degree is in the training script (PipelineModule)",
    "fp8": "FP8 through DeepSpeed: no such documented key",
}


def read(value: str, *, num_gpus: int, global_batch: int | None, seq_len: int | None) -> ImportedConfig:
    path = Path(value)
    source = f"deepspeed: {path}"
    try:
        data = json.loads(read_text(path, "DeepSpeed config"))
    except json.JSONDecodeError as exc:
        raise UserError(f"DeepSpeed config {path} is not valid JSON (line {exc.lineno}: {exc.msg}); DeepSpeed "
                        "reads it with json.load too") from None
    if not isinstance(data, dict):
        raise UserError(f"DeepSpeed config {path} must be a JSON object of settings")
    notes: list[str] = []
    unsupported: list[str] = []
    get = lambda key: _given(data.get(key), key, notes)  # noqa: E731
    tp = positive_int(_given((data.get("tensor_parallel") or {}).get("autotp_size"), "autotp_size", notes) or 1,
                      "tensor_parallel.autotp_size", source)
    sp = positive_int(get("sequence_parallel_size") or 1, "sequence_parallel_size", source)
    if sp > 1:
        notes.append(f"sequence_parallel_size {sp} (DeepSpeed-Ulysses, all-to-all over heads) is modelled as "
                     "context parallelism of that degree")
    dp = data_parallel(num_gpus, tp, 1, sp, source)
    notes.append("the pipeline degree is not part of a ds_config (PipelineModule sets it): pp = 1")
    micro, gb = _batch(get, dp, global_batch, source, notes)
    zero, offload = _zero(data.get("zero_optimization") or {}, source, notes, unsupported)
    precision = _precision(data, notes)
    recompute = _activation_checkpointing(data.get("activation_checkpointing"), notes, unsupported)
    optimizer = (data.get("optimizer") or {}).get("type")
    if optimizer and str(optimizer).lower() not in ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"):
        unsupported.append(f"optimizer {optimizer}: optimizer state is modelled as Adam's")
    for key in sorted(data):
        if key in UNSUPPORTED:
            unsupported.append(f"{key}: {UNSUPPORTED[key]}")
        elif key not in NEUTRAL:
            unsupported.append(f"{key}: not a DeepSpeed config key autoplan knows; ignored in the estimate")
    config = ParallelConfig(global_batch=gb, seq_len=finish_seq_len(seq_len, notes), dp=dp, tp=tp, pp=1, cp=sp,
                            zero_stage=zero, offload=offload, micro_batch=micro, recompute=recompute,
                            precision=precision, sequence_parallel=tp > 1)
    return ImportedConfig(config=config, unsupported=unsupported, notes=notes, source=source, seq_len=seq_len)


def _given(value: Any, key: str, notes: list[str]) -> Any:
    if value == "auto":
        notes.append(f"{key} is \"auto\" (filled in by the Hugging Face Trainer at launch): treated as not given")
        return None
    return value


def _batch(get, dp: int, cli_global: int | None, source: str, notes: list[str]) -> tuple[int, int]:
    """(micro-batch, global batch) from any two of the three DeepSpeed batch keys."""
    total = get("train_batch_size")
    micro = get("train_micro_batch_size_per_gpu")
    gas = get("gradient_accumulation_steps")
    total = None if total is None else positive_int(total, "train_batch_size", source)
    micro = None if micro is None else positive_int(micro, "train_micro_batch_size_per_gpu", source)
    gas = None if gas is None else positive_int(gas, "gradient_accumulation_steps", source)
    if total is not None and micro is not None and gas is not None and total != micro * gas * dp:
        raise UserError(
            f"{source}: train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {gas} x data-parallel ranks {dp} = {micro * gas * dp}; DeepSpeed "
            f"rejects this too. Fix the batch keys, or give the GPU count the file was written for")
    if micro is None:
        if total is not None:
            gas = gas or 1
            if total % (gas * dp):
                raise UserError(f"{source}: train_batch_size {total} is not a multiple of gradient_accumulation_"
                                f"steps {gas} x data-parallel ranks {dp}; check --gpus")
            micro = total // (gas * dp)
        else:
            micro = 1
            notes.append("no micro-batch in the file: 1 per GPU assumed")
    if total is None:
        total = micro * (gas or 1) * dp
        if cli_global is None:
            notes.append(f"global batch = micro-batch {micro} x accumulation {gas or 1} x dp {dp} = {total}")
    total = pick(total, cli_global, "global batch", notes)
    check_batch(total, dp, micro, source)
    return micro, total


def _zero(z: dict[str, Any], source: str, notes: list[str], unsupported: list[str]) -> tuple[int, str]:
    if not isinstance(z, dict):
        raise UserError(f"{source}: zero_optimization must be an object")
    stage = z.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise UserError(f"{source}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    devices = {}
    for key, what in (("offload_optimizer", "optimizer"), ("offload_param", "params")):
        device = (z.get(key) or {}).get("device", "none") if isinstance(z.get(key), dict) else "none"
        if device not in ("none", None):
            devices[what] = device
            if device == "nvme":
                unsupported.append(f"zero_optimization.{key}.device nvme: modelled as CPU offload")
    if z.get("cpu_offload"):
        devices["optimizer"] = "cpu"
        notes.append("zero_optimization.cpu_offload (old spelling) = offload_optimizer to cpu")
    if "params" in devices and stage != 3:
        notes.append("offload_param works only with ZeRO stage 3 (DeepSpeed ignores it here)")
        devices.pop("params")
    offload = {frozenset(): "none", frozenset({"optimizer"}): "optimizer", frozenset({"params"}): "params",
               frozenset({"optimizer", "params"}): "both"}[frozenset(devices)]
    for key in sorted(z):
        if key in ZERO_UNSUPPORTED and z[key] not in (0, False, None, 1.0):
            unsupported.append(f"zero_optimization.{key}: {ZERO_UNSUPPORTED[key]}")
        elif key not in ZERO_TUNING and key not in ZERO_UNSUPPORTED:
            unsupported.append(f"zero_optimization.{key}: not a ZeRO option autoplan knows; ignored")
    tuned = sorted(k for k in z if k in ZERO_TUNING and k not in ("stage", "offload_optimizer", "offload_param"))
    if tuned:
        notes.append("ZeRO bucket/overlap settings taken as autoplan models them (overlapped, default buckets): "
                     + ", ".join(tuned))
    return int(stage), offload


def _precision(data: dict[str, Any], notes: list[str]) -> str:
    def enabled(key: str) -> bool | None:
        section = data.get(key)
        if not isinstance(section, dict):
            return None
        value = section.get("enabled", False)  # DeepSpeed's default for both sections
        return None if value == "auto" else bool(value)

    fp16, bf16 = enabled("fp16"), enabled("bf16") if "bf16" in data else enabled("bfloat16")
    if fp16 and bf16:
        raise UserError("the DeepSpeed config enables both fp16 and bf16; DeepSpeed accepts only one")
    if fp16:
        return "fp16"
    if bf16:
        return "bf16"
    if fp16 is None and bf16 is None and ("fp16" in data or "bf16" in data):
        notes.append("fp16/bf16 enabled are \"auto\": bf16 assumed")
        return "bf16"
    notes.append("neither fp16 nor bf16 enabled: DeepSpeed trains in fp32")
    return "fp32"


def _activation_checkpointing(section: Any, notes: list[str], unsupported: list[str]) -> str:
    if not section:
        notes.append("no activation_checkpointing section: no recomputation assumed (the model code may still "
                     "call a checkpoint function)")
        return "none"
    notes.append("activation_checkpointing configures the checkpoint function the model code calls; every "
                 "block is assumed checkpointed (full recomputation)")
    if section.get("cpu_checkpointing"):
        unsupported.append("activation_checkpointing.cpu_checkpointing: checkpoints offloaded to CPU")
    if section.get("partition_activations"):
        notes.append("activation_checkpointing.partition_activations: checkpoints split across TP ranks, as "
                     "sequence parallelism does")
    return "full"
