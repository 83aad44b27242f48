"""A plan.json read back, the one way every command does it: schema and ranges
(`Plan.from_dict`), the model it was made for (fingerprint), the cluster (GPU known, size
within limits, degrees dividing it) and its estimate computed again from the model and the
cost model. The estimate stored in the file is never trusted: a hand-edited plan would
otherwise carry the numbers of the plan it was edited from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autoplan.errors import UserError
from autoplan.plan import Plan, PlanFormatError


@dataclass
class CheckedPlan:
    plan: Plan  # with the recomputed estimate
    loaded: object  # autoplan.models.sources.LoadedModel
    estimate: object  # autoplan.cost.estimate.Estimate, recomputed
    graph: object  # autoplan.trace.graph.ModelGraph at the plan's sequence length
    stages_layers: list | None = None  # (BlockInfo, recompute) of every virtual stage, as estimated


def read_plan(path: str) -> Plan:
    """The plan in `path`, or one UserError paragraph saying what is wrong with the file."""
    try:
        return Plan.load(path)
    except FileNotFoundError:
        raise UserError(f"plan file {path} does not exist; make one with `autoplan plan MODEL ... "
                        "-o plan.json`") from None
    except IsADirectoryError:
        raise UserError(f"plan file {path} is a directory; give the plan.json inside it") from None
    except (PlanFormatError, TypeError, OSError) as exc:
        raise UserError(f"{path} is not a plan file of this autoplan ({exc}); make it again "
                        "with `autoplan plan MODEL ... -o plan.json`") from None


def check_same_model(plan: Plan, ref, spec: str, plan_file: str) -> None:
    """The model given (or rebuilt from the plan's reference) is the one the plan was made for."""
    same = (ref.fingerprint == plan.model.fingerprint if plan.model.fingerprint
            else (ref.source, ref.name) == (plan.model.source, plan.model.name))
    if not same:
        made_for = plan.model.path or plan.model.name
        if made_for == spec:
            raise UserError(f"{plan_file} does not match the model {spec!r} it names (fingerprint "
                            "differs: the model changed since planning, or the plan was edited); "
                            "make the plan again with `autoplan plan`")
        raise UserError(f"{plan_file} was made for the model {made_for!r}, not for {spec!r} (their "
                        "parameter names, shapes or configs differ); give the model the plan was made "
                        "for, or make a plan for this one with `autoplan plan`")


def load_checked_plan(path: str, model_spec: str | None = None, gpu: str | None = None) -> CheckedPlan:
    """Read, check and re-estimate a plan file; `model_spec` defaults to the plan's own model,
    `gpu` to the plan's GPU (another GPU keeps the plan's node size and that GPU's own NIC)."""
    from autoplan.cost import estimate_partition
    from autoplan.hardware import resolve_cluster
    from autoplan.models.sources import load_model
    from autoplan.solve.plan_build import stored_estimate
    from autoplan.trace.tracer import trace_model

    plan = read_plan(path)
    own = plan.model.path or plan.model.name
    # a config built with its transformers class is named as it was given: hf:config.json
    spec = model_spec or (f"hf:{own}" if plan.model.source == "transformers" else own)
    loaded = load_model(spec, seq_len=plan.seq_len)
    check_same_model(plan, loaded.ref, spec, path)
    cluster = resolve_cluster(gpu or plan.gpu, None, plan.world_size, plan.gpus_per_node,
                              plan.memory_headroom_gib, None if gpu else plan.inter_node_bandwidth_gb_per_s)
    graph = trace_model(loaded.module, loaded.example_inputs(1, plan.seq_len), name=loaded.ref.name)
    by_path = {block: graph.segment(name) for block, name in graph.layer_order}
    stages = plan.stages or [[block for block, _ in graph.layer_order]]
    unknown = [block for stage in stages for block in stage if block not in by_path]
    if unknown:
        raise UserError(f"plan {path} names blocks the model does not have ({', '.join(unknown[:3])}); "
                        "was it made for another model?")
    modes = plan.recompute  # derived from the plan's config on each access
    layers = [[(by_path[b], modes.get(b, "none")) for b in stage] for stage in stages]
    est = estimate_partition(graph, plan.parallel, cluster, layers)
    return CheckedPlan(replace(plan, estimate=stored_estimate(est)), loaded, est, graph, layers)


def does_not_fit(est, plan_file: str) -> str:
    """The message of a plan (file) whose recomputed estimate does not fit its GPUs."""
    return (f"{plan_file} does not fit: {est.reason} (recomputed from the model and the cost "
            "model, not read from the file). Make a plan that fits with `autoplan plan`, or "
            "change the configuration")
