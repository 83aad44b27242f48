"""torchtitan job .toml -> ParallelConfig (sections and keys of torchtitan/config/job_config.py).

Read: [parallelism] (data_parallel_replicate/shard_degree, tensor/pipeline/context/expert
degrees, pipeline schedule and micro-batch), [training] (local_batch_size, global_batch_size,
seq_len, mixed_precision_param, enable_cpu_offload), [activation_checkpoint] (mode,
selective_ac_option) and float8 in [model].converters. Defaults are torchtitan's where a key
is absent (shard degree -1 = the ranks left over, AC selective every 2nd block).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from autoplan.config import FLOAT8_RECIPES, ParallelConfig
from autoplan.errors import UserError
from autoplan.textfile import read_text
from autoplan.importers import (ImportedConfig, check_batch, check_ep, data_parallel, finish_seq_len, pick,
                                positive_int)

NEUTRAL_SECTIONS = {"job", "profiling", "metrics", "checkpoint", "comm", "validation", "memory_estimation",
                    "experimental", "lr_scheduler", "compile", "float8", "mx", "quantize", "fault_tolerance"}
KNOWN = {
    "model": {"name", "flavor", "tokenizer_path", "hf_assets_path", "converters", "print_after_conversion"},
    "optimizer": {"name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation", "early_step_in_backward"},
    "training": {"dataset", "dataset_path", "local_batch_size", "batch_size", "global_batch_size", "seq_len",
                 "max_norm", "steps", "enable_cpu_offload", "mixed_precision_param", "mixed_precision_reduce",
                 "compile", "gc_freq", "gc_debug", "seed", "deterministic", "dtype", "warmup_steps",
                 "data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                 "disable_cuda_graphs"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "enable_sequence_parallel", "disable_loss_parallel", "enable_async_tensor_parallel",
                    "pipeline_parallel_degree", "pipeline_parallel_split_points", "pipeline_parallel_layers_per_stage",
                    "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                    "context_parallel_degree", "context_parallel_rotate_method", "expert_parallel_degree",
                    "expert_tensor_parallel_degree", "enable_compiled_autograd", "module_fqns_per_model_part"},
    "activation_checkpoint": {"mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns",
                              "early_stop", "memory_budget", "visualize_memory_budget_pareto"},
}
SCHEDULES = {  # torch.distributed.pipelining schedule name -> (autoplan schedule, stages per rank, exact?)
    "gpipe": ("gpipe", 1, True), "1f1b": ("1f1b", 1, True), "interleaved1f1b": ("interleaved-1f1b", 2, True),
    "loopedbfs": ("interleaved-1f1b", 2, False), "interleavedzerobubble": ("zero-bubble", 2, True),
    "zbvzerobubble": ("zero-bubble", 2, True), "dualpipev": ("zero-bubble", 2, False),
}


def read(value: str, *, num_gpus: int, global_batch: int | None, seq_len: int | None) -> ImportedConfig:
    path = Path(value)
    source = f"torchtitan: {path}"
    try:
        data = tomllib.loads(read_text(path, "torchtitan config (the job .toml you pass as --job.config_file)"))
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"torchtitan config {path} is not valid TOML ({exc})") from None
    notes: list[str] = []
    unsupported: list[str] = []
    training = _section(data, "training", source)
    par = dict(_section(data, "parallelism", source))
    for key in ("data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree"):
        if key in training and key not in par:  # torchtitan before the [parallelism] section
            par[key] = training[key]
            notes.append(f"[training] {key} read as [parallelism] {key} (older torchtitan layout)")
    deg = lambda key: positive_int(par.get(key, 1), key, source)  # noqa: E731
    tp, pp, cp, ep = deg("tensor_parallel_degree"), deg("pipeline_parallel_degree"), deg("context_parallel_degree"), \
        deg("expert_parallel_degree")
    replicate = deg("data_parallel_replicate_degree")
    shard = par.get("data_parallel_shard_degree", -1)
    if shard == -1:
        rest = data_parallel(num_gpus, tp * replicate, pp, cp, source)
        shard = rest
        notes.append(f"data_parallel_shard_degree -1: the {shard} ranks left over")
    shard = positive_int(shard, "data_parallel_shard_degree", source)
    dp = data_parallel(num_gpus, tp, pp, cp, source, dp=replicate * shard)
    check_ep(ep, dp, cp, tp, source)
    if positive_int(par.get("expert_tensor_parallel_degree", 1), "expert_tensor_parallel_degree", source) != 1:
        unsupported.append("parallelism.expert_tensor_parallel_degree > 1: experts are modelled with expert-TP 1")
    zero = _zero(shard, replicate, par.get("fsdp_reshard_after_forward", "default"), pp, notes)
    micro, gb = _batch(training, par, dp, pp, global_batch, source, notes)
    schedule, vpp, per_stage = _schedule(par, pp, notes, unsupported)
    stage_layers = _model_parts(par.get("module_fqns_per_model_part"), pp, source)
    if stage_layers is not None:
        vpp, per_stage = len(stage_layers) // pp, None
    recompute, every = _ac(data.get("activation_checkpoint"), notes)
    precision = _precision(data, training, notes, unsupported)
    recipe, all_gather = _float8(data, precision, zero, source, notes, unsupported)
    offload = "both" if training.get("enable_cpu_offload") else "none"
    compiled = _compiles_model(data, training)
    if offload != "none":
        notes.append("training.enable_cpu_offload: FSDP offloads parameters, gradients and optimizer state")
    _unknown(data, notes, unsupported)
    seq = pick(training.get("seq_len"), seq_len, "sequence length", notes)
    if seq is None:
        seq = 2048
        notes.append("no training.seq_len: torchtitan's default 2048")
    config = ParallelConfig(
        global_batch=gb, seq_len=finish_seq_len(seq, notes), dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=zero,
        offload=offload, micro_batch=micro, recompute=recompute if every is None else "full", schedule=schedule,
        vpp=vpp, precision=precision, sequence_parallel=tp > 1 and bool(par.get("enable_sequence_parallel", True)),
        dp_replicate=replicate if shard > 1 else 1, stage_layers=stage_layers,
        compile=compiled, async_tp=_async_tp(data, par, tp, compiled, notes),
        float8_recipe=recipe, float8_all_gather=all_gather)
    if every is not None:
        notes.append(f"selective_ac_option {every}: every {every}-th block fully recomputed (placed per stage "
                     "once the model's block count is known; until then every block)")
    return ImportedConfig(config=config, unsupported=unsupported, notes=notes, source=source, seq_len=seq,
                          layers_per_virtual_stage=per_stage, recompute_every=every)


def _compiles_model(data: dict[str, Any], training: dict[str, Any]) -> bool:
    """[compile] enable with "model" among its components (torchtitan's default components are
    model and loss), or the older [training] compile flag."""
    section = data.get("compile", {})
    if isinstance(section, dict) and section.get("enable"):
        return "model" in section.get("components", ["model", "loss"])
    return training.get("compile") is True


def _async_tp(data: dict[str, Any], par: dict[str, Any], tp: int, compiled: bool, notes: list[str]) -> bool:
    """[compile] enable_async_tensor_parallel (torchtitan 0.3; [parallelism] before it), which
    torchtitan applies only to a compiled model with a TP mesh."""
    section = data.get("compile", {})
    asked = (isinstance(section, dict) and section.get("enable_async_tensor_parallel") is True) \
        or par.get("enable_async_tensor_parallel") is True
    if asked and not (tp > 1 and compiled):
        notes.append("enable_async_tensor_parallel without tp > 1 and a compiled model: not applied")
        return False
    return asked


def _section(data: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    section = data.get(name, {})
    if not isinstance(section, dict):
        raise UserError(f"{source}: [{name}] must be a table")
    return section


def _zero(shard: int, replicate: int, reshard: str, pp: int, notes: list[str]) -> int:
    if shard == 1:
        if replicate > 1:
            notes.append("data_parallel_shard_degree 1: DDP (replicated parameters, ZeRO-0)")
        return 0
    # torchtitan's "default" policy keeps the parameters gathered after the forward under PP
    # (reshard_after_forward = not pp_enabled, models/llama3/infra/parallelize.py apply_fsdp)
    if reshard == "never" or (reshard == "default" and pp > 1):
        notes.append(f"fsdp_reshard_after_forward {reshard}{' with PP' if reshard == 'default' else ''}: "
                     "parameters stay gathered between forward and backward (modelled as ZeRO-2)")
        return 2
    notes.append(f"FSDP2 over {shard} ranks{f', HSDP with {replicate} replicas' if replicate > 1 else ''}: ZeRO-3")
    return 3


def _batch(training, par, dp, pp, cli_global, source, notes) -> tuple[int, int]:
    local = training.get("local_batch_size", training.get("batch_size"))
    if local is None:
        local = 8
        notes.append("no training.local_batch_size: torchtitan's default 8")
    local = positive_int(local, "training.local_batch_size", source)
    gb = training.get("global_batch_size", -1)
    gb = local * dp if gb in (-1, None) else positive_int(gb, "training.global_batch_size", source)
    if gb % (local * dp):
        raise UserError(f"{source}: global_batch_size {gb} is not a multiple of local_batch_size {local} x dp {dp}; "
                        "torchtitan needs whole gradient-accumulation steps")
    micro = local
    if pp > 1:
        micro = positive_int(par.get("pipeline_parallel_microbatch_size", 1), "pipeline_parallel_microbatch_size",
                             source)
        if local % micro:
            raise UserError(f"{source}: local_batch_size {local} is not a multiple of "
                            f"pipeline_parallel_microbatch_size {micro}")
    gb = pick(gb, cli_global, "global batch", notes)
    check_batch(gb, dp, micro, source)
    return micro, gb


def _schedule(par, pp, notes, unsupported) -> tuple[str, int, int | None]:
    """(schedule, vpp, layers per virtual stage to resolve against the model)."""
    if pp == 1:
        return "1f1b", 1, None
    name = str(par.get("pipeline_parallel_schedule", "1F1B"))
    key = name.lower().replace("_", "").replace("-", "")
    if key not in SCHEDULES:
        raise UserError(f"unknown pipeline_parallel_schedule {name!r}; torchtitan accepts "
                        "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV")
    schedule, stages, exact = SCHEDULES[key]
    if not exact:
        unsupported.append(f"pipeline_parallel_schedule {name}: modelled as {schedule}")
    if par.get("pipeline_parallel_schedule_csv"):
        unsupported.append("pipeline_parallel_schedule_csv: a custom schedule is modelled as " + schedule)
    if par.get("pipeline_parallel_split_points"):
        unsupported.append("pipeline_parallel_split_points: explicit split points; stages are modelled as even")
    per_stage = par.get("pipeline_parallel_layers_per_stage")
    if key == "zbvzerobubble":
        notes.append(f"{name}: zero-bubble schedule with 2 stages per rank in V placement")
        return schedule, 2, None
    if schedule == "zero-bubble":
        notes.append(f"{name}: zero-bubble schedule (its {stages} stages per rank are part of the schedule model)")
        return schedule, 1, None
    if per_stage is not None and stages > 1:
        return schedule, stages, int(per_stage)
    if stages > 1:
        notes.append(f"{name} without pipeline_parallel_layers_per_stage: {stages} virtual stages per rank")
    return schedule, stages, None


def _model_parts(parts: Any, pp: int, source: str) -> tuple[int, ...] | None:
    """Blocks per (virtual) stage from module_fqns_per_model_part (the `layers.<i>` entries of each part)."""
    if not parts or pp == 1:
        return None
    if not isinstance(parts, list) or not all(isinstance(p, list) for p in parts) or len(parts) % pp:
        raise UserError(f"{source}: parallelism.module_fqns_per_model_part must be a list of module-name lists, "
                        f"a multiple of pipeline_parallel_degree {pp} of them (one per virtual stage)")
    return tuple(sum(1 for name in part if str(name).startswith("layers.")) for part in parts)


def _ac(section: Any, notes: list[str]) -> tuple[str, int | None]:
    section = section or {}
    mode = section.get("mode", "selective")
    option = str(section.get("selective_ac_option", "2"))
    if "mode" not in section:
        notes.append("no activation_checkpoint.mode: torchtitan's default selective")
    if mode in ("none", "full"):
        return mode, None
    if mode != "selective":
        raise UserError(f"activation_checkpoint.mode must be none, selective or full, got {mode!r}")
    if option == "op":
        return "selective", None
    if not option.isdigit() or int(option) < 1:
        raise UserError(f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer, got {option!r}")
    return ("full", None) if int(option) == 1 else ("full", int(option))


def _float8(data: dict[str, Any], precision: str, zero: int, source: str, notes: list[str],
            unsupported: list[str]) -> tuple[str, bool]:
    """(recipe, FSDP float8 all-gather) of [quantize.linear.float8] (torchtitan 0.2) or [float8]
    (before): no recipe_name is tensorwise, whose all-gather ZeRO-3 uses (its converter
    enables it only where FSDP shards, and refuses it with a recipe_name)."""
    nested = data.get("quantize", {})
    for key in ("linear", "float8"):
        nested = nested.get(key, {}) if isinstance(nested, dict) else {}
    section = nested or data.get("float8") or {}
    if precision != "fp8" or not isinstance(section, dict):
        return "tensorwise", False
    recipe = section.get("recipe_name") or "tensorwise"
    if recipe == "rowwise_with_gw_hp":
        unsupported.append("float8 recipe_name rowwise_with_gw_hp: modelled as rowwise")
        recipe = "rowwise"
    if recipe not in FLOAT8_RECIPES:
        raise UserError(f"{source}: float8 recipe_name must be one of {', '.join(FLOAT8_RECIPES)}, got {recipe!r}")
    all_gather = bool(section.get("enable_fsdp_float8_all_gather")) and recipe == "tensorwise"
    if all_gather and zero != 3:
        notes.append("enable_fsdp_float8_all_gather below ZeRO-3: autoplan models the float8 all-gather "
                     "with ZeRO-3's per-block gathers only; read as the 16-bit all-gather")
        all_gather = False
    return recipe, all_gather


def _precision(data, training, notes, unsupported) -> str:
    converters = [str(c).lower() for c in (data.get("model", {}).get("converters") or [])]
    if isinstance(data.get("model", {}).get("converters"), str):
        converters = [c.strip().lower() for c in data["model"]["converters"].split(",")]
    if "mx" in converters or "mxfp8" in converters:
        unsupported.append("model.converters mx (MXFP8): modelled as fp8")
        return "fp8"
    if any("float8" in c for c in converters) or "linear" in data.get("quantize", {}):
        notes.append("float8 converter: FP8 linear layers (torchao)")
        return "fp8"
    param = training.get("mixed_precision_param", "bfloat16")
    if training.get("dtype") == "bfloat16":
        notes.append("training.dtype bfloat16: parameters kept in bf16; memory modelled as mixed precision")
    if param == "float32":
        return "fp32"
    if param != "bfloat16":
        raise UserError(f"training.mixed_precision_param must be bfloat16 or float32, got {param!r}")
    return "bf16"


def _unknown(data: dict[str, Any], notes: list[str], unsupported: list[str]) -> None:
    if data.get("fault_tolerance", {}).get("enable"):
        unsupported.append("fault_tolerance.enable: TorchFT replica groups")
    neutral = sorted(s for s in data if s in NEUTRAL_SECTIONS)
    if neutral:
        notes.append("no effect on step time or memory: " + ", ".join(f"[{s}]" for s in neutral))
    for name, section in sorted(data.items()):
        if name in NEUTRAL_SECTIONS:
            continue
        if name not in KNOWN:
            unsupported.append(f"[{name}]: not a torchtitan section autoplan knows; ignored")
            continue
        for key in sorted(section if isinstance(section, dict) else {}):
            if key not in KNOWN[name]:
                unsupported.append(f"{name}.{key}: not a torchtitan option autoplan knows; ignored")
    if data.get("optimizer", {}).get("name", "AdamW") not in ("AdamW", "Adam"):
        unsupported.append(f"optimizer.name {data['optimizer']['name']}: optimizer state is modelled as Adam's")
