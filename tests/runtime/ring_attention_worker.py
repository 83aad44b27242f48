"""Ring attention against SDPA on the whole sequence, values and gradients.

usage: torchrun --nproc-per-node CP ring_attention_worker.py RESULTS.json
Each rank takes its zig-zag rows of q, k and v, runs RingAttention over the world group and
compares its output and its q/k/v gradient rows with causal SDPA on the full tensors (the
same on every rank: one seed). Cases: fp32 and bf16 on the fused CPU kernel, grouped-query
K/V, and the unfused fallback (what fp32 on CUDA uses). Rank 0 writes {case: max abs error}.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoplan.runtime import context_parallel
from autoplan.runtime.data import zigzag_positions

CASES = {"fp32": (torch.float32, 4, 4, True), "bf16": (torch.bfloat16, 4, 4, True),
         "gqa": (torch.float32, 4, 2, True), "unfused": (torch.float32, 4, 2, False)}


def _error(dtype, heads: int, kv_heads: int, fused: bool) -> float:
    rank, size = dist.get_rank(), dist.get_world_size()
    seq, dim = 8 * size, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, seq, dim, generator=gen).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(2, heads, seq, dim, generator=gen).to(dtype)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True).backward(grad)
    rows = zigzag_positions(seq, size, rank)
    local = [t[..., rows, :].clone().requires_grad_() for t in (q, k, v)]
    kernel = context_parallel._fused_kernel
    context_parallel._fused_kernel = lambda _q: fused
    try:
        out = context_parallel.RingAttention.apply(*local, dist.group.WORLD, dim ** -0.5)
        out.backward(grad[..., rows, :])
    finally:
        context_parallel._fused_kernel = kernel
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    pairs = [(out, expected[..., rows, :])] + [
        (mine.grad, whole.grad[..., rows, :]) for mine, whole in zip(local, full)]
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs)


def main(results: str) -> None:
    dist.init_process_group("gloo")
    errors = {name: _error(*case) for name, case in CASES.items()}
    if dist.get_rank() == 0:
        with open(results, "w") as f:
            json.dump(errors, f)
    dist.barrier()  # nobody tears down while a peer still talks
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
