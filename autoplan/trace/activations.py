"""Bytes one block copy keeps for backward, per recomputation mode: the one definition that
`analyze` reports and the cost model scales.

- none: what autograd saves (the traced saved-tensor hooks), without the attention core's
  s^2 tensors when a FlashAttention kernel runs (Dao et al. 2022 §3.1), and with fused
  norm kernels, which save their input and per-row statistics only, not the upcast copies
  a decomposed norm saves (Apex / Transformer Engine / torch's fused RMSNorm on CUDA), and
  with the output projection's input counted once: a view of the fused attention kernel's
  saved output (attention_output_reuse_bytes).
- selective, policy "op" (autoplan's runtime, runtime/recompute.py; torchtitan's "op" SAC):
  torch's selective checkpoint keeps the outputs of the ops it must save -- matmuls
  (linear, matmul, expert GEMMs, the router) and the attention kernel (its output and fp32
  log-sum-exp) -- plus the block input, and recomputes everything else in backward.
- selective, policy "attention_core" (Megatron-LM --recompute-granularity selective,
  Korthikanti et al. 2022 §5 Eq. 6): "none" without the attention core's s^2 tensors.
- full: the block input only (Korthikanti et al. 2022 §5: 2sbh).

All bytes are at the traced batch, sequence length and dtype (ModelGraph).
"""

from __future__ import annotations

from autoplan.trace.graph import BlockInfo, ModelGraph, OpInfo, per_block

SELECTIVE_POLICIES = ("op", "attention_core")
# op kinds whose outputs torch's selective-checkpoint policy in runtime/recompute.py saves
# (aten mm/addmm/bmm and the SDPA kernels)
SAC_SAVED_KINDS = ("linear", "matmul", "attention", "expert", "moe_router")
LSE_BYTES = 4  # SDPA kernels save one fp32 log-sum-exp per query row and head


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def block_ops(graph: ModelGraph, block: BlockInfo) -> list[OpInfo]:
    """Ops of the block's first copy in the traced graph (empty for hand-built graphs)."""
    return list(_block_ops(graph, block))


@per_block
def _block_ops(graph: ModelGraph, block: BlockInfo) -> tuple[OpInfo, ...]:
    return tuple(graph.graph.nodes[n]["op"] for n in graph.block_nodes(block))


def fused_norm_excess_bytes(ops: list[OpInfo], dtype_bytes: int) -> float:
    """Bytes the traced (decomposed) norms save beyond what a fused norm kernel keeps."""
    excess = 0.0
    for op in ops:
        if op.kind == "norm" and op.input_shapes and op.input_shapes[0]:
            excess += max(0.0, op.saved_bytes - _numel(op.input_shapes[0]) * dtype_bytes)
    return excess


@per_block
def attention_output_reuse_bytes(graph: ModelGraph, block: BlockInfo) -> float:
    """Bytes traced twice where a linear saves the attention kernel's output as its input: the
    fused SDPA kernels (FlashAttention, memory-efficient, cuDNN; CPU flash as well) write their
    output in (batch, seq, heads, head_dim) order and return a transposed view, so the
    `transpose(1, 2).reshape` before the output projection is a view of the tensor the kernel
    already saves, one storage that autograd keeps once (measured by `autoplan check`)."""
    g = graph.graph
    reused = 0.0
    for name in graph.block_nodes(block):
        op = g.nodes[name]["op"]
        if op.kind != "linear":
            continue
        source = _through_views(g, name)
        if source is not None and g.nodes[source]["op"].kind == "attention":
            reused += min(float(op.saved_bytes), _numel(op.input_shapes[0]) * graph.dtype_bytes
                          if op.input_shapes else 0.0)
    return reused


@per_block
def linear_saved_input_bytes(graph: ModelGraph, block: BlockInfo) -> tuple[float, float]:
    """(own, shared) bytes of the inputs a block's linears save for their weight gradient, at
    the traced batch and dtype, each input tensor once (q, k and v read one norm output):
    `shared` are the inputs that are views of the attention kernel's output, which the kernel
    saves as well (attention_output_reuse_bytes); `own` the rest, saved for the linears alone.
    A MoE module traced as one op adds its routed experts' inputs: each routed token slot
    (tokens x top_k) enters the first GEMMs at the hidden width and the last at the expert's."""
    g = graph.graph
    own: dict[str, float] = {}
    shared = 0.0
    for name in graph.block_nodes(block):
        op = g.nodes[name]["op"]
        if op.kind == "expert" and op.output_shape and block.top_k:
            own[name] = float(_routed_slots(op, block) * (block.hidden + routed_expert_width(op, block)[0])
                              * graph.dtype_bytes)
        if op.kind != "linear" or not op.input_shapes:
            continue
        nbytes = float(_numel(op.input_shapes[0]) * graph.dtype_bytes)
        source = _through_views(g, name)
        if source is not None and g.nodes[source]["op"].kind == "attention":
            shared += nbytes
        else:
            own[source or name] = nbytes
    return sum(own.values()), shared


