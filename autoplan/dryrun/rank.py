"""One rank of a plan dry-run at full size: the job's own runtime (Trainer: materialise, apply
the plan, optimizers) on fake tensors as rank `rank` of torch's fake process group, one
training step, memory tracked by category (torch's MemTracker) and collectives logged.

What one step is here: each pipeline stage this rank holds runs one micro-batch forward and
backward (the schedule's order and the other micro-batches are not replayed; the activations
of the micro-batches a schedule keeps in flight are the caller's multiplication), then the
runtime's gradient synchronisation and the optimizer step. A pipelined FSDP stage runs as
torch.distributed.pipelining runs it: every micro-batch's backward without gradient sync or
resharding, then the stage's end-of-step reduction. With more than one micro-batch per step
one untracked micro-batch runs first, so that the measured one starts with the gradients
accumulated and the parameters gathered, as the step's last one does. Optimizer state is created by a
step outside the tracked one, so the tracked step sees it resident, as every step after the
first does. Tensors are fake CPU tensors: the runtime builds its mesh on the fake group with
device "cpu"; no memory is allocated. MoE layers route balanced, every expert taking
tokens * top_k / experts (autoplan.dryrun.routing), as the cost model assumes.

CPU offload (FSDP2's CPUOffloadPolicy) needs CUDA, so the runtime does not apply it here; its
data flow on the GPU is the same but for the host copies, and the dry run books in host
memory what the policy keeps there (`_book_offloaded_states`).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from autoplan.dryrun.collectives import Collective, CollectiveLog
from autoplan.dryrun.kernels import cuda_saved_tensors, refuse_mixed_matmul
from autoplan.dryrun.memory import StepMemoryTracker, Window
from autoplan.dryrun.routing import BalancedRouting
from autoplan.plan import Plan
from autoplan.runtime.args import TrainArgs
from autoplan.runtime.loop import Trainer
from autoplan.runtime.objective import token_loss
from autoplan.runtime.mesh import build_mesh
from autoplan.runtime.model_io import logits_of
from autoplan.trace.fake_group import fake_process_group

# what a pipeline stage hands on: (shape, dtype, requires_grad) of each tensor it sends; the
# next stage receives them with the same requires_grad (as PipelineStage does), so gradients
# cross back only for those
Boundary = list[tuple[tuple[int, ...], torch.dtype, bool]]

@dataclass
class RankRun:
    rank: int
    pp_rank: int
    stage_ids: list[int]
    peak_bytes: int
    at_peak: dict[str, int]  # category -> bytes at the moment of the peak
    category_max: dict[str, int]  # category -> its own maximum over the step
    collectives: list[Collective] = field(default_factory=list)
    boundary: Boundary = field(default_factory=list)
    # per stage this rank holds: the activations its micro-batch keeps for the backward
    # (held when the stage's last block returns, above what was held before the stage ran)
    # and the memory window of that micro-batch; what the stage allocates after its blocks
    # (the head's logits and loss on the last stage) lives only while its micro-batch runs
    microbatches: list[tuple[int, Window]] = field(default_factory=list)
    reduction: Window = field(default_factory=Window)  # gradient sync and optimizer step
    host_peak_bytes: int = 0  # what CPU offload keeps in host memory, at its peak
    host_at_peak: dict[str, int] = field(default_factory=dict)
    balanced_routings: int = 0  # MoE routings made balanced (autoplan.dryrun.routing)
    # elements of the distinct parameters of the stages this rank holds (DTensors counted
    # whole): as the runtime holds them after applying the plan, and as the model has them
    runtime_parameters: int = 0
    model_parameters: int = 0


class _StepOps(BalancedRouting):
    """Balanced MoE routing and the real kernels' refusal of mixed-dtype matmuls (kernels.py
    MatmulDtypes) in one dispatch mode: every op of the step passes through each mode on the
    stack, a Python call each, and the step runs tens of thousands of ops."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        refuse_mixed_matmul(func, args)
        return super().__torch_dispatch__(func, types, args, kwargs)


