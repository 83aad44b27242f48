"""DCP checkpoints that reshard across plans, written atomically and verified on load.

Layout: <dir>/step_000010/ (DCP files + .metadata + trainer.json + manifest.json). Every rank
writes into <dir>/step_000010.tmp/; after a barrier the ranks hash the files (each a share),
rank 0 writes trainer.json and manifest.json (bytes and sha256 of every file) and renames
the folder. `latest_checkpoint` only considers complete folders (no .tmp suffix,
trainer.json present), so a checkpoint half-written when a process died is never loaded;
`verified_checkpoint` also rehashes the files and falls back to the newest checkpoint whose
files all match their manifest, so a truncated or bit-flipped file is never loaded either; a
folder without manifest.json, or with a file its manifest does not list, cannot be verified
and is skipped the same way (never loaded silently). Each rank also writes rank_<rank>.json
(its random streams, rng.py), listed in the manifest like every other file.

Non-persistent buffers (RoPE tables) are not in `state_dict()` of the model, but the fx
pipeline stages register them as ordinary buffers; they are left out of every checkpoint
(`skip` holds their names), so a checkpoint loads whether or not it was saved pipelined.

Keys are the model's own parameter FQNs (wrappers are stripped by
torch.distributed.checkpoint.state_dict; pipeline stages keep the original names), and
the optimizer state is flattened per FQN, so a checkpoint saved by one plan loads into
another (different world size, DP/TP/PP/EP split).

A parameter pipeline stages share (a head tied to the embedding, pipeline.StageTie) is a copy
on each stage, named there as the model names it in that stage (`embed_tokens.weight`,
`lm_head.weight`): the weights are saved under those names, as the unsplit model's state dict
holds both. Its optimizer state is saved under the model's own name of the parameter, the
first (`aliases` rename the other copies' keys), as the unsplit model's optimizer state dict
keeps it: the copies' states are identical, and DCP's planner writes a key that several ranks
save once (dedup_save_plans); on load every copy reads that key back (two copies on one rank,
under the V placement, share the key: the value DCP loaded is copied into the other's own
tensors, `_copy_loaded`, so no two optimizers step one tensor).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from autoplan.errors import UserError
from autoplan.files import write_file
from autoplan.runtime.data_parallel import Zero1
from autoplan.runtime.faults import causes, is_no_space
from autoplan.runtime.fused_projection import fused_row_orders, in_model_layout, into_runtime_layout
from autoplan.runtime.tying import model_fqn

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
_CHUNK_BYTES = 1 << 20


def non_persistent_buffers(model: nn.Module) -> frozenset[str]:
    """FQNs of buffers registered with persistent=False (recomputed at build, never saved)."""
    return frozenset(f"{prefix}.{name}" if prefix else name
                     for prefix, module in model.named_modules()
                     for name in module._non_persistent_buffers_set)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _file_entries(folder: Path, names: list[str]) -> dict[str, dict]:
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)}
            for name in names}


def manifest_problems(folder: Path, names: list[str] | None = None) -> list[str]:
    """What in `folder` does not match its manifest ("file: why"); [] when all listed files match.

    `names` restricts the check to those manifest entries (ranks split the reading)."""
    manifest_path = folder / MANIFEST
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return [f"{manifest_path}: missing or unreadable"]
    problems = [] if names is not None else unlisted_files(folder, files)
    for name in sorted(files) if names is None else names:
        path, want = folder / name, files[name]
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != want["bytes"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, the manifest says {want['bytes']}")
        elif sha256_file(path) != want["sha256"]:
            problems.append(f"{path}: sha256 differs from the manifest (corrupted)")
    return problems


def unlisted_files(folder: Path, listed: dict) -> list[str]:
    """Files in `folder` its manifest does not list: they cannot be verified."""
    return [f"{folder / p.name}: not listed in the manifest, cannot be verified"
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST
            and p.name not in listed]


def _manifest_names(folder: Path) -> list[str]:
    try:
        return sorted(json.loads((folder / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _is_zero1(opt) -> bool:
    return isinstance(opt, Zero1)


def _state(parts: list[nn.Module], optimizers: list, skip: frozenset[str] = frozenset(),
           aliases: list[dict[str, str]] | None = None) -> dict:
    """Model and optimizer state of this rank's parts by FQN; `aliases`: per part, the names
    of its copies of shared parameters -> the model's own name, for the optimizer's keys."""
    return _merged(_part_states(parts, optimizers, skip, aliases))


def _part_states(parts: list[nn.Module], optimizers: list, skip: frozenset[str],
                 aliases: list[dict[str, str]] | None) -> list[dict]:
    """`_state` of each part on its own (two parts holding copies of one shared parameter
    both have its optimizer key)."""
    shares = []
    for index, (part, opt) in enumerate(zip(parts, optimizers)):
        model = {key: value for key, value in get_model_state_dict(part, options=_OPTIONS).items()
                 if key not in skip}
        states = (_zero1_state(part, opt) if _is_zero1(opt)
                  else get_optimizer_state_dict(part, opt, options=_OPTIONS))
        shares.append({"model": model,
                       "optim": renamed_optimizer_keys(states, aliases[index] if aliases else {})})
    return shares


def _merged(shares: list[dict]) -> dict:
    return {section: {key: value for share in shares for key, value in share[section].items()}
            for section in ("model", "optim")}


def _copy_loaded(shares: list[dict], loaded: dict) -> None:
    """Where two parts of this rank hold one key (copies of a shared parameter), DCP loaded
    one part's tensor: copy it into the other's, so each part gets its own values."""
    for share in shares:
        for section, values in share.items():
            for key, value in values.items():
                source = loaded[section][key]
                if isinstance(value, torch.Tensor) and value is not source:
                    value.copy_(source)


def renamed_optimizer_keys(states: dict, names: dict[str, str]) -> dict:
    """A flattened optimizer state dict ("state.<fqn>.<key>", "param_groups.<fqn>.<key>") with
    each FQN of `names` replaced by its value."""
    if not names:
        return states
    out = {}
    for key, value in states.items():
        section, _, rest = key.partition(".")
        for old, new in names.items():
            if rest.startswith(old + "."):
                key = f"{section}.{new}.{rest[len(old) + 1:]}"
                break
        out[key] = value
    return out


def _row_orders(parts: list[nn.Module]) -> dict[str, tuple[torch.Tensor, int]]:
    return {fqn: order for part in parts for fqn, order in fused_row_orders(part).items()}


def _in_model_layout(state: dict, parts: list[nn.Module]) -> dict:
    """`_state` with each tensor-parallel fused projection's weight and optimizer states in
    the model's own row order (fused_projection.py), so any plan loads the checkpoint."""
    orders = _row_orders(parts)
    return {section: in_model_layout(values, orders) for section, values in state.items()}


