"""Memory per rank: model states, activations, communication buffers.

Sources:
- Model states (Rajbhandari et al. 2020, ZeRO, §3 and Figure 1): mixed-precision Adam keeps
  2 (16-bit weights) + 2 (16-bit gradients) + K = 12 (fp32 master weights, momentum,
  variance) bytes per parameter = 16 B; ZeRO-1 divides the K part by the data-parallel
  degree N_d, ZeRO-2 also the gradients, ZeRO-3 also the weights. fp32 training: 4 + 4 + 8.
- Activations (Korthikanti et al. 2022, §4): the graph's bytes saved for backward, with
  tensor parallelism dividing everything but the LayerNorm/dropout/residual-width tensors
  (their 10sbh of 34sbh) unless sequence parallelism is on (then all of it, Eq. 4),
  context parallelism dividing the tokens. The bytes per recomputation mode are defined once
  in trace/activations.py: selective = what the runtime's selective checkpoint keeps (torch's
  "op" policy: matmul and attention outputs) or, for Megatron runs, Korthikanti's Eq. 6
  (the attention core's s^2 tensors dropped); full = the block input only (2sbh).
- Last stage: the loss's log-probabilities and its backward's fp32 gradients (loss_bytes;
  Korthikanti et al. 2022 App. B's 4sbV for Megatron's fused cross entropy).
- Buffers: ZeRO-3 keeps the gathered weights of the current and the prefetched block
  (FSDP/DeepSpeed prefetch); pipeline stages keep one send and one receive buffer of one
  micro-batch's boundary activation (Narayanan et al. 2021 §4.1: b*s*h per transfer).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.config import ParallelConfig
from autoplan.cost.compute import activation_dtype_bytes
from autoplan.cost.kv_heads import kv_params_per_rank
from autoplan.trace import activations
from autoplan.trace.activations import sac_saved_bytes, saved_bytes_by_mode
from autoplan.trace.graph import BlockInfo, ModelGraph, per_block

ADAM_MIXED_OPTIMIZER_BYTES = 12  # ZeRO §3: fp32 master + momentum + variance
ADAM_FP32_OPTIMIZER_BYTES = 8  # momentum + variance; the fp32 weights are the master copy
FP32_BYTES = 4
# 16-bit casts autocast makes, and the fp32-over-16-bit growth of an activation it leaves in fp32
AUTOCAST_BYTES = 2


def weight_bytes_per_param(precision: str) -> int:
    """16-bit weights for bf16/fp16/fp8 training (fp8 GEMMs cast on the fly), 4 for fp32."""
    return 4 if precision == "fp32" else 2


FLOAT8_BYTES = 1


def fsdp_gather_bytes_per_param(config: ParallelConfig, block_kind: str) -> int:
    """Bytes per parameter a ZeRO-3 (FSDP) all-gather of a `block_kind` block moves: 1 for a
    repeated block of an fp8 plan with the float8 all-gather, else the 16-bit (or fp32)
    weight. torchao's enable_fsdp_float8_all_gather "cast[s] Float8Linear.weight from high
    precision to float8 before FSDP all-gather so we can communicate in float8 to save
    bandwidth" (torchtitan docs/float8.md; torchao float8/fsdp_utils.py
    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather). The embedding and head ("pre",
    "post") stay 16-bit, as do a block's norms, a small share of its parameters, counted as
    float8 here."""
    if config.precision == "fp8" and config.float8_all_gather and block_kind not in ("pre", "post"):
        return FLOAT8_BYTES
    return weight_bytes_per_param(config.precision)


def grad_reduce_bytes_per_param(precision: str) -> int:
    """Gradients are reduced across data-parallel ranks in fp32 by default: Megatron-LM's fp32
    main_grad buffers, PyTorch FSDP MixedPrecision(reduce_dtype=float32) as torchtitan
    (mixed_precision_reduce = "float32") and Composer's DEFAULT mixed precision set it."""
    return FP32_BYTES


def optimizer_bytes_per_param(precision: str) -> int:
    return ADAM_FP32_OPTIMIZER_BYTES if precision == "fp32" else ADAM_MIXED_OPTIMIZER_BYTES