def representative_ranks(plan: Plan) -> list[int]:
    """Rank 0 of the first, a middle and the last pipeline stage (pp is the outermost axis of
    the runtime's mesh, so pipeline rank s starts at global rank s * world / pp)."""
    stages = sorted({0, plan.pp // 2, plan.pp - 1})
    return [s * (plan.world_size // plan.pp) for s in stages]


@contextlib.contextmanager
def _mesh_tensors_outside_fake_mode():
    """DeviceMesh finds this rank's coordinates with `nonzero`, which FakeTensorMode refuses
    (data-dependent shape) when FSDP2 builds the combined dp x tp mesh inside the fake step;
    mesh tensors are rank bookkeeping, not model data, so meshes are built on real tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    init, mesh = DeviceMesh.__init__, DeviceMesh.mesh

    def real_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    def real_mesh(self):
        with unset_fake_temporarily():
            return mesh.fget(self)

    DeviceMesh.__init__, DeviceMesh.mesh = real_init, property(real_mesh)
    try:
        yield
    finally:
        DeviceMesh.__init__, DeviceMesh.mesh = init, mesh


@contextlib.contextmanager
def _sharding_propagation_in_its_own_fake_mode():
    """DTensor derives an op's global output shape by running it on fake global-shape tensors
    (ShardingPropagator._propagate_tensor_meta_non_cached) in `detect_fake_mode() or
    FakeTensorMode()`: on a GPU a fresh fake mode, allocating nothing. Inside the dry run it
    would find the step's own fake mode, and MemTracker, which skips only ops of another fake
    mode than the one it was entered in, would count those global tensors as memory (under
    loss_parallel: fp32 logits of the full vocabulary). With the step's mode set aside the
    propagation gets its fresh mode, as on a GPU."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def own_mode(self, op_schema):
        with unset_fake_temporarily():
            return propagate(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = own_mode
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate


def _fake_inputs(boundary: Boundary) -> list[torch.Tensor]:
    return [torch.zeros(shape, dtype=dtype).requires_grad_(grad) for shape, dtype, grad in boundary]


def _boundary_of(tensors: list[torch.Tensor]) -> Boundary:
    return [(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors]


def _received(part: nn.Module, stage_id: int, boundary: Boundary) -> Boundary:
    """What stage `stage_id` receives, `boundary` being stage 0's outputs: those outputs from
    stage 0, and from a later stage the same values as it hands them on. A stage passes on the
    values it does not make (the rotary tables) as it took them in: at ZeRO-2/3 cast by FSDP,
    which casts a stage's floating forward inputs to its parameters' compute dtype
    (MixedPrecisionPolicy cast_forward_inputs; FSDPState._cast_forward_inputs), by the policy
    this rank's own part has as the other ranks' do; its hidden states come out of blocks like
    stage 0's, in the same dtype."""
    from torch.distributed.fsdp import FSDPModule

    if stage_id <= 1 or not isinstance(part, FSDPModule):
        return boundary
    policy = part._get_fsdp_state()._mp_policy
    if not (policy.cast_forward_inputs and policy.param_dtype):
        return boundary
    return [(shape, policy.param_dtype if dtype.is_floating_point else dtype, grad)
            for shape, dtype, grad in boundary]


def _p2p(kind: str, boundary: Boundary, grads_only: bool = False) -> list[Collective]:
    """The pipeline sends or receives of one micro-batch across one stage boundary: every
    tensor forward, the gradients of those that require one backward. The step runs stages
    directly rather than through PipelineStage, so these are recorded from the boundary."""
    return [Collective(kind, torch.Size(shape).numel() * dtype.itemsize,
                       str(dtype).removeprefix("torch."))
            for shape, dtype, grad in boundary if grad or not grads_only]


def pipelined_fsdp(plan: Plan) -> bool:
    """Whether the step runs FSDP stages through torch.distributed.pipelining, which keeps
    every micro-batch's gradients unsharded and its parameters gathered until the step ends."""
    return plan.pp > 1 and plan.zero_stage >= 2


def _accumulate_without_sync(part: nn.Module) -> None:
    """The FSDP flags a pipeline stage sets before every micro-batch's backward
    (torch/distributed/pipelining/stage.py, _PipelineStageBase.backward_maybe_with_nosync,
    FSDPModule branch, in this order): not the last backward, no reshard after backward, no
    gradient sync. Gradients then accumulate unsharded in the reduce dtype (fp32; FSDPParam
    .to_accumulated_grad_if_needed) and gathered parameters stay for the next micro-batch."""
    part.set_is_last_backward(False)
    part.set_reshard_after_backward(False)
    part.set_requires_gradient_sync(False)


def _reduce_grads(part: nn.Module) -> None:
    """The stage's end-of-step gradient reduction, torch's own code: PipelineStage's
    perform_reduce_grad (the schedule's REDUCE_GRAD after the last backward) sets the three
    flags back to True, runs every FSDP parameter group's post_backward (reduce-scatter,
    reshard) and the root's final callback. It only reads `submod`; grad_scale_factor 1 skips
    the in-place division by the micro-batch count, which moves no memory."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.stage import _PipelineStageBase

    _PipelineStageBase.perform_reduce_grad(SimpleNamespace(submod=part), 1)


@contextlib.contextmanager
def _held_after_blocks(part: nn.Module, last_block: str, tracker: StepMemoryTracker | None,
                       held: list[int]):
    """Append to `held` the activations the tracker holds when `last_block` (the stage's last
    block) returns from its forward: what a pipeline schedule keeps per micro-batch in flight.
    Without the block (a part that renames it) the whole forward's activations are taken."""
    if tracker is None:
        yield
        return
    try:
        block = part.get_submodule(last_block)
    except AttributeError:
        block = part
    seen, before = len(held), tracker.current("activations")

    def record(*_) -> None:  # the forward's call only, not a recomputation in the backward
        if len(held) == seen:
            held.append(tracker.current("activations") - before)

    handle = block.register_forward_hook(record)
    try:
        yield
    finally:
        handle.remove()


def _run_part(trainer, part: nn.Module, stage_id: int, boundary: Boundary,
              log: CollectiveLog, tracker: StepMemoryTracker | None = None,
              held: list[int] | None = None, last_microbatch: bool = True) -> Boundary:
    """One micro-batch forward and backward through one stage, its pipeline sends and receives
    added to `log`; the stage's outputs as a boundary. With a tracker, the activations held
    after the stage's blocks are appended to `held`."""
    plan = trainer.plan
    first, last = stage_id == 0, stage_id == plan.pp * plan.vpp - 1
    tokens = torch.zeros(plan.micro_batch, plan.seq_len // plan.cp, dtype=torch.long)
    if pipelined_fsdp(plan):
        _accumulate_without_sync(part)
    elif trainer.par.fsdp:
        trainer._fsdp_microbatch(part, last_microbatch)
    last_block = plan.stages[stage_id][-1] if plan.stages else ""
    with trainer._context(), _held_after_blocks(part, last_block, tracker,
                                                held if held is not None else []):
        if first and plan.pp == 1:
            out = part(tokens, **trainer.model_call.kwargs(tokens, trainer.token_positions,
                                                          zigzag=plan.cp > 1))
        else:  # a pipeline stage: token ids on stage 0, what the previous stage hands on after
            out = part(tokens) if first else part(*_fake_inputs(boundary))
        if not first:
            log.calls += _p2p("recv", boundary) + _p2p("send", boundary, grads_only=True)
        if last:
            loss = token_loss(logits_of(out), tokens)
            if plan.pp == 1:  # as the runtime's step; a pipeline schedule keeps stage outputs
                del out
            loss.backward()
            return []
        outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
        carried = [t for t in outs if t.requires_grad]
        torch.autograd.backward(carried, [torch.ones_like(t) for t in carried])
        handed_on = _boundary_of(outs)
        log.calls += _p2p("send", handed_on) + _p2p("recv", handed_on, grads_only=True)
        return handed_on


def _warm_optimizers(trainer) -> None:
    """Create the optimizer state with one step on zero gradients (untracked)."""
    for part in trainer.par.parts:
        for p in part.parameters():
            p.grad = torch.zeros_like(p)
    for opt in trainer.optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)


def _earlier_microbatch(trainer, boundary: Boundary) -> None:
    """One untracked micro-batch through every stage before the measured one, so that the
    measured micro-batch starts where the last one of a step with gradient accumulation does:
    the gradients the micro-batches before it accumulated (unsharded fp32 in a pipelined FSDP
    stage, the sharded fp32 gradients of FSDP's per-micro-batch reduce-scatter, DDP's .grad)
    and the parameters they left gathered."""
    scratch = CollectiveLog()  # never entered: its p2p records are dropped
    for part, stage_id in zip(trainer.par.parts, trainer.par.stage_ids):
        handed_on = _run_part(trainer, part, stage_id, _received(part, stage_id, boundary), scratch,
                              last_microbatch=False)
        boundary = boundary or handed_on


def _track_fsdp_state(tracker: StepMemoryTracker, parts: list[nn.Module]) -> None:
    """Mark what FSDP holds outside module.parameters() before the tracked step: sharded
    parameters while the unsharded ones are registered (parameters), gathered parameters
    and fp32 gradients accumulated across micro-batches, unsharded in a pipeline or sharded
    on the sharded parameters (gradients). Untracked, the
    accumulated gradients would show up as temporaries when first touched."""
    from torch.distributed._tools.mem_tracker import _MemRefType
    from torch.distributed.fsdp import FSDPModule

    for part in parts:
        for module in part.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            for group in state._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    _track_fsdp_param(tracker, fsdp_param, _MemRefType)


def _track_fsdp_param(tracker: StepMemoryTracker, fsdp_param, ref) -> None:
    tracker._update_and_maybe_create_winfos(fsdp_param._sharded_param_data, ref.PARAM)
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    if unsharded is not None and unsharded.untyped_storage().size() > 0:
        tracker._update_and_maybe_create_winfos(unsharded, ref.PARAM)
    if fsdp_param.unsharded_accumulated_grad is not None:
        tracker._update_and_maybe_create_winfos(fsdp_param.unsharded_accumulated_grad, ref.GRAD)
    sharded_grad = fsdp_param.sharded_param.grad
    if sharded_grad is not None:  # reduce-scattered by the micro-batches before this one
        tracker._update_and_maybe_create_winfos(getattr(sharded_grad, "_local_tensor", sharded_grad),
                                                ref.GRAD)


def offloads_to_host(plan: Plan) -> bool:
    """Whether the runtime applies FSDP2's CPUOffloadPolicy on a GPU (parallelize.py: offload
    of parameters, or of both, at ZeRO-2/3)."""
    return plan.offload in ("params", "both") and plan.zero_stage >= 2


def _book_offloaded_states(tracker: StepMemoryTracker, trainer) -> list:
    """Book as host memory what FSDP2's CPUOffloadPolicy keeps there (torch/distributed/fsdp/
    _fully_shard): each FSDPParam's padded sharded parameter (`_sharded_param_data`, moved
    `.cpu()` in FSDPParam._init_sharded_param) with the optimizer states made from it, and its
    sharded gradient (foreach_reduce in _fsdp_collectives.py copies the reduce-scatter output
    `.to("cpu")` and accumulates it there). The GPU keeps what offload does not move: the
    all-gathered parameters (all_gather_inputs copies the shard `.to(device)` first) and the
    unsharded gradients until their reduce-scatter. Gradients made by the tracked step are
    booked when FSDP2 hands them to the sharded parameter's post-accumulate-grad hooks, which
    it calls after assigning them. Returns the hook handles, to be removed after the step."""
    from torch.distributed.fsdp import FSDPModule

    sharded: dict[int, nn.Parameter] = {}
    for part in trainer.par.parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    for fsdp_param in group.fsdp_params:
                        sharded[id(fsdp_param.sharded_param)] = fsdp_param.sharded_param
                        tracker.to_host(fsdp_param._sharded_param_data)
    for opt in trainer.optimizers:
        for param, state in opt.state.items():
            if id(param) in sharded:
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        tracker.to_host(value)

    def book_grad(param: nn.Parameter) -> None:
        tracker.to_host(param.grad)

    handles = []
    for param in sharded.values():
        if param.grad is not None:  # accumulated by the micro-batches before this one
            tracker.to_host(param.grad)
        handles.append(param.register_post_accumulate_grad_hook(book_grad))
    return handles


def run_rank(plan: Plan, build_model: Callable[[], nn.Module], meta: nn.Module, rank: int,
             boundary: Boundary) -> RankRun:
    """Dry-run one step of `plan` as global rank `rank`; `boundary`: stage 0's outputs (empty
    for pipeline rank 0, which measures them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with fake_process_group(plan.world_size, rank), _mesh_tensors_outside_fake_mode(), \
            _sharding_propagation_in_its_own_fake_mode(), cuda_saved_tensors():
        mesh = build_mesh(plan, "cpu")  # outside FakeTensorMode (torch-cpu-facts.md item 16)
        meta = copy.deepcopy(meta)  # meta tensors cannot be copied inside FakeTensorMode
        model_parameters = _model_parameters(meta, plan, mesh.pp_rank)
        with FakeTensorMode(allow_non_fake_inputs=True), _StepOps() as routing:
            trainer = Trainer(build_model, plan, TrainArgs(), mesh=mesh, meta=meta,
                              ddp=False)
            _warm_optimizers(trainer)
            if plan.num_microbatches > 1:
                _earlier_microbatch(trainer, boundary)
            tracker, log = StepMemoryTracker(), CollectiveLog()
            tracker.track_external(*trainer.par.parts, *trainer.optimizers)
            _track_fsdp_state(tracker, trainer.par.parts)
            hooks = _book_offloaded_states(tracker, trainer) if offloads_to_host(plan) else []
            held: list[int] = []
            with tracker, log:
                for part, stage_id in zip(trainer.par.parts, trainer.par.stage_ids):
                    tracker.open(f"stage {stage_id}")
                    handed_on = _run_part(trainer, part, stage_id, _received(part, stage_id, boundary),
                                          log, tracker, held)
                    boundary = boundary or handed_on
                tracker.open("reduction")
                if pipelined_fsdp(plan):
                    for part in trainer.par.parts:
                        _reduce_grads(part)
                trainer._finish_grads()
                with tracker.host_step():  # an offloaded step runs on the host's states
                    for opt in trainer.optimizers:
                        opt.step()
                        opt.zero_grad(set_to_none=True)
            for hook in hooks:
                hook.remove()
        peak, at_peak = tracker.peak()
        host_peak, host_at_peak = tracker.host_peak()
        return RankRun(rank, mesh.pp_rank, list(trainer.par.stage_ids), peak, at_peak,
                       dict(tracker.category_max), log.calls, boundary,
                       _microbatch_windows(tracker, trainer.par.stage_ids, held),
                       tracker.windows["reduction"], host_peak, host_at_peak, routing.routed,
                       distinct_elements(trainer.par.parts), model_parameters)


def distinct_elements(parts: list[nn.Module]) -> int:
    """Elements of the distinct parameter objects of `parts` (a DTensor counts its global
    shape): a tie the runtime broke counts twice."""
    params = {id(p): p for part in parts for p in part.parameters()}
    return sum(p.numel() for p in params.values())


def _model_parameters(meta: nn.Module, plan: Plan, pp_rank: int) -> int:
    """Elements of the model's distinct parameters in each stage pipeline rank `pp_rank` holds
    (the whole model without a pipeline), read off the meta model before any parallelism: a
    parameter two of its stages share is a copy in each (runtime/pipeline.py untie_on_one_rank)."""
    from autoplan.runtime.pipeline import split_stages, stage_indices

    if plan.pp == 1:
        return distinct_elements([meta])
    parts = split_stages(meta, plan.stages, torch.arange(plan.seq_len))
    return sum(distinct_elements([parts[i]]) for i in stage_indices(pp_rank, plan.pp, plan.vpp, plan.schedule))


def _microbatch_windows(tracker: StepMemoryTracker, stage_ids: list[int],
                        held: list[int]) -> list[tuple[int, Window]]:
    if len(held) != len(stage_ids):
        raise RuntimeError(f"the activations after the last block were seen for {len(held)} "
                           f"of this rank's {len(stage_ids)} stages")
    return [(h, tracker.windows[f"stage {s}"]) for h, s in zip(held, stage_ids)]
