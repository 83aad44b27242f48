"""Ring attention against SDPA on the whole sequence, values and gradients.

usage: torchrun --nproc-per-node CP ring_attention_worker.py RESULTS.json
Each rank takes its zig-zag rows of q, k and v, runs RingAttention over the world group and
compares its output and its q/k/v gradient rows with SDPA on the full tensors (the same on
every rank: one seed), causal, and not causal for an encoder's attention. Cases: fp32 and bf16 on the fused CPU kernel, grouped-query
K/V, the unfused fallback (what fp32 on CUDA uses), and SDPA's call under bf16 autocast
with fp32 q/k and bf16 v (a Hugging Face model's RoPE under autocast from fp32 weights).
Rank 0 writes {"errors": {case: max abs error}, "sent": {case: {dtype: [messages, bytes]}}},
what each case's forward and backward sent on this rank.
"""

import gc
import json
import sys
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoplan.runtime import context_parallel
from autoplan.runtime.data import zigzag_positions

CASES = {"fp32": (torch.float32, 4, 4, True), "bf16": (torch.bfloat16, 4, 4, True),
         "gqa": (torch.float32, 4, 2, True), "unfused": (torch.float32, 4, 2, False),
         "autocast": (torch.float32, 4, 2, True),
         "encoder": (torch.float32, 4, 2, True), "encoder_unfused": (torch.float32, 4, 2, False)}
NOT_CAUSAL = {"encoder", "encoder_unfused"}  # an encoder's attention: every query sees every key
SENT: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))


def _recording(case: str):
    """context_parallel._ring_exchange, counting each message it sends under `case`."""
    exchange = context_parallel._ring_exchange

    def record(tensor, group):
        row = SENT[case][str(tensor.dtype).removeprefix("torch.")]
        row[0] += 1
        row[1] += tensor.numel() * tensor.element_size()
        return exchange(tensor, group)
    return exchange, record


def _ring(case: str, q, k, v):
    """Ring attention of the local rows, as the runtime calls it: the autocast case through the
    SDPA replacement under bf16 autocast, the others straight."""
    if case in NOT_CAUSAL:  # through the SDPA replacement, as an encoder's module calls it
        context_parallel._ACTIVE.state = dist.group.WORLD
        try:
            return context_parallel._cp_sdpa(q, k, v, is_causal=False, enable_gqa=True)
        finally:
            context_parallel._ACTIVE.state = None
    if case != "autocast":
        return context_parallel.RingAttention.apply(q, k, v, dist.group.WORLD, q.shape[-1] ** -0.5)
    context_parallel._ACTIVE.state = dist.group.WORLD
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return context_parallel._cp_sdpa(q, k, v.bfloat16(), is_causal=True, enable_gqa=True)
    finally:
        context_parallel._ACTIVE.state = None


def _whole(case: str, q, k, v):
    if case in NOT_CAUSAL:
        return F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True)
    if case != "autocast":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.scaled_dot_product_attention(q, k, v.bfloat16(), is_causal=True, enable_gqa=True)


def _error(case: str, dtype, heads: int, kv_heads: int, fused: bool) -> float:
    rank, size = dist.get_rank(), dist.get_world_size()
    seq, dim = 8 * size, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, seq, dim, generator=gen).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(2, heads, seq, dim, generator=gen).to(dtype)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    _whole(case, *full).backward(grad)
    rows = zigzag_positions(seq, size, rank)
    local = [t[..., rows, :].clone().requires_grad_() for t in (q, k, v)]
    kernel = context_parallel._fused_kernel
    exchange, context_parallel._ring_exchange = _recording(case)
    context_parallel._fused_kernel = lambda _q: fused
    try:
        out = _ring(case, *local)
        out.backward(grad[..., rows, :])
    finally:
        context_parallel._fused_kernel = kernel
        context_parallel._ring_exchange = exchange
    expected = _whole(case, q, k, v)
    pairs = [(out, expected[..., rows, :])] + [
        (mine.grad, whole.grad[..., rows, :]) for mine, whole in zip(local, full)]
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs)


def main(results: str) -> None:
    dist.init_process_group("gloo")
    errors = {name: _error(name, *case) for name, case in CASES.items()}
    if dist.get_rank() == 0:
        with open(results, "w") as f:
            json.dump({"errors": errors, "sent": SENT}, f)
    gc.collect()  # free DTensor cycles before teardown (runtime/loop.py train)
    dist.barrier()  # nobody tears down while a peer still talks
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
