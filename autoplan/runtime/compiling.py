"""torch.compile per repeated block, as torchtitan's apply_compile.

It runs after TP, CP/EP and recomputation, so the compiled code is the parallel,
checkpointed block, and before FSDP, whose hooks stay outside the compiled region. Each
block is compiled in place (`nn.Module.compile`), so parameter names, and with them
checkpoints, are unchanged; identical blocks share Dynamo's compiled code (their
parameters are graph inputs), so a model compiles each block class once. Graph breaks are
allowed (no fullgraph): a forward Dynamo cannot capture whole still runs, less fused.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from autoplan.errors import UserError
from autoplan.runtime.model_io import real_parameters


def apply_compile(part: nn.Module, blocks: list[str], async_tp_mesh=None) -> None:
    """Compile each of `blocks` (module paths) this (stage) module holds. Not on fake or meta
    parameters (the dry run and the plan-time probe): what they measure, memory and whether
    the plan applies, is the eager block's, as the cost model assumes. `async_tp_mesh`: the
    TP mesh of a plan with async TP (enable_async_tp)."""
    if not real_parameters(part.parameters()):
        return
    if async_tp_mesh is not None:
        enable_async_tp(async_tp_mesh)
    for path in blocks:
        try:
            block = part.get_submodule(path)
        except AttributeError:
            continue  # on another pipeline stage
        block.compile()


def enable_async_tp(tp_mesh) -> None:
    """Turn on Inductor's micro-pipeline TP pass for the blocks compiled after it, as
    torchtitan's _maybe_enable_async_tp does: it rewrites each sequence-parallel all-gather
    and the matmuls on its output (and each matmul feeding a reduce-scatter) into fused ops
    that pipeline the collective's chunks with the matmul's over CUDA symmetric memory. The
    TP group's symmetric memory is registered first, as torchtitan still does (torch marks
    the call deprecated; pytorch/pytorch#193027 tracks registering it automatically)."""
    if tp_mesh.device_type != "cuda":
        raise UserError(f"this plan turns on async TP, whose fused collectives need CUDA symmetric memory, but its "
                        f"ranks run on {tp_mesh.device_type}; set \"async_tp\": false in the plan, or run it on "
                        "CUDA GPUs")
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True
