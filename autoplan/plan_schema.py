"""The plan file's schema: every field's type and range, checked before anything reads it.

`field_problems(data)` lists each wrong field of a plan's JSON object, one line naming it, so a
hand-edited plan is refused by every reader (the commands and the runtime) before any value
reaches the optimizer, the cost model or the model loader. Standard library only: plans are
read on training nodes.
"""

from __future__ import annotations

import math
import re
from typing import Any

from autoplan.config import (FLOAT8_RECIPES, OFFLOAD, PRECISIONS, RECOMPUTE, SCHEDULES, TP_STYLE_FORMS,
                             async_tp_problem, float8_problem, schedule_problem,
                             tp_style_known)
from autoplan.limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_SEQ_LEN

MODEL_SOURCES = ("catalog", "config", "transformers", "file")
MODEL_KEYS = ("source", "name", "path", "fingerprint", "file_sha256")
# what the model path of each source ends with (load_model picks the loader by the suffix too)
_MODEL_SUFFIX = {"config": ".json", "transformers": ".json", "file": ".py"}
_SHA256 = re.compile(r"[0-9a-f]{64}")

# The optimizers autoplan.runtime builds (make_optimizer) and the plan keys it reads.
OPTIMIZERS = ("adamw",)
LR_SCHEDULES = ("cosine", "constant")  # cosine: warmup then cosine decay to 10% (lr_at)
OPTIMIZER_KEYS = ("name", "lr", "betas", "weight_decay", "warmup_steps", "max_steps", "grad_clip",
                  "schedule")

# inputs of an image model, or the model file's example_batch (a plan without `inputs` trains
# on token ids)
INPUT_KINDS = ("images", "batch")
INPUT_KEYS = ("kind", "image_size", "channels", "num_classes")
MAX_IMAGE_SIDE = 1 << 16
MAX_CLASSES = 1 << 24

# positive integers and their upper bounds (MAX_GPUS for the degrees)
_POSITIVE_INTS = {"world_size": MAX_GPUS, "gpus_per_node": MAX_GPUS, "global_batch": MAX_GLOBAL_BATCH,
                  "seq_len": MAX_SEQ_LEN, "dp": MAX_GPUS, "dp_replicate": MAX_GPUS, "tp": MAX_GPUS,
                  "pp": MAX_GPUS, "cp": MAX_GPUS, "ep": MAX_GPUS, "micro_batch": MAX_GLOBAL_BATCH,
                  "vpp": MAX_GPUS}
# estimate values the runtime and `validate` read as numbers (the commands recompute the rest)
_ESTIMATE_NUMBERS = ("step_time_s", "model_flops_per_token", "peak_flops_per_gpu", "memory_gib_per_gpu")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    """A JSON number that is not NaN or infinite (Python's json reads NaN and Infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _shown(value: Any) -> str:
    return repr(value)[:120]


def field_problems(data: dict[str, Any]) -> list[str]:
    """Every field of a plan dict with the wrong type or out of range, one line each."""
    return [*model_problems(data.get("model")), *_cluster_problems(data), *_config_problems(data),
            *_module_problems(data), *inputs_problems(data.get("inputs", {})), *optimizer_problems(data.get("optimizer", {})),
            *_estimate_problems(data.get("estimate", {}))]


def model_problems(model: Any) -> list[str]:
    """model: {source, name, path, fingerprint, file_sha256}; a catalog model has no path, the
    others a path with their kind's suffix."""
    if not isinstance(model, dict):
        return [f"model must be an object {{{', '.join(MODEL_KEYS)}}}, got {_shown(model)}"]
    problems = [f"model.{key} is not a model field (they are {', '.join(MODEL_KEYS)})"
                for key in sorted(set(model) - set(MODEL_KEYS))]
    source, path = model.get("source"), model.get("path")
    if source not in MODEL_SOURCES:
        problems.append(f"model.source must be one of {list(MODEL_SOURCES)}, got {_shown(source)}")
    if not isinstance(model.get("name"), str) or not model.get("name"):
        problems.append(f"model.name must be the model's name, got {_shown(model.get('name'))}")
    for key in ("fingerprint", "file_sha256"):
        value = model.get(key, "")
        if not isinstance(value, str) or (value and not _SHA256.fullmatch(value)):
            problems.append(f"model.{key} must be a sha256 (64 hex digits) or empty, got {_shown(value)}")
    if source == "catalog" and path is not None:
        problems.append(f"model.path must be null for a catalog model, got {_shown(path)}")
    suffix = _MODEL_SUFFIX.get(source)
    if suffix and (not isinstance(path, str) or not path.endswith(suffix)):
        problems.append(f"model.path of a {source} model must be a path ending in {suffix}, "
                        f"got {_shown(path)}")
    return problems


