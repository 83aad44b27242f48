"""Counts the collectives FSDP issues in one training step (one process group).

usage: torchrun --nproc-per-node 2 collectives_worker.py RESULTS.json RUN_DIR
For ZeRO-2 and ZeRO-3 plans with 1 and 4 micro-batches per step, rank 0 writes
{"zero<k>_m<m>": {"reduce_scatter": n, "all_gather": n}} for the second step (the first
builds FSDP's lazy state). For a bf16 ZeRO-1 plan it also writes the model-state bytes the
run holds ("zero1_bf16_states": parameters and gradients on rank 0, optimizer summed over
ranks, and the parameter count), and for bf16 ZeRO-2/3 (FSDP2) the sharded states summed over
ranks ("zero<k>_bf16_states"), which cost/memory.py's fp32_module_weights describes.
"""

import gc
import json
import sys
from collections import Counter

import torch
import torch.distributed as dist

from autoplan.plan import Plan
from autoplan.runtime import TrainArgs, Trainer, init_distributed
from runtime_models import SEED, builder, plan_dict

# FSDP2 (torch 2.13) issues its collectives through these two (_fsdp_collectives.py)
COUNTED = {"reduce_scatter_single": "reduce_scatter", "all_gather_single": "all_gather"}


def _count_calls(counts: Counter) -> None:
    for name, kind in COUNTED.items():
        original = getattr(dist, name)

        def counted(*args, _original=original, _kind=kind, **kwargs):
            counts[_kind] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def _zero1_bf16_states() -> dict:
    plan = Plan.from_dict(plan_dict(dp=2, zero_stage=1, precision="bf16"))
    trainer = Trainer(builder("llama"), plan, TrainArgs(steps=1, seed=SEED, log_every=10**9, run_dir=sys.argv[2]))

    def nbytes(t):
        return t.numel() * t.element_size()

    grads = {}  # the step frees gradients: record each as backward completes it
    for p in trainer.params:
        p.register_post_accumulate_grad_hook(lambda q: grads.__setitem__(id(q), nbytes(q.grad)))
    trainer.run()
    # ZeRO-1 keeps this rank's states in the local optimizers its owned() lists
    optimizer = sum(nbytes(v) for opt in trainer.optimizers for inner, _ in opt.owned()
                    for state in inner.state.values()
                    for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    total = torch.tensor([float(optimizer)])
    dist.all_reduce(total)
    return {"params": sum(p.numel() for p in trainer.params),
            "parameters": sum(nbytes(p) for p in trainer.params),
            "gradients": sum(grads.values()),
            "optimizer_all_ranks": float(total.item())}


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _fsdp_bf16_states(zero: int) -> dict:
    """Sharded parameter, gradient (read just before the optimizer step, which frees them)
    and Adam state bytes of a bf16 FSDP2 plan, summed over the ranks."""
    plan = Plan.from_dict(plan_dict(dp=2, zero_stage=zero, precision="bf16"))
    trainer = Trainer(builder("llama"), plan, TrainArgs(steps=1, seed=SEED, log_every=10**9, run_dir=sys.argv[2]))
    grads = []
    for opt in trainer.optimizers:
        def step(*args, _step=opt.step, **kwargs):
            grads.append(sum(_local_bytes(p.grad) for p in trainer.params if p.grad is not None))
            return _step(*args, **kwargs)
        opt.step = step
    trainer.run()
    optimizer = sum(_local_bytes(v) for opt in trainer.optimizers for state in opt.state.values()
                    for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    totals = torch.tensor([float(sum(_local_bytes(p) for p in trainer.params)), float(sum(grads)),
                           float(optimizer)])
    dist.all_reduce(totals)
    return {"params": sum(p.numel() for p in trainer.params), "parameters_all_ranks": totals[0].item(),
            "gradients_all_ranks": totals[1].item(), "optimizer_all_ranks": totals[2].item()}


def main() -> None:
    init_distributed()
    counts: Counter = Counter()
    _count_calls(counts)
    results = {}
    for zero in (2, 3):
        for microbatches in (1, 4):
            # every block its own FSDP unit, as in generated plans (which list each block's recompute)
            plan = Plan.from_dict(plan_dict(dp=2, zero_stage=zero, global_batch=2 * microbatches,
                                            recompute={f"layers.{i}": "none" for i in range(4)}))
            trainer = Trainer(builder("llama"), plan, TrainArgs(steps=1, seed=SEED, log_every=10**9, run_dir=sys.argv[2]))
            trainer.run()  # first step: FSDP's lazy init gathers once more
            counts.clear()
            trainer.step(1)
            results[f"zero{zero}_m{microbatches}"] = dict(counts)
    results["zero1_bf16_states"] = _zero1_bf16_states()
    for zero in (2, 3):
        results[f"zero{zero}_bf16_states"] = _fsdp_bf16_states(zero)
    if dist.get_rank() == 0:
        json.dump(results, open(sys.argv[1], "w"))
    gc.collect()  # free FSDP/DTensor cycles before teardown (runtime/loop.py train)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