@per_block
def gated_activation_excess_bytes(graph: ModelGraph, block: BlockInfo) -> float:
    """Bytes the traced gated MLPs save beyond what a fused gated-activation kernel keeps, at
    the traced batch and dtype. Run op by op, act(gate) * up saves the gate for the activation
    and act(gate) and up for the product; a fused kernel (Megatron-Core's bias_swiglu_impl,
    megatron/core/fusions/fused_bias_swiglu.py, saves its input, the gate and up halves, and
    recomputes the activation in backward) does without act(gate). A MoE module traced as one
    op runs its gated experts op by op: one act(gate) per routed token slot and expert width."""
    g = graph.graph
    excess = 0.0
    for name in graph.block_nodes(block):
        op = g.nodes[name]["op"]
        if op.kind == "expert" and op.output_shape and block.top_k:
            width, gated = routed_expert_width(op, block)
            if gated:
                excess += _routed_slots(op, block) * width * graph.dtype_bytes
        if op.kind != "elementwise" or op.target != "mul":
            continue
        for source in g.predecessors(name):
            act = g.nodes[source]["op"]
            if act.kind == "elementwise" and _is_gate_activation(act.target) and act.saved_bytes \
                    and act.output_shape:
                excess += _numel(act.output_shape) * graph.dtype_bytes
    return excess


GATE_ACTIVATIONS = ("silu", "gelu", "swish")


def _is_gate_activation(target: str) -> bool:
    return any(word in target.lower() for word in GATE_ACTIVATIONS)


def routed_expert_width(op: OpInfo, block: BlockInfo) -> tuple[float, bool]:
    """(inner width, gated) of one routed expert of a MoE module traced as one op. Its GEMMs
    write per routed slot the expert's outputs, 2f + h when gated (gate, up, down) or f + h,
    and it holds 3hf or 2hf parameters: the ratio of the two tells which, and f follows."""
    slots = _routed_slots(op, block)
    if not slots or not block.experts or not op.routed_gemm_output_elements:
        return float(block.ffn), False
    inner = op.routed_gemm_output_elements / slots - block.hidden
    per_expert = block.expert_parameters / block.experts / block.hidden
    gated = abs(per_expert - 1.5 * inner) < abs(per_expert - 2.0 * inner)
    return (inner / 2 if gated else inner), gated


def _routed_slots(op: OpInfo, block: BlockInfo) -> int:
    """Routed token slots of a MoE module traced as one op: its tokens x top_k."""
    return _numel(op.output_shape[:-1]) * block.top_k


def _through_views(g, name: str) -> str | None:
    """The op feeding `name` through a chain of views of one tensor each (shape arguments,
    which have no output shape, aside), or None."""
    def tensor_inputs(node: str) -> list[str]:
        return [p for p in g.predecessors(node) if g.nodes[p]["op"].output_shape]

    preds = tensor_inputs(name)
    while len(preds) == 1 and g.nodes[preds[0]]["op"].kind == "view":
        preds = tensor_inputs(preds[0])
    return preds[0] if len(preds) == 1 else None


