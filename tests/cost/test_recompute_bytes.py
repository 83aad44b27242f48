"""The cost model's activation bytes per recomputation mode against what autoplan's runtime
really keeps: a small Llama block (and one whose MLP is autoplan's MoE) run on CPU under
runtime/recompute.py's wrappers, the bytes
of every storage created in forward that is still alive when forward returns (saved for
backward or cached by the selective checkpoint), deduplicated by storage."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.config import ParallelConfig
from autoplan.cost.memory import block_activation_bytes
from autoplan.models.llama import Attention, DecoderBlock, SwiGLU, rope_tables
from autoplan.models.moe import MoE
from autoplan.runtime.recompute import apply_recompute
from autoplan.trace.activations import saved_bytes_by_mode
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


def measured_kept_bytes(mode: str, fused_norm: bool = False, moe: bool = False) -> int:
    """Bytes one block keeps from forward to backward under the runtime's wrapper (bf16, CPU);
    `fused_norm`: RMSNorm keeps what the fused CUDA kernel saves (the dry run's shim)."""
    if fused_norm:
        from autoplan.dryrun.kernels import cuda_saved_tensors

        with cuda_saved_tensors():
            return measured_kept_bytes(mode, moe=moe)
    torch.manual_seed(0)
    model = _Blocks(1, moe).to(torch.bfloat16)
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
