"""Context parallelism: ring attention over P2P ops with zig-zag load balancing.

Each CP rank holds the tokens at `zigzag_positions(seq, cp, rank)` (chunks r and 2cp-1-r),
so every rank does the same amount of causal work. Inside the attention modules the plan
names, `F.scaled_dot_product_attention` is replaced by `RingAttention`: K and V travel
around the cp ring (cp-1 hops, each overlapped with the attention of the block already
here). Each hop runs the fused flash kernel SDPA itself uses on one block (the scores are
never materialised, so memory grows with the sequence, not its square) and the partial
outputs are merged with their log-sum-exp (online softmax), as torch's own ring attention
does. The backward passes K and V around the ring again in their own dtype (cp-1 hops,
each prefetched under the block before), and beside them, one hop behind, the fp32
accumulators of the gradients of the K/V block each rank holds: the rank after the owner
starts one, each rank adds its share and passes it on, and the owner adds the one that
arrives after cp-1 hops to its own share, kept at home. (torch's ring attention,
_templated_ring_attention_backward, starts the accumulator at the owner and sends it cp
hops; Transformer Engine's sends it in K/V's 16-bit dtype.) The accumulators stay fp32 as
torch's do (_cp_options.convert_to_f32): each hop adds a partial sum, and rounding it to 16
bits cp-1 times would compound. Grouped-query K/V (fewer heads than Q, SDPA's enable_gqa)
travel at their own size and are expanded to Q's heads per block. Under torch.autocast,
q/k/v are cast to its dtype first, as autocast casts SDPA's inputs (a model's fp32 RoPE
tables would otherwise hand the ring fp32 q and k). torch's own context_parallel() has no
CPU SDPA sharding rule (torch 2.13), so this is used on every device.
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
from autoplan.runtime import rng
from autoplan.runtime.data import zigzag_positions
from autoplan.runtime.model_io import attended_length, without_causal_only_mask

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


def _fused_kernel(q: torch.Tensor) -> bool:
    """Whether the fused flash kernel takes these blocks: always on CPU; on CUDA for 16-bit
    inputs with a head size it supports (torch's sdp_utils: FlashAttention-2 needs fp16/bf16
    and head dim <= 256)."""
    if q.device.type == "cpu":
        return True
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def _block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, list]:
    """One block's attention output and fp32 log-sum-exp (B, H, Sq), by the kernel SDPA itself
    uses: O(S) memory, the scores never materialised. The unfused fallback (fp32 on CUDA)
    holds one block's fp32 scores while it runs."""
    if not _fused_kernel(q):
        scores = _unfused_scores(q, k, causal, scale)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
        return torch.matmul(probs, v.float()).to(q.dtype), lse, []
    if q.is_cuda:
        out, lse, *rest = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse, rest
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                         scale=scale)
    return out, lse, []


def _block_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float, rest: list):
    """(dq, dk, dv) of one block given the merged output and log-sum-exp of all blocks (the
    softmax normaliser of the whole row, so each block's share comes out right)."""
    if not _fused_kernel(q):
        scores = _unfused_scores(q, k, causal, scale)
        probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
        grad_out, v = grad_out.float(), v.float()
        delta = (grad_out * out.float()).sum(-1, keepdim=True)  # rowsum(dO * O)
        grad_scores = probs * (torch.matmul(grad_out, v.transpose(-1, -2)) - delta)
        return (torch.matmul(grad_scores, k.float()) * scale,
                torch.matmul(grad_scores.transpose(-1, -2), q.float()) * scale,
                torch.matmul(probs.transpose(-1, -2), grad_out))
    if q.is_cuda:
        # as torch's own ring attention does: the first block's varlen/rng outputs serve every
        # block (unused without dropout and with dense batches)
        cum_q, cum_k, _, _, seed, offset, _ = rest
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cum_q, cum_k, q.shape[-2], k.shape[-2], 0.0, causal,
            seed, offset, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)


def _unfused_scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """Scaled scores (B, H, Sq, Sk) in fp32, causal over the block's own positions."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def _ring_blocks(hop: int, rank: int, causal: bool = True) -> tuple[bool, str]:
    """Which part of the zig-zag layout attends at this hop: (causal, part).

    A rank holds chunks (r, 2cp-1-r) of the sequence. Its own K/V (hop 0): both chunks,
    causal. K/V from an earlier ring rank s < r: every local query sees their first chunk
    (s < r) and none sees their second (2cp-1-s > 2cp-1-r > r): "first kv". From a later
    rank s > r: only the second local chunk of queries attends, to both chunks: "second q".
    Without causality (an encoder) every query sees every key at every hop.
    """
    if not causal:
        return False, "all"
    if hop == 0:
        return True, "all"
    return False, "first kv" if hop <= rank else "second q"


def _merged(out, lse, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The running fp32 (out, lse) with one block's (output, lse) folded in; the sigmoid form
    of the online-softmax update is the numerically stable one (ring-flash-attention, as
    torch's ring attention merges). Out of place: selective recompute may hold the block's
    tensors."""
    block_out, block_lse = block_out.float(), block_lse.float()
    return (out - torch.sigmoid(block_lse - lse)[..., None] * (out - block_out),
            lse - F.logsigmoid(lse - block_lse))


