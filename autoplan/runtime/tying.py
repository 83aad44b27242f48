"""Parameters a model shares between modules (tied embeddings, a block or norm used twice):
which names share one parameter, and how each parallelism keeps them one parameter.

  TP    each style re-registers the parameters of its module as new DTensors, so a tie
        would come out as two parameters; `retie` points every user at one of them (the
        embedding's vocab rows and a vocab-parallel head are both Shard(0): one parameter
        serves both) and refuses ties whose users are sharded differently.
  FSDP  one FSDP unit must own a shared parameter (FSDP2 keeps ties inside a unit): a block
        sharing a parameter with a module outside it is not a unit of its own
        (`shares_outside`), so the enclosing unit (the stage root) holds it, as torchtitan
        puts tied embedding and output in one unit.
  PP    each stage using a shared parameter holds its own copy (same initial value: one
        seed, one checkpoint key); after the backward the copies' gradients are summed over
        the pipeline ranks holding them and the norm counts the first stage's copy only, so
        every copy takes the same step (pipeline.py `StageTie`, `sum_tied_grads`: Megatron's
        embedding group). Two stages on one pipeline rank (zero-bubble's V placement puts
        the first and the last on rank 0) hold a copy each too, summed on the rank first
        (`untie_on_one_rank`).
  EP    experts are sharded per MoE layer; a parameter an expert shares with a module
        outside its layer is refused (expert_parallel.py `check_ep_modules`).
"""

from __future__ import annotations

import torch.nn as nn

from autoplan.errors import UserError


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The fully-qualified names of each parameter reachable under more than one name."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def model_fqn(name: str) -> str:
    """A parameter's or module's name in the user's model, as torch's state-dict functions
    write it: without DDP's `module.` prefix or activation checkpointing's
    `_checkpoint_wrapped_module.` level."""
    return name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")


def inside(name: str, path: str) -> bool:
    return path == "" or name == path or name.startswith(path + ".")


def shares_outside(groups: list[list[str]], path: str) -> list[str] | None:
    """A tie group with names both inside and outside module `path`, or None."""
    for group in groups:
        within = [inside(n, path) for n in group]
        if any(within) and not all(within):
            return group
    return None


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def retie(model: nn.Module, groups: list[list[str]], what: str) -> None:
    """Make every name of each group (taken before `what` re-registered parameters) the
    same parameter again: the first name's, when every copy has its layout."""
    for group in groups:
        owners = [_owner(model, name) for name in group]
        params = [module._parameters[attr] for module, attr in owners]
        # a user no style re-registered only holds the parameter (T5's `shared`, looked up
        # through the encoder's and decoder's embed_tokens; BERT's prediction head, holding
        # the bias its decoder adds): it takes the styled users' layout (a forward of its
        # own would then fail on the DTensor, not train a stale copy)
        styled = any(hasattr(p, "placements") for p in params)
        holders = {name for name, p in zip(group, params) if styled and not hasattr(p, "placements")}
        keep = next(p for name, p in zip(group, params) if name not in holders)
        if all(p is keep for p in params):
            continue
        layouts = {_layout(p) for name, p in zip(group, params) if name not in holders}
        if len(layouts) > 1:
            described = "; ".join(f"{name}: {_describe(p)}" for name, p in zip(group, params))
            raise UserError(f"{what} would untie the shared parameter {' = '.join(group)}: its "
                            f"users are sharded differently ({described}); shard them alike "
                            f"(a vocab_embedding token table with a vocab_head output head) or "
                            f"leave both whole.")
        for module, attr in owners:
            module._parameters[attr] = keep


def _layout(param) -> tuple:
    placements = getattr(param, "placements", None)
    mesh = getattr(param, "device_mesh", None)
    return (tuple(param.shape), None if placements is None else tuple(placements),
            None if mesh is None else id(mesh))


def _describe(param) -> str:
    placements = getattr(param, "placements", None)
    return "whole" if placements is None else f"DTensor {tuple(map(str, placements))}"
