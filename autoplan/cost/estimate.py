"""`estimate`: step time, throughput, MFU/HFU and worst-rank memory of one configuration.

Built only from `stage_cost` and `step_time_s`, so a solver that sums the same stage
costs for the same partition gets the same numbers.
MFU counts model FLOPs (3 x the graph's forward FLOPs, no recomputation, attention
non-causal as the graph counts it: PaLM App. B convention); HFU adds recomputation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from autoplan.config import OFFLOAD, PRECISIONS, RECOMPUTE, SCHEDULES, ParallelConfig
from autoplan.cost import hw, memory
from autoplan.cost.cache import CostCache
from autoplan.cost.layers import DEFAULT_RUNTIME, Runtime
from autoplan.cost.stages import StageCost, num_virtual_stages, partition, stage_cost
from autoplan.cost.step import StepTime, step_time_s
from autoplan.errors import UserError
from autoplan.trace.graph import BlockInfo, ModelGraph

GIB = 2**30
MEMORY_KEYS = ("parameters", "gradients", "optimizer", "activations", "buffers", "temporaries", "overhead")


@dataclass(frozen=True)
class Estimate:
    feasible: bool
    reason: str
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    hfu: float
    tflops_per_gpu: float
    bubble_fraction: float
    memory_gib_per_gpu: float
    memory_breakdown_gib: dict[str, float]
    time_breakdown_s: dict[str, float]
    comm_breakdown_s: dict[str, float]
    model_flops_per_token: float
    peak_flops_per_gpu: float
    worst_rank_stage: int
    per_stage: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    # CPU offload: the model states kept in host memory by the fullest rank, and by one node's
    # ranks (gpus_per_node x that rank: a bound when a node mixes pipeline stages)
    host_memory_gib_per_gpu: float = 0.0
    host_memory_gib_per_node: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of `autoplan estimate --json`."""
        return asdict(self)


