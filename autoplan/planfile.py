"""A plan.json read back, the one way every command does it: schema and ranges
(`Plan.from_dict`), the model it was made for (fingerprint), the cluster (GPU known, size
within limits, degrees dividing it) and its estimate computed again from the model and the
cost model. The estimate stored in the file is never trusted: a hand-edited plan would
otherwise carry the numbers of the plan it was edited from.

Nor does a plan file run code by itself. Its model path is relative to the file's folder, and
the model it names is loaded only when its bytes still have the sha256 the plan recorded; a
model given on the command line is the user's choice, and --trust-plan-model loads the plan's
own file whatever its bytes. Catalog models run no user code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from autoplan.errors import UserError
from autoplan.files import write_output
from autoplan.plan import ModelRef, Plan, PlanFormatError

TRUST_FLAG = "--trust-plan-model"


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


def write_plan(plan: Plan, path: str) -> None:
    """Save `plan` to `path` with a relative model path rewritten relative to the file's folder,
    where readers look for it (an absolute path stays as it is)."""
    model_path = plan.model.path
    if model_path is not None and not os.path.isabs(model_path):
        folder = os.path.abspath(os.path.dirname(path) or ".")
        plan = replace(plan, model=replace(plan.model, path=os.path.relpath(os.path.abspath(model_path), folder)))
    write_output(path, plan.to_json())


def plan_model_ref(plan: Plan, plan_file: str) -> ModelRef:
    """The plan's model with its path resolved against the plan file's folder."""
    path = plan.model.path
    if path is None or os.path.isabs(path):
        return plan.model
    return replace(plan.model, path=os.path.normpath(os.path.join(os.path.dirname(plan_file), path)))


def _no_code_from_plan(ref: ModelRef, plan_file: str, why: str) -> UserError:
    return UserError(
        f"{plan_file} names the model file {ref.path}, {why}, and a plan file alone never runs or "
        f"reads a model file it cannot vouch for: give the model on the command line as MODEL (the "
        f"file you mean to load), pass {TRUST_FLAG} to load {ref.path} as the plan names it, or make "
        "the plan again with `autoplan plan`")


def load_plan_model(plan: Plan, plan_file: str, *, trust: bool = False):
    """The LoadedModel of the plan's own model. A file is read once and, unless `trust`, parsed
    or run only if its bytes have the plan's file_sha256 (a plan without one is refused)."""
    from autoplan.models.sources import ModelFileChanged, load_model_of_ref

    ref = plan_model_ref(plan, plan_file)
    if ref.source != "catalog" and not os.path.isfile(ref.path or ""):
        raise UserError(f"{plan_file} names the model file {plan.model.path}, read relative to the plan "
                        f"file's folder: {ref.path} does not exist. Give the model on the command line "
                        "as MODEL, or put the plan file where its model path leads to the model")
    if ref.source != "catalog" and not trust and not ref.file_sha256:
        raise _no_code_from_plan(ref, plan_file, "but records no sha256 of its bytes (it was made "
                                 "before autoplan recorded one, or the field was removed)")
    try:
        loaded = load_model_of_ref(ref, seq_len=plan.seq_len, check_bytes=not trust)
    except ModelFileChanged:
        raise _no_code_from_plan(ref, plan_file, "whose bytes are not those the plan was made with "
                                 "(its file_sha256 differs: the file changed, or the plan was "
                                 "edited)") from None
    if loaded.ref.source != plan.model.source:
        raise UserError(f"{plan_file} says its model is a {plan.model.source} model, but {ref.path} "
                        f"builds as a {loaded.ref.source} model (was model.source edited?); make the "
                        "plan again with `autoplan plan`")
    return loaded


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


def load_checked_plan(path: str, model_spec: str | None = None, gpu: str | None = None, *,
                      trust_plan_model: bool = False, probe_runtime: bool = True) -> CheckedPlan:
    """Read, check and re-estimate a plan file; `model_spec` (a MODEL given on the command
    line) defaults to the plan's own model (`load_plan_model`), `gpu` to the plan's GPU
    (another GPU keeps the plan's node size and that GPU's own NIC). The checked plan's model
    is the one loaded: its path as given, or resolved against the plan file's folder.
    `probe_runtime=False` leaves the runtime's capability facts (`graph.refused`) off the
    graph: the estimate does not read them, only the planner's choice of axes does."""
    from autoplan.cost import estimate_partition
    from autoplan.hardware import resolve_cluster
    from autoplan.models.sources import load_model
    from autoplan.solve.plan_build import stored_estimate
    from autoplan.trace.tracer import trace_model

    plan = read_plan(path)
    if model_spec:
        loaded, spec = load_model(model_spec, seq_len=plan.seq_len), model_spec
    else:
        loaded = load_plan_model(plan, path, trust=trust_plan_model)
        spec = plan.model.path or plan.model.name
    check_same_model(plan, loaded.ref, spec, path)
    cluster = resolve_cluster(gpu or plan.gpu, None, plan.world_size, plan.gpus_per_node,
                              plan.memory_headroom_gib, None if gpu else plan.inter_node_bandwidth_gb_per_s)
    graph = trace_model(loaded.module, loaded.example_inputs(1, _input_extent(plan, loaded, path)),
                        name=loaded.ref.name, probe_runtime=probe_runtime, user_batch=loaded.user_batch)
    by_path = {block: graph.segment(name) for block, name in graph.layer_order}
    stages = plan.stages or [[block for block, _ in graph.layer_order]]
    unknown = [block for stage in stages for block in stage if block not in by_path]
    if unknown:
        raise UserError(f"plan {path} names blocks the model does not have ({', '.join(unknown[:3])}); "
                        "was it made for another model?")
    modes = plan.recompute  # derived from the plan's config on each access
    layers = [[(by_path[b], modes.get(b, "none")) for b in stage] for stage in stages]
    est = estimate_partition(graph, plan.parallel, cluster, layers)
    checked = replace(plan, model=replace(loaded.ref, name=plan.model.name), estimate=stored_estimate(est))
    return CheckedPlan(checked, loaded, est, graph, layers)


def _input_extent(plan: Plan, loaded, path: str) -> int:
    """The plan's sequence length, or for an image model the image side it was planned at."""
    if not loaded.takes_images:
        return plan.seq_len
    side = plan.inputs.get("image_size")
    if not side:
        raise UserError(f"{path} keeps no image size for this image model (it was made by an older "
                        "autoplan, or the model's output is not (batch, classes)); make the plan "
                        "again with `autoplan plan --image-size N`")
    return side


def does_not_fit(est, plan_file: str) -> str:
    """The message of a plan (file) whose recomputed estimate does not fit its GPUs."""
    return (f"{plan_file} does not fit: {est.reason} (recomputed from the model and the cost "
            "model, not read from the file). Make a plan that fits with `autoplan plan`, or "
            "change the configuration")
