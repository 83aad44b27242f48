"""A plan as a torchtitan job configuration (the torchtitan.toml of a generated job).

Sections and keys are torchtitan's JobConfig (pytorch/torchtitan, torchtitan/config/job_config.py
up to 0.2, torchtitan/config/configs.py in 0.3.0): [parallelism] data_parallel_replicate_degree,
data_parallel_shard_degree, fsdp_reshard_after_forward, tensor_parallel_degree,
enable_sequence_parallel, pipeline_parallel_degree, pipeline_parallel_schedule,
module_fqns_per_model_part, pipeline_parallel_microbatch_size, context_parallel_degree,
expert_parallel_degree; [training] local_batch_size, global_batch_size, seq_len,
mixed_precision_param, enable_cpu_offload, max_norm, steps; [activation_checkpoint] mode,
selective_ac_option; [model] name, flavor, converters; [compile] enable, components;
[quantize.linear.float8] recipe_name, enable_fsdp_float8_all_gather,
precompute_float8_dynamic_scale_for_fsdp.

torchtitan up to 0.2 reads the file itself (`--job.config_file torchtitan.toml`); 0.3 takes the
same keys as command-line overrides (`--parallelism.tensor_parallel_degree 2`) on top of a
config_registry function; `torchtitan_overrides` spells them out in the file's header.
What torchtitan cannot say is listed by `torchtitan_notes`, with the nearest setting used.

Names that changed between releases follow `version` (generate/plan `--stack-version
torchtitan=X.Y`, the current release by default):
- the output projection is `lm_head` in 0.3 (torchtitan/models/common/decoder.py) and `output`
  before (torchtitan/models/llama3/model/model.py, 0.2);
- `enable_sequence_parallel` is a [parallelism] key from 0.3 on; 0.2 always shards the sequence
  under tensor parallelism;
- 0.3 captures the step in CUDA graphs by default and refuses that with pipeline parallelism and
  with the default expert-parallel dispatcher (Trainer.Config._validate_cuda_graphs), so such a
  plan gets `disable_cuda_graphs = true` in [training], named in the header.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from autoplan.plan import Plan

# torch.distributed.pipelining schedule names torchtitan accepts, per autoplan schedule and
# stages per rank (the classes autoplan.runtime.pipeline.build_schedule runs).
_SCHEDULES = {("gpipe", False): "GPipe", ("gpipe", True): "LoopedBFS",
              ("1f1b", False): "1F1B", ("1f1b", True): "Interleaved1F1B",
              ("interleaved-1f1b", False): "Interleaved1F1B", ("interleaved-1f1b", True): "Interleaved1F1B",
              ("zero-bubble", False): "InterleavedZeroBubble"}
# autoplan catalog name -> (torchtitan model name, flavor, 0.3 config_registry function);
# flavors from torchtitan/models/llama3/__init__.py and deepseek_v3/__init__.py (0.2),
# functions from torchtitan/models/*/config_registry.py (0.3.0).
_MODELS = {"llama3.1-8b": ("llama3", "8B", "llama3_8b"), "llama3.1-70b": ("llama3", "70B", "llama3_70b"),
           "llama3.1-405b": ("llama3", "405B", "llama3_405b"),
           "deepseek-v3": ("deepseek_v3", "671B", "deepseek_v3_671b"),
           "deepseek-v2-lite": ("deepseek_v3", "16B", "deepseek_v3_16b")}
_PRECISION = {"fp32": "float32", "bf16": "bfloat16", "fp16": "bfloat16", "fp8": "bfloat16"}
CURRENT_VERSION = "0.3.0"
KNOWN_VERSIONS = ("0.2", "0.3")  # major.minor releases whose key names this module knows


def is_legacy(version: str) -> bool:
    """True for the releases before 0.3 (their own TOML reader, `output` head, no SP key)."""
    return tuple(int(part) for part in version.split(".")[:2]) < (0, 3)


def head_name(version: str) -> str:
    return "output" if is_legacy(version) else "lm_head"


def _needs_cuda_graphs_off(plan: Plan, version: str) -> bool:
    return not is_legacy(version) and (plan.pp > 1 or plan.ep > 1)


def torchtitan_config(plan: Plan, version: str = CURRENT_VERSION) -> dict[str, dict[str, Any]]:
    """The job configuration as {section: {key: value}} (what torchtitan.toml holds)."""
    opt = plan.optimizer
    training = {"local_batch_size": _local_batch(plan), "global_batch_size": plan.global_batch,
                "seq_len": plan.seq_len, "mixed_precision_param": _PRECISION[plan.precision],
                "enable_cpu_offload": plan.offload != "none",
                "max_norm": float(opt.get("grad_clip", 1.0) or 0.0), "steps": int(opt.get("max_steps", 1000))}
    if _needs_cuda_graphs_off(plan, version):
        training["disable_cuda_graphs"] = True
    config: dict[str, dict[str, Any]] = {}
    model = _MODELS.get(plan.model.name) if plan.model.source == "catalog" else None
    if model or plan.precision == "fp8":
        config["model"] = {"name": model[0], "flavor": model[1]} if model else {}
        if plan.precision == "fp8":
            config["model"]["converters"] = ["float8"]
    config["training"] = training
    if plan.precision == "fp8":
        config[FLOAT8_SECTION] = float8_section(plan)
    config["parallelism"] = _parallelism(plan, version)
    # said either way: some config_registry functions (DeepSeek-V3's) compile by default
    config["compile"] = {"enable": plan.compile}
    if plan.compile:  # the model's blocks, as autoplan's runtime compiles them (not the loss)
        config["compile"]["components"] = ["model"]
    if plan.async_tp:
        config["compile"]["enable_async_tensor_parallel"] = True
    config["activation_checkpoint"] = _activation_checkpoint(plan)
    config["optimizer"] = {"name": "AdamW", "lr": float(opt.get("lr", 3e-4)),
                           "beta1": float(opt.get("betas", [0.9, 0.95])[0]),
                           "beta2": float(opt.get("betas", [0.9, 0.95])[1]),
                           "weight_decay": float(opt.get("weight_decay", 0.0))}
    config["lr_scheduler"] = {"warmup_steps": int(opt.get("warmup_steps", 0))}
    return config


FLOAT8_SECTION = "quantize.linear.float8"


def float8_section(plan: Plan) -> dict[str, Any]:
    """torchtitan's [quantize.linear.float8] (Float8Linear in job_config.py, 0.2): the tensorwise
    recipe is the one without a recipe_name, and the only one taking the FSDP float8
    all-gather (its converter asserts so), with the scales precomputed after each step."""
    if plan.float8_recipe != "tensorwise":
        return {"recipe_name": plan.float8_recipe}
    return {"enable_fsdp_float8_all_gather": plan.float8_all_gather,
            "precompute_float8_dynamic_scale_for_fsdp": plan.float8_all_gather}


def _local_batch(plan: Plan) -> int:
    """Sequences per data-parallel rank per optimizer step, or per micro-step without a pipeline.

    torchtitan accumulates gradients over global / (local x dp) steps; with a pipeline the local
    batch is cut into pipeline_parallel_microbatch_size micro-batches instead."""
    return plan.global_batch // plan.dp if plan.pp > 1 else plan.micro_batch


def _parallelism(plan: Plan, version: str) -> dict[str, Any]:
    replicate, shard = (plan.dp, 1) if plan.zero_stage == 0 else (plan.dp_replicate, plan.dp_shard)
    section: dict[str, Any] = {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard}
    if shard > 1:
        # torchtitan's "default" keeps the parameters gathered after the forward under PP
        # (ZeRO-2 there): a pipelined ZeRO-3 plan says "always"
        section["fsdp_reshard_after_forward"] = ("never" if plan.zero_stage != 3 else
                                                 "always" if plan.pp > 1 else "default")
    section["tensor_parallel_degree"] = plan.tp
    if plan.tp > 1 and not is_legacy(version):
        section["enable_sequence_parallel"] = plan.sequence_parallel
    section["pipeline_parallel_degree"] = plan.pp
    if plan.pp > 1:
        section["pipeline_parallel_schedule"] = _schedule_name(plan)
        section["pipeline_parallel_microbatch_size"] = plan.micro_batch
        section["module_fqns_per_model_part"] = model_parts(stage_block_counts(plan), head_name(version))
    section["context_parallel_degree"] = plan.cp
    section["expert_parallel_degree"] = plan.ep
    return section


def _schedule_name(plan: Plan) -> str:
    if plan.schedule == "zero-bubble":
        return "ZBVZeroBubble" if plan.vpp == 2 else "InterleavedZeroBubble"
    return _SCHEDULES[(plan.schedule, plan.vpp > 1)]


def stage_block_counts(plan: Plan) -> list[int]:
    """Blocks per (virtual) pipeline stage, in model order."""
    return [len(stage) for stage in plan.stages]


def model_parts(counts: list[int], head: str = "lm_head") -> list[list[str]]:
    """torchtitan's module_fqns_per_model_part for stages of `counts` blocks (in model order).

    torchtitan's decoder models name their parts tok_embeddings, layers.<i>, norm and the head
    (`head_name`); the embedding goes with the first stage, the final norm and output projection
    with the last, as autoplan.runtime places them."""
    parts, start = [], 0
    for index, count in enumerate(counts):
        part = [f"layers.{i}" for i in range(start, start + count)]
        if index == 0:
            part.insert(0, "tok_embeddings")
        if index == len(counts) - 1:
            part += ["norm", head]
        parts.append(part)
        start += count
    return parts


def _block_modes(plan: Plan) -> list[str]:
    return list(plan.recompute.values())


def _activation_checkpoint(plan: Plan) -> dict[str, Any]:
    modes = _block_modes(plan)
    kinds = set(modes) or {"none"}
    if kinds == {"none"}:
        return {"mode": "none"}
    if kinds == {"full"}:
        return {"mode": "full"}
    if "full" not in kinds:
        return {"mode": "selective", "selective_ac_option": "op"}
    every = max(1, round(len(modes) / modes.count("full")))
    return {"mode": "full"} if every == 1 else {"mode": "selective", "selective_ac_option": str(every)}


def torchtitan_notes(plan: Plan, version: str = CURRENT_VERSION) -> list[str]:
    """What of `plan` torchtitan's configuration cannot say, and the nearest setting written instead."""
    notes = []
    if plan.tp > 1 and is_legacy(version) and not plan.sequence_parallel:
        notes.append(f"tensor parallelism without sequence parallelism: torchtitan {version} always shards "
                     "the sequence (no enable_sequence_parallel key); sequence parallelism is the nearest.")
    if plan.model.source != "catalog" or plan.model.name not in _MODELS:
        notes.append(f"torchtitan has no model family for {plan.model.name}; [model] is left for you to name "
                     "(torchtitan trains the models of torchtitan/models only).")
    if plan.zero_stage == 1 and plan.dp > 1:
        notes.append("ZeRO-1 (only optimizer state sharded) has no torchtitan setting: FSDP2 with "
                     "fsdp_reshard_after_forward = \"never\" (ZeRO-2) is the nearest.")
    if plan.zero_stage == 0 and plan.dp_replicate > 1:
        notes.append(f"HSDP with {plan.dp_replicate} replicas at ZeRO-0 is written as plain replication (DDP).")
    if plan.offload in ("optimizer", "params"):
        notes.append(f"offload {plan.offload}: torchtitan's enable_cpu_offload offloads parameters, gradients "
                     "and optimizer state together (the nearest).")
    if plan.precision == "fp16":
        notes.append("fp16: torchtitan's mixed precision is bfloat16 or float32; bfloat16 is written.")
    if plan.pp > 1 and plan.schedule == "zero-bubble" and plan.vpp not in (1, 2):
        notes.append(f"zero-bubble with {plan.vpp} stages per rank: InterleavedZeroBubble is written.")
    notes += _recompute_notes(plan, version)
    return notes