class RingAttention(torch.autograd.Function):
    """Attention of local q (zig-zag chunks) against all ranks' k/v, causal or not."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, causal_model=True):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        repeat, half = q.shape[-3] // k.shape[-3], q.shape[-2] // 2
        kv = torch.stack([k, v])
        out = lse = first_rest = None
        for hop in range(size):
            pending = _ring_exchange(kv, group) if hop < size - 1 else None
            causal, part = _ring_blocks(hop, rank, causal_model)
            kk, vv = _expand_heads(kv[0], repeat), _expand_heads(kv[1], repeat)
            if part == "first kv":
                kk, vv = kk[..., :half, :], vv[..., :half, :]
            qq = q[..., half:, :] if part == "second q" else q
            block_out, block_lse, rest = _block_forward(qq.contiguous(), kk.contiguous(),
                                                        vv.contiguous(), causal, scale)
            if out is None:
                out, lse, first_rest = block_out.float(), block_lse.float(), rest
            elif part == "second q":
                tail_out, tail_lse = _merged(out[..., half:, :], lse[..., half:], block_out,
                                             block_lse)
                out = torch.cat([out[..., :half, :], tail_out], dim=-2)
                lse = torch.cat([lse[..., :half], tail_lse], dim=-1)
            else:
                out, lse = _merged(out, lse, block_out, block_lse)
            if pending is not None:
                kv = _arrived(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.rest, ctx.causal_model = group, scale, first_rest, causal_model
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        repeat, half = q.shape[-3] // k.shape[-3], q.shape[-2] // 2
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        own = arriving = None  # this rank's share of its K/V's gradient; the accumulator in transit
        for hop in range(size):
            # the K/V block of the next hop travels while this one's gradients are computed
            pending = _ring_exchange(kv, group) if hop < size - 1 else None
            causal, part = _ring_blocks(hop, rank, ctx.causal_model)
            kk, vv = _expand_heads(kv[0], repeat), _expand_heads(kv[1], repeat)
            rows = slice(half, None) if part == "second q" else slice(None)
            cols = slice(None, half) if part == "first kv" else slice(None)
            dq, dk, dv = _block_backward(
                grad_out[..., rows, :].contiguous(), q[..., rows, :].contiguous(),
                kk[..., cols, :].contiguous(), vv[..., cols, :].contiguous(),
                out[..., rows, :].contiguous(), lse[..., rows].contiguous(), causal, scale,
                ctx.rest)
            grad_q[..., rows, :] += dq
            # the gradient of the K/V block held at this hop, fp32: a fresh accumulator at hop 0
            # (this rank's own share, kept) and hop 1 (the first rank after the owner), else
            # the one the previous rank passed on
            acc = _arrived(arriving) if hop > 1 else torch.zeros(kv.shape, dtype=torch.float32,
                                                                  device=q.device)
            acc[0][..., cols, :] += _sum_head_groups(dk.float(), repeat)
            acc[1][..., cols, :] += _sum_head_groups(dv.float(), repeat)
            if hop == 0:
                own = acc
            else:  # on to the next rank, which holds this K/V block at the next hop
                arriving = _ring_exchange(acc, group)
            if pending is not None:
                kv = _arrived(pending)
        grad_kv = own + _arrived(arriving) if arriving is not None else own
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None


def _arrived(exchange: tuple[torch.Tensor, list]) -> torch.Tensor:
    """The tensor an exchange (_ring_exchange) receives, once its send and receive are done."""
    received, works = exchange
    for work in works:
        work.wait()
    return received


def _cp_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
    state = getattr(_ACTIVE, "state", None)
    if state is None:
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    group = state
    if attn_mask is not None or dropout_p:
        raise UserError("context parallelism supports SDPA without attn_mask or dropout (causal via "
                        "is_causal=True, or not causal); pass no mask, or use cp=1 for this model.")
    if query.shape[-3] != key.shape[-3] and (not enable_gqa or query.shape[-3] % key.shape[-3]):
        raise UserError("context parallelism got K/V with a different head count than Q: pass "
                        "enable_gqa=True to scaled_dot_product_attention (Q heads a multiple of "
                        "K/V heads), or repeat the K/V heads before the call.")
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    value_dim = value.shape[-1]
    query, key, value = _one_head_dim(query, key, value)
    device = query.device.type
    if not torch.amp.is_autocast_available(device):
        return RingAttention.apply(query, key, value, group, scale, is_causal)[..., :value_dim]
    if torch.is_autocast_enabled(device):
        # as autocast casts SDPA's inputs (on its lower-precision list): the ring then sends
        # 16-bit K/V and the fused kernel takes them
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    with torch.autocast(device, enabled=False):  # the ring's fp32 merges stay fp32
        return RingAttention.apply(query, key, value, group, scale, is_causal)[..., :value_dim]


def _one_head_dim(query, key, value):
    """Q, K and V zero-padded to one head size, for the ring that sends K and V together and
    the fused kernel that wants one size (MLA's q/k heads are wider than its v heads). Zero
    features add nothing to a score (the scale is the caller's, from the unpadded q) and
    give zero output columns, which the caller slices off."""
    qk_dim, v_dim = key.shape[-1], value.shape[-1]
    if qk_dim > v_dim:
        value = F.pad(value, (0, qk_dim - v_dim))
    elif v_dim > qk_dim:
        query, key = F.pad(query, (0, v_dim - qk_dim)), F.pad(key, (0, v_dim - qk_dim))
    return query, key, value


def context_parallel_supported(module: nn.Module) -> str | None:
    """None when ring attention can replace this module's attention, else the reason.

    Three ways a module reaches F.scaled_dot_product_attention: its own forward calls it, it
    is a Hugging Face attention module whose config selects the "sdpa" implementation (the
    call then sits in transformers' sdpa_attention_forward), or it is an
    nn.MultiheadAttention called with need_weights=False (F.multi_head_attention_forward,
    or the head-parallel forward of mha_parallel.py, calls it). Ring attention runs causal
    attention and attention without a mask (an encoder's); a mask it cannot shard (padding,
    a relative position bias) is refused when the call passes one."""
    if isinstance(module, nn.MultiheadAttention):  # F.multi_head_attention_forward calls SDPA
        return None
    config = getattr(module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is not None:
        if implementation != "sdpa":
            return (f"its attention implementation is {implementation!r}; context parallelism "
                    "replaces scaled_dot_product_attention, so build the model with "
                    "attn_implementation='sdpa'")
        return None
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        source = ""
    if "scaled_dot_product_attention" not in source:
        return ("its forward does not call F.scaled_dot_product_attention, the call context "
                "parallelism replaces with ring attention")
    return None


_MHA_PARAMETERS = list(inspect.signature(nn.MultiheadAttention.forward).parameters)[1:]


def _check_mha_call(args: tuple, kwargs: dict) -> None:
    """nn.MultiheadAttention reaches SDPA only when no attention weights are asked for
    (need_weights=False; with weights it multiplies and softmaxes itself, over this rank's
    keys alone)."""
    bound = dict(zip(_MHA_PARAMETERS, args)) | kwargs
    if bound.get("need_weights", True):
        raise UserError("context parallelism runs nn.MultiheadAttention through ring attention, "
                        "which returns no attention weights: call it with need_weights=False "
                        "(as nn.TransformerEncoderLayer does), or use cp=1 for this model.")


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
        if isinstance(module, nn.MultiheadAttention):
            _check_mha_call(args, kwargs)
        _ACTIVE.state = group
        return args, without_causal_only_mask(module, kwargs, attended_length(args, kwargs))

    def leave(_module, _args, _out):
        _ACTIVE.state = None

    if any(isinstance(modules.get(path), nn.MultiheadAttention) for path in cp_modules):
        # the inference fast path of nn.MultiheadAttention and TransformerEncoderLayer runs
        # a fused kernel, not SDPA: attention over this rank's tokens only
        torch.backends.mha.set_fastpath_enabled(False)
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


def mark_sequence_shards(model: nn.Module, blocks: list[str], cp_rank: int) -> None:
    """Every activation of this rank is its part of the sequence: dropout draws its masks
    from the rank's own stream (rng.ShardDropouts) through the forward, and through each
    block recomputed in backward (opened there, it ends with the backward: the autograd
    engine restores torch's function-mode stack). Random ops that are not a mask over an
    activation (a drop-path's per-sample draw) keep the shared stream: a sample's parts on
    the ranks must agree on them."""
    regions = rng.ShardRegions(cp_rank)
    modules = dict(model.named_modules())
    for module in [model] + [modules[path] for path in blocks if path in modules]:
        # before tensor parallelism's hooks: its regions open inside this one
        module.register_forward_pre_hook(lambda m, args: regions.open(), prepend=True)
    model.register_forward_hook(lambda m, args, out: regions.close())