def check_config(graph: ModelGraph, config: ParallelConfig, cluster) -> None:
    """UserError naming what is inconsistent and how to fix it; never a silent fix."""
    problems: list[str] = []
    n = cluster.num_gpus
    if config.world_size != n:
        problems.append(
            f"dp x tp x pp x cp = {config.dp} x {config.tp} x {config.pp} x {config.cp} = "
            f"{config.world_size} but there are {n} GPUs; choose degrees whose product is {n} "
            f"(omit --dp to get dp = {n} / (tp x pp x cp))")
    if config.schedule not in SCHEDULES:
        problems.append(f"schedule {config.schedule!r} is not one of {', '.join(SCHEDULES)}")
    if config.recompute not in RECOMPUTE:
        problems.append(f"recompute {config.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    if config.precision not in PRECISIONS:
        problems.append(f"precision {config.precision!r} is not one of {', '.join(PRECISIONS)}")
    if config.offload not in OFFLOAD:
        problems.append(f"offload {config.offload!r} is not one of {', '.join(OFFLOAD)}")
    if config.zero_stage not in (0, 1, 2, 3):
        problems.append(f"ZeRO stage {config.zero_stage} is not 0, 1, 2 or 3")
    elif config.offload in ("params", "both") and config.zero_stage < 2:
        # FSDP2's CPUOffloadPolicy (autoplan's runtime) needs ZeRO-2/3; DeepSpeed offloads
        # parameters at stage 3 only (offload_param)
        problems.append(f"offload {config.offload!r} needs ZeRO stage 2 or 3 (FSDP2's CPUOffloadPolicy "
                        f"offloads sharded parameters), not {config.zero_stage}; add --zero 3")
    if min(config.dp, config.tp, config.pp, config.cp, config.ep, config.micro_batch, config.vpp) < 1:
        problems.append("every degree, --vpp and the micro-batch must be at least 1")
        raise UserError("Inconsistent parallel configuration: " + "; ".join(problems) + ".")
    if config.dp % config.dp_replicate:
        problems.append(f"dp_replicate={config.dp_replicate} must divide dp={config.dp} (HSDP: "
                        "dp = dp_replicate x dp_shard)")
    blocks = graph.blocks
    heads = max((b.heads for b in blocks), default=0)
    kv_heads = max((b.kv_heads for b in blocks), default=0)
    if heads and heads % config.tp:
        problems.append(f"tp={config.tp} does not divide the {heads} attention heads; use a "
                        "divisor of the head count")
    elif kv_heads and kv_heads % config.tp and config.tp % kv_heads:
        problems.append(f"tp={config.tp} neither divides nor is a multiple of the {kv_heads} "
                        "key/value heads; use a divisor of the KV head count")
    experts = max((b.experts for b in blocks), default=0)
    if config.ep > 1:
        if not experts:
            problems.append(f"ep={config.ep} but the model has no routed experts; use --ep 1")
        elif experts % config.ep:
            problems.append(f"ep={config.ep} does not divide the {experts} experts")
        if (config.dp * config.cp * config.tp) % config.ep:
            problems.append(f"ep={config.ep} must divide dp x cp x tp = "
                            f"{config.dp * config.cp * config.tp} (EP is carved from the data/context-"
                            "parallel ranks, and from TP ranks with expert-TP 1 as in Megatron-Core)")
    stages = num_virtual_stages(config)
    if config.stage_layers is not None:
        if len(config.stage_layers) != stages or sum(config.stage_layers) != graph.num_layers:
            problems.append(f"stage_layers {list(config.stage_layers)} must list {stages} stages "
                            f"summing to the {graph.num_layers} blocks")
    elif graph.num_layers < stages:
        problems.append(f"{graph.num_layers} blocks cannot fill pp x vpp = {stages} pipeline stages; "
                        "lower --pp or --vpp")
    if config.schedule == "interleaved-1f1b" and config.vpp < 2:
        problems.append("interleaved-1f1b needs --vpp 2 or more virtual stages per rank")
    if config.vpp > 1 and config.schedule != "interleaved-1f1b":
        problems.append(f"--vpp {config.vpp} needs --schedule interleaved-1f1b")
    per_dp = config.global_batch / config.dp if config.dp else 0
    if config.global_batch % (config.dp * config.micro_batch):
        problems.append(
            f"micro-batch {config.micro_batch} does not divide the global batch per DP rank "
            f"({config.global_batch} / dp {config.dp} = {per_dp:g}); choose a global batch that is "
            f"a multiple of dp x micro-batch = {config.dp * config.micro_batch}")
    if config.seq_len % config.cp:
        problems.append(f"cp={config.cp} does not divide the sequence length {config.seq_len}")
    if config.seq_len != graph.seq_len:
        problems.append(f"the graph was traced at seq_len {graph.seq_len}, the configuration "
                        f"asks for {config.seq_len}; trace again at that length")
    if problems:
        raise UserError("Inconsistent parallel configuration: " + "; ".join(problems) + ".")
    cluster.gpu.peak_flops(config.precision)  # UserError: fp8 on a GPU without it


def estimate(graph: ModelGraph, config: ParallelConfig, cluster, *,
             flash_attention: bool = True, runtime: Runtime = DEFAULT_RUNTIME) -> Estimate:
    """Predict one configuration: feasibility, step time, throughput, MFU, memory per rank.

    `flash_attention=False` models an unfused attention core (validation of runs that
    predate FlashAttention); autoplan's own runtime uses fused SDPA. `runtime` describes how
    another runtime schedules its collectives (layers.Runtime: TP/GEMM overlap, DeepSpeed-2021
    style ZeRO-3 gathers); the default is autoplan's own runtime.
    """
    return estimate_partition(graph, config, cluster, partition(graph, config),
                              flash_attention=flash_attention, runtime=runtime)


def estimate_partition(graph: ModelGraph, config: ParallelConfig, cluster,
                       stages_layers: list[list[tuple[BlockInfo, str]]], *,
                       flash_attention: bool = True, runtime: Runtime = DEFAULT_RUNTIME,
                       cache: CostCache | None = None) -> Estimate:
    """`estimate` for an explicit partition: (block, recompute) of every virtual stage. The
    stages' copies of one block cost the same: without a search's `cache`, one for this call
    costs each once."""
    check_config(graph, config, cluster)
    cache = CostCache() if cache is None else cache
    if len(stages_layers) != num_virtual_stages(config):
        raise UserError(f"the partition has {len(stages_layers)} stages, the configuration "
                        f"{num_virtual_stages(config)} (pp x vpp)")
    stages = [stage_cost(graph, config, cluster, i, layers, flash_attention=flash_attention,
                         runtime=runtime, cache=cache)
              for i, layers in enumerate(stages_layers)]
    step = step_time_s(stages, config, cluster, graph, runtime)
    return assemble(graph, config, cluster, stages, step,
                    allocator_reserve_fraction=runtime.allocator_reserve_fraction)


def rank_memory_bytes(stages: list[StageCost], pp: int,
                      allocator_reserve_fraction: float = 0.0) -> list[dict[str, float]]:
    """Memory breakdown of each physical stage's ranks (virtual stages summed); with a
    reserve fraction, the caching allocator's reserve over them as "allocator_reserve"."""
    ranks = [{k: 0.0 for k in MEMORY_KEYS} for _ in range(pp)]
    for s in stages:
        for k, v in s.memory_bytes.items():
            ranks[s.physical_stage][k] += v
    for r in ranks:
        r["overhead"] = memory.runtime_overhead_bytes()
        if allocator_reserve_fraction:
            r["allocator_reserve"] = allocator_reserved_extra_bytes(sum(r.values()), allocator_reserve_fraction)
    return ranks


def allocator_reserved_extra_bytes(allocated_bytes: float, reserve_fraction: float) -> float:
    """Bytes the CUDA caching allocator holds reserved beyond `allocated_bytes` of live tensors
    at the peak: cached blocks that cannot be split or merged to serve the next request
    (cost_models/allocator_reserve.toml gives the fraction and its source)."""
    return allocated_bytes * reserve_fraction


def host_memory_check(host_bytes_per_rank: float, cluster) -> tuple[float, str]:
    """(host bytes per node, reason or "") for `host_bytes_per_rank` of offloaded model states
    on every rank. The node's host memory is the GPU's typical system's (data file), scaled to
    the cluster's node size; a GPU file without `host_memory_gib` is not checked."""
    ranks = min(cluster.gpus_per_node, cluster.num_gpus)
    per_node = host_bytes_per_rank * ranks
    capacity = cluster.gpu.host_memory_bytes
    if not per_node or not capacity:
        return per_node, ""
    capacity *= ranks / cluster.gpu.gpus_per_node
    if per_node <= capacity:
        return per_node, ""
    return per_node, (f"CPU offload needs {per_node / GIB:.1f} GiB of host memory per node "
                      f"({ranks} ranks x {host_bytes_per_rank / GIB:.1f} GiB) but a {cluster.gpu.key} "
                      f"node has {capacity / GIB:.0f} GiB")


def time_breakdown(step: StepTime, config: ParallelConfig) -> tuple[dict[str, float], dict[str, float]]:
    """(time parts, exposed communication by kind) of one step; the parts sum to the step.
    With CPU offload, "offload" takes the exposed host<->device copies and the optimizer step
    on the CPU (with the copies it waits on) out of "exposed_comm" and "compute"."""
    comm = dict(step.comm_breakdown_s)
    parts = {"compute": step.compute_s, "recompute": step.recompute_s,
             "exposed_comm": step.exposed_comm_s, "bubble": step.bubble_s}
    if config.offload == "none":
        return parts, comm
    copies = comm.pop("offload", 0.0)
    parts["compute"] -= step.optimizer_s
    parts["exposed_comm"] -= copies
    parts["offload"] = copies + step.optimizer_s
    return parts, comm


def assemble(graph: ModelGraph, config: ParallelConfig, cluster, stages: list[StageCost],
             step: StepTime, allocator_reserve_fraction: float = 0.0) -> Estimate:
    """Estimate from stage costs and the step time (shared with the solver)."""
    world = config.world_size
    tokens = config.global_batch * config.seq_len
    tokens_per_s = tokens / step.step_s
    per_gpu = tokens_per_s / world
    peak = hw.peak_flops_per_s(cluster.gpu, config.precision)
    flops_per_token = 3.0 * graph.forward_flops() / (graph.batch_size * graph.seq_len)
    mfu = flops_per_token * per_gpu / peak
    hw_flops = sum(s.hardware_flops for s in stages) * config.num_microbatches
    model_flops = sum(s.model_flops for s in stages) * config.num_microbatches
    hfu = mfu * (hw_flops / model_flops) if model_flops else mfu
    ranks = rank_memory_bytes(stages, config.pp, allocator_reserve_fraction)
    worst = max(range(config.pp), key=lambda r: sum(ranks[r].values()))
    total = sum(ranks[worst].values())
    capacity = hw.usable_memory_bytes(cluster)
    kept_free = (f", less {cluster.memory_headroom_bytes / GIB:g} GiB of headroom"
                 if cluster.memory_headroom_bytes else "")
    reasons = [] if total <= capacity else [
        f"{f'pipeline stage {worst}' if config.pp > 1 else 'each rank'} needs {total / GIB:.1f} GiB per GPU "
        f"but {cluster.gpu.key} has "
        f"{capacity / GIB:.1f} GiB for the estimate ({cluster.gpu.memory_bytes / GIB:g} GiB{kept_free}, "
        f"less {hw.model_error_fraction():.0%} for the estimate's measured error)"]
    host_per_rank = max(sum(s.host_bytes for s in stages if s.physical_stage == r) for r in range(config.pp))
    host_per_node, host_reason = host_memory_check(host_per_rank, cluster)
    reasons += [host_reason] if host_reason else []
    feasible, reason = not reasons, "; ".join(reasons)
    times, comm = time_breakdown(step, config)
    per_stage = []
    for r in range(config.pp):
        per_stage.append({
            "stage": r,
            "blocks": sum(len([c for c in s.layers if c.name not in (graph.pre.name, graph.post.name)])
                          for s in stages if s.physical_stage == r),
            "time_per_microbatch_s": step.stage_time_s[r],
            "memory_gib": sum(ranks[r].values()) / GIB,
            "memory_breakdown_gib": {k: v / GIB for k, v in ranks[r].items()},
            "in_flight": max((s.in_flight for s in stages if s.physical_stage == r), default=0.0),
        })
    return Estimate(
        feasible=feasible, reason=reason, step_time_s=step.step_s, tokens_per_s=tokens_per_s,
        tokens_per_s_per_gpu=per_gpu, mfu=mfu, hfu=hfu, tflops_per_gpu=flops_per_token * per_gpu / 1e12,
        bubble_fraction=step.bubble_fraction, memory_gib_per_gpu=total / GIB,
        memory_breakdown_gib={k: v / GIB for k, v in ranks[worst].items()},
        time_breakdown_s=times, comm_breakdown_s=comm, model_flops_per_token=flops_per_token,
        peak_flops_per_gpu=peak, worst_rank_stage=worst, per_stage=per_stage,
        config=config_dict(config), host_memory_gib_per_gpu=host_per_rank / GIB,
        host_memory_gib_per_node=host_per_node / GIB,
    )


def config_dict(config: ParallelConfig) -> dict[str, Any]:
    d = asdict(config)
    for key in ("stage_layers", "stage_recompute"):
        if d[key] is not None:
            d[key] = [list(x) if isinstance(x, tuple) else x for x in d[key]]
    return d
