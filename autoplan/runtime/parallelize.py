"""Apply a Plan to a model, in one fixed order:

  1. PP split   - cut at the plan's block boundaries (fx), keep this rank's stage modules;
                  a parameter several stages use is a copy per stage (pipeline.StageTie),
                  also where two of them are on this rank (untie_on_one_rank).
     fp8        - torchao's Float8Linear for the blocks' linears when the plan is fp8, with the
                  plan's recipe and, at ZeRO-3, its float8 all-gather (float8.py).
  2. TP / SP    - DTensor parallelize_module with the plan's style table, per stage; dropout
                  on a rank's shards draws from the rank's own stream (rng.py).
  3. CP / EP    - ring attention inside the attention modules + this rank's RoPE rows, and
                  dropout over the rank's part of the sequence from its own stream;
                  experts sharded over the ep axis.
  4. recompute  - checkpoint wrappers per block (after TP so the wrapped code is the TP code).
     compile    - torch.compile per block when the plan says so (compiling.py).
  5. DP         - BatchNorm statistics over the DP ranks' micro-batches (batch_norm.py);
                  FSDP2 (ZeRO-2/3, HSDP) or DDP (ZeRO-0/1) last, on the parallelised blocks,
                  as FSDP2 + DTensor composition requires; at ZeRO-2/3 each layer's experts
                  are an FSDP unit on the expert-replica mesh, below it outside DDP.
Every check that could fail runs on the meta model before any collective (`validate_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from autoplan.config import TP_STYLE_FORMS, tp_style_known
from autoplan.errors import UserError
from autoplan.plan import SCHEDULES, Plan
from autoplan.runtime import data_parallel as dp_mod
from autoplan.runtime import rng
from autoplan.runtime.batch_norm import sync_batch_norms
from autoplan.runtime.compiling import apply_compile
from autoplan.runtime.float8 import apply_float8, gather_float8_as_bytes
from autoplan.runtime.context_parallel import apply_context_parallel, check_cp_module, mark_sequence_shards
from autoplan.runtime.expert_parallel import apply_expert_parallel, check_ep_modules
from autoplan.runtime.mesh import ParallelMesh
from autoplan.runtime.model_io import real_parameters
from autoplan.runtime.data import zigzag_positions
from autoplan.runtime.pipeline import (StageTie, pipeline_split_problem, split_stages, stage_indices,
                                       stage_ties, untie_on_one_rank)
from autoplan.runtime.precision import compute_dtype
from autoplan.runtime.recompute import apply_recompute
from autoplan.runtime.tensor_parallel import apply_tensor_parallel, expand_tp_styles, local_input_linears


@dataclass
class Parallelized:
    """This rank's share of the model after apply_plan."""

    parts: list[nn.Module]  # one per pipeline stage held (one without PP)
    stage_ids: list[int]
    stage_ties: list[StageTie] = field(default_factory=list)  # parameters stages share
    expert_modules: list[nn.Module] = field(default_factory=list)  # each MoE layer's experts
    # the experts of nn.ModuleList MoEs: plain parameters, different ones on each ep rank
    one_rank_experts: list[nn.Module] = field(default_factory=list)
    # expert parameters the loop syncs itself (sync_expert_grads) and ZeRO-1 shards over their
    # replicas: below ZeRO-2 only; FSDP reduces them at ZeRO-2/3
    expert_params: list[nn.Parameter] = field(default_factory=list)
    tp_token_local: list[nn.Module] = field(default_factory=list)  # grads summed over tp: MoE on SP shards, MLA down-projections
    manual_grad_sync: bool = False  # ZeRO-0 with DTensor params: all-reduce after backward
    fsdp: bool = False
    ddp: bool = False