def model_state_bytes(params: float, precision: str, zero_stage: int, shard_degree: int,
                      offload: str = "none", fp32_module_weights: bool = False) -> dict[str, float]:
    """{parameters, gradients, optimizer} bytes on one rank for `params` parameters it holds.

    16 B/param for mixed-precision Adam without ZeRO; ZeRO-1/2/3 divide the optimizer /
    + gradients / + weights by `shard_degree` (ZeRO §5.1, Figure 1).

    `fp32_module_weights`: the runtime keeps the fp32 master weights as the module's own
    parameters, with fp32 gradients (autoplan's runtime), so the optimizer holds only Adam's
    two moments (8 B). Below ZeRO-2 torch.autocast computes from them (DDP, DDP +
    ZeroRedundancyOptimizer): 4 + 4 + 8/N_d with ZeRO-1. FSDP2 (ZeRO-2/3) shards the fp32
    weights and gradients and casts to 16 bits for compute: 4/N_d + 4/N_d + 8/N_d, plus, at
    ZeRO-2, the 16-bit unsharded weights it keeps from forward to backward. 16 B in all, and
    2 B more at ZeRO-2; the ZeRO paper's ZeRO-2 shards 16-bit gradients, 2/N_d.
    """
    w = weight_bytes_per_param(precision)
    n = max(shard_degree, 1)
    weights = params * w / (n if zero_stage >= 3 else 1)
    grads = params * w / (n if zero_stage >= 2 else 1)
    optimizer = params * optimizer_bytes_per_param(precision) / (n if zero_stage >= 1 else 1)
    fp32_master = fp32_module_weights and precision != "fp32"
    gathered = params * w if fp32_master and zero_stage == 2 else 0.0  # FSDP2 ZeRO-2, fwd to bwd
    if fp32_master:
        sharded = zero_stage >= 2
        weights = params * FP32_BYTES / (n if sharded else 1) + gathered
        grads = params * FP32_BYTES / (n if sharded else 1)
        optimizer = params * ADAM_FP32_OPTIMIZER_BYTES / (n if zero_stage >= 1 else 1)
    if offload in ("optimizer", "both"):
        optimizer = 0.0
    if offload in ("params", "both"):
        weights = 0.0
        if fp32_master and zero_stage >= 2:
            # FSDP2's CPUOffloadPolicy: the fp32 shards, their gradients and the optimizer step
            # live on the CPU; only ZeRO-2's gathered 16-bit weights stay
            weights, grads, optimizer = gathered, 0.0, 0.0
    return {"parameters": weights, "gradients": grads, "optimizer": optimizer}


def host_state_bytes(params: float, precision: str, zero_stage: int, shard_degree: int,
                     offload: str, fp32_module_weights: bool = False) -> float:
    """Host (CPU) bytes one rank keeps for `params` parameters: the model states offload moves
    off the GPU, i.e. the states without offload less those the GPU keeps with it
    (model_state_bytes). Under FSDP2's CPUOffloadPolicy that is the rank's fp32 weight,
    gradient and Adam-moment shards, 16 B/param / N_d; the 16-bit working copies the GPU
    gathers are not on the host."""
    if offload == "none":
        return 0.0
    on_gpu = model_state_bytes(params, precision, zero_stage, shard_degree, offload, fp32_module_weights)
    without = model_state_bytes(params, precision, zero_stage, shard_degree, "none", fp32_module_weights)
    return sum(without.values()) - sum(on_gpu.values())


def autocasts_fp32_weights(precision: str, zero_stage: int, fp32_module_weights: bool) -> bool:
    """Unsharded fp32 module weights under torch.autocast: mixed precision below ZeRO-2 on a
    runtime with fp32 module weights (model_state_bytes)."""
    return fp32_module_weights and zero_stage < 2 and precision != "fp32"


def synced_weight_bytes_per_param(precision: str, zero_stage: int, fp32_module_weights: bool) -> int:
    """Bytes per parameter a ZeRO-1/2 step all-gathers after the sharded update: the module's
    weights, fp32 where the runtime autocasts from fp32 weights (model_state_bytes)."""
    if autocasts_fp32_weights(precision, zero_stage, fp32_module_weights):
        return FP32_BYTES
    return weight_bytes_per_param(precision)


@dataclass(frozen=True)
class BlockParams:
    """Parameters of one block copy held by one rank."""

    dense: float  # replicated over the dense data-parallel group
    expert: float  # replicated over the expert data-parallel group