def _cluster_problems(data: dict[str, Any]) -> list[str]:
    problems = []
    if not isinstance(data.get("gpu"), str) or not data.get("gpu"):
        problems.append(f"gpu must be a GPU name, got {_shown(data.get('gpu'))}")
    headroom = data.get("memory_headroom_gib", 0.0)
    if not is_finite(headroom) or headroom < 0:
        problems.append(f"memory_headroom_gib must be a number >= 0, got {_shown(headroom)}")
    nic = data.get("inter_node_bandwidth_gb_per_s")
    if nic is not None and (not is_finite(nic) or nic <= 0):
        problems.append(f"inter_node_bandwidth_gb_per_s must be null or a positive number, got {_shown(nic)}")
    return problems


def _config_problems(data: dict[str, Any]) -> list[str]:
    problems = []
    for name, limit in _POSITIVE_INTS.items():
        value = data.get(name, 1)
        if not is_int(value) or value < 1:
            problems.append(f"{name} must be a positive integer, got {_shown(value)}")
        elif value > limit:
            problems.append(f"{name} {value:,} is above autoplan's limit of {limit:,}")
    zero = data.get("zero_stage", 0)
    if not is_int(zero) or not 0 <= zero <= 3:
        problems.append(f"zero_stage must be 0, 1, 2 or 3, got {_shown(zero)}")
    for name, allowed in (("offload", OFFLOAD), ("precision", PRECISIONS), ("schedule", SCHEDULES)):
        if data.get(name, allowed[0]) not in allowed:
            problems.append(f"{name} must be one of {list(allowed)}, got {_shown(data.get(name))}")
    flags = (("sequence_parallel", True), ("compile", False), ("async_tp", False), ("float8_all_gather", False))
    not_bools = [flag for flag, default in flags if not isinstance(data.get(flag, default), bool)]
    problems += [f"{flag} must be true or false, got {_shown(data.get(flag))}" for flag in not_bools]
    problems += _float8_problems(data)
    if not not_bools and is_int(data.get("tp", 1)):
        problem = async_tp_problem(data.get("async_tp", False), data.get("tp", 1),
                                   data.get("sequence_parallel", True), data.get("compile", False),
                                   str(data.get("gpu", "")))
        problems += [problem] if problem else []
    problems += _schedule_problems(data)
    stages = data.get("stages", [])
    if not isinstance(stages, list) or not all(_is_str_list(stage) for stage in stages):
        problems.append("stages must be a list of lists of block module paths")
    recompute = data.get("recompute", {})
    if not isinstance(recompute, dict) or not all(v in RECOMPUTE for v in recompute.values()):
        problems.append(f"recompute must map block paths to one of {list(RECOMPUTE)}, "
                        f"got {_shown(recompute)}")
    return problems