def validate_plan(model: nn.Module, plan: Plan) -> None:
    """Raise UserError naming every module path of the plan the model lacks (meta-safe)."""
    names = {name for name, _ in model.named_modules()}
    buffers = {name for name, _ in model.named_buffers()}
    tp_styles = expand_tp_styles(plan.tp_styles, names)
    wanted = {"stages": [p for stage in plan.stages for p in stage],
              "tp_styles": list(tp_styles), "cp_modules": list(plan.cp_modules),
              "ep_modules": list(plan.ep_modules), "recompute": list(plan.recompute)}
    missing = [f"{key}: {path}" for key, paths in wanted.items() for path in paths
               if path not in names]
    missing += [f"cp_buffers: {path}" for path in plan.cp_buffers if path not in buffers]
    missing += [f"tp_styles: {scope} (matches no block)" for scope in plan.tp_styles
                if scope and not expand_tp_styles({scope: {"": "any"}}, names)]
    if missing:
        raise UserError("the plan names module paths this model does not have ("
                        + "; ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
                        + "). Was the plan made for another model? Re-run `autoplan plan` "
                        "for this model.")
    bad_styles = sorted({s for s in tp_styles.values() if not tp_style_known(s)})
    if bad_styles:
        raise UserError(f"unknown TP styles {bad_styles}; known: {', '.join(TP_STYLE_FORMS)}.")
    if plan.schedule not in SCHEDULES:
        raise UserError(f"unknown pipeline schedule {plan.schedule!r}; use one of {SCHEDULES}.")
    if plan.pp > 1 and len(plan.stages) != plan.pp * plan.vpp:
        raise UserError(f"pp={plan.pp}, vpp={plan.vpp} needs {plan.pp * plan.vpp} stage lists "
                        f"in plan.stages, found {len(plan.stages)}.")
    if plan.pp > 1:
        reason = pipeline_split_problem(model, plan.stages)
        if reason is not None:
            raise UserError(f"pipeline parallelism cannot split {type(model).__name__}: {reason}. "
                            "Use pp=1 for this model.")
    if plan.cp_modules:  # checked whenever listed, so a 1-rank dry run catches it too
        modules = dict(model.named_modules())
        for path in plan.cp_modules:
            check_cp_module(modules[path], path)
    if plan.cp > 1:
        if not plan.cp_modules:
            raise UserError(f"cp={plan.cp} but plan.cp_modules is empty: context parallelism "
                            "needs the attention modules that call F.scaled_dot_product_attention.")
    if plan.ep > 1:
        check_ep_modules(model, plan.ep_modules, plan.ep)
        if (plan.dp_shard * plan.cp) % plan.ep:
            raise UserError(f"ep={plan.ep} must divide dp_shard*cp = {plan.dp_shard * plan.cp}.")
    for wanted, what in ((plan.compile, "torch.compile per block"), (plan.precision == "fp8", "fp8 linears")):
        if wanted and not plan.blocks:
            raise UserError(f"the plan asks for {what} but names no blocks (its recompute lists "
                            "them); make the plan again with `autoplan plan` for this model.")
    if plan.zero_stage not in (0, 1, 2, 3):
        raise UserError(f"zero_stage {plan.zero_stage} must be 0, 1, 2 or 3.")


