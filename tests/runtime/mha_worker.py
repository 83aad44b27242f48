"""Head-parallel nn.MultiheadAttention (mha_parallel.py) computes what the module computes.

usage: torchrun --nproc-per-node 2 mha_worker.py RESULTS.json
For each case the same module runs whole on every rank (the reference) and split by heads
over the 2 ranks, on the same inputs and output gradient; rank 0 writes {case: {quantity:
max abs difference}} over the output, the attention weights, the inputs' gradients and
the in_proj/out_proj weight gradients (gathered, in the model's row order).
"""

import copy
import gc
import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from autoplan.runtime.fused_projection import ROW_ORDER
from autoplan.runtime.mha_parallel import MultiheadAttentionParallel

E, HEADS, BATCH = 32, 4, 2


def transformer_case(sp: bool):
    """A tiny nn.Transformer (sequence first): the encoder's self-attention, the decoder's
    causal self-attention (mask + is_causal) and its cross-attention over the encoder's
    output with a padding mask. Without SP: every input whole."""
    model = nn.Transformer(E, HEADS, 1, 1, 64, dropout=0.0)
    src, tgt = torch.randn(8, BATCH, E), torch.randn(6, BATCH, E)
    padding = torch.zeros(BATCH, 8, dtype=torch.bool)
    padding[1, -3:] = True

    def call(m, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(6)
        return m(src, tgt, tgt_mask=mask, tgt_is_causal=True, memory_key_padding_mask=padding)

    return model, (src, tgt), call, None


def masked_weights_case(sp: bool):
    """A lone sequence-first module under SP: a 3-D float mask of one (L, S) slice per
    (batch, head), a key padding mask, every head's weights returned."""
    model = nn.MultiheadAttention(E, HEADS)
    x = torch.randn(8, BATCH, E)
    mask = torch.randn(BATCH * HEADS, 8, 8)
    padding = torch.zeros(BATCH, 8, dtype=torch.bool)
    padding[0, :2] = True

    def call(m, x):
        return m(x, x, x, attn_mask=mask, key_padding_mask=padding, average_attn_weights=False)

    return model, (x,), call, 0


def batch_first_case(sp: bool):
    """A batch-first module under SP, its weights averaged over heads."""
    model = nn.MultiheadAttention(E, HEADS, batch_first=True)
    x = torch.randn(BATCH, 8, E)
    return model, (x,), lambda m, x: m(x, x, x), 1


CASES = {"transformer_whole_inputs": transformer_case, "masked_weights_sp": masked_weights_case,
         "batch_first_sp": batch_first_case}


def _shard(t: torch.Tensor, dim, rank: int) -> torch.Tensor:
    return t if dim is None else t.chunk(2, dim=dim)[rank]


def _model_order(param, module) -> torch.Tensor:
    grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
    order = getattr(module, ROW_ORDER, None)
    if order is None or grad.shape[0] != order.numel():
        return grad
    out = torch.empty_like(grad)
    out[order] = grad
    return out


def run_case(build, mesh, rank: int) -> dict[str, float]:
    torch.manual_seed(0)
    model, inputs, call, seq_dim = build(True)
    split = copy.deepcopy(model)
    sp = seq_dim is not None
    parallelize_module(split, mesh, {name: MultiheadAttentionParallel(sp) for name, m in split.named_modules()
                                     if isinstance(m, nn.MultiheadAttention)})
    ref_in = [x.clone().requires_grad_() for x in inputs]
    out_ref = call(model, *ref_in)
    local_in = [_shard(x, seq_dim, rank).clone().requires_grad_() for x in inputs]
    out = call(split, *local_in)
    (out_ref, w_ref), (out, w) = (o if isinstance(o, tuple) else (o, None) for o in (out_ref, out))
    grad = torch.randn(out_ref.shape)
    out_ref.backward(grad)
    out.backward(_shard(grad, seq_dim, rank))
    diffs = {"output": (out - _shard(out_ref, seq_dim, rank)).abs().max().item()}
    if w_ref is not None:
        diffs["weights"] = (w - w_ref).abs().max().item()
    for i, (a, b) in enumerate(zip(local_in, ref_in)):
        diffs[f"input{i}_grad"] = (a.grad - _shard(b.grad, seq_dim, rank)).abs().max().item()
    modules = dict(split.named_modules())
    for name, param in split.named_parameters():
        owner = modules[name.rpartition(".")[0]]
        want = dict(model.named_parameters())[name].grad
        diffs[f"{name}_grad"] = (_model_order(param, owner) - want).abs().max().item()
    return diffs


def main(results_path: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    results = {name: run_case(build, mesh, rank) for name, build in CASES.items()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        worst = {name: {k: max(r[name][k] for r in gathered) for k in results[name]} for name in results}
        with open(results_path, "w") as f:
            json.dump(worst, f)
    gc.collect()  # free DTensor cycles before teardown (runtime/loop.py train)
    dist.barrier()  # nobody tears down while a peer still talks
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
