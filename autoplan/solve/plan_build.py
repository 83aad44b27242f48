"""Candidate -> Plan: the configuration plus what the runtime needs to apply it."""

from __future__ import annotations

from autoplan.trace.graph import ModelGraph
from autoplan.hardware import GIB
from autoplan.plan import ModelRef, Plan
from autoplan.solve.search import Candidate


def to_plan(candidate: Candidate, graph: ModelGraph, model: ModelRef, cluster,
            optimizer: dict | None = None) -> Plan:
    c = candidate.config
    blocks = tuple(path for path, _ in graph.layer_order)
    # a plan states every block's mode, so the config's uniform `recompute` is left at its default
    parallel = c.with_(sequence_parallel=c.sequence_parallel and c.tp > 1, recompute="none",
                       stage_recompute=None,
                       layer_recompute=(c.layer_recompute or (c.recompute,) * len(blocks)) or None)
    extra = {"optimizer": optimizer} if optimizer else {}
    return Plan(
        model=model, gpu=cluster.gpu.key, world_size=c.world_size, gpus_per_node=cluster.gpus_per_node,
        parallel=parallel, blocks=blocks,
        memory_headroom_gib=cluster.memory_headroom_bytes / GIB,
        inter_node_bandwidth_gb_per_s=cluster.inter_node_override_gb_per_s,
        tp_styles={k: dict(v) for k, v in graph.tp_styles.items()} if c.tp > 1 else {},
        cp_modules=list(graph.context_parallel) if c.cp > 1 else [],
        cp_buffers=dict(graph.cp_buffers) if c.cp > 1 else {},
        ep_modules=[e["module"] for e in graph.expert_parallel] if c.ep > 1 else [],
        inputs=plan_inputs(graph),
        estimate=stored_estimate(candidate.estimate), **extra,
    )


def plan_inputs(graph: ModelGraph) -> dict:
    """What the runtime feeds the model: the model file's example_batch ({"kind": "batch"});
    an image classifier its images and labels; {} for token models, and for an image model
    whose output is not (batch, classes), which the runtime cannot train (`autoplan generate`
    says so)."""
    if graph.user_batch_inputs:
        return {"kind": "batch"}
    if not graph.image_size or graph.num_classes < 2:
        return {}
    return {"kind": "images", "image_size": graph.image_size, "channels": graph.image_channels,
            "num_classes": graph.num_classes}


def stored_estimate(estimate) -> dict:
    """The predictions a plan file keeps: the estimate without its configuration, which the
    plan's own fields already state."""
    return {k: v for k, v in estimate.to_dict().items() if k != "config"}
