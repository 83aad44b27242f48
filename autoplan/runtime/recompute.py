"""Activation checkpointing per block, as the plan says: none | selective | full.

full: the block keeps only its input and recomputes everything in backward.
selective: matmul and attention outputs are saved, cheap element-wise ops (norms,
activations, RoPE) are recomputed (torch's selective-AC policy, as in torchtitan's "op" mode).
"""

from __future__ import annotations


import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         checkpoint_wrapper)
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


# Selective checkpointing replays a block's ops by their call count, which must not grow in
# the recomputation. An FSDP unit inside the block (expert-parallel experts at ZeRO-2/3)
# calls its hooks there too, and they mark profiler ranges as they go: more of them in the
# recomputation, where FSDP's forward root has already finished ("FSDP::root_pre_forward",
# torch 2.13 _fsdp_state.py), than in the forward, which SAC refuses ("invocation index ...
# not found in storage"). The ranges compute nothing: SAC passes them through, as it does
# the detaches checkpointing itself adds (SAC_IGNORED_OPS, exported for this).
SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter.default,
                        torch.ops.profiler._record_function_enter_new.default,
                        torch.ops.profiler._record_function_exit.default,
                        torch.ops.profiler._record_function_exit._RecordFunction})


def _policy(_ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


def apply_recompute(model: nn.Module, recompute: dict[str, str]) -> None:
    """Replace each listed block of this (stage) module by its checkpoint wrapper."""
    for path, mode in recompute.items():
        if mode == "none":
            continue
        parent_path, _, name = path.rpartition(".")
        try:
            parent = model.get_submodule(parent_path) if parent_path else model
            block = parent.get_submodule(name)
        except AttributeError:
            continue  # on another pipeline stage
        kwargs = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT}
        if mode == "selective":
            kwargs["context_fn"] = _selective_context
        wrapped = checkpoint_wrapper(block, **kwargs)
        parent.register_module(name, wrapped)