def _recompute_notes(plan: Plan, version: str) -> list[str]:
    modes = _block_modes(plan)
    if len(set(modes)) <= 1:
        return []
    section = _activation_checkpoint(plan)
    counts = ", ".join(f"{modes.count(m)} {m}" for m in ("full", "selective", "none") if modes.count(m))
    written = section["mode"] + (f" {section['selective_ac_option']}" if "selective_ac_option" in section else "")
    if not is_legacy(version) and ac_kind(section) != section["mode"]:
        written += (f" (torchtitan {version}'s selective recomputation is op-level only: its "
                    f"activation-checkpoint:{ac_kind(section)} recomputes every block)")
    return [f"per-block recomputation ({counts}) has no torchtitan setting: activation_checkpoint "
            f"{written} is the nearest (torchtitan applies one mode to every block; see plan.json recompute)."]


def torchtitan_overrides(config: dict[str, dict[str, Any]]) -> list[str]:
    """The configuration as torchtitan 0.3 command-line overrides (tyro: --section.key value).

    Booleans are tyro flags (--section.key / --section.no-key); a list of lists is one word per
    inner list, comma-joined (torchtitan's list[str] rule), a list of words one word each. The recomputation mode is tyro's
    subcommand of the activation_checkpoint union, last (`activation-checkpoint:full`). [model],
    [optimizer] and [lr_scheduler] are left out: torchtitan 0.3 chooses the model with
    --module/--config and those components in its config_registry."""
    args: list[str] = []
    for section, values in config.items():
        if section not in ("training", "parallelism", "compile"):
            continue
        for key, value in values.items():
            if isinstance(value, bool):
                args.append(f"--{section}.{key}" if value else f"--{section}.no-{key}")
            elif isinstance(value, list):
                args += [f"--{section}.{key}",
                         *(",".join(part) if isinstance(part, list) else part for part in value)]
            else:
                args += [f"--{section}.{key}", str(value)]
    return args + [f"activation-checkpoint:{ac_kind(config['activation_checkpoint'])}"]