def block_params_per_rank(block: BlockInfo, tp: int, ep: int) -> BlockParams:
    """TP shards tp_parameters (Megatron column/row-parallel linears) but k and v projections
    whose K/V heads tp exceeds, which every rank holds whole (cost/kv_heads.py); EP shards
    experts.

    Routed experts are not TP-sharded when EP > 1 (expert-TP = 1, Megatron default with EP).
    """
    expert = float(block.expert_parameters)
    non_expert = float(block.parameters) - expert
    tp_params = min(float(block.tp_parameters), non_expert)
    kv = min(float(block.kv_parameters), tp_params)
    dense = (tp_params - kv) / tp + kv_params_per_rank(kv, block.kv_heads, tp) + (non_expert - tp_params)
    if expert:
        expert = expert / ep if ep > 1 else expert / tp
    return BlockParams(dense, expert)


def _scale(graph: ModelGraph, config: ParallelConfig) -> float:
    """Rescale traced saved bytes to this micro-batch, CP shard and activation dtype."""
    act_bytes = activation_dtype_bytes(config.precision)
    return config.micro_batch / graph.batch_size / config.cp * act_bytes / graph.dtype_bytes


@per_block
def replicated_saved_bytes(graph: ModelGraph, block: BlockInfo) -> float:
    """Bytes saved by residual-width tensors that TP without SP keeps on every rank.

    Norm inputs, dropout masks on the residual stream, and the inputs of column-parallel
    linears (the norm outputs): Korthikanti et al. 2022's 10sbh for a GPT block.
    """
    g = graph.graph
    names = graph.block_nodes(block)
    if not names:
        return 5.0 * block.input_bytes  # Korthikanti: 10sbh = 5 x the 2sbh block input
    total = 0.0
    for name in names:
        op = g.nodes[name]["op"]
        width = op.output_shape[-1] if op.output_shape else 0
        if op.kind == "norm":
            total += op.saved_bytes
        elif op.kind == "elementwise" and "dropout" in op.target.lower() and width == block.hidden:
            total += op.saved_bytes
        elif op.kind == "linear" and any(g.nodes[p]["op"].kind == "norm" for p in g.predecessors(name)):
            total += op.saved_bytes  # input of a column-parallel linear = a norm output
    return min(total, float(block.saved_bytes))


def block_activation_bytes(graph: ModelGraph, block: BlockInfo, config: ParallelConfig,
                           recompute: str, flash_attention: bool = True,
                           selective_policy: str = "op", sp_saves_gathered_inputs: bool = False,
                           autocast_fp32_weights: bool = False,
                           float8_input_bytes: float = 0.0, fused_gated_activation: bool = False) -> float:
    """Activation bytes one block copy keeps per micro-batch in flight on one rank: the
    traced bytes of `recompute` (trace/activations.py) rescaled, TP/SP-divided.
    `sp_saves_gathered_inputs`: under sequence parallelism the runtime's column-parallel
    linears keep their all-gathered full-sequence input for backward (DTensor
    parallelize_module, as autoplan's runtime and torchtitan run; measured by `autoplan
    check`), where Megatron keeps the 1/tp shard and gathers it again in backward.
    `autocast_fp32_weights`: torch.autocast computes from fp32 module weights
    (autocast_extra_bytes; the weight casts are the layer cost's, held once).
    `float8_input_bytes`: bytes per element at which the linears save their inputs when
    they keep the float8 copy (float8_saved_input_delta_bytes); 0 keeps the 16-bit input.
    `fused_gated_activation`: a gated MLP's act(gate) * up runs as one kernel that saves its
    input only (trace/activations.py gated_activation_excess_bytes)."""
    extra = autocast_extra_bytes(graph, block, config, recompute) if autocast_fp32_weights else 0.0
    if float8_input_bytes and recompute != "full":
        extra += float8_saved_input_delta_bytes(graph, block, config, float8_input_bytes)
    return extra + _traced_activation_bytes(graph, block, config, recompute, flash_attention,
                                            selective_policy, sp_saves_gathered_inputs,
                                            fused_gated_activation)


# A float8 element is one byte; MXFP8 adds one 8-bit (E8M0) scale per block of 32 elements
# (OCP Microscaling Formats (MX) Specification v1.0: blocks of 32 share an E8M0 scale); the
# per-tensor recipes keep one scale for the whole tensor.
FLOAT8_BYTES = 1.0
MX_BLOCK = 32


def float8_saved_input_bytes_per_element(scaling: str) -> float:
    """Bytes per element of a float8 tensor saved for backward, with its scales."""
    return FLOAT8_BYTES + (1.0 / MX_BLOCK if scaling == "mxfp8" else 0.0)


