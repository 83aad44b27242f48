"""Candidate -> Plan: the configuration plus what the runtime needs to apply it."""

from __future__ import annotations

from autoplan.trace.graph import ModelGraph
from autoplan.hardware import GIB
from autoplan.plan import ModelRef, Plan
from autoplan.solve.search import Candidate


def to_plan(candidate: Candidate, graph: ModelGraph, model: ModelRef, cluster,
            optimizer: dict | None = None) -> Plan:
    c = candidate.config
    paths = [path for path, _ in graph.layer_order]
    counts = list(c.stage_layers or [])
    stages, start = [], 0
    for count in counts:
        stages.append(paths[start:start + count])
        start += count
    modes = list(c.layer_recompute or [c.recompute] * len(paths))
    extra = {"optimizer": optimizer} if optimizer else {}
    return Plan(
        model=model, gpu=cluster.gpu.key, world_size=c.world_size, gpus_per_node=cluster.gpus_per_node,
        global_batch=c.global_batch, seq_len=c.seq_len, dp=c.dp, dp_replicate=c.dp_replicate,
        tp=c.tp, pp=c.pp, cp=c.cp, ep=c.ep, zero_stage=c.zero_stage, offload=c.offload,
        precision=c.precision, micro_batch=c.micro_batch, schedule=c.schedule, vpp=c.vpp,
        sequence_parallel=c.sequence_parallel and c.tp > 1, stages=stages,
        memory_headroom_gib=cluster.memory_headroom_bytes / GIB,
        inter_node_bandwidth_gb_per_s=cluster.inter_node_override_gb_per_s,
        recompute=dict(zip(paths, modes)),
        tp_styles={k: dict(v) for k, v in graph.tp_styles.items()} if c.tp > 1 else {},
        cp_modules=list(graph.context_parallel) if c.cp > 1 else [],
        cp_buffers=dict(graph.cp_buffers) if c.cp > 1 else {},
        ep_modules=[e["module"] for e in graph.expert_parallel] if c.ep > 1 else [],
        estimate=stored_estimate(candidate.estimate), **extra,
    )


def stored_estimate(estimate) -> dict:
    """The predictions a plan file keeps: the estimate without its configuration, which the
    plan's own fields already state."""
    return {k: v for k, v in estimate.to_dict().items() if k != "config"}


def plan_to_config(plan: Plan):
    """The ParallelConfig a plan was made from (per-block recompute in execution order)."""
    from autoplan.config import ParallelConfig

    order = [path for stage in plan.stages for path in stage]
    return ParallelConfig(
        global_batch=plan.global_batch, seq_len=plan.seq_len, dp=plan.dp, tp=plan.tp, pp=plan.pp,
        cp=plan.cp, ep=plan.ep, zero_stage=plan.zero_stage, offload=plan.offload,
        micro_batch=plan.micro_batch, schedule=plan.schedule, vpp=plan.vpp,
        precision=plan.precision, sequence_parallel=plan.sequence_parallel,
        dp_replicate=plan.dp_replicate,
        stage_layers=tuple(len(s) for s in plan.stages) if plan.stages else None,
        layer_recompute=tuple(plan.recompute.get(p, "none") for p in order) if order else None,
    )
