"""One rank of a plan dry-run at full size: the job's own runtime (Trainer: materialise, apply
the plan, optimizers) on fake tensors as rank `rank` of torch's fake process group, one
training step, memory tracked by category (torch's MemTracker) and collectives logged.

What one step is here: each pipeline stage this rank holds runs one micro-batch forward and
backward (the schedule's order and the other micro-batches are not replayed; the activations
of the micro-batches a schedule keeps in flight are the caller's multiplication), then the
runtime's gradient synchronisation and the optimizer step. Optimizer state is created by a
step outside the tracked one, so the tracked step sees it resident, as every step after the
first does. Tensors are fake CPU tensors: the runtime builds its mesh on the fake group with
device "cpu"; no memory is allocated.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from autoplan.dryrun.collectives import Collective, CollectiveLog
from autoplan.dryrun.memory import StepMemoryTracker
from autoplan.plan import Plan
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


def _fake_inputs(boundary: Boundary) -> list[torch.Tensor]:
    return [torch.zeros(shape, dtype=dtype).requires_grad_(grad) for shape, dtype, grad in boundary]


def _boundary_of(tensors: list[torch.Tensor]) -> Boundary:
    return [(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors]


def _p2p(kind: str, boundary: Boundary, grads_only: bool = False) -> list[Collective]:
    """The pipeline sends or receives of one micro-batch across one stage boundary: every
    tensor forward, the gradients of those that require one backward. The step runs stages
    directly rather than through PipelineStage, so these are recorded from the boundary."""
    return [Collective(kind, torch.Size(shape).numel() * dtype.itemsize,
                       str(dtype).removeprefix("torch."))
            for shape, dtype, grad in boundary if grad or not grads_only]


def _run_part(trainer, part: nn.Module, stage_id: int, boundary: Boundary,
              log: CollectiveLog) -> Boundary:
    """One micro-batch forward and backward through one stage, its pipeline sends and receives
    added to `log`; the stage's outputs as a boundary."""
    from autoplan.runtime.loop import token_loss
    from autoplan.runtime.model_io import logits_of

    plan = trainer.plan
    first, last = stage_id == 0, stage_id == plan.pp * plan.vpp - 1
    tokens = torch.zeros(plan.micro_batch, plan.seq_len // plan.cp, dtype=torch.long)
    if trainer.par.fsdp:
        trainer._fsdp_microbatch(part, True)
    with trainer._context():
        if first and plan.pp == 1:
            out = part(tokens, **trainer.model_call.kwargs(tokens, trainer.token_positions,
                                                          zigzag=plan.cp > 1))
        else:  # a pipeline stage: token ids on stage 0, what the previous stage hands on after
            out = part(tokens) if first else part(*_fake_inputs(boundary))
        if not first:
            log.calls += _p2p("recv", boundary) + _p2p("send", boundary, grads_only=True)
        if last:
            token_loss(logits_of(out), tokens).backward()
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


def run_rank(plan: Plan, build_model: Callable[[], nn.Module], meta: nn.Module, rank: int,
             boundary: Boundary) -> RankRun:
    """Dry-run one step of `plan` as global rank `rank`; `boundary`: stage 0's outputs (empty
    for pipeline rank 0, which measures them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autoplan.runtime.args import TrainArgs
    from autoplan.runtime.loop import Trainer
    from autoplan.runtime.mesh import build_mesh

    with fake_process_group(plan.world_size, rank), _mesh_tensors_outside_fake_mode():
        mesh = build_mesh(plan, "cpu")  # outside FakeTensorMode (torch-cpu-facts.md item 16)
        meta = copy.deepcopy(meta)  # meta tensors cannot be copied inside FakeTensorMode
        with FakeTensorMode(allow_non_fake_inputs=True):
            trainer = Trainer(build_model, plan, TrainArgs(), mesh=mesh, meta=meta,
                              ddp=False)
            _warm_optimizers(trainer)
            tracker, log = StepMemoryTracker(), CollectiveLog()
            tracker.track_external(*trainer.par.parts, *trainer.optimizers)
            with tracker, log:
                for part, stage_id in zip(trainer.par.parts, trainer.par.stage_ids):
                    handed_on = _run_part(trainer, part, stage_id, boundary, log)
                    boundary = boundary or handed_on
                trainer._finish_grads()
                for opt in trainer.optimizers:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        peak, at_peak = tracker.peak()
        return RankRun(rank, mesh.pp_rank, list(trainer.par.stage_ids), peak, at_peak,
                       dict(tracker.category_max), log.calls, boundary)
