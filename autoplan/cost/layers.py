"""Per-block cost on one rank: time per micro-batch and memory (the solver's linear terms).

`layer_cost` is what a solver sums over the blocks it places on a stage; `stage_cost`
(stages.py) and `step_time_s` (step.py) are built from it, and `estimate` from those, so a
solver's total equals `estimate` for the same partition.

`Runtime` says how the training runtime schedules its collectives where runtimes differ
(TP/GEMM overlap, DeepSpeed-2021 ZeRO-3); the default is autoplan's own runtime. Host time
(host.py: dropless MoE read-backs, the kernel-launch floor) and offload copies (offload.py)
are part of a block's time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Mapping

from autoplan.config import ParallelConfig
from autoplan.cost import comm, compute, host, hw, memory, offload, sac, volume
from autoplan.cost.cache import NO_CACHE, CostCache, or_no_cache
from autoplan.cost.profile import BlockProfile, block_profile
from autoplan.trace.graph import BlockInfo, ModelGraph

COMM_KINDS = ("tp", "cp", "ep", "zero3", "pp", "dp", "offload")


@dataclass(frozen=True)
class Runtime:
    """How the training runtime schedules communication, where runtimes differ.

    tp_comm_overlap: TP collectives pipelined with their GEMMs (Megatron --tp-comm-overlap,
    Transformer Engine userbuffers); autoplan's own runtime does not.
    zero3_flat_gather: ZeRO-3 gathers and reduce-scatters run at one NIC's rate per GPU, as
    DeepSpeed ZeRO-3 of 2021 measured by Narayanan et al. 2021 §5.2 (Table 2: step time
    ~constant as GPUs double at a fixed batch), prefetched under compute
    (zero3_flat_comm_s); FSDP and later runtimes gather over the hierarchical ring
    (zero3_comm_s).
    fp32_module_weights: the module's own parameters are the fp32 master weights, with fp32
    gradients, as in autoplan's runtime: torch.autocast computes in 16 bits below ZeRO-2 (DDP,
    DDP + ZeroRedundancyOptimizer), FSDP2 casts its fp32 shards to 16 bits for compute at
    ZeRO-2/3; Megatron, DeepSpeed and the ZeRO paper keep 16-bit module weights and gradients
    and the fp32 master in the optimizer (memory.model_state_bytes).
    flash_kernel: the FlashAttention kernel (compute.FLASH_KERNEL_SLOWDOWN): "flash2" (FA2 and
    later, cuDNN/TE, PyTorch SDPA) or "triton" (the 2022 Triton kernel, MosaicML's default).
    selective_policy: what selective recomputation keeps: "op", the matmul and attention
    outputs (torch's selective checkpoint as autoplan's runtime applies it,
    trace/activations.py); "attention_core", everything but the attention core's s^2 tensors
    (Megatron-LM --recompute-granularity selective, Korthikanti et al. 2022); or sac.OP_SAC,
    torchtitan's op-level SAC (matmul and SDPA outputs except every second matmul).
    allocator_reserve_fraction: memory the CUDA caching allocator reserves beyond the tensors,
    as a fraction of them (cost_models/allocator_reserve.toml); 0 reports allocated bytes.
    Where it is set, memory and feasibility are the reserved figure.
    sp_saves_gathered_inputs: sequence-parallel column linears keep their all-gathered input
    for backward (DTensor: autoplan's runtime, torchtitan) rather than the 1/tp shard
    (Megatron-LM); memory.block_activation_bytes.
    optimizer_kernels: how the AdamW step runs (step.adam_update_bytes_per_param): "fused", one
    pass over the states (Apex/TE FusedAdam, torch fused AdamW), or "per-op", a kernel per tensor
    op of the update (Composer's DecoupledAdamW, llm-foundry's default optimizer; torch's
    foreach and single-tensor AdamW, which autoplan's runtime builds: runtime/loop.py).
    fsdp_buffer_copies: FSDP2's copies through its flat communication buffers, both on the
    compute stream: ZeRO-2/3 all-gathers land in a flat buffer copied out into the parameters
    (compute.fsdp_copy_out_s), and each micro-batch's unsharded gradients are copied into the
    reduce-scatter's send buffer in the reduce dtype (compute.fsdp_copy_in_s). FSDP1's flat
    parameter is the gather buffer itself and its flat gradient the send buffer.
    fsdp_root_regathered: ZeRO-3 gathers the embedding and head again for the backward
    (volume.fsdp_gathers); autoplan's runtime keeps them, FSDP's root unit, gathered from
    forward to backward.
    loss_keeps_logits, fused_vocab_cross_entropy: how the loss holds memory (memory.loss_bytes):
    the step keeps the 16-bit logits through the loss backward (autoplan's loop and torchtitan
    free them first; a pipeline schedule keeps them regardless); Megatron's in-place fused
    vocab-parallel cross entropy.
    rmsnorm_kernel: how an eager RMSNorm runs: "fused", one kernel (torch's F.rms_norm in
    autoplan's runtime, Apex/TE, torchtitan's fused_rmsnorm), or "decomposed", op by op in
    fp32 (torchtitan's norm_type "rmsnorm"; compute.decomposed_rmsnorm_bytes_per_element).
    experts_replicated_over_tp: expert parallelism is carved from dp x cp and the TP ranks of an
    expert-parallel rank hold the same experts (autoplan's runtime, runtime/mesh.py ep_mesh),
    so ZeRO shards the experts' model states over their replicas along dp and cp only
    (expert_state_layout); Megatron's distributed optimizer (expert-DP group tp x dp x cp / ep
    at expert-TP 1) and torchtitan's FSDP on its expert mesh (efsdp = dp_shard x cp x tp / ep)
    shard them over the TP ranks too. Without TP the two agree.
    cp_grad_ring: how ring attention's backward passes the K/V gradients back to their owner
    (volume.CP_GRAD_RINGS): "fp32" accumulators over cp - 1 hops (autoplan's runtime),
    "fp32-home" over cp hops (torch's ring attention, torchtitan), "kv-dtype" in K/V's
    16-bit dtype over cp - 1 hops (Transformer Engine under Megatron-Core and NeMo).
    checkpoint_early_stop: the recomputation stops once the backward's saved tensors are back
    (torch's non-reentrant checkpoint: autoplan's runtime, torchtitan), so a layer's last TP
    reduction does not run again (volume.tp_forward_reruns); Megatron's and DeepSpeed's
    reentrant checkpoint reruns the whole forward.
    pp_hands_on_side_values: a pipeline stage hands on every value live across its cut, the
    rotary tables beside the hidden states (autoplan's fx split, runtime/pipeline.py;
    volume.pp_side_traffic); Megatron's and torchtitan's stages build their own and hand on
    the hidden states alone.
    float8_scaling: how an fp8 step scales its float8 casts (compute.FLOAT8_CAST_BYTES): ""
    for the plan's torchao recipe (autoplan's runtime, torchtitan), or a Transformer Engine
    recipe a published run names ("delayed", "tensorwise" for current scaling, "mxfp8").
    float8_weights_per_step: the float8 weights are cast once per step, not per micro-batch
    (Megatron-Core hands Transformer Engine's modules is_first_microbatch, and they keep the
    cast weights for the later micro-batches).
    float8_casts_fused: the activations' and gradients' float8 casts run inside the ops before
    them even when eager (Transformer Engine's fused norm, activation and dact kernels);
    torchao's fuse only under torch.compile.
    fused_gated_activation: a gated MLP's act(gate) * up runs as one kernel that saves its
    input only (Megatron-Core's bias_swiglu_impl; memory.block_activation_bytes); eager
    PyTorch saves act(gate) as well.
    float8_saved_inputs: an fp8 step's linears keep the float8 copy of their input for the
    weight gradient (Transformer Engine; memory.float8_saved_input_delta_bytes); torchao's
    Float8Linear saves the high-precision input and casts it again in backward.
    """

    tp_comm_overlap: bool = False
    zero3_flat_gather: bool = False
    fp32_module_weights: bool = True
    flash_kernel: str = "flash2"
    selective_policy: str = "op"
    allocator_reserve_fraction: float = 0.0
    sp_saves_gathered_inputs: bool = True
    optimizer_kernels: str = "per-op"
    fsdp_buffer_copies: bool = True
    loss_keeps_logits: bool = False
    fused_vocab_cross_entropy: bool = False
    experts_replicated_over_tp: bool = True
    fsdp_root_regathered: bool = False
    cp_grad_ring: str = "fp32"
    rmsnorm_kernel: str = "fused"
    checkpoint_early_stop: bool = True
    pp_hands_on_side_values: bool = True
    float8_scaling: str = ""
    float8_weights_per_step: bool = False
    float8_casts_fused: bool = False
    float8_saved_inputs: bool = False
    fused_gated_activation: bool = False


DEFAULT_RUNTIME = Runtime()


@dataclass(frozen=True)
class LayerCost:
    """One block copy on one rank. Times per micro-batch; bytes per rank."""

    name: str
    recompute: str
    fwd_s: float
    bwd_s: float
    recompute_s: float
    comm_s: Mapping[str, float]  # exposed seconds per micro-batch, by kind
    comm_total_s: Mapping[str, float]  # before overlap, by kind (for reports)
    model_flops: float  # fwd + bwd FLOPs per micro-batch on this rank, no recomputation
    hardware_flops: float  # with recomputation
    weight_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # per micro-batch in flight
    dense_params: float  # parameters on this rank (after TP) replicated over dp x cp
    expert_params: float  # routed-expert parameters on this rank (after EP)
    zero3_gather_params: float = 0.0  # parameters gathered per block under ZeRO-3
    host_bytes: float = 0.0  # model states CPU offload keeps in host memory for this rank
    # the 16-bit casts of the block's weights torch.autocast caches while a micro-batch runs
    # (memory.autocast_weight_bytes): activations by the allocator's account, once per rank
    cast_weight_bytes: float = 0.0

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.recompute_s + sum(self.comm_s.values())

    @property
    def state_bytes(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.cast_weight_bytes


def _frozen(d: dict) -> Mapping[str, float]:
    return MappingProxyType(dict(d))


def tp_comm_s(graph: ModelGraph, block: BlockInfo, config: ParallelConfig, fabric: comm.Fabric,
              groups: comm.Groups, recompute: str, runtime: Runtime = DEFAULT_RUNTIME) -> float:
    """Tensor-parallel collectives of one block per micro-batch (volume.tp_collectives), not
    overlapped."""
    if config.tp <= 1:
        return 0.0
    elements = volume.tp_payload_elements(graph, block, config)
    total = 0.0
    for kind, nbytes, count in volume.tp_collectives(block, config, recompute, runtime.fp32_module_weights,
                                                     runtime.selective_policy, runtime.checkpoint_early_stop):
        one = {"all_reduce": comm.allreduce_time_s, "all_gather": comm.allgather_time_s,
               "reduce_scatter": comm.reduce_scatter_time_s}[kind]
        total += count * one(elements * nbytes, groups.tp, fabric)
    return total


def tp_exposed_s(tp_comm_s: float, tp: int, gemm_s: float) -> float:
    """Exposed TP communication with collective/GEMM overlap (Megatron --tp-comm-overlap,
    Transformer Engine userbuffers; Wang et al. ASPLOS 2023, "Overlap communication with
    dependent computation via decomposition"): each all-gather / reduce-scatter is split into
    tp chunks pipelined with the GEMM that consumes or produces it, so one chunk in tp stays
    exposed, and whatever the GEMMs are too short to hide."""
    if tp <= 1:
        return tp_comm_s
    return min(tp_comm_s, max(0.0, tp_comm_s - gemm_s) + tp_comm_s / tp)


def cp_comm_s(graph: ModelGraph, block: BlockInfo, config: ParallelConfig, fabric: comm.Fabric,
              groups: comm.Groups, attention_fwd_s: float, recompute: str = "none",
              runtime: Runtime = DEFAULT_RUNTIME) -> tuple[float, float]:
    """(total, exposed) ring exchange per micro-batch (Liu et al. 2023 Ring Attention), on the
    steps volume.cp_hops counts.

    cp - 1 steps pass this rank's K/V chunk on in forward; backward passes K/V on again and
    the K/V gradients back to their owners (Runtime.cp_grad_ring). Each step overlaps with
    one block of attention compute. The forward ring run again under recomputation
    (volume.cp_ring_forwards) hides under the recomputed attention where the attention is
    recomputed (full; Megatron's selective) and is exposed where the kernels' outputs were
    saved ("op" selective: nothing left to compute while K/V travel).
    """
    if config.cp <= 1 or not block.kv_bytes:
        return 0.0, 0.0
    cross_node = groups.cp.nodes > 1
    step = comm.p2p_time_s(volume.cp_hop_bytes(graph, block, config), cross_node, fabric)
    grad_bytes = volume.cp_grad_bytes(config, runtime.cp_grad_ring)
    grad_step = comm.p2p_time_s(volume.cp_hop_bytes(graph, block, config, grad_bytes), cross_node, fabric)
    fwd_hops, bwd_hops, grad_hops = volume.cp_hops(config.cp, recompute, runtime.selective_policy,
                                                   runtime.cp_grad_ring)
    fwd = (config.cp - 1) * step
    rerun = (fwd_hops - (config.cp - 1)) * step
    bwd = bwd_hops * step + grad_hops * grad_step
    attn_bwd = attention_fwd_s * compute.BACKWARD_ATTENTION_FACTOR
    attn_rerun = attention_fwd_s if recompute == "full" or runtime.selective_policy == "attention_core" else 0.0
    exposed = (max(0.0, fwd - attention_fwd_s) + max(0.0, rerun - attn_rerun)
               + max(0.0, bwd - attn_bwd))
    return fwd + rerun + bwd, exposed


def ep_comm_s(graph: ModelGraph, block: BlockInfo, config: ParallelConfig, fabric: comm.Fabric,
              groups: comm.Groups, recompute: str, fp32_module_weights: bool = False,
              selective_policy: str = "attention_core") -> float:
    """Expert-parallel all-to-all: dispatch + combine in forward and in backward (GShard,
    Lepikhin et al. 2020 §2.2; Megatron-Core MoE token dispatcher), again where the
    recomputation reruns them (volume.ep_alltoall_reruns), not overlapped; the dispatch in the
    residual stream's dtype (volume.ep_token_bytes)."""
    if config.ep <= 1 or not block.experts:
        return 0.0
    dispatch, combine = (comm.moe_dispatch_time_s(volume.ep_tokens(graph, config), block.top_k, b,
                                                  groups.ep, fabric)
                         for b in volume.ep_token_bytes(block, config, fp32_module_weights))
    return volume.ep_alltoall_count(recompute, selective_policy) // 2 * (dispatch + combine)


def zero3_comm_s(params: memory.BlockParams, config: ParallelConfig, fabric: comm.Fabric,
                 groups: comm.Groups, fwd_s: float, bwd_s: float, gathers: int = 2,
                 block_kind: str = "dense") -> tuple[float, float]:
    """(total, exposed) ZeRO-3 per micro-batch: all-gather weights in forward and, but for
    FSDP's root unit, again in backward (`gathers`, volume.fsdp_gathers), reduce-scatter
    gradients (Rajbhandari et al. 2020 §5.3), each prefetched under the block's own compute
    (FSDP); what compute cannot hide is exposed. A block's weights go in float8 with the
    float8 all-gather (memory.fsdp_gather_bytes_per_param)."""
    if config.zero_stage < 3:
        return 0.0, 0.0
    w = memory.fsdp_gather_bytes_per_param(config, block_kind)
    g = memory.grad_reduce_bytes_per_param(config.precision)
    gather = comm.dp_allgather_time_s(params.dense, params.expert, w, groups, fabric)
    scatter = comm.dp_allgather_time_s(params.dense, params.expert, g, groups, fabric)
    total = gathers * gather + scatter  # AG forward, AG backward, RS of the gradients
    exposed = max(0.0, gather - fwd_s) + max(0.0, (gathers - 1) * gather + scatter - bwd_s)
    return total, exposed


def expert_shard_degree(config: ParallelConfig) -> int:
    """Ranks a routed expert's model states are sharded over under ZeRO: its replicas
    (comm.expert_dp_degree), less HSDP's replication, which keeps a full set per replica."""
    return max(1, comm.expert_dp_degree(config.tp, config.cp, config.dp, config.ep) // config.dp_replicate)


def expert_state_layout(config: ParallelConfig, runtime: Runtime) -> tuple[int, int, str]:
    """(ZeRO stage, shard degree, offload) the routed experts' model states are kept under on
    one rank (memory.model_state_bytes): as the dense ones, sharded over the experts' replicas
    (expert_shard_degree) where ep is 1 or the runtime shards them over the TP ranks too
    (Megatron's distributed optimizer over the expert-DP group, torchtitan's fully_shard on
    its expert mesh). autoplan's runtime (Runtime.experts_replicated_over_tp) shards
    expert-parallel experts over the ranks holding the same experts along dp and cp: at
    ZeRO-1 ZeroRedundancyOptimizer over dp_replicate x ep_rest = dp x cp / ep ranks
    (runtime/mesh.py ep_replica, runtime/data_parallel.py Zero1), at ZeRO-2/3 FSDP on the
    expert-replica mesh, dp_shard x cp / ep shards replicated over dp_replicate
    (runtime/mesh.py expert_dp_mesh, runtime/data_parallel.py apply_fsdp)."""
    if not (runtime.experts_replicated_over_tp and config.ep > 1):
        return config.zero_stage, expert_shard_degree(config), config.offload
    if config.zero_stage == 1:
        return 1, max(1, config.dp * config.cp // config.ep), config.offload
    return config.zero_stage, max(1, config.dp_shard * config.cp // config.ep), config.offload


def fsdp_pipeline_unsharded(config: ParallelConfig) -> bool:
    """torch.distributed.pipelining runs every backward of a step with FSDP's gradient sync
    and reshard-after-backward off (stage.py backward_maybe_with_nosync, torch 2.13) and
    reduces once after the last (the schedule's REDUCE_GRAD, perform_reduce_grad): ZeRO-2/3
    stages then hold unsharded gradients (accumulated in the fp32 reduce dtype) and ZeRO-3
    stages their gathered weights."""
    return config.zero_stage >= 2 and config.pp > 1


def zero2_comm_s(params: memory.BlockParams, config: ParallelConfig, fabric: comm.Fabric,
                 groups: comm.Groups, bwd_s: float) -> tuple[float, float]:
    """(total, exposed) ZeRO-2 per micro-batch: the block's gradients are reduce-scattered as
    soon as its backward ends (FSDP2 fully_shard, DeepSpeed stage 2), hidden under the rest
    of the backward; the updated weights are gathered once per step (step.dp_sync_s)."""
    if config.zero_stage != 2 or fsdp_pipeline_unsharded(config):
        return 0.0, 0.0
    scatter = comm.dp_allgather_time_s(params.dense, params.expert,
                                       memory.grad_reduce_bytes_per_param(config.precision), groups, fabric)
    return scatter, max(0.0, scatter - bwd_s)


def zero3_flat_comm_s(params: memory.BlockParams, config: ParallelConfig, fabric: comm.Fabric,
                      groups: comm.Groups, recompute: str, fwd_s: float, recompute_s: float,
                      bwd_s: float) -> tuple[float, float]:
    """(total, exposed) ZeRO-3 per micro-batch when every gather streams the block through the
    GPU's own NIC (one NIC per GPU, no hierarchical ring across the node's NICs;
    Runtime.zero3_flat_gather): all-gather in forward, again in the recomputation forward
    and in backward, reduce-scatter of the gradients in the 16-bit training dtype (DeepSpeed's
    communication_data_type defaults to the model's fp16). A NIC streams at the measured
    single-NIC rate (the all-to-all fraction, hardware.md B.3 [NCCLT-267]). DeepSpeed
    prefetches the next parameters while a block computes (ZeRO-Infinity's overlap-centric
    design, Rajbhandari et al. 2021 arXiv:2104.07857 §6; overlap_comm and
    stage3_prefetch_bucket_size in its ZeRO-3 config), so each pass exposes what its own
    compute cannot hide, as zero3_comm_s; at the single-NIC rate the larger runs stay
    communication-bound, the ~constant step time as GPUs double that Narayanan et al. 2021
    §5.2 (Table 2) measured."""
    if config.zero_stage < 3:
        return 0.0, 0.0
    n = groups.dp.size
    if groups.dp.nodes <= 1 or n <= 1:
        return zero3_comm_s(params, config, fabric, groups, fwd_s + recompute_s, bwd_s)
    w = memory.weight_bytes_per_param(config.precision)
    nic = fabric.nic_bytes_per_s * fabric.inter_alltoall_fraction
    one_pass = (params.dense + params.expert) * w * (n - 1) / n / nic  # one gather or scatter
    full = recompute == "full"
    total = (4 if full else 3) * one_pass
    exposed = (max(0.0, one_pass - fwd_s) + (max(0.0, one_pass - recompute_s) if full else 0.0)
               + max(0.0, 2 * one_pass - bwd_s))
    return total, exposed


def layer_cost(block: BlockInfo, graph: ModelGraph, config: ParallelConfig, cluster,
               recompute: str = "none", *, flash_attention: bool = True,
               runtime: Runtime = DEFAULT_RUNTIME, cache: CostCache | None = None) -> LayerCost:
    """Cost of one copy of `block` on one rank under `config` with `recompute` (_layer_cost).

    With a `cache` (a search's), kept under every field it reads: a block's cost does not
    depend on the schedule, the virtual stages or the partition."""
    cache = or_no_cache(cache)
    c = config  # every field _layer_cost reads; not the schedule, virtual stages or partition
    key = ("layer_cost", id(graph), block.name, c.global_batch, c.seq_len, c.dp, c.tp, c.pp, c.cp, c.ep,
           c.zero_stage, c.offload, c.micro_batch, c.precision, c.sequence_parallel, c.dp_replicate,
           c.compile, c.async_tp, c.float8_recipe, c.float8_all_gather, id(cluster), recompute, flash_attention,
           runtime)
    return cache.get(key, lambda: _layer_cost(block, graph, config, cluster, recompute,
                                              flash_attention=flash_attention, runtime=runtime, cache=cache),
                     graph, cluster)


def compute_times(block: BlockInfo, graph: ModelGraph, config: ParallelConfig, gpu,
                  flash_attention: bool = True, flash_kernel: str = "flash2",
                  compiled_blocks: bool = False, rmsnorm_kernel: str = "fused",
                  cache: CostCache | None = None) -> compute.BlockTimes:
    """Forward/backward seconds of one block copy per micro-batch (GEMMs, attention, memory
    traffic, the fp32 loss in the head, the host's kernel-issue floor); `compiled_blocks` and
    `rmsnorm_kernel` as in Runtime.

    With a `cache`, kept apart from `layer_cost`: these do not depend on dp, pp, ZeRO,
    offload or recomputation, so every configuration sharing the keyed fields shares them,
    across clusters of the same GPU object too (a sweep plans many counts of one GPU)."""
    cache = or_no_cache(cache)
    c = config  # every field read below and by compute.block_times / loss_times_s
    key = ("compute_times", id(graph), block.name, c.tp, c.cp, c.ep, c.micro_batch, c.precision,
           c.sequence_parallel, id(gpu), flash_attention, flash_kernel, compiled_blocks, rmsnorm_kernel)
    return cache.get(key, lambda: _compute_times(block, graph, config, gpu, flash_attention, flash_kernel,
                                                 compiled_blocks, rmsnorm_kernel, cache), graph, gpu)


def cached_block_profile(graph: ModelGraph, block: BlockInfo, cache: CostCache,
                         fused: bool = False) -> BlockProfile:
    """`block_profile`, kept in `cache`: it depends on the traced graph and the block alone
    (and whether its torch.compile traffic is asked for)."""
    return cache.get(("block_profile", id(graph), block.name, fused),
                     lambda: block_profile(graph, block, fused), graph)


def fabric_and_groups(config: ParallelConfig, cluster,
                      cache: CostCache | None = None) -> tuple[comm.Fabric, comm.Groups]:
    """The cluster's link numbers and the process groups of `config`'s degrees on it."""
    c = config
    return or_no_cache(cache).get(("groups", id(cluster), c.tp, c.cp, c.dp, c.pp, c.ep),
                                  lambda: _fabric_and_groups(c, cluster), cluster)


def _fabric_and_groups(config: ParallelConfig, cluster) -> tuple[comm.Fabric, comm.Groups]:
    fabric = hw.fabric(cluster)
    return fabric, comm.config_groups(config.tp, config.cp, config.dp, config.pp, config.ep, fabric)


def activation_bytes(block: BlockInfo, graph: ModelGraph, config: ParallelConfig, recompute: str,
                     flash_attention: bool, runtime: Runtime, cache: CostCache | None = None) -> float:
    """Bytes one copy of `block` keeps per micro-batch in flight under `recompute`
    (memory.block_activation_bytes; sac.py's under torchtitan's op SAC). With a `cache`, kept
    under the fields they read: not dp, pp or offload, which a search varies most, and ZeRO only
    as whether autocast computes from fp32 weights."""
    cache = or_no_cache(cache)
    c = config  # every field read by memory.block_activation_bytes and sac.op_sac_activation_bytes
    key = ("activation_bytes", id(graph), block.name, c.micro_batch, c.cp, c.tp, c.precision,
           c.sequence_parallel, recompute, flash_attention, runtime.selective_policy,
           runtime.sp_saves_gathered_inputs, _autocasts(c, runtime), _float8_input_bytes(block, c, runtime),
           runtime.fused_gated_activation)
    return cache.get(key, lambda: _activation_bytes(block, graph, config, recompute, flash_attention, runtime),
                     graph)


def _activation_bytes(block: BlockInfo, graph: ModelGraph, config: ParallelConfig, recompute: str,
                      flash_attention: bool, runtime: Runtime) -> float:
    if runtime.selective_policy == sac.OP_SAC and recompute == "selective":
        return sac.op_sac_activation_bytes(graph, block, config)
    return memory.block_activation_bytes(graph, block, config, recompute, flash_attention,
                                         _memory_policy(runtime), runtime.sp_saves_gathered_inputs,
                                         _autocasts(config, runtime),
                                         _float8_input_bytes(block, config, runtime),
                                         runtime.fused_gated_activation)


def _float8_input_bytes(block: BlockInfo, config: ParallelConfig, runtime: Runtime) -> float:
    """Bytes per element of the inputs the block's float8 linears save (0: 16-bit inputs)."""
    if config.precision != "fp8" or not runtime.float8_saved_inputs or not float8_linears(block):
        return 0.0
    return memory.float8_saved_input_bytes_per_element(runtime.float8_scaling or config.float8_recipe)


def _autocasts(config: ParallelConfig, runtime: Runtime) -> bool:
    return memory.autocasts_fp32_weights(config.precision, config.zero_stage,
                                         runtime.fp32_module_weights)


def _memory_policy(runtime: Runtime) -> str:
    """The selective policy memory.py and compute.py cost. torchtitan's op SAC is costed in
    sac.py; for "none" and "full" any policy keeps the same, so it is "op"'s there."""
    return "op" if runtime.selective_policy == sac.OP_SAC else runtime.selective_policy


def _compute_times(block: BlockInfo, graph: ModelGraph, config: ParallelConfig, gpu,
                   flash_attention: bool, flash_kernel: str = "flash2", compiled_blocks: bool = False,
                   rmsnorm_kernel: str = "fused", cache: CostCache = NO_CACHE) -> compute.BlockTimes:
    # torch.compile wraps the repeated blocks; the segments around them run eagerly
    compiled = compiled_blocks and block.kind not in ("pre", "post")
    profile = cached_block_profile(graph, block, cache, fused=compiled)
    times = compute.block_times(profile, block.hidden, block.experts, config, gpu,
                                graph.batch_size, graph.dtype_bytes, block.heads, graph.seq_len,
                                flash_attention, flash_kernel, compiled, rmsnorm_kernel,
                                gpu.fused_library_kernels, float8_linears(block))
    if block.kind == "post" and not profile.has_loss and graph.vocab:
        loss_fwd, loss_bwd = compute.loss_times_s(volume.tokens_per_rank(graph, config), graph.vocab,
                                                  config.tp, gpu)
        times = replace(times, memory_fwd_s=times.memory_fwd_s + loss_fwd,
                        fwd_s=times.fwd_s + loss_fwd, bwd_s=times.bwd_s + loss_bwd)
    # the host issues kernels no faster than HOST_S_PER_OP each: a floor under a short block
    floor_fwd, floor_bwd = host.block_host_s(compute.block_kernels(
        profile, compiled, rmsnorm_kernel, gpu.fused_library_kernels and not compiled))
    return replace(times, fwd_s=max(times.fwd_s, floor_fwd), bwd_s=max(times.bwd_s, floor_bwd))


def float8_linears(block: BlockInfo) -> bool:
    """Whether an fp8 plan runs the block's linears in float8: the repeated blocks' only (the
    runtime's apply_float8 converts the blocks' linears; the embedding and head stay 16-bit)."""
    return block.kind not in ("pre", "post")


def float8_cast_times(block: BlockInfo, graph: ModelGraph, config: ParallelConfig, gpu,
                      runtime: Runtime, profile) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of the float8 casts of the block's linears
    (compute.float8_cast_s); none outside fp8 plans and the blocks. The scaling is the
    runtime's (Runtime.float8_scaling), else the plan's torchao recipe, whose activation amax
    torch.compile fuses into the op before it."""
    if config.precision != "fp8" or not float8_linears(block):
        return 0.0, 0.0
    scaling = runtime.float8_scaling or config.float8_recipe
    fused = runtime.float8_casts_fused or config.compile
    weight_casts = 1.0 / config.num_microbatches if runtime.float8_weights_per_step else 1.0
    if config.float8_all_gather:
        weight_casts /= config.dp_shard  # torchao casts the local shard before gathering it
    return compute.float8_cast_s(profile, block.hidden, block.experts, config, gpu,
                                 graph.batch_size, scaling, fused, weight_casts)


def _layer_cost(block: BlockInfo, graph: ModelGraph, config: ParallelConfig, cluster,
                recompute: str = "none", *, flash_attention: bool = True,
                runtime: Runtime = DEFAULT_RUNTIME, cache: CostCache = NO_CACHE) -> LayerCost:
    """Cost of one copy of `block` on one rank under `config` with `recompute`.

    Per micro-batch: forward, backward and recomputation seconds, exposed communication by
    kind; per rank: weight/gradient/optimizer bytes and activation bytes per micro-batch
    in flight. Pre/post segments take recompute "none". `flash_attention=False` costs an
    unfused attention core (time and s^2 activations), as runs before FlashAttention had.
    `runtime` says which collectives the runtime overlaps and how (Runtime).
    """
    gpu = cluster.gpu
    fabric, groups = fabric_and_groups(config, cluster, cache)
    profile = cached_block_profile(graph, block, cache)
    times = compute_times(block, graph, config, gpu, flash_attention, runtime.flash_kernel,
                          config.compile, runtime.rmsnorm_kernel, cache)
    rc = recompute if block.kind not in ("pre", "post") else "none"
    policy = _memory_policy(runtime)
    op_sac = runtime.selective_policy == sac.OP_SAC and rc == "selective"
    recompute_s = compute.recompute_time_s(times, rc, policy)
    rc_flops = compute.recompute_flops(times, profile, config, graph.batch_size, rc, policy)
    if op_sac:
        fraction = sac.op_sac_recompute_fraction(graph, block)
        recompute_s = sac.op_sac_recompute_s(times.gemm_fwd_s, times.memory_fwd_s, fraction)
        rc_flops = fraction * (times.fwd_flops - profile.attention_flops * config.micro_batch
                               / graph.batch_size / config.cp / config.tp)
    params = block_params(block, graph, config)
    fwd_s, bwd_s = times.fwd_s, times.bwd_s  # plus what the runtime adds to them below
    accumulate = grad_accumulation_s(params, config, gpu)
    if accumulate:
        bwd_s += accumulate
    if runtime.fsdp_buffer_copies and config.zero_stage >= 2 and not fsdp_pipeline_unsharded(config):
        # ZeRO-3 gathers before forward and again before backward, ZeRO-2 before forward only
        block_params_on_rank = params.dense + params.expert
        copy = compute.fsdp_copy_out_s(block_params_on_rank, memory.weight_bytes_per_param(config.precision), gpu)
        fwd_s += copy
        bwd_s += copy if config.zero_stage >= 3 else 0.0
        bwd_s += compute.fsdp_copy_in_s(block_params_on_rank, compute.activation_dtype_bytes(config.precision),
                                        memory.grad_reduce_bytes_per_param(config.precision), gpu)
    cast_fwd, cast_bwd = float8_cast_times(block, graph, config, gpu, runtime, profile)
    fwd_s, bwd_s = fwd_s + cast_fwd, bwd_s + cast_bwd
    if rc == "full" or (rc == "selective" and policy == "op"):
        recompute_s += cast_fwd  # the recomputed forward casts its linears' inputs again
    total: dict[str, float] = {}
    exposed: dict[str, float] = {}
    tp = tp_comm_s(graph, block, config, fabric, groups, rc, runtime)
    total["tp"] = tp
    exposed["tp"] = tp_exposed_s(tp, config.tp, times.gemm_fwd_s * (1 + compute.BACKWARD_GEMM_FACTOR)
                                 + (times.gemm_fwd_s if rc == "full" else 0.0)) \
        if runtime.tp_comm_overlap or config.async_tp else tp
    cp_total, cp_exposed = cp_comm_s(graph, block, config, fabric, groups, times.attention_fwd_s, rc, runtime)
    total["cp"], exposed["cp"] = cp_total, cp_exposed
    ep = ep_comm_s(graph, block, config, fabric, groups, rc, runtime.fp32_module_weights,
                   runtime.selective_policy)
    total["ep"] = ep
    # With pipelining, the all-to-all of one micro-batch runs under another's compute
    # (DeepSeek-V3 DualPipe, §3.2.1; Megatron-Core 1F1B A2A overlap): only what compute
    # cannot hide is exposed. Without PP there is no other micro-batch to hide it under.
    exposed["ep"] = max(0.0, ep - fwd_s - bwd_s) if config.pp > 1 else ep
    z_total, z_exposed = zero3_comm_s(params, config, fabric, groups, fwd_s + recompute_s,
                                      bwd_s, volume.fsdp_gathers(block, runtime.fsdp_root_regathered),
                                      block.kind)
    if runtime.zero3_flat_gather:
        z_total, z_exposed = zero3_flat_comm_s(params, config, fabric, groups, rc, fwd_s,
                                               recompute_s, bwd_s)
    total["zero3"], exposed["zero3"] = z_total, z_exposed
    total["zero2"], exposed["zero2"] = zero2_comm_s(params, config, fabric, groups, bwd_s)
    exposed["zero2"] = comm.contended_exposed_s(total["zero2"], exposed["zero2"])
    # hidden NCCL weight gathers / gradient reductions slow the compute they hide under (the
    # measured case, comm.OVERLAP_COMPUTE_RATE). Not applied to TP overlap (Transformer Engine
    # userbuffers copy with the copy engines, not SM/HBM-staged NCCL kernels: pytorch/pytorch
    # PR #130583 on low-contention copy-engine collectives) nor to EP/CP exchanges (unmeasured).
    exposed["zero3"] = comm.contended_exposed_s(total["zero3"], exposed["zero3"])
    total["offload"], exposed["offload"] = param_offload_comm_s(params, config, gpu, fwd_s + recompute_s,
                                                                bwd_s, runtime.fp32_module_weights,
                                                                expert_state_layout(config, runtime)[1])
    if block.experts and block.kind not in ("pre", "post"):
        # dropless routing reads token counts back every MoE layer: host time is exposed (host.py)
        h_fwd, h_bwd, h_rc = host.moe_host_s(block.experts / (config.ep or 1), rc)
        fwd_s += h_fwd
        bwd_s += h_bwd
        recompute_s += h_rc
    states = layer_states(block, graph, config, runtime, cache)
    activation = activation_bytes(block, graph, config, rc, flash_attention, runtime, cache)
    return LayerCost(
        name=block.name, recompute=rc, fwd_s=fwd_s, bwd_s=bwd_s,
        recompute_s=recompute_s,
        comm_s=_frozen({k: v for k, v in exposed.items() if v}),
        comm_total_s=_frozen({k: v for k, v in total.items() if v}),
        model_flops=3 * times.fwd_flops, hardware_flops=3 * times.fwd_flops + rc_flops,
        weight_bytes=states.weight_bytes, grad_bytes=states.grad_bytes, optimizer_bytes=states.optimizer_bytes,
        activation_bytes=activation, dense_params=params.dense, expert_params=params.expert,
        zero3_gather_params=states.zero3_gather_params, host_bytes=states.host_bytes,
        cast_weight_bytes=states.cast_weight_bytes,
    )


@dataclass(frozen=True)
class LayerStates:
    """The model states one block copy keeps on one rank (LayerCost's byte fields but the
    activations, which depend on the recomputation)."""

    weight_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    host_bytes: float
    cast_weight_bytes: float
    zero3_gather_params: float

    @property
    def state_bytes(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.cast_weight_bytes


def layer_states(block: BlockInfo, graph: ModelGraph, config: ParallelConfig,
                 runtime: Runtime = DEFAULT_RUNTIME, cache: CostCache | None = None) -> LayerStates:
    """Model states of one copy of `block` on one rank under `config` (weights, gradients,
    optimizer, their host share under offload, autocast's weight casts). With a `cache`, kept
    under every field it reads: not the cluster, the recomputation or the schedule, so the
    search bounds a family's memory without costing its time."""
    c = config  # every field _layer_states reads
    key = ("layer_states", id(graph), block.name, c.dp, c.tp, c.pp, c.cp, c.ep, c.zero_stage, c.offload,
           c.precision, c.dp_replicate, runtime)
    return or_no_cache(cache).get(key, lambda: _layer_states(block, graph, config, runtime), graph)


def _layer_states(block: BlockInfo, graph: ModelGraph, config: ParallelConfig, runtime: Runtime) -> LayerStates:
    params = block_params(block, graph, config)
    dense_states = memory.model_state_bytes(params.dense, config.precision, config.zero_stage,
                                            config.dp_shard * config.cp, config.offload,
                                            runtime.fp32_module_weights)
    # HSDP: states are sharded over dp_shard only, replicated over dp_replicate
    expert_zero, expert_shard, expert_offload = expert_state_layout(config, runtime)
    expert_states = memory.model_state_bytes(params.expert, config.precision, expert_zero, expert_shard,
                                             expert_offload, runtime.fp32_module_weights)
    if fsdp_pipeline_unsharded(config):
        unsharded = params.dense + params.expert
        # the unsharded fp32 sums accumulate over the micro-batches; the end-of-step
        # reduce-scatter frees each group's sum as it makes its shard, so the peak is the sums
        # (measured by `autoplan check`: 4 bytes per parameter, not 4 + 4/dp)
        dense_states["gradients"] = unsharded * memory.grad_reduce_bytes_per_param(config.precision)
        expert_states["gradients"] = 0.0
        if config.zero_stage >= 3:
            # the 16-bit gathered weights stay for the whole step, offloaded or not (FSDP2
            # all-gathers into GPU tensors); fp32 master shards stay too unless offloaded
            # (then model_state_bytes leaves none on the GPU; a 16-bit shard is part of the
            # gathered copy)
            shards = (dense_states["parameters"] + expert_states["parameters"]
                      if runtime.fp32_module_weights else 0.0)
            dense_states["parameters"] = shards + unsharded * memory.weight_bytes_per_param(config.precision)
            expert_states["parameters"] = 0.0
    host_bytes = (memory.host_state_bytes(params.dense, config.precision, config.zero_stage,
                                          config.dp_shard * config.cp, config.offload, runtime.fp32_module_weights)
                  + memory.host_state_bytes(params.expert, config.precision, expert_zero, expert_shard,
                                            expert_offload, runtime.fp32_module_weights))
    return LayerStates(
        weight_bytes=dense_states["parameters"] + expert_states["parameters"],
        grad_bytes=dense_states["gradients"] + expert_states["gradients"],
        optimizer_bytes=dense_states["optimizer"] + expert_states["optimizer"],
        host_bytes=host_bytes,
        cast_weight_bytes=(memory.autocast_weight_bytes(graph, block, config)
                           if _autocasts(config, runtime) else 0.0),
        zero3_gather_params=(params.dense + params.expert) if config.zero_stage >= 3 else 0.0,
    )


def param_offload_comm_s(params: memory.BlockParams, config: ParallelConfig, gpu,
                         fwd_s: float, bwd_s: float, fp32_shards: bool = False,
                         expert_shard: int | None = None) -> tuple[float, float]:
    """(total, exposed) host<->device copies per micro-batch of a block whose weights are
    offloaded (offload.param_offload_s); under ZeRO-2/3 each rank copies only its shard, then
    all-gathers it (ZeRO-Infinity §5; FSDP2 CPUOffloadPolicy). `fp32_shards`: the host keeps
    fp32 weight shards and receives fp32 gradient shards (FSDP2 with fp32 module weights and
    reduce_dtype float32, as autoplan's runtime), so 4 B/param cross the link each way.
    `expert_shard`: the ranks the experts' states are sharded over (expert_state_layout),
    their replicas (expert_shard_degree) unless given."""
    if config.offload not in ("params", "both"):
        return 0.0, 0.0
    held = params.dense + params.expert
    if config.zero_stage >= 2:
        held = (params.dense / (config.dp_shard * config.cp)
                + params.expert / (expert_shard or expert_shard_degree(config)))
    w = memory.FP32_BYTES if fp32_shards and config.zero_stage >= 2 else memory.weight_bytes_per_param(config.precision)
    return offload.param_offload_s(held, w, w, fwd_s, bwd_s, gpu)


def grad_accumulation_s(params: memory.BlockParams, config: ParallelConfig, gpu) -> float:
    """Accumulating weight gradients into the full fp32 gradient buffer every micro-batch
    (Megatron main_grad with gradient-accumulation fusion, PyTorch DDP .grad): the buffer is
    read and written once per micro-batch, memory-bound. Under ZeRO-2/3 the gradients are
    reduce-scattered per micro-batch instead (zero2_comm_s, zero3_comm_s), except inside a
    pipeline, where the schedule accumulates them unsharded (fsdp_pipeline_unsharded)."""
    if config.zero_stage >= 2 and not fsdp_pipeline_unsharded(config):
        return 0.0
    per_param = 2 * memory.grad_reduce_bytes_per_param(config.precision)
    return (params.dense + params.expert) * per_param / hw.hbm_bytes_per_s(gpu)


def block_params(block: BlockInfo, graph: ModelGraph, config: ParallelConfig) -> memory.BlockParams:
    """Parameters of this block on one rank. The vocabulary-parallel embedding and output
    layer are TP-sharded (Megatron), the final norm beside them is not; a tied output layer on a different pipeline stage
    than the embedding keeps its own copy of the embedding matrix."""
    if block.kind in ("pre", "post"):
        vocab = graph.vocab_parameters(block)
        params = vocab / config.tp + (block.parameters - vocab)
        if block.kind == "post" and config.pp > 1 and volume.tied_head(graph):
            params += graph.embedding_parameters / config.tp
        return memory.BlockParams(params, 0.0)
    return memory.block_params_per_rank(block, config.tp, config.ep)