def ac_kind(section: dict[str, Any]) -> str:
    """torchtitan 0.3's recomputation class for an [activation_checkpoint] section. 0.3's
    SelectiveAC is op-level only: the layer option ("every Nth block in full") becomes full."""
    if section["mode"] == "selective" and section.get("selective_ac_option", "op") != "op":
        return "full"
    return section["mode"]


def torchtitan_toml(plan: Plan, version: str = CURRENT_VERSION) -> str:
    """torchtitan.toml: a header (how to run it, what could not be expressed) and the sections."""
    config = torchtitan_config(plan, version)
    model = _MODELS.get(plan.model.name) if plan.model.source == "catalog" else None
    module = f"--module {model[0]} --config {model[2]}" if model else "--module <yours> --config <yours>"
    header = [f"torchtitan {version} job configuration written by autoplan from plan.json "
              "(another release: autoplan generate --stack-version torchtitan=X.Y)",
              f"model {plan.model.name}, {plan.world_size} x {plan.gpu}"]
    if is_legacy(version):
        header.append("run: torchrun ... -m torchtitan.train --job.config_file torchtitan.toml")
    else:
        header.append(f"run: torchrun ... -m torchtitan.train {module} followed by the overrides of "
                      "[training], [parallelism], [compile] and [activation_checkpoint] below:")
        header.append(shlex.join(torchtitan_overrides(config)))
        if plan.precision == "fp8":
            header.append(f"fp8: torchtitan {version} sets its float8 converter in the config_registry "
                          f"function (Float8LinearConverter.Config): give it the [{FLOAT8_SECTION}] settings below")
    if _needs_cuda_graphs_off(plan, version):
        header.append("changed from torchtitan's defaults for this plan: [training] disable_cuda_graphs = true "
                      "(torchtitan 0.3 refuses CUDA graphs with pipeline or expert parallelism)")
    notes = torchtitan_notes(plan, version)
    header += ["", "Not expressible in torchtitan (nearest setting written):"] + [f"- {n}" for n in notes] \
        if notes else ["", "Everything in the plan is expressed."]
    lines = [f"# {' '.join(line.split())}".rstrip() for line in header]
    for section, values in config.items():
        lines += ["", f"[{section}]"] + [f"{key} = {_toml_entry(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml_entry(value: Any) -> str:
    """A value, a list of lists one inner list a line (module_fqns_per_model_part stays readable)."""
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return "[\n" + "".join(f"    {toml_value(v)},\n" for v in value) + "]"
    return toml_value(value)


def toml_value(value: Any) -> str:
    """A TOML value for a bool/int/float/str/list (strings in basic quotes, escaped)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else
                                                         ("inf" if value > 0 else "-inf"))
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'