def _fqns(part: nn.Module) -> dict[int, str]:
    """Parameter id -> its FQN in the unwrapped model (no DDP / checkpoint-wrapper prefixes)."""
    return {id(param): model_fqn(name) for name, param in part.named_parameters()}


def _zero1_state(part: nn.Module, opt) -> dict:
    """ZeRO-1 states in torch's flattened format ("state.<fqn>.<key>",
    "param_groups.<fqn>.<key>"): each rank contributes the states of the parameters it
    owns, as DTensors shaped like their (TP/EP) parameters, so the checkpoint loads into
    any plan, and any plan's checkpoint into ZeRO-1."""
    names, out = _fqns(part), {}
    for inner, stepped in opt.owned():
        for local in stepped:
            param = opt.param_of[id(local)]
            state = inner.state.get(local) or {
                "step": torch.zeros(()), "exp_avg": torch.zeros_like(local),
                "exp_avg_sq": torch.zeros_like(local)}
            inner.state[local] = state  # the tensors DCP loads into, in place
            for key, value in state.items():
                if isinstance(param, DTensor) and value.shape == local.shape:
                    value = DTensor.from_local(value, param.device_mesh, param.placements,
                                               run_check=False, shape=param.shape,
                                               stride=param.stride())
                out[f"state.{names[id(param)]}.{key}"] = value
    for group in opt.param_groups:
        for local in group["params"]:
            param = opt.param_of[id(local)]
            for key, value in group.items():
                if key != "params":
                    out[f"param_groups.{names[id(param)]}.{key}"] = value
    return out