def float8_saved_input_delta_bytes(graph: ModelGraph, block: BlockInfo, config: ParallelConfig,
                                   float8_input_bytes: float) -> float:
    """Change in one block copy's saved bytes per micro-batch when its linears keep the float8
    copy of their input for the weight gradient instead of the 16-bit input, as Transformer
    Engine's do (transformer_engine/pytorch/module/linear.py: under fp8 the quantized input
    is saved, its row-wise data discarded as "not needed in backward pass"; TE 1.x saved the
    float8 transpose). An input only the linears keep shrinks to `float8_input_bytes` per
    element; one the attention kernel saves as its output (the output projection's) gains a
    float8 copy beside it. TP divides it as it divides the linears' inputs (an approximation
    for TP without SP, which keeps the column-parallel inputs whole: Korthikanti's 10sbh)."""
    own, shared = activations.linear_saved_input_bytes(graph, block)
    float8_per_act_byte = float8_input_bytes / activation_dtype_bytes(config.precision)
    delta = own * (float8_per_act_byte - 1) + shared * float8_per_act_byte
    return delta * _scale(graph, config) / config.tp


def autocast_extra_bytes(graph: ModelGraph, block: BlockInfo, config: ParallelConfig,
                         recompute: str) -> float:
    """Bytes one block copy keeps per micro-batch beyond the traced 16-bit ones when
    torch.autocast runs it from fp32 module weights (trace/activations.py
    autocast_extra_elements: fp32 norm inputs, one 16-bit input cast per matmul). A
    checkpointed block keeps its input only, fp32 here: 2 B more per element. Under sequence parallelism the norm inputs are sequence shards and each column
    linear casts the gathered full sequence. The weight casts are autocast_weight_bytes."""
    norm_inputs, casts, _ = activations.autocast_extra_elements(graph, block)
    per_element = AUTOCAST_BYTES * config.micro_batch / graph.batch_size / config.cp
    shard = config.tp if config.sequence_parallel else 1
    if recompute != "none":
        return block.input_bytes / graph.dtype_bytes * per_element / shard
    return (norm_inputs / shard + casts) * per_element


def autocast_weight_bytes(graph: ModelGraph, block: BlockInfo, config: ParallelConfig) -> float:
    """The 16-bit casts of one block copy's matmul weights on one rank when torch.autocast
    computes from fp32 module weights: autocast caches the cast of every leaf tensor for the
    rest of its region (torch/csrc/autograd/autocast_mode.h `cached_cast`), which in autoplan's
    runtime spans a micro-batch's forward and backward (runtime/loop.py), so they are held at
    the step's peak whatever the recomputation, once, not per micro-batch in flight (measured
    by `autoplan check`: 6.4 GiB of a Llama-8B TP2 selective step)."""
    return activations.autocast_extra_elements(graph, block)[2] * AUTOCAST_BYTES / config.tp


def _traced_activation_bytes(graph: ModelGraph, block: BlockInfo, config: ParallelConfig,
                             recompute: str, flash_attention: bool, selective_policy: str,
                             sp_saves_gathered_inputs: bool, fused_gated_activation: bool = False) -> float:
    scale = _scale(graph, config)
    tp = config.tp
    saved = saved_bytes_by_mode(graph, block, selective_policy=selective_policy,
                                flash_attention=flash_attention)[recompute]
    if fused_gated_activation and recompute != "full":
        saved -= activations.gated_activation_excess_bytes(graph, block)
    if recompute == "full":
        return saved * scale / (tp if config.sequence_parallel else 1)
    if tp == 1:
        return saved * scale
    if config.sequence_parallel:
        gathered = sp_gathered_input_bytes(graph, block) * scale * (1 - 1 / tp) \
            if sp_saves_gathered_inputs else 0.0
        return saved * scale / tp + gathered
    if recompute == "selective" and selective_policy == "op":
        replicated = sac_saved_bytes(graph, block)[1]
    else:
        replicated = replicated_saved_bytes(graph, block)
    replicated = min(replicated, saved)
    return (replicated + (saved - replicated) / tp) * scale


@per_block
def sp_gathered_input_bytes(graph: ModelGraph, block: BlockInfo) -> float:
    """The full-sequence inputs of a block's column-parallel linears as traced: one block
    input per tensor-parallel pair (q/k/v share one, gate/up another), two where the block
    has no pairs on record (attention and MLP)."""
    pairs = sum(1 for pair in graph.tensor_parallel if pair["block"] == block.name)
    return (pairs or 2) * float(block.input_bytes)