def apply_plan(model: nn.Module, plan: Plan, mesh: ParallelMesh,
               data_parallel: bool = True, ddp: bool = True) -> Parallelized:
    """Parallelise a materialised, initialised model in place for this rank.

    `data_parallel=False` stops before step 5: the plan-time capability probe runs on meta
    tensors, which DDP/FSDP cannot wrap, and DP applies to any model. `ddp=False` averages
    ZeRO-0/1 gradients with the all-reduce after backward instead of DDP (whose C++ reducer
    cannot hold the fake tensors of a dry run)."""
    # 1. Pipeline split: keep only this rank's (virtual) stages.
    if plan.pp > 1:
        ids = stage_indices(mesh.pp_rank, plan.pp, plan.vpp, plan.schedule)
        positions = (zigzag_positions(plan.seq_len, plan.cp, mesh.cp_rank) if plan.cp > 1
                     else torch.arange(plan.seq_len))
        all_parts = split_stages(model, plan.stages, positions, zigzag=plan.cp > 1)
        parts: list[nn.Module] = [all_parts[i] for i in ids]
        ties = stage_ties(model, all_parts)
        untie_on_one_rank(ties, parts, ids)
    else:
        ids, parts, ties = [0], [model], []
    result = Parallelized(parts=parts, stage_ids=ids, stage_ties=ties)
    for part in parts:
        # dropout over a rank's own part of an activation from the rank's stream (rng.py);
        # not under compile, whose graphs draw their own seeds
        streams = not plan.compile and rng.dropout_layers(part) > 0 and real_parameters(part.parameters())
        if plan.precision == "fp8":  # before TP, so the styles shard the Float8Linears
            apply_float8(part, list(plan.blocks), plan.float8_recipe, plan.float8_all_gather,
                         keep=local_input_linears(part, plan) if plan.tp > 1 else frozenset())
        # 2. Tensor (+ sequence) parallelism.
        if plan.tp > 1:
            result.tp_token_local += apply_tensor_parallel(
                part, plan.tp_styles, mesh.axis("tp"), plan.sequence_parallel,
                dropout_shard=mesh.axis("tp").get_local_rank() if streams else None)
        # 3. Context and expert parallelism.
        if plan.cp > 1:
            apply_context_parallel(part, plan.cp_modules, plan.cp_buffers, mesh.group("cp"),
                                   plan.seq_len)
            if streams:
                mark_sequence_shards(part, list(plan.blocks), mesh.cp_rank)
        if plan.ep > 1:
            experts = apply_expert_parallel(part, plan.ep_modules, mesh.ep_mesh)
            result.expert_modules += experts
            result.one_rank_experts += [m for m in experts if not dp_mod.has_dtensor_params(m)]
        # 4. Activation recomputation, then compilation of the checkpointed blocks.
        apply_recompute(part, plan.recompute)
        if plan.compile:
            apply_compile(part, list(plan.blocks), mesh.axis("tp") if plan.async_tp else None)
    # 5. Data parallelism (also over cp: CP ranks average gradients like DP ranks).
    if not data_parallel:
        return result
    dp_cp = plan.dp * plan.cp
    if dp_cp > 1:  # before FSDP/DDP wrap them: the layers as the model built them
        sync_batch_norms(parts, mesh.group("dp_cp"), dp_cp)
    device_is_cpu = mesh.world.device_type == "cpu"
    if plan.zero_stage < 2:
        result.expert_params = [p for m in result.expert_modules for p in m.parameters()]
    ignored = set(result.expert_params)
    for index, part in enumerate(parts):
        if plan.zero_stage >= 2:
            experts = [m for m in result.expert_modules if _contains(part, m)]
            parts[index] = dp_mod.apply_fsdp(
                part, list(plan.blocks), mesh, reshard=plan.zero_stage == 3,
                param_dtype=compute_dtype(plan.precision),
                offload_params=plan.offload in ("params", "both") and not device_is_cpu,
                experts=experts)
            result.fsdp = True
            if plan.float8_all_gather and device_is_cpu:
                gather_float8_as_bytes([m for m in parts[index].modules() if isinstance(m, FSDPModule)
                                        and not any(m is e for e in experts)])
        elif dp_cp > 1 and (plan.pp > 1 or not ddp or (dp_mod.has_dtensor_params(part)
                                            and not _only(part, ignored))):
            # DDP cannot wrap DTensor (TP) modules, and its bucket rebuild breaks when a
            # pipeline schedule runs several forwards before the first backward.
            result.manual_grad_sync = True
        elif dp_cp > 1:
            parts[index] = dp_mod.apply_ddp(part, mesh, ignored)
            result.ddp = True
    return result


def _contains(part: nn.Module, module: nn.Module) -> bool:
    return any(m is module for m in part.modules())


def _only(part: nn.Module, ignored: set[nn.Parameter]) -> bool:
    """True when the only DTensor parameters are the (separately synced) experts."""
    ids = {id(p) for p in ignored}
    from torch.distributed.tensor import DTensor

    return all(id(p) in ids for p in part.parameters() if isinstance(p, DTensor))