class CheckpointWriteError(Exception):
    """A checkpoint could not be written; raised on every rank, the .tmp folder removed."""

    def __init__(self, directory: Path, step: int, failures: list[str], no_space: bool) -> None:
        super().__init__(f"checkpoint of step {step} in {directory}: {'; '.join(failures)}")
        self.directory, self.step, self.failures, self.no_space = directory, step, failures, no_space


def _attempt(action) -> BaseException | None:
    try:
        action()
    except (Exception, CheckpointException) as exc:  # the latter is a BaseException
        return exc
    return None


def failure_text(error: BaseException) -> str:
    """One line naming what failed: the OSError underneath if there is one, else the first
    cause that is not DCP's CheckpointException (whose text is every rank's traceback), with
    its whitespace folded and its length capped, so the job's error stays one paragraph."""
    found = causes(error)
    root = next((e for e in found if isinstance(e, OSError)), None) or \
        next((e for e in found if not isinstance(e, CheckpointException)), error)
    text = " ".join(f"{type(root).__name__}: {root}".split())
    return text if len(text) <= 300 else text[:299] + "…"


def _agree(error: BaseException | None, tmp: Path, step: int) -> None:
    """Every rank learns whether any rank failed; then all of them raise, the .tmp removed."""
    mine = None if error is None else (f"rank {dist.get_rank()}: {failure_text(error)}", is_no_space(error))
    shares: list = [None] * dist.get_world_size()
    dist.all_gather_object(shares, mine)
    failed = [share for share in shares if share is not None]
    if not failed:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    raise CheckpointWriteError(tmp.parent, step, [text for text, _ in failed],
                               any(no_space for _, no_space in failed))


def save_checkpoint(directory: str | Path, step: int, parts: list[nn.Module], optimizers: list,
                    trainer_state: dict, skip: frozenset[str] = frozenset(),
                    rank_state: dict | None = None,
                    aliases: list[dict[str, str]] | None = None) -> Path:
    """Write <directory>/step_NNNNNN atomically. `trainer_state` goes into trainer.json (rank
    0's); `rank_state`, different on every rank (its random streams), into rank_<rank>.json.
    A write error on any rank (a full disk) raises CheckpointWriteError on every rank, with the
    .tmp folder removed and older checkpoints untouched; the ranks agree after each phase, so
    none waits in a barrier for a failed one."""
    final = Path(directory) / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    rank, world = dist.get_rank(), dist.get_world_size()

    def prepare():
        if rank == 0:
            _remove(tmp)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()  # new: every rank writes into a fresh folder, never through a link

    def write():
        dcp.save(_in_model_layout(_state(parts, optimizers, skip, aliases), parts),
                 checkpoint_id=str(tmp))
        if rank_state is not None:
            write_file(tmp / _rank_file(rank), json.dumps(rank_state).encode())
        if rank == 0:
            write_file(tmp / "trainer.json", json.dumps({"step": step, **trainer_state}).encode())

    _agree(_attempt(prepare), tmp, step)
    _agree(_attempt(write), tmp, step)
    names = sorted(p.name for p in tmp.iterdir() if p.is_file())
    shares: list = [None] * world
    dist.all_gather_object(shares, _file_entries(tmp, names[rank::world]))

    def publish():
        if rank == 0:
            files = {name: entry for share in shares for name, entry in share.items()}
            write_file(tmp / MANIFEST, json.dumps({"step": step, "files": files}, indent=1).encode())
            _remove(final)
            os.replace(tmp, final)  # atomic on POSIX: the folder is complete or absent

    _agree(_attempt(publish), tmp, step)
    return final


def state_bytes(parts: list[nn.Module], optimizers: list, skip: frozenset[str] = frozenset(),
                pp_group=None, aliases: list[dict[str, str]] | None = None) -> int:
    """What one checkpoint of this state needs on disk: the tensors' global sizes (pipeline
    stages hold disjoint parameters, so their sums add up over the pp group; the optimizer
    state of a tied parameter's copies, one key written once, is counted on each rank holding
    a copy: a small overestimate)."""
    total = 0
    for section in _state(parts, optimizers, skip, aliases).values():
        for value in section.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()  # DTensor: the global numel
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        shares: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(shares, total, group=pp_group)
        total = sum(shares)
    return total