def fused_norm_excess_bytes(graph: ModelGraph, block: BlockInfo) -> float:
    """Bytes the traced (decomposed) norms save beyond what a fused norm kernel keeps."""
    return activations.fused_norm_excess_bytes(activations.block_ops(graph, block), graph.dtype_bytes)


def loss_bytes(graph: ModelGraph, config: ParallelConfig, *, keeps_logits: bool = True,
               fused_vocab_cross_entropy: bool = False) -> dict[str, float]:
    """{activations, temporaries} of the loss of one micro-batch on the last stage, at its
    worst moment, the log-softmax backward (every activation of the micro-batch still held).
    Per logit (tokens x vocab / tp, tokens / cp):

    - torch eager `F.cross_entropy(logits.float(), labels)` (autoplan's runtime,
      runtime/loop.py token_loss; torchtitan's cross_entropy_loss): log_softmax saves its fp32
      output (4 B, activations); `.float()` saves nothing. In backward nll_loss_backward makes
      an fp32 zero-filled gradient and _log_softmax_backward_data a second fp32 one beside it
      (8 B, temporaries). Under loss_parallel (tp > 1: vocab-sharded DTensor logits,
      torch/distributed/tensor/parallel/loss.py) the log-softmax backward also materialises
      exp(output) in fp32 (12 B). `keeps_logits`: the step still holds the model's
      16-bit logits (2 B; 4 in fp32) through the backward, as a pipeline schedule holds the
      last stage's output; autoplan's loop and torchtitan free them first (torchtitan
      train.py: "need to free to before bwd to avoid peaking memory", `del pred`).
    - Megatron's fused vocab-parallel cross entropy (`fused_vocab_cross_entropy`;
      megatron/core/tensor_parallel/cross_entropy.py): the fp32 copy of the logits is turned
      into the softmax in place and saved (4 B, Korthikanti et al. 2022 App. B's 4sbV); its
      backward computes the gradient in that buffer, and casting it back to 16 bits adds a
      2-byte gradient (temporaries).

    Measured by `autoplan check` (fake tensors) on the 8B example's dp8 plan while the loop
    still held the logits: 6 + 8 B per logit, the same moment and tensors (the 16-bit
    logits, the fp32 log-probabilities, two fp32 gradients)."""
    tokens = config.micro_batch * graph.seq_len / config.cp
    logits = tokens * graph.vocab / config.tp
    act = activation_dtype_bytes(config.precision)
    if fused_vocab_cross_entropy:
        return {"activations": logits * FP32_BYTES, "temporaries": logits * act}
    gradients = (3 if config.tp > 1 else 2) * FP32_BYTES
    kept = FP32_BYTES + (act if keeps_logits else 0)
    return {"activations": logits * kept, "temporaries": logits * gradients}


def pipeline_buffer_bytes(graph: ModelGraph, config: ParallelConfig) -> float:
    """One send + one receive buffer of a micro-batch boundary activation."""
    if config.pp <= 1:
        return 0.0
    act = activation_dtype_bytes(config.precision)
    per = config.micro_batch * graph.seq_len / config.cp * _hidden(graph) * act
    if config.sequence_parallel:
        per /= config.tp
    return 2 * per


def zero3_buffer_bytes(max_block_params_per_rank: float, config: ParallelConfig) -> float:
    """Gathered weights of the running and the prefetched block under ZeRO-3."""
    if config.zero_stage < 3:
        return 0.0
    return 2 * max_block_params_per_rank * weight_bytes_per_param(config.precision)


def _hidden(graph: ModelGraph) -> int:
    blocks = graph.blocks
    return blocks[0].hidden if blocks else graph.pre.hidden


# CUDA context + PyTorch/NCCL kernels and workspaces per process: "~1GB, although it can be
# much higher" (pytorch/pytorch#12873 as summarised in skrl docs, trainers/parallel), 781 MB
# measured at process start in pytorch/pytorch#34323. A software constant, not a GPU number.
RUNTIME_OVERHEAD_BYTES = 2**30


def runtime_overhead_bytes() -> float:
    """Fixed per-rank overhead: CUDA context, kernels, NCCL/cuBLAS workspaces."""
    return float(RUNTIME_OVERHEAD_BYTES)
