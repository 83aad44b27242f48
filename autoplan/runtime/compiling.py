"""torch.compile per repeated block, as torchtitan's apply_compile.

It runs after TP, CP/EP and recomputation, so the compiled code is the parallel,
checkpointed block, and before FSDP, whose hooks stay outside the compiled region. Each
block is compiled in place (`nn.Module.compile`), so parameter names, and with them
checkpoints, are unchanged; identical blocks share Dynamo's compiled code (their
parameters are graph inputs), so a model compiles each block class once. Graph breaks are
allowed (no fullgraph): a forward Dynamo cannot capture whole still runs, less fused.
"""

from __future__ import annotations

import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake


def apply_compile(part: nn.Module, blocks: list[str]) -> None:
    """Compile each of `blocks` (module paths) this (stage) module holds. Not on fake or meta
    parameters (the dry run and the plan-time probe): what they measure, memory and whether
    the plan applies, is the eager block's, as the cost model assumes."""
    if any(is_fake(p) or p.is_meta for p in part.parameters()):
        return
    for path in blocks:
        try:
            block = part.get_submodule(path)
        except AttributeError:
            continue  # on another pipeline stage
        block.compile()
