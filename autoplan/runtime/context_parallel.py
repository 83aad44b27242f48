"""Context parallelism: ring attention over P2P ops with zig-zag load balancing.

Each CP rank holds the tokens at `zigzag_positions(seq, cp, rank)` (chunks r and 2cp-1-r),
so every rank does the same amount of causal work. Inside the attention modules the plan
names, `F.scaled_dot_product_attention` is replaced by `RingAttention`: K and V travel
around the cp ring (cp-1 hops, each overlapped with the attention of the block already
here); partial outputs are merged with their log-sum-exp (online softmax). The backward
passes K, V and their gradient accumulators around the ring again, so dK/dV arrive back
at their owner after cp hops. Grouped-query K/V (fewer heads than Q, SDPA's enable_gqa)
travel at their own size and are expanded to Q's heads only for each block's scores.
torch's own context_parallel() has no CPU SDPA sharding rule (torch 2.13), so this is used
on every device.
"""

from __future__ import annotations

import inspect
import math
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autoplan.errors import UserError
from autoplan.runtime.data import zigzag_positions
from autoplan.runtime.model_io import without_fake_causal_mask

_ORIGINAL_SDPA = F.scaled_dot_product_attention
_ACTIVE = threading.local()


def _ring_exchange(tensor: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, list]:
    """Start sending `tensor` to the next ring rank and receiving the previous rank's."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    recv = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), nxt, group),
           dist.P2POp(dist.irecv, recv, prv, group)]
    return recv, dist.batch_isend_irecv(ops)


def _expand_heads(t: torch.Tensor, repeat: int) -> torch.Tensor:
    """K/V (B, H_kv, S, D) -> (B, H_kv * repeat, S, D), each K/V head serving `repeat` query heads."""
    return t.repeat_interleave(repeat, dim=-3) if repeat > 1 else t


def _sum_head_groups(t: torch.Tensor, repeat: int) -> torch.Tensor:
    """Gradient w.r.t. expanded K/V back to the grouped heads: sum each group's copies."""
    return t.unflatten(-3, (-1, repeat)).sum(-3) if repeat > 1 else t


def _block_scores(q, k, q_pos, k_pos, scale):
    """Masked scaled scores (B, H, Sq, Sk) in fp32; causal by absolute position."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    mask = k_pos[None, :] > q_pos[:, None]
    return scores.masked_fill(mask, float("-inf"))


class RingAttention(torch.autograd.Function):
    """Causal attention of local q (positions q_pos) against all ranks' k/v."""

    @staticmethod
    def forward(ctx, q, k, v, group, seq_len, scale):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        q_pos = zigzag_positions(seq_len, size, rank).to(q.device)
        repeat = q.shape[-3] // k.shape[-3]
        kv = torch.stack([k, v])
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for hop in range(size):
            pending = _ring_exchange(kv, group) if hop < size - 1 else None
            src = (rank - hop) % size
            k_pos = zigzag_positions(seq_len, size, src).to(q.device)
            scores = _block_scores(q, _expand_heads(kv[0], repeat), q_pos, k_pos, scale)
            block_lse = torch.logsumexp(scores, dim=-1)
            block_out = torch.matmul(torch.exp(scores - block_lse[..., None]).nan_to_num(0.0),
                                     _expand_heads(kv[1], repeat).float())
            new_lse = torch.logaddexp(lse, block_lse)
            out = (out * torch.exp(lse - new_lse).nan_to_num(0.0)[..., None]
                   + block_out * torch.exp(block_lse - new_lse).nan_to_num(0.0)[..., None])
            lse = new_lse
            if pending is not None:
                kv_next, works = pending
                for work in works:
                    work.wait()
                kv = kv_next
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.seq_len, ctx.scale = group, seq_len, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, seq_len, scale = ctx.group, ctx.seq_len, ctx.scale
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        q_pos = zigzag_positions(seq_len, size, rank).to(q.device)
        repeat = q.shape[-3] // k.shape[-3]
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O)
        grad_q = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for hop in range(size):
            src = (rank - hop) % size
            k_pos = zigzag_positions(seq_len, size, src).to(q.device)
            k_full, v_full = _expand_heads(kv[0], repeat).float(), _expand_heads(kv[1], repeat).float()
            scores = _block_scores(q, k_full, q_pos, k_pos, scale)
            probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
            grad_kv[1] += _sum_head_groups(torch.matmul(probs.transpose(-1, -2), grad_out), repeat)
            grad_scores = probs * (torch.matmul(grad_out, v_full.transpose(-1, -2)) - delta)
            grad_q += torch.matmul(grad_scores, k_full) * scale
            grad_kv[0] += _sum_head_groups(torch.matmul(grad_scores.transpose(-1, -2), q.float()) * scale,
                                           repeat)
            # K/V go on to the next rank with their gradient accumulators (one message);
            # the accumulators are home again after `size` hops.
            both, works = _ring_exchange(torch.cat([kv.float(), grad_kv]), group)
            for work in works:
                work.wait()
            kv, grad_kv = both[:2].to(kv.dtype), both[2:]
        return (grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype),
                None, None, None)


