"""The cost model's activation bytes per recomputation mode against what autoplan's runtime
really keeps: a small Llama block (and one whose MLP is autoplan's MoE) run on CPU under
runtime/recompute.py's wrappers, the bytes
of every storage created in forward that is still alive when forward returns (saved for
backward or cached by the selective checkpoint), deduplicated by storage."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.config import ParallelConfig
from autoplan.cost.memory import block_activation_bytes, float8_saved_input_delta_bytes
from autoplan.models.llama import Attention, DecoderBlock, SwiGLU, rope_tables
from autoplan.models.moe import MoE
from autoplan.runtime.recompute import apply_recompute
from autoplan.trace.activations import (gated_activation_excess_bytes, linear_saved_input_bytes,
                                        saved_bytes_by_mode)
from autoplan.trace.tracer import trace_model

H, HEADS, FFN, BATCH, SEQ = 96, 4, 256, 2, 64  # hidden != seq: no (b, s, s)-shaped residual
EXPERTS, TOP_K = 4, 2


class _Storages(TorchDispatchMode):
    """Weak references to the storage of every tensor an op creates."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.refs.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        return out


class _Blocks(nn.Module):
    def __init__(self, layers: int, moe: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(
            DecoderBlock(H, Attention(H, HEADS, HEADS, H // HEADS, False),
                         MoE(H, FFN, EXPERTS, TOP_K) if moe else SwiGLU(H, FFN), 1e-5)
            for _ in range(layers))
        cos, sin = rope_tables(H // HEADS, SEQ, 1e4)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return x


def measured_kept_bytes(mode: str, fused_norm: bool = False, moe: bool = False, kernels=None) -> int:
    """Bytes one block keeps from forward to backward under the runtime's wrapper (bf16, CPU);
    `fused_norm`: RMSNorm keeps what the fused CUDA kernel saves (the dry run's shim);
    `kernels`: a function that swaps the block's modules for ones saving what a library's do."""
    if fused_norm:
        from autoplan.dryrun.kernels import cuda_saved_tensors

        with cuda_saved_tensors():
            return measured_kept_bytes(mode, moe=moe, kernels=kernels)
    torch.manual_seed(0)
    model = _Blocks(1, moe).to(torch.bfloat16)
    if kernels is not None:
        kernels(model)
    apply_recompute(model, {"layers.0": mode})
    x0 = torch.randn(BATCH, SEQ, H, dtype=torch.bfloat16, requires_grad=True)
    outside = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers(), x0)}
    tracker = _Storages()
    with tracker:
        x = x0 * 1  # the block input, as the previous block's output would be
        y = model(x)
    del x
    kept = sum(n for key, (ref, n) in tracker.refs.items()
               if not ref.expired() and key not in outside and key != y.untyped_storage()._cdata)
    y.float().sum().backward()  # the wrapper really runs backward from what it kept
    return kept


@pytest.fixture(scope="module")
def traced_block():
    with torch.device("meta"):
        model = _Blocks(2)
    graph = trace_model(model, (torch.empty(BATCH, SEQ, H, device="meta"),))
    return graph, graph.segment("layers")


@pytest.fixture(scope="module")
def traced_moe_block():
    with torch.device("meta"):
        model = _Blocks(2, moe=True)
    graph = trace_model(model, (torch.empty(BATCH, SEQ, H, device="meta"),))
    return graph, graph.segment("layers")


def test_selective_moe_bytes_are_every_expert_gemm_output(traced_moe_block):
    # The selective checkpoint saves every mm output inside the MoE: each routed token slot's
    # gate, up and down outputs (2 x FFN + H) and the router's logits, however the router
    # spreads the tokens; the trace folds the MoE into one op, whose T x H output alone was
    # what the cost model counted. Equal up to float rounding.
    graph, block = traced_moe_block
    measured = measured_kept_bytes("selective", moe=True)
    expert_outputs = BATCH * SEQ * (TOP_K * (2 * FFN + H) + EXPERTS) * 2  # bf16
    assert expert_outputs > measured / 2  # the experts dominate what this block keeps
    assert saved_bytes_by_mode(graph, block)["selective"] == pytest.approx(measured, rel=1e-9)


def test_selective_and_full_bytes_are_what_the_runtime_keeps(traced_block):
    # The selective checkpoint caches exactly the outputs of the ops it must save, which
    # the trace records with their shapes: equal up to float rounding.
    graph, block = traced_block
    modes = saved_bytes_by_mode(graph, block)
    for mode in ("selective", "full"):
        assert modes[mode] == pytest.approx(measured_kept_bytes(mode), rel=1e-9), mode


def test_no_recompute_bytes_follow_autograd_within_ten_percent(traced_block):
    # "none" is autograd's saved tensors with the decomposed norms' fp32 copies removed (a
    # fused CUDA norm does not keep them), while on CPU torch's RMSNorm decomposes and keeps
    # them: the traced raw bytes are compared. 10%: the trace attributes RoPE's dtype-cast
    # cos/sin tables once per tensor, the CPU run casts them per call, a few percent here.
    graph, block = traced_block
    measured = measured_kept_bytes("none")
    assert block.saved_bytes == pytest.approx(measured, rel=0.10)
    assert saved_bytes_by_mode(graph, block)["none"] < measured  # fused norms keep less


def test_no_recompute_bytes_are_what_autograd_keeps_with_fused_norms(traced_block):
    # With RMSNorm saving what the fused CUDA kernel saves, "none" is autograd's storages:
    # the output projection's input a view of the attention kernel's saved output, counted
    # once. 1%: the trace attributes RoPE's 16-bit cos/sin tables to its multiplications
    # (q/k-sized), the run keeps the small (seq, head_dim / 2) casts.
    graph, block = traced_block
    assert saved_bytes_by_mode(graph, block)["none"] == pytest.approx(
        measured_kept_bytes("none", fused_norm=True), rel=0.01)


def test_modes_order_and_the_cost_model_uses_them(traced_block):
    graph, block = traced_block
    config = ParallelConfig(global_batch=BATCH, seq_len=SEQ, micro_batch=BATCH)
    costed = {m: block_activation_bytes(graph, block, config, m) for m in ("none", "selective", "full")}
    modes = saved_bytes_by_mode(graph, block)
    assert costed == pytest.approx(modes, rel=1e-9)
    assert costed["full"] < costed["selective"] < costed["none"]
    megatron = block_activation_bytes(graph, block, config, "selective", selective_policy="attention_core")
    assert megatron == pytest.approx(costed["none"], rel=1e-9)  # SDPA: no s^2 tensors to drop


class _FusedSwiGLUFn(torch.autograd.Function):
    """silu(gate) * up saving its inputs only, as Megatron-Core's SwiGLUFunction does
    (megatron/core/fusions/fused_bias_swiglu.py); silu is recomputed in backward."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        return grad * up * sig * (1 + gate * (1 - sig)), grad * F.silu(gate)


def _fused_swiglu(model: nn.Module) -> None:
    for mlp in (m for m in model.modules() if isinstance(m, SwiGLU)):
        mlp.forward = lambda x, m=mlp: m.down_proj(_FusedSwiGLUFn.apply(m.gate_proj(x), m.up_proj(x)))


class _Float8InputLinearFn(torch.autograd.Function):
    """A linear that keeps the float8 copy of its input for the weight gradient, as Transformer
    Engine's Linear does under fp8; `cache` shares one copy between linears reading one tensor,
    as Megatron's fused QKV and gate-up projections quantize it once."""

    @staticmethod
    def forward(ctx, x, weight, cache):
        key = x.untyped_storage()._cdata
        if key not in cache:
            cache[key] = x.detach().to(torch.float8_e4m3fn)
        ctx.save_for_backward(cache[key], weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x8, weight = ctx.saved_tensors
        x = x8.to(grad.dtype)
        return grad @ weight, grad.flatten(0, -2).t() @ x.flatten(0, -2), None


def _float8_input_linears(model: nn.Module) -> None:
    cache: dict[int, torch.Tensor] = {}
    for linear in (m for m in model.modules() if isinstance(m, nn.Linear)):
        linear.forward = lambda x, m=linear: _Float8InputLinearFn.apply(x, m.weight, cache)


def test_fused_gated_activation_keeps_what_the_cost_model_counts(traced_block):
    # A fused SwiGLU saves gate and up but not silu(gate): the measured difference is the
    # trace's gated-activation excess, and the cost model drops exactly that. Equal up to
    # float rounding (one (batch, seq, ffn) bf16 tensor).
    graph, block = traced_block
    eager = measured_kept_bytes("none", fused_norm=True)
    fused = measured_kept_bytes("none", fused_norm=True, kernels=_fused_swiglu)
    excess = gated_activation_excess_bytes(graph, block)
    assert excess == BATCH * SEQ * FFN * 2
    assert eager - fused == pytest.approx(excess, rel=1e-9)
    config = ParallelConfig(global_batch=BATCH, seq_len=SEQ, micro_batch=BATCH)
    costed = block_activation_bytes(graph, block, config, "none", fused_gated_activation=True)
    assert costed == pytest.approx(saved_bytes_by_mode(graph, block)["none"] - excess, rel=1e-9)
    full = block_activation_bytes(graph, block, config, "full", fused_gated_activation=True)
    assert full == block_activation_bytes(graph, block, config, "full")  # the block input only


def test_float8_saved_inputs_change_what_the_block_keeps_as_measured(traced_block):
    # Linears keeping a float8 copy of their input: the norm outputs and the down projection's
    # input shrink to 1 B an element, the output projection's input (the attention kernel's
    # saved output) gains a float8 copy beside it. The cost model's change is the measured one
    # up to float rounding, and it is a saving.
    graph, block = traced_block
    config = ParallelConfig(global_batch=BATCH, seq_len=SEQ, micro_batch=BATCH, precision="fp8")
    bf16 = measured_kept_bytes("none", fused_norm=True)
    float8 = measured_kept_bytes("none", fused_norm=True, kernels=_float8_input_linears)
    delta = float8_saved_input_delta_bytes(graph, block, config, 1.0)
    assert delta < 0
    assert float8 - bf16 == pytest.approx(delta, rel=1e-9)
    own, shared = linear_saved_input_bytes(graph, block)
    assert (own, shared) == (BATCH * SEQ * (2 * H + FFN) * 2, BATCH * SEQ * H * 2)


def test_moe_gated_experts_excess_is_one_activation_per_routed_slot(traced_moe_block):
    # The MoE traced as one op runs silu(gate) * up per expert: a fused kernel drops one
    # (routed slot, expert width) tensor, and the routed experts' inputs are the slots at the
    # hidden width (gate, up) and at the expert width (down).
    graph, block = traced_moe_block
    assert gated_activation_excess_bytes(graph, block) == BATCH * SEQ * TOP_K * FFN * 2
    assert linear_saved_input_bytes(graph, block)[0] >= BATCH * SEQ * TOP_K * (H + FFN) * 2