def _remove(path: Path) -> None:
    """Remove a folder, or a link in its place (the link, not its target)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def latest_checkpoint(directory: str | Path) -> Path | None:
    return next(iter(complete_checkpoints(directory)), None)


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoint folders, newest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    complete = [p for p in root.iterdir() if _STEP_DIR.match(p.name)
                and (p / "trainer.json").is_file() and (p / ".metadata").is_file()]
    return sorted(complete, key=lambda p: int(_STEP_DIR.match(p.name).group(1)), reverse=True)


def verified_checkpoint(directory: str | Path, say=print) -> Path | None:
    """The newest complete checkpoint whose files match its manifest; None when there is none.

    Under a process group every rank hashes a share of each candidate's files and all ranks
    agree on the result. A checkpoint that is damaged or cannot be verified (no manifest, or
    a file the manifest does not list) is reported (`say`) and skipped; when no checkpoint
    verifies it is a UserError naming the files: loading unverified weights silently is
    what this refuses.
    """
    damaged: list[str] = []
    for folder in complete_checkpoints(directory):
        problems = _distributed_problems(folder)
        if not problems:
            if damaged:
                say(f"autoplan: falling back to {folder}, the newest checkpoint whose files match "
                    "its manifest")
            return folder
        say(f"autoplan: checkpoint {folder} is damaged or cannot be verified and is skipped: "
            f"{'; '.join(problems[:4])}")
        damaged += problems
    if damaged:
        raise UserError(f"no checkpoint in {directory} can be loaded, every one is damaged: "
                        f"{'; '.join(damaged[:8])}. Remove those step_* "
                        "folders to start from step 0 (or restore them, with their manifest.json, "
                        "from a copy); a folder without manifest.json is never loaded, since a "
                        "flipped byte in it would go unnoticed.")
    return None


def _distributed_problems(folder: Path) -> list[str]:
    if not (folder / MANIFEST).is_file():
        return [f"{folder / MANIFEST}: missing, so its files cannot be verified"]
    if not dist.is_initialized():
        return manifest_problems(folder)
    rank, world = dist.get_rank(), dist.get_world_size()
    names = _manifest_names(folder)
    mine = manifest_problems(folder, names[rank::world]) if names else manifest_problems(folder)
    if names and rank == 0:
        mine += unlisted_files(folder, dict.fromkeys(names))
    shares: list = [None] * world
    dist.all_gather_object(shares, mine)
    return sorted({problem for share in shares for problem in share})


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def load_rank_state(path: Path, rank: int, world: int) -> dict | None:
    """This rank's rank_<rank>.json when the checkpoint was saved by `world` ranks, else None
    (another world size: the per-rank streams do not map onto these ranks)."""
    saved = sorted(p.name for p in path.glob("rank_*.json"))
    if saved != [_rank_file(r) for r in range(world)]:
        return None
    return json.loads((path / _rank_file(rank)).read_text())


def load_checkpoint(path: Path, parts: list[nn.Module], optimizers: list,
                    skip: frozenset[str] = frozenset(),
                    aliases: list[dict[str, str]] | None = None) -> dict:
    shares = _part_states(parts, optimizers, skip, aliases)
    state = _merged(shares)
    saved = _in_model_layout(state, parts)
    dcp.load(saved, checkpoint_id=str(path))
    orders = _row_orders(parts)
    for section in state:
        into_runtime_layout(saved[section], state[section], orders)
    _copy_loaded(shares, state)
    for index, (part, opt, share) in enumerate(zip(parts, optimizers, shares)):
        set_model_state_dict(part, share["model"], options=StateDictOptions(strict=False))
        if not _is_zero1(opt):  # ZeRO-1 states were loaded in place by dcp.load
            own = {new: old for old, new in (aliases[index] if aliases else {}).items()}
            set_optimizer_state_dict(part, opt, renamed_optimizer_keys(share["optim"], own),
                                     options=_OPTIONS)
    return json.loads((path / "trainer.json").read_text())
