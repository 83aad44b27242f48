"""One call from a MODEL spec and a cluster to a ranked set of plans (used by plan, generate, report)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from autoplan.errors import UserError
from autoplan.hardware import resolve_cluster  # noqa: F401  (re-exported for commands)
from autoplan.trace.graph import ModelGraph
from autoplan.plan import ModelRef, Plan
from autoplan.solve.search import SearchResult, search
from autoplan.solve.space import Request, check_fixed


@dataclass
class PlanJob:
    plan: Plan | None  # the best plan, None when nothing fits
    result: SearchResult
    graph: ModelGraph
    model: ModelRef
    cluster: object
    request: Request


def precisions_for(precision: str, cluster) -> tuple[str, ...]:
    """--precision auto lets the solver choose bf16 or, where the GPU has it, fp8."""
    if precision == "auto":
        return ("bf16", "fp8") if cluster.gpu.supports("fp8") else ("bf16",)
    cluster.gpu.peak_flops(precision)  # UserError: fp8 on a GPU without it
    return (precision,)


def load_graph(model_spec: str, seq_len: int | None,
               image_size: int | None = None) -> tuple[ModelGraph, ModelRef, int]:
    """Load and trace MODEL at batch 1 and the training sequence length (an image model at
    its image size; its sequence length is then 1: a sample is one image)."""
    from autoplan.models.sources import load_model
    from autoplan.trace.tracer import trace_model

    loaded = load_model(model_spec, seq_len=seq_len)
    seq = input_extent(loaded, seq_len, image_size)
    graph = trace_model(loaded.module, loaded.example_inputs(1, seq), name=loaded.ref.name)
    return graph, loaded.ref, graph.seq_len


def input_extent(loaded, seq_len: int | None, image_size: int | None) -> int:
    """The second argument of `loaded.example_inputs`: the image side of an image model, else
    the sequence length (the model's, else 2048)."""
    from autoplan.models.sources import default_image_size

    if loaded.takes_images:
        side = image_size if image_size is not None else default_image_size(loaded.module)
        if side <= 0:
            raise UserError(f"--image-size must be a positive number of pixels, got {side}")
        return side
    if image_size is not None:
        raise UserError(f"--image-size applies to image models; {loaded.ref.name} takes token "
                        "ids, so give its sequence length with --seq-len instead")
    seq = seq_len if seq_len is not None else (loaded.default_seq_len or 2048)
    if seq <= 0:
        raise UserError(f"--seq-len must be positive, got {seq}")
    return seq


def plan_job(graph: ModelGraph, model: ModelRef, cluster, *, global_batch: int, seq_len: int,
             fixed: dict | None = None, precision: str = "bf16", objective: str = "time",
             top: int = 3, progress: Callable[[int, int], None] | None = None,
             time_limit_s: float = 60.0) -> PlanJob:
    """Search the plan space of `graph` on `cluster`; the best as a Plan plus the ranked result."""
    from autoplan.solve.plan_build import to_plan

    if global_batch is None or global_batch < 1:
        raise UserError(f"--global-batch must be a positive number of sequences, got {global_batch}")
    request = Request(num_gpus=cluster.num_gpus, gpus_per_node=cluster.gpus_per_node,
                      global_batch=global_batch, seq_len=seq_len,
                      precisions=precisions_for(precision, cluster) if "precision" not in (fixed or {})
                      else (fixed["precision"],),
                      fixed=dict(fixed or {}), objective=objective)
    check_fixed(graph, request)
    result = search(graph, cluster, request, top=top, progress=progress, time_limit_s=time_limit_s)
    if result.configurations_considered == 0:
        raise UserError(
            f"no configuration of {cluster.num_gpus} GPUs can split a global batch of {global_batch} "
            f"sequences of {seq_len} tokens into micro-batches"
            + (f" with --fix {' '.join(f'{k}={v}' for k, v in request.fixed.items())}" if request.fixed else "")
            + "; use a global batch that is a multiple of the data-parallel degree you want, or drop a --fix")
    plan = to_plan(result.best, graph, model, cluster) if result.best else None
    return PlanJob(plan=plan, result=result, graph=graph, model=model, cluster=cluster, request=request)