def _cp_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
    state = getattr(_ACTIVE, "state", None)
    if state is None:
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    group, seq_len = state
    if attn_mask is not None or dropout_p or not is_causal:
        raise UserError("context parallelism supports causal SDPA without attn_mask or dropout; "
                        "pass is_causal=True and no mask, or use cp=1 for this model.")
    if query.shape[-3] != key.shape[-3] and (not enable_gqa or query.shape[-3] % key.shape[-3]):
        raise UserError("context parallelism got K/V with a different head count than Q: pass "
                        "enable_gqa=True to scaled_dot_product_attention (Q heads a multiple of "
                        "K/V heads), or repeat the K/V heads before the call.")
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    return RingAttention.apply(query, key, value, group, seq_len, scale)


def context_parallel_supported(module: nn.Module) -> str | None:
    """None when ring attention can replace this module's attention, else the reason.

    Two ways a module reaches F.scaled_dot_product_attention: its own forward calls it, or it
    is a Hugging Face attention module whose config selects the "sdpa" implementation (the
    call then sits in transformers' sdpa_attention_forward). Hugging Face marks causal
    attention with `is_causal`; ring attention is causal only."""
    if isinstance(module, nn.MultiheadAttention):
        return ("nn.MultiheadAttention passes causality as a mask (or not at all) to its "
                "attention, and ring attention is causal SDPA without a mask")
    config = getattr(module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is not None:
        if implementation != "sdpa":
            return (f"its attention implementation is {implementation!r}; context parallelism "
                    "replaces scaled_dot_product_attention, so build the model with "
                    "attn_implementation='sdpa'")
        if not getattr(module, "is_causal", False):
            return "it is not causal attention (is_causal is False); ring attention is causal only"
        return None
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        source = ""
    if "scaled_dot_product_attention" not in source:
        return ("its forward does not call F.scaled_dot_product_attention, the call context "
                "parallelism replaces with ring attention")
    return None


def check_cp_module(module: nn.Module, path: str) -> None:
    """Raise UserError naming the module when context parallelism cannot apply to it."""
    reason = context_parallel_supported(module)
    if reason is not None:
        raise UserError(f"plan.cp_modules names {path!r} ({type(module).__name__}): {reason}. "
                        "Use cp=1 for this model or list the modules that call SDPA.")


def apply_context_parallel(model: nn.Module, cp_modules: list[str], cp_buffers: dict[str, int],
                           group: dist.ProcessGroup, seq_len: int) -> None:
    """Swap SDPA for ring attention inside `cp_modules` and keep this rank's buffer rows."""
    F.scaled_dot_product_attention = _cp_sdpa  # inert outside the hooked modules
    modules = dict(model.named_modules())

    def enter(module, args, kwargs):
        _ACTIVE.state = (group, seq_len)
        return args, without_fake_causal_mask(module, kwargs)

    def leave(_module, _args, _out):
        _ACTIVE.state = None

    for path in cp_modules:
        if path in modules:
            modules[path].register_forward_pre_hook(enter, with_kwargs=True)
            modules[path].register_forward_hook(leave, always_call=True)
    positions = zigzag_positions(seq_len, dist.get_world_size(group), dist.get_rank(group))
    for path, dim in cp_buffers.items():
        owner_path, _, name = path.rpartition(".")
        owner = modules.get(owner_path)
        if owner is None or name not in owner._buffers:
            continue  # on another pipeline stage
        rows = owner._buffers[name][:seq_len].index_select(dim, positions.to(owner._buffers[name].device))
        owner._buffers[name] = rows.contiguous()
