"""Plan: the one serialisable value every later stage consumes (estimate, generate, report, runtime).

A plan file (plan.json) holds the parallel configuration, what the runtime needs to apply
it without re-analysing the model (module paths of each pipeline stage, TP styles per
block class, attention modules for CP, MoE modules for EP, recomputation per block), the
hardware it was made for, its predicted estimate, a format version and a fingerprint of
the model. This module imports only the standard library (and the stdlib-only config and
limits) so that `autoplan.runtime` can read plans on training nodes.

A Plan embeds one ParallelConfig (`plan.parallel`): the degrees, batch, schedule and
precision, and per block its stage (`stage_layers`) and recomputation (`layer_recompute`),
counted over `plan.blocks`, the block module paths in execution order. The file stays flat:
the config's fields are top-level keys, and the per-block facts are written by path, as
`stages` (block paths per stage) and `recompute` (runs of consecutive blocks:
{"layers.0-4": "full", "layers.5": "none"}). `plan.dp`, `plan.stages`, `plan.recompute` ...
read through to the one config; nothing is stored twice.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields, replace
from operator import attrgetter
from pathlib import Path
from typing import Any

from autoplan.config import FLOAT8_KEYS, PER_BLOCK, SCHEDULES, ParallelConfig  # noqa: F401 (the runtime imports SCHEDULES from here)
from autoplan.limits import MAX_LAYERS
from autoplan.plan_schema import field_problems

FORMAT_VERSION = 3
# version 1 kept tp_styles as one flat {module path: style}; versions 1 and 2 list recompute
# per block path, which version 3 reads as runs of one block each
READS_VERSIONS = (1, 2, 3)

# The config's fields a plan file holds as top-level keys (the per-block ones it writes by path).
DEGREES = tuple(f.name for f in fields(ParallelConfig) if f.name not in PER_BLOCK)
# A run of consecutive blocks in a recompute key: "layers.0-4" is layers.0 ... layers.4.
_RUN = re.compile(r"((?:.*\.)?)(0|[1-9][0-9]*)-(0|[1-9][0-9]*)")
_INDEXED = re.compile(r"((?:.*\.)?)(0|[1-9][0-9]*)")


class PlanFormatError(ValueError):
    """A file that is not a plan of this format version."""


@dataclass(frozen=True)
class ModelRef:
    """How to build the model again: a catalog name, an HF config.json, or a Python file."""

    source: str  # "catalog" | "config" | "transformers" (config.json, its HF class) | "file"
    name: str  # catalog name, or a display name (file stem)
    # config.json or model.py path: as the user gave it, or in a plan file relative to the
    # file's folder (unless absolute)
    path: str | None = None
    fingerprint: str = ""  # sha256 over the model's parameter names, shapes and dtypes
    # sha256 of the file's bytes: a plan's model file is loaded only if its bytes still match
    file_sha256: str = ""


@dataclass(frozen=True)
class Plan:
    model: ModelRef
    gpu: str
    world_size: int
    gpus_per_node: int
    # degrees, batch, schedule, precision; blocks per stage and recompute per block of `blocks`
    parallel: ParallelConfig
    memory_headroom_gib: float = 0.0  # memory per GPU the plan leaves free (--memory-headroom)
    inter_node_bandwidth_gb_per_s: float | None = None  # NIC per GPU if not the GPU's default
    # block module paths in execution order, counted by parallel.stage_layers and
    # parallel.layer_recompute; the modules before the first block go with stage 0, those
    # after the last with the last.
    blocks: tuple[str, ...] = ()
    # TP styles per block class, as torchtitan's parallelize plans: "" -> {module path: style}
    # for modules outside the blocks; "layers.*" (every block of that list) or a block path
    # -> {path relative to the block ("" = the block itself): style}
    tp_styles: dict[str, dict[str, str]] = field(default_factory=dict)
    cp_modules: list[str] = field(default_factory=list)  # attention modules calling SDPA
    cp_buffers: dict[str, int] = field(default_factory=dict)  # buffer path -> its sequence dim (RoPE tables)
    ep_modules: list[str] = field(default_factory=list)  # MoE modules
    # what one training sample is; {} (the file has no key) = token ids with next-token
    # prediction; {"kind": "images", "image_size", "channels", "num_classes"}: image
    # classification; {"kind": "batch"}: the model file's example_batch (plan_schema.INPUT_KEYS)
    inputs: dict[str, Any] = field(default_factory=dict)
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
    def stages(self) -> list[list[str]]:
        """Block paths of each (virtual) pipeline stage in stage order; [] when the plan
        does not split the blocks."""
        out, start = [], 0
        for count in self.parallel.stage_layers or ():
            out.append(list(self.blocks[start:start + count]))
            start += count
        return out

    @property
    def recompute(self) -> dict[str, str]:
        """Block path -> none | selective | full, for every block in execution order."""
        modes = self.parallel.layer_recompute or (self.parallel.recompute,) * len(self.blocks)
        return dict(zip(self.blocks, modes))

    def with_(self, **changes) -> "Plan":
        """A copy with `changes`; ParallelConfig field names (dp, tp, stage_layers, ...)
        change the embedded config."""
        config_names = {f.name for f in fields(ParallelConfig)}
        parallel = {k: changes.pop(k) for k in list(changes) if k in config_names}
        return replace(self, parallel=replace(self.parallel, **parallel), **changes)

    def to_dict(self) -> dict[str, Any]:
        """The plan file's JSON object: the config's fields flat, blocks written by path."""
        out: dict[str, Any] = {}
        for name, value in asdict(self).items():
            if name == "parallel":  # the float8 settings only in an fp8 plan's file, async_tp when on
                out.update((key, value[key]) for key in DEGREES
                           if (key not in FLOAT8_KEYS or self.precision == "fp8")
                           and (key != "async_tp" or value[key]))
            elif name == "blocks":
                out["stages"] = self.stages
                out["recompute"] = recompute_runs(self.recompute)
            elif name == "model":  # a catalog model has no file to hash
                out[name] = {k: v for k, v in value.items() if k != "file_sha256" or v}
            elif name == "inputs":  # token plans keep the layout they always had
                if value:
                    out[name] = value
            else:
                out[name] = value
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

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
        own = {f.name for f in fields(cls)} - {"parallel", "blocks"}
        known = own | set(DEGREES) | {"stages", "recompute"}
        unknown = sorted(set(data) - known)
        missing = sorted(k for k in ("model", "gpu", "world_size", "gpus_per_node",
                                     "global_batch", "seq_len") if k not in data)
        if unknown or missing:
            raise PlanFormatError(f"plan keys do not match: unknown {unknown}, missing {missing}")
        problems = field_problems(data)
        if problems:
            raise PlanFormatError("; ".join(problems))
        kwargs = {k: v for k, v in data.items() if k in own}
        kwargs["model"] = ModelRef(**data["model"])
        kwargs["format_version"] = FORMAT_VERSION
        if version == 1:
            kwargs["tp_styles"] = {"": dict(data.get("tp_styles", {}))} if data.get("tp_styles") else {}
        blocks, per_block = _blocks_of(data.get("stages", []), data.get("recompute", {}), version)
        parallel = ParallelConfig(**{k: data[k] for k in DEGREES if k in data}, **per_block)
        plan = cls(parallel=parallel, blocks=blocks, **kwargs)
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
        counts, modes = self.parallel.stage_layers, self.parallel.layer_recompute
        if counts is not None and sum(counts) != len(self.blocks):
            problems.append(f"stage_layers {list(counts)} do not add up to the {len(self.blocks)} blocks")
        if modes is not None and len(modes) != len(self.blocks):
            problems.append(f"{len(modes)} recompute modes for {len(self.blocks)} blocks")
        if self.stages and len(self.stages) != self.pp * self.vpp:
            problems.append(f"{len(self.stages)} stages listed, pp*vpp = {self.pp * self.vpp}")
        if problems:
            raise PlanFormatError("; ".join(problems))


# plan.dp, plan.tp, ... read the embedded config: the plan's degrees are its config's.
for _name in DEGREES + ("dp_shard", "num_microbatches"):
    setattr(Plan, _name, property(attrgetter(f"parallel.{_name}"), doc=f"parallel.{_name}"))


def _blocks_of(stages: list[list[str]], recompute: dict[str, str], version: int) -> tuple[tuple, dict]:
    """(block paths in execution order, the config's stage_layers and layer_recompute) of a
    plan file's stages and recompute; without stages the blocks are recompute's."""
    per_path = expand_runs(recompute) if version >= 3 else dict(recompute)
    blocks = tuple(path for stage in stages for path in stage) if stages else tuple(per_path)
    listed = set(blocks)
    outside = [path for path in per_path if path not in listed]
    if outside:
        raise PlanFormatError(f"recompute names blocks no stage lists ({', '.join(outside[:3])}); "
                              "list them in stages or drop them from recompute")
    return blocks, {
        "stage_layers": tuple(len(stage) for stage in stages) if stages else None,
        "layer_recompute": tuple(per_path.get(path, "none") for path in blocks) if blocks else None,
    }


def recompute_runs(per_block: dict[str, str]) -> dict[str, str]:
    """{block path: mode} with consecutive blocks of one mode joined into one key:
    layers.0 ... layers.4 all "full" -> {"layers.0-4": "full"}."""
    runs: list[list] = []  # [prefix, first index, last index, mode]; indices None if unindexed
    for path, mode in per_block.items():
        match = _INDEXED.fullmatch(path)
        prefix, index = (match.group(1), int(match.group(2))) if match else (path, None)
        last = runs[-1] if runs else None
        if index is not None and last and last[2] is not None \
                and (last[0], last[2] + 1, last[3]) == (prefix, index, mode):
            last[2] = index
        else:
            runs.append([prefix, index, index, mode])
    return {_run_key(prefix, first, last): mode for prefix, first, last, mode in runs}


def _run_key(prefix: str, first: int | None, last: int | None) -> str:
    if first is None:
        return prefix
    return f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}"


def expand_runs(recompute: dict[str, str]) -> dict[str, str]:
    """{block path: mode} from a version-3 plan file's recompute, whose keys are block paths
    or runs ("layers.0-4"); PlanFormatError for a backward run or a block named twice."""
    out: dict[str, str] = {}
    for key, mode in recompute.items():
        match = _RUN.fullmatch(key)
        if match is None:
            paths = [key]
        else:
            prefix, first, last = match.group(1), int(match.group(2)), int(match.group(3))
            if not first <= last < first + MAX_LAYERS:
                raise PlanFormatError(f"recompute run {key!r} must go from a lower block index to a "
                                      f"higher one, at most {MAX_LAYERS:,} blocks")
            paths = [f"{prefix}{i}" for i in range(first, last + 1)]
        for path in paths:
            if path in out:
                raise PlanFormatError(f"recompute names block {path!r} twice; give each block one mode")
            out[path] = mode
    return out
