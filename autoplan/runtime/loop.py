"""The training loop: process group, model (initialise once, then shard), optimizer, steps.

`train(build_model, plan, args)` is what a generated train.py calls under torchrun.
`Trainer` is the same loop for callers that own the process group (tests run many plans
inside one torchrun launch).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import resource
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch._subclasses.fake_tensor import is_fake

from autoplan.errors import UserError
from autoplan.files import write_file
from autoplan.plan import Plan, PlanFormatError
from autoplan.runtime.args import TrainArgs
from autoplan.runtime import rng
from autoplan.runtime.batch_norm import batch_norms
from autoplan.runtime.checkpoint import (CheckpointWriteError, latest_checkpoint, load_checkpoint,
                                         load_rank_state, non_persistent_buffers, save_checkpoint,
                                         state_bytes, verified_checkpoint)
from autoplan.runtime.data import check_same_data, check_token_file, data_record, zigzag_positions
from autoplan.runtime.data_parallel import Zero1, allreduce_grads
from autoplan.runtime.expert_parallel import sync_expert_grads
from autoplan.runtime.float8 import precompute_scales, require_torchao
from autoplan.runtime.faults import (STOP, RunStopped, StepVerdict, agree_on_step,
                                     checkpoint_write_stop, clear_exit_file, earlier_stop,
                                     non_finite_stop, preempted_stop, write_exit_file)
from autoplan.runtime.mesh import ParallelMesh, build_mesh
from autoplan.runtime.model_io import model_call, vocab_size_of
from autoplan.runtime.objective import check_inputs, make_objective
from autoplan.runtime.parallelize import apply_plan, validate_plan
from autoplan.runtime.pipeline import (build_schedule, check_tied_copies, make_stages, stage_aliases,
                                       stage_ranks, sum_tied_grads, tied_copies)
from autoplan.runtime.precision import DynamicLossScaler, autocast, clip_grads
from autoplan.runtime.rundir import (METRICS_NAME, DirectoryLock, check_unlocked, drop_metrics_from,
                                      job_directories, lock_job, refuse_linked_run_files)
from autoplan.runtime.tensor_parallel import reduce_partial_grads, uses_loss_parallel


def lr_at(step: int, cfg: dict) -> float:
    """Linear warmup over warmup_steps, then cosine decay to 10% of lr at max_steps."""
    peak, warmup = float(cfg.get("lr", 3e-4)), int(cfg.get("warmup_steps", 0))
    max_steps = int(cfg.get("max_steps", 1000))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    floor = 0.1 * peak
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def check_world_size(plan: Plan) -> None:
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != plan.world_size:
        raise UserError(f"the plan is for {plan.world_size} processes but {launched} were "
                        f"launched; run `torchrun --nproc-per-node {plan.world_size}` (per node: "
                        "plan.gpus_per_node) or make a plan for this world size.")


def init_distributed() -> str:
    """Process group from the torchrun environment: cuda+nccl when present, else cpu+gloo."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if dist.is_initialized():
        return device_type
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    else:
        backend = "nccl" if device_type == "cuda" else "gloo"
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # After `torchrun --max-restarts` restarts the workers, a new rank could read the
            # dead ranks' gloo addresses from torchrun's store (seen on torch 2.13: "Connection
            # refused" in connectFullMesh); each attempt gets its own key space.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  int(os.environ["WORLD_SIZE"]), is_master=False,
                                  timeout=timedelta(minutes=30))
            dist.init_process_group(backend, store=dist.PrefixStore(f"autoplan/attempt{restart}", store),
                                    rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
        else:
            dist.init_process_group(backend)
    return device_type


def build_meta(build_model: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return build_model()


def materialise(build_model: Callable[[], nn.Module], meta: nn.Module, seed: int,
                device: torch.device) -> nn.Module:
    """The full model with the seed's weights, identical on every rank and for every plan.

    A model with `init_weights` (transformers', autoplan's own) is built on meta and
    initialised in place. A tensor its `init_weights` leaves as `to_empty` made it (memory
    that differs between ranks: transformers' `_init_weights` does not know xIELU's learned
    scalars and buffers) takes the value the constructor gives it under the seed, from one
    build of the model on the device."""
    torch.manual_seed(seed)
    if not hasattr(meta, "init_weights"):
        with torch.device(device):  # constructor init is deterministic under the seed
            return build_model()
    meta.to_empty(device=device)
    with torch.no_grad():
        for _, tensor in _named_tensors(meta):
            _fill_unset(tensor)
        meta.init_weights()  # which may tie again what to_empty untied
    tensors = dict(_named_tensors(meta))
    if any(is_fake(t) for t in tensors.values()):  # a dry run: no values to check
        return meta
    unset = [name for name, tensor in tensors.items() if _is_unset(tensor)]
    if unset:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            with torch.device(device):
                built = dict(_named_tensors(build_model()))
        with torch.no_grad():
            for name in unset:
                tensors[name].copy_(built[name])
    return meta


def _named_tensors(model: nn.Module):
    yield from model.named_parameters()
    yield from model.named_buffers()


def _fill_unset(tensor: torch.Tensor) -> None:
    """A value no initialisation writes: NaN, or an integer type's least value."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype != torch.bool:
        tensor.fill_(torch.iinfo(tensor.dtype).min)


def _is_unset(tensor: torch.Tensor) -> bool:
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(tensor.isnan().any())
    return tensor.dtype != torch.bool and bool((tensor == torch.iinfo(tensor.dtype).min).any())


class Trainer:
    """One plan, one model, on an initialised process group."""

    def __init__(self, build_model: Callable[[], nn.Module], plan: Plan, args: TrainArgs,
                 mesh: ParallelMesh | None = None, meta: nn.Module | None = None,
                 ddp: bool = True, loss: Callable | None = None, batch: Callable | None = None) -> None:
        self.plan, self.args = plan, args
        meta = meta if meta is not None else build_meta(build_model)
        validate_plan(meta, plan)
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(self.device_type, torch.cuda.current_device()) \
            if self.device_type == "cuda" else torch.device("cpu")
        if dist.get_world_size() != plan.world_size:
            raise UserError(f"the plan is for {plan.world_size} processes but the process group "
                            f"has {dist.get_world_size()}; launch {plan.world_size} ranks.")
        self.mesh = mesh or build_mesh(plan, self.device_type)
        self.unsaved = non_persistent_buffers(meta)
        model = materialise(build_model, meta, args.seed, self.device)
        if plan.pp > 1:
            rng.fork_pipeline_stream(self.mesh.pp_rank)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.par = apply_plan(model, plan, self.mesh, ddp=ddp)
        self.params = [p for part in self.par.parts for p in part.parameters()]
        self.tied = tied_copies(self.par.stage_ties, self.par.parts, self.par.stage_ids,
                                stage_ranks(plan.pp, plan.vpp, plan.schedule), self.mesh.world)
        check_tied_copies(self.tied)
        self.aliases = stage_aliases(self.par.stage_ties, self.par.stage_ids)  # checkpoint keys
        uncounted = {id(c.param) for c in self.tied if not c.counted}
        self.norm_params = [p for p in self.params if id(p) not in uncounted]  # each tie once
        self.one_rank_experts = self._one_rank_experts()
        self.optimizers = [self._optimizer(part) for part in self.par.parts]
        self.scaler = DynamicLossScaler(plan.precision == "fp16")
        self.loss_parallel = plan.tp > 1 and uses_loss_parallel(plan.tp_styles)
        self.positions = (zigzag_positions(plan.seq_len, plan.cp, self.mesh.cp_rank)
                          if plan.cp > 1 else None)
        self.objective = make_objective(meta, plan, args.data, args.seed, args.data_dtype,
                                        self.positions, loss, batch)
        self.token_positions = self.positions if plan.cp > 1 else torch.arange(plan.seq_len)
        self.model_call = model_call(meta)
        self.schedule = self._schedule() if plan.pp > 1 else None
        self.start_step = 0
        self.resuming = False
        self._warn_unsupported()
        self.last_grad_norm = float("nan")  # pre-clip global grad norm of the last step
        self.grad_norms: list[float] = []
        self.stop_requested = False  # a rank got SIGTERM/SIGUSR1 (agreed in the last step)
        self.skipped_steps: list[int] = []  # non-finite steps skipped (--skip-bad-steps)

    # -- construction -------------------------------------------------------------
    def _one_rank_experts(self) -> tuple[set[int], dist.ProcessGroup] | None:
        """(ids, ep group) of the expert parameters each ep rank holds different ones of, for
        the gradient norm; read after DP wrapped them (FSDP replaces parameters)."""
        params = [p for m in self.par.one_rank_experts for p in m.parameters()]
        return ({id(p) for p in params}, self.mesh.ep_mesh["ep"].get_group()) if params else None

    def _optimizer(self, part: nn.Module):
        return make_optimizer(part, self.plan, self.mesh, self.par.expert_params)

    def _schedule(self):
        plan = self.plan
        stages = make_stages(self.par.parts, self.par.stage_ids, plan.pp * plan.vpp,
                             self.device, self.mesh.group("pp"))

        def loss_fn(logits, labels):
            return self.objective.loss(logits, labels) * self.scaler.scale

        return build_schedule(stages, plan.schedule, plan.num_microbatches, loss_fn, plan.vpp)

    def _warn_unsupported(self) -> None:
        plan = self.plan
        if dist.get_rank() != 0:
            return
        if plan.cp > 1 and not plan.cp_buffers and "position_ids" not in self.model_call.accepted:
            print("autoplan: cp > 1 and plan.cp_buffers is empty: positions the model derives "
                  "inside forward (e.g. torch.arange for learned position embeddings) are not "
                  "this rank's zig-zag positions; only RoPE-style tables listed in cp_buffers "
                  "are re-indexed.", flush=True)
        self._note_batch_norm()
        self._note_dropout()
        if plan.offload == "none":
            return
        if self.device_type == "cpu" or plan.zero_stage < 2 or plan.offload == "optimizer":
            print(f"autoplan: offload={plan.offload!r} is not applied here (it needs CUDA and "
                  "zero_stage >= 2; FSDP2 offloads parameters, gradients and the optimizer step "
                  "together, so 'optimizer' alone is not available)", flush=True)

    def _note_batch_norm(self) -> None:
        count = sum(len(batch_norms(part)) for part in self.par.parts)
        if count:
            plan = self.plan
            print(f"autoplan: {count} BatchNorm layers on this rank normalise over each global "
                  f"micro-batch of dp x micro_batch = {plan.dp * plan.cp * plan.micro_batch} samples "
                  "(statistics synchronised over the DP ranks); a plan with another dp x "
                  "micro_batch normalises over other groups, so its losses differ.", flush=True)

    def _note_dropout(self) -> None:
        count = sum(rng.dropout_layers(part) for part in self.par.parts)
        plan = self.plan
        if not count or plan.tp * plan.cp == 1:
            return
        where = ", ".join(f"{axis}={n}" for axis, n in (("tp", plan.tp), ("cp", plan.cp)) if n > 1)
        if plan.compile:
            print(f"autoplan: {count} dropout layers on this rank under {where} and torch.compile: "
                  "compiled blocks draw from one seed on every rank, so the ranks' parts of one "
                  "activation get the same mask pattern (README: Not guaranteed).", flush=True)
            return
        print(f"autoplan: {count} dropout layers on this rank under {where}: masks over this "
              "rank's own part of an activation come from a stream of its own, so the losses "
              "differ from a run with other degrees by the masks.", flush=True)

    # -- one step -----------------------------------------------------------------
    def _context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(autocast(self.device_type, self.plan.precision, self.par.fsdp))
        if self.loss_parallel:
            stack.enter_context(loss_parallel())
        return stack

    def _forward_backward(self, microbatches) -> torch.Tensor:
        model, count = self.par.parts[0], len(microbatches)
        total = torch.zeros((), device=self.device)
        for index, (inputs, labels) in enumerate(microbatches):
            last = index == count - 1
            sync = contextlib.nullcontext()
            if self.par.ddp and not last:
                sync = model.no_sync()
            if self.par.fsdp:
                self._fsdp_microbatch(model, last)
            with sync, self._context():
                output = self._call(model, inputs)
                loss = self.objective.loss(output, labels.to(self.device))
                del output  # the 16-bit logits: the loss keeps its own fp32 log-probabilities
                (loss * (self.scaler.scale / count)).backward()
            total += _plain(loss).detach()
        return total / count

    def _call(self, model: nn.Module, inputs) -> object:
        """The forward on one micro-batch: token ids or images with the keyword inputs the
        model accepts (model_io), or the model file's own inputs as they are."""
        if isinstance(inputs, dict):
            return model(**{k: x.to(self.device) for k, x in inputs.items()})
        if isinstance(inputs, tuple):
            return model(*(x.to(self.device) for x in inputs))
        inputs = inputs.to(self.device)
        return model(inputs, **self.model_call.kwargs(inputs, self.token_positions, zigzag=self.plan.cp > 1))

    def _fsdp_microbatch(self, model, last: bool) -> None:
        # Reduce-scatter every micro-batch so gradients stay sharded (the memory the plan
        # was costed with); skipping the sync would accumulate unsharded fp32 gradients.
        # ZeRO-2 keeps the gathered parameters until the last backward (one all-gather per
        # step); HSDP all-reduces across replicas only after the last micro-batch.
        if self.plan.zero_stage == 2:
            model.set_reshard_after_backward(last)
        if self.plan.dp_replicate > 1:
            model.set_requires_all_reduce(last)

    def _pipeline_step(self, microbatches) -> torch.Tensor | None:
        inputs = torch.cat([x for x, _ in microbatches]).to(self.device)
        labels = torch.cat([y for _, y in microbatches]).to(self.device)
        num_stages = self.plan.pp * self.plan.vpp
        args = (inputs,) if 0 in self.par.stage_ids else ()
        losses: list[torch.Tensor] = []
        kwargs = {}
        if num_stages - 1 in self.par.stage_ids:
            kwargs = {"target": labels, "losses": losses}
        with self._context():
            self.schedule.step(*args, **kwargs)
        if not losses:
            return None
        return torch.stack([_plain(l).detach().float() for l in losses]).mean() / self.scaler.scale

    def step(self, step: int) -> float:
        plan = self.plan
        microbatches = self.objective.microbatches(step, self.mesh.dp_rank)
        lr = lr_at(step, plan.optimizer)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        loss = self._pipeline_step(microbatches) if self.schedule else self._forward_backward(microbatches)
        self._finish_grads()
        skip = self.scaler.unscale_and_check(self.params)
        self.last_grad_norm = clip_grads(self.params, float(plan.optimizer.get("grad_clip", 0.0) or 0.0),
                                         self.mesh.group("pp") if plan.pp > 1 else None,
                                         counted=self.norm_params, one_rank=self.one_rank_experts)
        verdict = agree_on_step(loss, self.last_grad_norm, skip, self.device)
        self.stop_requested = verdict.stop
        if verdict.bad:
            self._bad_step(step, verdict)
        elif not skip:
            for opt in self.optimizers:
                opt.step()
            if plan.float8_all_gather:  # the next step's float8 weight scales, as torchtitan
                precompute_scales(self.par.parts)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return math.nan if verdict.bad else self._global_loss(loss)

    def _bad_step(self, step: int, verdict: StepVerdict) -> None:
        """A NaN/inf loss or gradient norm: skip the step (--skip-bad-steps) or stop the run,
        before the optimizer step and before any checkpoint of it."""
        if len(self.skipped_steps) >= self.args.skip_bad_steps:
            raise non_finite_stop(step, verdict, self.last_grad_norm, len(self.skipped_steps),
                                  latest_checkpoint(self.args.checkpoint_path))
        self.skipped_steps.append(step)
        if dist.get_rank() == 0:
            print(f"autoplan: {verdict.describe(step, self.last_grad_norm)}: step skipped, no "
                  f"optimizer step ({len(self.skipped_steps)} of --skip-bad-steps "
                  f"{self.args.skip_bad_steps})", flush=True)

    def _finish_grads(self) -> None:
        plan = self.plan
        expert_ids = {id(p) for p in self.par.expert_params}
        if self.par.manual_grad_sync:
            dense = [p for p in self.params if id(p) not in expert_ids]
            allreduce_grads(dense, self.mesh.group("dp_cp"), plan.dp * plan.cp)
        if self.par.expert_params:
            sync_expert_grads(self.par.expert_params, self.mesh.ep_mesh, plan.dp * plan.cp)
        if self.par.tp_token_local:  # each tp rank saw its tokens or its heads: sum them
            params = [p for m in self.par.tp_token_local for p in m.parameters()]
            allreduce_grads(params, self.mesh.group("tp"), 1)
        if plan.tp > 1:
            reduce_partial_grads(self.params)
        sum_tied_grads(self.tied)  # the pipeline stages' copies of a shared parameter

    def _global_loss(self, loss: torch.Tensor | None) -> float:
        """Mean loss of the global batch, the same on every rank."""
        plan = self.plan
        counts = loss is not None and self.mesh.local_rank("tp") == 0
        value = loss.detach().float().reshape(()) if counts else torch.zeros(())
        value = value.to(self.device)
        dist.all_reduce(value)
        return float(value) / (plan.dp * plan.cp)

    # -- checkpoints --------------------------------------------------------------
    def save(self, step: int) -> None:
        """Weights, optimizer states, the loss scaler, --data's fingerprint and, per rank,
        the random streams (rng.py): with the step, all a resumed run needs to repeat the
        uninterrupted run's steps bit for bit."""
        if not hasattr(self, "data_record"):  # fingerprinted once: the file trained on
            self.data_record = data_record(self.args.data)
        save_checkpoint(self.args.checkpoint_path, step, self.par.parts, self.optimizers,
                        {"loss_scaler": self.scaler.state_dict(), "data": self.data_record},
                        skip=self.unsaved, rank_state={"rng": rng.capture()}, aliases=self.aliases)

    def maybe_resume(self) -> None:
        """With --resume, or after torchrun restarted the workers: continue from the newest
        checkpoint whose files match their manifest."""
        restart = restart_count()
        if not (self.args.resume or restart):
            return
        self.resuming = True
        say = _say if dist.get_rank() == 0 else (lambda _text: None)
        if restart:
            say(f"autoplan: restart {restart} after a failure: resuming from the latest checkpoint")
        path = verified_checkpoint(self.args.checkpoint_path, say)
        if path is None:
            say(f"autoplan: no complete checkpoint in {self.args.checkpoint_path}: starting from step 0")
            return
        check_resume_data(path, self.args, say)
        state = load_checkpoint(path, self.par.parts, self.optimizers, skip=self.unsaved,
                                aliases=self.aliases)
        self.scaler.load_state_dict(state["loss_scaler"])
        self.start_step = int(state["step"])
        self._restore_rng(path, say)
        say(f"autoplan: resumed from {path} (step {self.start_step})")

    def _restore_rng(self, path: Path, say) -> None:
        saved = load_rank_state(path, dist.get_rank(), dist.get_world_size())
        if saved is None:
            say(f"autoplan: {path} was saved by another number of ranks (or records no random "
                "streams): dropout and other random draws restart from --seed, so the steps "
                "are not bit-identical to an uninterrupted run")
            return
        rng.restore(saved["rng"])

    # -- the loop -----------------------------------------------------------------
    def run(self) -> list[float]:
        self.maybe_resume()
        losses = []
        metrics = None
        if dist.get_rank() == 0:
            metrics = MetricsLog(self.args.run_dir, self.plan, self.num_params)
            if self.resuming:  # the replayed steps are written again below
                drop_metrics_from(metrics.path, self.start_step)
        for step in range(self.start_step, self.args.steps):
            start = time.perf_counter()
            loss = self.step(step)
            elapsed = time.perf_counter() - start
            losses.append(loss)
            self.grad_norms.append(self.last_grad_norm)
            if metrics is not None:
                metrics.write(step, loss, lr_at(step, self.plan.optimizer), elapsed,
                              print_line=(step + 1) % self.args.log_every == 0,
                              grad_norm=self.last_grad_norm)
            every = self.args.checkpoint_every
            saved = bool(every and (step + 1) % every == 0)
            if saved or self.stop_requested:
                self._save_or_stop(step + 1)
            if self.stop_requested:
                raise preempted_stop(step + 1, STOP.signum, self._step_dir(step + 1))
        return losses

    def _step_dir(self, step: int) -> Path:
        return Path(self.args.checkpoint_path) / f"step_{step:06d}"

    def _save_or_stop(self, step: int) -> None:
        try:
            self.save(step)
        except CheckpointWriteError as exc:
            pp = self.mesh.group("pp") if self.plan.pp > 1 else None
            needed = state_bytes(self.par.parts, self.optimizers, self.unsaved, pp, self.aliases)
            raise checkpoint_write_stop(step, str(exc.directory), exc.failures, exc.no_space,
                                        needed) from None


def restart_count() -> int:
    """How many times torchrun (--max-restarts) has restarted this job's workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def check_resume_data(path: Path, args: TrainArgs, say) -> None:
    """Refuses --data when it is not the data the checkpoint at `path` was trained on."""
    saved = json.loads((path / "trainer.json").read_text()).get("data")
    note = check_same_data(saved, args.data, args.allow_data_change)
    if note:
        say(note)


def _say(text: str) -> None:
    print(text, flush=True)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor loss (loss_parallel) as a plain tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def make_optimizer(part: nn.Module, plan: Plan, mesh: ParallelMesh,
                   expert_params: list[nn.Parameter] = ()):
    """AdamW over one stage's parameters (decay on matrices only), ZeRO-1 sharded when asked."""
    cfg = plan.optimizer
    decay = [p for p in part.parameters() if p.ndim >= 2]
    no_decay = [p for p in part.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": float(cfg.get("weight_decay", 0.0))},
              {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=float(cfg.get("lr", 3e-4)), betas=tuple(cfg.get("betas", (0.9, 0.95))))
    if plan.zero_stage == 1 and plan.dp * plan.cp > 1:
        return Zero1([g for g in groups if g["params"]], mesh.group("dp_cp"),
                     {id(p) for p in expert_params}, mesh.expert_replica_group(), **kwargs)
    return torch.optim.AdamW(groups, foreach=False if plan.ep > 1 else None, **kwargs)


def peak_memory_gib(device_type: str) -> float:
    """CUDA allocator peak on GPU; the process's peak resident set (ru_maxrss) on CPU."""
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsLog:
    """One JSON object per step appended to <run_dir>/metrics.jsonl (rank 0 only)."""

    def __init__(self, run_dir: str, plan: Plan, num_params: int) -> None:
        self.path = Path(run_dir) / METRICS_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.plan = plan
        est = plan.estimate or {}
        self.flops_per_token = float(est.get("model_flops_per_token") or 6 * num_params)
        self.peak_flops = est.get("peak_flops_per_gpu")
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"

    def write(self, step: int, loss: float, lr: float, step_time_s: float, print_line: bool,
              grad_norm: float = float("nan")) -> None:
        """`grad_norm`: the global gradient norm before clipping, the same under every plan (a
        gradient summed where it should be averaged shows here, where Adam's updates hide it)."""
        tokens_per_s = self.plan.global_batch * self.plan.seq_len / step_time_s
        mfu = None
        if self.peak_flops:
            mfu = self.flops_per_token * tokens_per_s / (float(self.peak_flops) * self.plan.world_size)
        record = {"step": step, "loss": loss if math.isfinite(loss) else None,
                  "grad_norm": grad_norm if math.isfinite(grad_norm) else None, "lr": lr, "tokens_per_s": tokens_per_s, "mfu": mfu,
                  "peak_memory_gib": peak_memory_gib(self.device_type), "step_time_s": step_time_s,
                  "device": self.device_type}
        write_file(self.path, (json.dumps(record) + "\n").encode(), append=True)
        if print_line:
            mfu_text = f"{mfu:.2%}" if mfu is not None else "n/a"
            # an image plan's seq_len is 1: its "tokens" are images
            unit = "img/s" if self.plan.inputs.get("kind") == "images" else "tok/s"
            print(f"step {step:5d}  loss {loss:.4f}  lr {lr:.2e}  {tokens_per_s:,.0f} {unit}  "
                  f"mfu {mfu_text}  peak {record['peak_memory_gib']:.2f} GiB", flush=True)


def train(build_model: Callable[[], nn.Module], plan: Plan | dict, args: TrainArgs,
          loss: Callable | None = None, batch: Callable | None = None) -> list[float]:
    """Train `plan` for args.steps steps under torchrun; returns the per-step losses (every rank).
    `loss(outputs, labels)` and `batch` (`example_batch(batch_size)`): the model file's own
    loss and batch, if it defines them (objective.py, models/user_batch.py).

    Bad input (plan/world mismatch, module paths the model lacks, CP without SDPA, EP
    without MoE) is reported on rank 0 before any collective, and every rank exits with
    status 2.
    """
    rank = int(os.environ.get("RANK", "0"))
    locks: list[DirectoryLock] = []
    owns_group = False
    try:
        plan = plan if isinstance(plan, Plan) else Plan.from_dict(plan)
        meta = build_meta(build_model)
        if args.check_only:
            check_before_launch(meta, plan, args, batch)
            return []
        check_world_size(plan)
        stop_if_stopped_before(args.run_dir)
        validate_plan(meta, plan)  # before the process group: nothing can hang
        check_inputs(meta, plan, args.data, batch)  # a model the runtime cannot feed stops here too
        if plan.precision == "fp8":
            require_torchao()
        if rank == 0:  # held until this process exits; the kernel releases it if it dies
            run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
            locks = lock_job(job_directories(args.run_dir, args.checkpoint_path), run_id,
                             restarted=restart_count() > 0)
            refuse_linked_run_files(args.run_dir)
            clear_exit_file(args.run_dir)
        owns_group = not dist.is_initialized()
        init_distributed()
        # SIGTERM/SIGUSR1 from here on: checkpoint at the next step boundary. Not before: until
        # the group is up there is nothing to save, and a rank waiting in rendezvous (a C++ wait,
        # as when rank 0 was refused the run directory) cannot run a Python handler, so torchrun
        # would wait out its grace period before killing it instead of ending it at once.
        STOP.install()
        losses = Trainer(build_model, plan, args, meta=meta, loss=loss, batch=batch).run()
        _leave(owns_group)
        return losses
    except (UserError, PlanFormatError) as exc:
        if rank == 0:
            print(f"autoplan: error: {exc}", file=sys.stderr, flush=True)
        if owns_group and dist.is_initialized():  # no barrier: a peer may never get there
            dist.destroy_process_group()  # the caller's process lives on (train() in a test)
        raise SystemExit(2) from None
    except RunStopped as stopped:  # every rank agreed on it
        if rank == 0:
            prefix = "autoplan: " if stopped.reason == "preempted" else "autoplan: error: "
            print(prefix + stopped.message, file=sys.stderr, flush=True)
            write_exit_file(args.run_dir, stopped)
        _leave(owns_group)
        raise SystemExit(stopped.status) from None
    finally:
        STOP.uninstall()
        for lock in locks:
            lock.release()


def _leave(owns_group: bool) -> None:
    # FSDP/DTensor state forms reference cycles that only the cyclic GC frees; left to
    # interpreter shutdown, their tensors and collective handles are destroyed after the
    # runtime is half torn down, where gloo can abort the process (SIGABRT seen in
    # tests/runtime/test_checkpoint.py; pytorch/pytorch PR #179291 describes the race)
    gc.collect()
    if owns_group:  # leave together: no rank tears down while a peer still talks
        dist.barrier()
        dist.destroy_process_group()


def stop_if_stopped_before(run_dir: str) -> None:
    """After torchrun restarted the workers of a run that stopped on purpose (NaN, full disk,
    preemption: <run_dir>/exit.json), stop again at once instead of replaying the steps."""
    record = earlier_stop(run_dir) if restart_count() else None
    if record is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"autoplan: not restarting: the run stopped with status {record['status']} "
                  f"({record.get('reason')}) at step {record.get('step')}", file=sys.stderr, flush=True)
        raise SystemExit(int(record["status"]))


def check_before_launch(meta: nn.Module, plan: Plan, args: TrainArgs, batch: Callable | None = None) -> None:
    """What launch.sh checks in one process before torchrun starts the ranks (--check-only):
    the plan against the model, the token file (size, dtype, every id below the vocabulary),
    that no other job holds the run directory, and with --resume the checkpoint to resume from.
    """
    validate_plan(meta, plan)
    check_inputs(meta, plan, args.data, batch)
    if args.data != "synthetic":
        count = check_token_file(args.data, vocab_size_of(meta), plan.seq_len, args.data_dtype)
        print(f"autoplan: --data {args.data}: {count:,} tokens, all ids below the vocabulary", flush=True)
    for directory in job_directories(args.run_dir, args.checkpoint_path):
        check_unlocked(directory, os.environ.get("AUTOPLAN_RUN_ID", ""))
    refuse_linked_run_files(args.run_dir)
    if args.resume:
        path = verified_checkpoint(args.checkpoint_path, _say)
        if path is not None:
            check_resume_data(path, args, _say)
        _say(f"autoplan: will resume from {path}" if path else
             f"autoplan: --resume: no complete checkpoint in {args.checkpoint_path}, the run starts "
             "from step 0")
