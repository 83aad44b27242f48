"""DCP checkpoints that reshard across plans, written atomically.

Layout: <dir>/step_000010/ (DCP files + .metadata + trainer.json). Every rank writes into
<dir>/step_000010.tmp/; after a barrier rank 0 writes trainer.json and renames the folder.
`latest_checkpoint` only considers complete folders (no .tmp suffix, trainer.json present),
so a checkpoint half-written when a process died is never loaded.

Keys are the model's own parameter FQNs (wrappers are stripped by
torch.distributed.checkpoint.state_dict; pipeline stages keep the original names), and
the optimizer state is flattened per FQN, so a checkpoint saved by one plan loads into
another (different world size, DP/TP/PP/EP split).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _is_zero1(opt) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(opt, ZeroRedundancyOptimizer)


def _state(parts: list[nn.Module], optimizers: list) -> dict:
    model, optim = {}, {}
    for part, opt in zip(parts, optimizers):
        model.update(get_model_state_dict(part, options=_OPTIONS))
        optim.update(_zero1_state(part, opt) if _is_zero1(opt)
                     else get_optimizer_state_dict(part, opt, options=_OPTIONS))
    return {"model": model, "optim": optim}


def _fqns(part: nn.Module) -> dict[int, str]:
    """Parameter id -> its FQN in the unwrapped model (no DDP / checkpoint-wrapper prefixes)."""
    names = {}
    for name, param in part.named_parameters():
        if name.startswith("module."):
            name = name[len("module."):]
        names[id(param)] = name.replace("_checkpoint_wrapped_module.", "")
    return names


def _zero1_state(part: nn.Module, opt) -> dict:
    """ZeroRedundancyOptimizer in torch's flattened format ("state.<fqn>.<key>",
    "param_groups.<fqn>.<key>"): each rank contributes the states of the parameters it
    owns, so the checkpoint loads into any plan, and any plan's checkpoint into ZeRO-1."""
    names, out = _fqns(part), {}
    local = opt.optim  # the AdamW over this rank's partition
    for group in local.param_groups:
        for param in group["params"]:
            state = local.state.get(param) or {
                "step": torch.zeros(()), "exp_avg": torch.zeros_like(param),
                "exp_avg_sq": torch.zeros_like(param)}
            local.state[param] = state  # the tensors DCP loads into, in place
            for key, value in state.items():
                out[f"state.{names[id(param)]}.{key}"] = value
    for group in opt.param_groups:
        for param in group["params"]:
            for key, value in group.items():
                if key != "params":
                    out[f"param_groups.{names[id(param)]}.{key}"] = value
    return out


def save_checkpoint(directory: str | Path, step: int, parts: list[nn.Module], optimizers: list,
                    trainer_state: dict) -> Path:
    final = Path(directory) / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dcp.save(_state(parts, optimizers), checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer_state}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # atomic on POSIX: the folder is complete or absent
    dist.barrier()
    return final


def latest_checkpoint(directory: str | Path) -> Path | None:
    root = Path(directory)
    if not root.is_dir():
        return None
    complete = [p for p in root.iterdir() if _STEP_DIR.match(p.name)
                and (p / "trainer.json").is_file() and (p / ".metadata").is_file()]
    return max(complete, key=lambda p: int(_STEP_DIR.match(p.name).group(1)), default=None)


def load_checkpoint(path: Path, parts: list[nn.Module], optimizers: list) -> dict:
    state = _state(parts, optimizers)
    dcp.load(state, checkpoint_id=str(path))
    for part, opt in zip(parts, optimizers):
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        if not _is_zero1(opt):  # ZeRO-1 states were loaded in place by dcp.load
            set_optimizer_state_dict(part, opt, state["optim"], options=_OPTIONS)
    return json.loads((path / "trainer.json").read_text())