@per_block
def autocast_extra_elements(graph: ModelGraph, block: BlockInfo) -> tuple[int, int, int]:
    """(norm-input elements, extra-cast elements, both at the traced batch; weight elements):
    what one block copy keeps for backward at 2 B each beyond its traced bytes when torch.autocast runs it in 16 bits from
    fp32 module weights (autoplan's runtime below ZeRO-2; measured by `autoplan check`):

    - the residual stream stays fp32 (an fp32 embedding starts it, fp32 + 16-bit adds keep
      it), so each norm saves its input at 4 B, 2 B more per element than in 16 bits;
    - autocast casts an fp32 activation to 16 bits once per matmul that reads it (its cast
      cache holds leaf tensors only: torch/csrc/autograd/autocast_mode.h `cached_cast`), so
      a norm output read by q, k and v is saved as three 16-bit copies where the traced
      graph shares one;
    - every linear saves the 16-bit cast of its weight (cached once per forward) for its
      input gradient, whatever the batch."""
    g = graph.graph
    names = graph.segment_nodes(block)
    readers: dict[str, int] = {}
    weights = 0
    for name in names:
        op = g.nodes[name]["op"]
        if op.kind != "linear":
            continue
        weights += op.parameters
        source = _through_views(g, name)
        if source is not None and g.nodes[source]["op"].kind == "norm":
            readers[source] = readers.get(source, 0) + 1
    norm_inputs = casts = 0
    for name in names:
        op = g.nodes[name]["op"]
        if op.kind == "norm" and op.input_shapes and op.input_shapes[0]:
            numel = _numel(op.input_shapes[0])
            norm_inputs += numel
            casts += numel * max(0, readers.get(name, 0) - 1)
    return norm_inputs, casts, weights


def sac_output_bytes(op: OpInfo, dtype_bytes: int) -> float:
    """Bytes the selective checkpoint caches for one op it must save: its output (and the
    attention kernel's log-sum-exp, one per row of (batch, heads, seq)).

    A MoE module traced as one op (trace/recorder.py merge_moe) is the GEMMs it ran: every
    routed expert's gate, up and down outputs for each routed token slot (tokens x top_k),
    the router's logits and any shared expert's outputs (its inner GEMMs, M x N each), as
    the runtime's policy saves every mm (runtime/recompute.py; the experts run one mm per
    matrix, autoplan.models.moe.GroupedExperts and runtime/expert_parallel.py). The module's
    combined output is an index_add, recomputed."""
    if op.kind == "expert" and op.routed_gemm_output_elements:
        inner = sum(m * n for m, n, _, _ in op.inner_gemms)
        return float((op.routed_gemm_output_elements + inner) * dtype_bytes)
    if not op.output_shape:
        return float(op.saved_bytes) if op.kind == "expert" else 0.0
    out = _numel(op.output_shape) * dtype_bytes
    if op.kind == "attention" and len(op.output_shape) >= 2:
        out += _numel(op.output_shape[:-1]) * LSE_BYTES
    return float(out)


@per_block
def sac_saved_bytes(graph: ModelGraph, block: BlockInfo) -> tuple[float, float]:
    """(total, residual-width part) of what the "op" selective checkpoint keeps per copy.

    The residual-width part (block input, outputs of linears that produce the hidden width:
    row-parallel o_proj / down_proj) is what tensor parallelism without sequence
    parallelism leaves whole on every rank. Without an op graph: Korthikanti's 34sbh minus
    the element-wise tensors is not derivable, so the selective bytes fall back to "none".
    """
    ops = block_ops(graph, block)
    if not ops:
        return float(block.saved_bytes_selective), float(block.input_bytes)
    total = residual = float(block.input_bytes)
    for op in ops:
        if op.kind not in SAC_SAVED_KINDS:
            continue
        nbytes = sac_output_bytes(op, graph.dtype_bytes)
        total += nbytes
        if op.kind == "linear" and op.output_shape and op.output_shape[-1] == block.hidden:
            residual += nbytes
    return total, residual


def saved_bytes_by_mode(graph: ModelGraph, block: BlockInfo, *, selective_policy: str = "op",
                        flash_attention: bool = True) -> dict[str, float]:
    """{none, selective, full} bytes one copy keeps for backward (traced batch/seq/dtype)."""
    if selective_policy not in SELECTIVE_POLICIES:
        raise ValueError(f"selective_policy must be one of {SELECTIVE_POLICIES}, got {selective_policy!r}")
    excess = fused_norm_excess_bytes(block_ops(graph, block), graph.dtype_bytes)
    quadratic_free = float(block.saved_bytes_selective) - excess
    reused = attention_output_reuse_bytes(graph, block) if flash_attention else 0.0
    none = (quadratic_free if flash_attention else float(block.saved_bytes) - excess) - reused
    if selective_policy == "op":
        selective = sac_saved_bytes(graph, block)[0]
    else:
        selective = quadratic_free - reused
    return {"none": none, "selective": selective, "full": float(block.input_bytes)}
