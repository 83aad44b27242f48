"""Plan: the one serialisable value every later stage consumes (estimate, generate, report, runtime).

A plan file (plan.json) holds the parallel configuration, what the runtime needs to apply
it without re-analysing the model (module paths of each pipeline stage, TP styles per
block class, attention modules for CP, MoE modules for EP, recomputation per block), the
hardware it was made for, its predicted estimate, a format version and a fingerprint of
the model. This module imports only the standard library so that `autoplan.runtime`
can read plans on training nodes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

FORMAT_VERSION = 2
READS_VERSIONS = (1, 2)  # version 1 kept tp_styles as one flat {module path: style}

# Allowed values of a plan's choice fields: the one definition, which the planner's config
# and the runtime read too.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
OFFLOAD = ("none", "optimizer", "params", "both")
MODEL_SOURCES = ("catalog", "config", "transformers", "file")
_POSITIVE_INTS = ("world_size", "gpus_per_node", "global_batch", "seq_len", "dp", "dp_replicate",
                  "tp", "pp", "cp", "ep", "micro_batch", "vpp")


class PlanFormatError(ValueError):
    """A file that is not a plan of this format version."""


@dataclass(frozen=True)
class ModelRef:
    """How to build the model again: a catalog name, an HF config.json, or a Python file."""

    source: str  # "catalog" | "config" | "transformers" (config.json, its HF class) | "file"
    name: str  # catalog name, or a display name (file stem)
    path: str | None = None  # config.json or model.py path, as the user gave it
    fingerprint: str = ""  # sha256 over the model's parameter names, shapes and dtypes


@dataclass(frozen=True)
class Plan:
    model: ModelRef
    gpu: str
    world_size: int
    gpus_per_node: int
    global_batch: int
    seq_len: int
    dp: int = 1
    dp_replicate: int = 1  # HSDP replicas; dp_shard = dp // dp_replicate
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0
    offload: str = "none"  # none | optimizer | params | both
    precision: str = "bf16"  # fp32 | bf16 | fp16 | fp8
    micro_batch: int = 1
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved-1f1b | zero-bubble
    vpp: int = 1
    sequence_parallel: bool = True
    memory_headroom_gib: float = 0.0  # memory per GPU the plan leaves free (--memory-headroom)
    inter_node_bandwidth_gb_per_s: float | None = None  # NIC per GPU if not the GPU's default
    # pipeline: block module paths of each (virtual) stage, in stage order; the
    # modules before the first block go with stage 0, those after the last with the last.
    stages: list[list[str]] = field(default_factory=list)
    recompute: dict[str, str] = field(default_factory=dict)  # block path -> none|selective|full
    # TP styles per block class, as torchtitan's parallelize plans: "" -> {module path: style}
    # for modules outside the blocks; "layers.*" (every block of that list) or a block path
    # -> {path relative to the block ("" = the block itself): style}
    tp_styles: dict[str, dict[str, str]] = field(default_factory=dict)
    cp_modules: list[str] = field(default_factory=list)  # attention modules calling SDPA
    cp_buffers: dict[str, int] = field(default_factory=dict)  # buffer path -> its sequence dim (RoPE tables)
    ep_modules: list[str] = field(default_factory=list)  # MoE modules
    optimizer: dict[str, Any] = field(
        default_factory=lambda: {
            "name": "adamw",
            "lr": 3e-4,
            "betas": [0.9, 0.95],
            "weight_decay": 0.1,
            "warmup_steps": 10,
            "max_steps": 1000,
            "grad_clip": 1.0,
        }
    )
    estimate: dict[str, Any] = field(default_factory=dict)  # predicted numbers (estimate --json keys)
    format_version: int = FORMAT_VERSION

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        if not isinstance(data, dict):
            raise PlanFormatError("a plan is a JSON object")
        version = data.get("format_version")
        if version not in READS_VERSIONS:
            raise PlanFormatError(
                f"plan format_version is {version!r}, this autoplan reads versions "
                f"{', '.join(map(str, READS_VERSIONS))}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        missing = sorted(k for k in ("model", "gpu", "world_size", "gpus_per_node",
                                     "global_batch", "seq_len") if k not in data)
        if unknown or missing:
            raise PlanFormatError(f"plan keys do not match: unknown {unknown}, missing {missing}")
        problems = field_problems(data)
        if problems:
            raise PlanFormatError("; ".join(problems))
        kwargs = dict(data)
        kwargs["model"] = ModelRef(**data["model"])
        if version == 1:
            kwargs["tp_styles"] = {"": dict(data.get("tp_styles", {}))} if data.get("tp_styles") else {}
            kwargs["format_version"] = FORMAT_VERSION
        plan = cls(**kwargs)
        plan.check()
        return plan

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise PlanFormatError(f"{path} is not JSON: {exc}") from None
        except UnicodeDecodeError:
            raise PlanFormatError(f"{path} is not a text file") from None
        return cls.from_dict(data)

    def check(self) -> None:
        """Internal consistency; raises PlanFormatError naming every mismatch."""
        problems = []
        if self.dp * self.tp * self.pp * self.cp != self.world_size:
            problems.append(
                f"dp*tp*pp*cp = {self.dp}*{self.tp}*{self.pp}*{self.cp} != world_size {self.world_size}"
            )
        if self.dp % self.dp_replicate:
            problems.append(f"dp_replicate {self.dp_replicate} does not divide dp {self.dp}")
        if (self.dp * self.cp) % self.ep:
            problems.append(f"ep {self.ep} does not divide dp*cp = {self.dp * self.cp}")
        if self.global_batch % (self.dp * self.micro_batch):
            problems.append(
                f"global_batch {self.global_batch} is not a multiple of dp*micro_batch "
                f"= {self.dp * self.micro_batch}"
            )
        if any(not isinstance(v, dict) for v in self.tp_styles.values()):
            problems.append("tp_styles maps a block class (or \"\") to {relative path: style}")
        if self.stages and len(self.stages) != self.pp * self.vpp:
            problems.append(f"{len(self.stages)} stages listed, pp*vpp = {self.pp * self.vpp}")
        if problems:
            raise PlanFormatError("; ".join(problems))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def field_problems(data: dict[str, Any]) -> list[str]:
    """Every field of a plan dict with the wrong type or out of range, one line each."""
    from autoplan.limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_SEQ_LEN

    problems = []
    model = data.get("model")
    if not isinstance(model, dict) or set(model) - {f.name for f in fields(ModelRef)} \
            or model.get("source") not in MODEL_SOURCES or not isinstance(model.get("name"), str) \
            or not isinstance(model.get("fingerprint", ""), str) \
            or not isinstance(model.get("path"), (str, type(None))):
        problems.append(f"model must be {{source: one of {list(MODEL_SOURCES)}, name, path, "
                        f"fingerprint}}, got {model!r}"[:300])
    if not isinstance(data.get("gpu"), str):
        problems.append(f"gpu must be a GPU name, got {data.get('gpu')!r}")
    limits = {"world_size": MAX_GPUS, "gpus_per_node": MAX_GPUS, "global_batch": MAX_GLOBAL_BATCH,
              "seq_len": MAX_SEQ_LEN}
    for name in _POSITIVE_INTS:
        value = data.get(name, 1)
        if not _is_int(value) or value < 1:
            problems.append(f"{name} must be a positive integer, got {value!r}")
        elif value > limits.get(name, MAX_GPUS):
            problems.append(f"{name} {value:,} is above autoplan's limit of {limits.get(name, MAX_GPUS):,}")
    zero = data.get("zero_stage", 0)
    if not _is_int(zero) or not 0 <= zero <= 3:
        problems.append(f"zero_stage must be 0, 1, 2 or 3, got {zero!r}")
    for name, allowed in (("offload", OFFLOAD), ("precision", PRECISIONS), ("schedule", SCHEDULES)):
        if data.get(name, allowed[0]) not in allowed:
            problems.append(f"{name} must be one of {list(allowed)}, got {data.get(name)!r}")
    if not isinstance(data.get("sequence_parallel", True), bool):
        problems.append(f"sequence_parallel must be true or false, got {data.get('sequence_parallel')!r}")
    headroom = data.get("memory_headroom_gib", 0.0)
    if not _is_number(headroom) or headroom < 0:
        problems.append(f"memory_headroom_gib must be a number >= 0, got {headroom!r}")
    nic = data.get("inter_node_bandwidth_gb_per_s")
    if nic is not None and (not _is_number(nic) or nic <= 0):
        problems.append(f"inter_node_bandwidth_gb_per_s must be null or a positive number, got {nic!r}")
    stages = data.get("stages", [])
    if not isinstance(stages, list) or not all(_is_str_list(stage) for stage in stages):
        problems.append("stages must be a list of lists of block module paths")
    recompute = data.get("recompute", {})
    if not isinstance(recompute, dict) or not all(v in RECOMPUTE for v in recompute.values()):
        problems.append(f"recompute must map block paths to one of {list(RECOMPUTE)}, "
                        f"got {recompute!r}"[:300])
    for name in ("cp_modules", "ep_modules"):
        if not _is_str_list(data.get(name, [])):
            problems.append(f"{name} must be a list of module paths")
    buffers = data.get("cp_buffers", {})
    if not isinstance(buffers, dict) or not all(_is_int(v) and v >= 0 for v in buffers.values()):
        problems.append("cp_buffers must map buffer paths to their sequence dimension (an integer)")
    for name in ("tp_styles", "optimizer", "estimate"):
        if not isinstance(data.get(name, {}), dict):
            problems.append(f"{name} must be a JSON object")
    optimizer = data.get("optimizer", {})
    if isinstance(optimizer, dict):
        for key in ("lr", "weight_decay", "grad_clip", "warmup_steps", "max_steps"):
            if key in optimizer and (not _is_number(optimizer[key]) or optimizer[key] < 0):
                problems.append(f"optimizer.{key} must be a number >= 0, got {optimizer[key]!r}")
    return problems