def _schedule_problems(data: dict[str, Any]) -> list[str]:
    pp, batch, dp, micro_batch, vpp = (data.get(name, 1) for name in ("pp", "global_batch", "dp", "micro_batch", "vpp"))
    zero = data.get("zero_stage", 0)
    if not all(is_int(n) and n >= 1 for n in (pp, batch, dp, micro_batch, vpp)) or not is_int(zero):
        return []  # said above
    problem = schedule_problem(data.get("schedule", SCHEDULES[0]), pp, batch // (dp * micro_batch), zero, vpp)
    return [problem] if problem else []


def _float8_problems(data: dict[str, Any]) -> list[str]:
    recipe = data.get("float8_recipe", FLOAT8_RECIPES[0])
    if recipe not in FLOAT8_RECIPES:
        return [f"float8_recipe must be one of {list(FLOAT8_RECIPES)}, got {_shown(recipe)}"]
    all_gather, zero = data.get("float8_all_gather", False), data.get("zero_stage", 0)
    if not isinstance(all_gather, bool) or not is_int(zero):
        return []  # said above
    problem = float8_problem(data.get("precision", "bf16"), zero, recipe, all_gather)
    return [problem] if problem else []


def _module_problems(data: dict[str, Any]) -> list[str]:
    problems = []
    for name in ("cp_modules", "ep_modules"):
        if not _is_str_list(data.get(name, [])):
            problems.append(f"{name} must be a list of module paths")
    buffers = data.get("cp_buffers", {})
    if not isinstance(buffers, dict) or not all(is_int(v) and v >= 0 for v in buffers.values()):
        problems.append("cp_buffers must map buffer paths to their sequence dimension (an integer >= 0)")
    styles = data.get("tp_styles", {})
    # version 1 kept one flat {module path: style}; later versions {scope: {path: style}}
    tables = [styles] if data.get("format_version") == 1 else list(styles.values()) \
        if isinstance(styles, dict) else None
    if tables is None or not all(isinstance(table, dict) for table in tables):
        problems.append("tp_styles must map a block scope (or \"\") to {relative path: style}")
    else:
        unknown = sorted({str(s) for table in tables for s in table.values() if not tp_style_known(s)})
        if unknown:
            problems.append(f"tp_styles names unknown styles {unknown[:5]}; known: {list(TP_STYLE_FORMS)}")
    return problems


def inputs_problems(inputs: Any) -> list[str]:
    """inputs: {} (token ids), an image classifier's {kind, image_size, channels, num_classes},
    or {"kind": "batch"} (the model file's example_batch)."""
    if not isinstance(inputs, dict):
        return [f"inputs must be a JSON object, got {_shown(inputs)}"]
    if not inputs:
        return []
    problems = [f"inputs.{key} is not an inputs field (they are {', '.join(INPUT_KEYS)})"
                for key in sorted(set(inputs) - set(INPUT_KEYS))]
    if inputs.get("kind") not in INPUT_KINDS:
        problems.append(f"inputs.kind must be one of {list(INPUT_KINDS)}, got {_shown(inputs.get('kind'))}")
    if inputs.get("kind") == "batch":
        return problems + [f"inputs.{key} does not go with kind \"batch\" (the model file's "
                           "example_batch makes the inputs)" for key in sorted(set(inputs) & set(INPUT_KEYS) - {"kind"})]
    for key, low, high in (("image_size", 1, MAX_IMAGE_SIDE), ("channels", 1, 4096),
                           ("num_classes", 2, MAX_CLASSES)):
        value = inputs.get(key)
        if not is_int(value) or not low <= value <= high:
            problems.append(f"inputs.{key} must be an integer from {low} to {high:,}, got {_shown(value)}")
    return problems


def optimizer_problems(optimizer: Any) -> list[str]:
    """What autoplan.runtime's optimizer reads: AdamW with a finite positive learning rate,
    betas in [0, 1), finite weight decay and clipping >= 0, whole warmup and step counts."""
    if not isinstance(optimizer, dict):
        return [f"optimizer must be a JSON object, got {_shown(optimizer)}"]
    problems = [f"optimizer.{key} is not an optimizer setting autoplan's runtime reads "
                f"(they are {', '.join(OPTIMIZER_KEYS)})" for key in sorted(set(optimizer) - set(OPTIMIZER_KEYS))]
    name = optimizer.get("name", OPTIMIZERS[0])
    if name not in OPTIMIZERS:
        problems.append(f"optimizer.name must be one of {list(OPTIMIZERS)} (what autoplan's runtime "
                        f"trains with), got {_shown(name)}")
    schedule = optimizer.get("schedule", LR_SCHEDULES[0])
    if schedule not in LR_SCHEDULES:
        problems.append(f"optimizer.schedule must be one of {list(LR_SCHEDULES)}, got {_shown(schedule)}")
    lr = optimizer.get("lr", 3e-4)
    if not is_finite(lr) or lr <= 0:
        problems.append(f"optimizer.lr must be a finite number > 0, got {_shown(lr)}")
    for key in ("weight_decay", "grad_clip"):
        value = optimizer.get(key, 0.0)
        if not is_finite(value) or value < 0:
            problems.append(f"optimizer.{key} must be a finite number >= 0, got {_shown(value)}")
    for key in ("warmup_steps", "max_steps"):
        value = optimizer.get(key, 0)
        if not is_int(value) or value < 0:
            problems.append(f"optimizer.{key} must be an integer >= 0, got {_shown(value)}")
    betas = optimizer.get("betas", [0.9, 0.95])
    if not isinstance(betas, list) or len(betas) != 2 \
            or not all(is_finite(b) and 0 <= b < 1 for b in betas):
        problems.append(f"optimizer.betas must be two numbers in [0, 1), got {_shown(betas)}")
    return problems


def _estimate_problems(estimate: Any) -> list[str]:
    if not isinstance(estimate, dict):
        return [f"estimate must be a JSON object, got {_shown(estimate)}"]
    return [f"estimate.{key} must be null or a finite number >= 0, got {_shown(estimate[key])}"
            for key in _ESTIMATE_NUMBERS
            if estimate.get(key) is not None and (not is_finite(estimate[key]) or estimate[key] < 0)]
