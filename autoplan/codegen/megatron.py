"""A plan as Megatron-LM command-line arguments (the megatron.args of a generated job).

Argument names are those of Megatron-LM's parser (NVIDIA/Megatron-LM,
megatron/training/arguments.py at tag core_v0.16.1; the full list is committed in
tests/codegen/data/megatron_lm_core_v0.16.1_arguments.json and checked by a test):
--tensor-model-parallel-size, --pipeline-model-parallel-size, --num-virtual-stages-per-pipeline-rank,
--pipeline-model-parallel-layout (stages split by "|", E embedding, t transformer layer, L loss;
megatron/core/transformer/pipeline_parallel_layer_layout.py), --decoder-first/last-pipeline-num-layers,
--context-parallel-size, --expert-model-parallel-size, --sequence-parallel,
--use-distributed-optimizer (ZeRO-1), --use-megatron-fsdp with --data-parallel-sharding-strategy
optim_grads (ZeRO-2) / optim_grads_params (ZeRO-3), --optimizer-cpu-offload,
--recompute-granularity/-method/-num-layers, --micro-batch-size, --global-batch-size,
--seq-length, --num-layers, --bf16 / --fp16 / --fp8-format, and the AdamW settings.
What Megatron-LM cannot say is listed by `megatron_notes`, with the nearest setting used.
"""

from __future__ import annotations

import shlex

from autoplan.codegen.torchtitan import stage_block_counts
from autoplan.plan import Plan

_SHARDING = {2: "optim_grads", 3: "optim_grads_params"}
# autoplan.runtime.lr_at decays the cosine to 10% of the peak learning rate.
_MIN_LR_RATIO = 0.1


def megatron_arguments(plan: Plan) -> list[tuple[str, str | None]]:
    """(flag, value or None for a switch), in the order the file lists them."""
    args: list[tuple[str, str | None]] = [
        ("--tensor-model-parallel-size", str(plan.tp)), ("--pipeline-model-parallel-size", str(plan.pp)),
        ("--context-parallel-size", str(plan.cp)), ("--expert-model-parallel-size", str(plan.ep))]
    if plan.ep > 1 and plan.tp > 1:  # Megatron's default expert-TP is the TP size; autoplan never TP-shards experts
        args.append(("--expert-tensor-parallel-size", "1"))
    if plan.tp > 1 and plan.sequence_parallel:
        args.append(("--sequence-parallel", None))
    args += _pipeline(plan) + _sharding(plan)
    args += [("--micro-batch-size", str(plan.micro_batch)), ("--global-batch-size", str(plan.global_batch)),
             ("--seq-length", str(plan.seq_len))]
    layers = _num_layers(plan)
    if layers:
        args.append(("--num-layers", str(layers)))
    args += _recompute(plan) + _precision(plan) + _optimizer(plan)
    return args


def _num_layers(plan: Plan) -> int:
    return len(plan.recompute) or sum(stage_block_counts(plan))


def _pipeline(plan: Plan) -> list[tuple[str, str | None]]:
    if plan.pp == 1:
        return []
    counts = stage_block_counts(plan)
    # Megatron-LM accepts at most one of the layout and the virtual-stage count (validate_args);
    # the layout's stage count gives the virtual stages.
    if counts and len(set(counts)) > 1:
        return [("--pipeline-model-parallel-layout", pipeline_layout(counts))]
    if len(counts) > plan.pp:
        return [("--num-virtual-stages-per-pipeline-rank", str(len(counts) // plan.pp))]
    return []


def pipeline_layout(counts: list[int]) -> str:
    """Megatron's layout string for stages of `counts` blocks: embedding first, loss last."""
    stages = [f"t*{count}" if count else "" for count in counts]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + ("," if stages[-1] else "") + "L"
    return "|".join(stages)


def _sharding(plan: Plan) -> list[tuple[str, str | None]]:
    args: list[tuple[str, str | None]] = []
    if plan.zero_stage == 1 or (plan.zero_stage in _SHARDING and plan.pp > 1):
        args.append(("--use-distributed-optimizer", None))
    elif plan.zero_stage in _SHARDING:  # Megatron-FSDP checkpoints only in its own format (validate_args)
        args += [("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", _SHARDING[plan.zero_stage]),
                 ("--ckpt-format", "fsdp_dtensor")]
    if plan.offload != "none":  # the offloading optimizer runs on the precision-aware path (validate_args)
        args += [("--optimizer-cpu-offload", None), ("--use-precision-aware-optimizer", None)]
    return args


def _recompute(plan: Plan) -> list[tuple[str, str | None]]:
    modes = list(plan.recompute.values())
    if not modes or set(modes) == {"none"}:
        return []
    if "full" not in modes:
        return [("--recompute-granularity", "selective")]
    if set(modes) == {"full"}:
        return [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                ("--recompute-num-layers", "1")]
    per_stage = _full_per_stage(plan)
    return [("--recompute-granularity", "full"), ("--recompute-method", "block"),
            ("--recompute-num-layers", str(max(per_stage)))]


def _full_per_stage(plan: Plan) -> list[int]:
    """Blocks recomputed fully in each (virtual) stage."""
    modes = plan.recompute  # derived from the plan's config on each access
    stages = plan.stages or [list(plan.blocks)]
    return [sum(1 for block in stage if modes[block] == "full") for stage in stages]


def _precision(plan: Plan) -> list[tuple[str, str | None]]:
    if plan.precision == "fp8":
        return [("--bf16", None), ("--fp8-format", "hybrid")]
    return {"bf16": [("--bf16", None)], "fp16": [("--fp16", None)]}.get(plan.precision, [])


def _optimizer(plan: Plan) -> list[tuple[str, str | None]]:
    opt = plan.optimizer
    betas = list(opt.get("betas", [0.9, 0.95]))
    return [("--optimizer", "adam"), ("--lr", repr(float(opt.get("lr", 3e-4)))),
            ("--min-lr", f"{float(opt.get('lr', 3e-4)) * _MIN_LR_RATIO:.6g}"), ("--lr-decay-style", "cosine"),
            ("--lr-warmup-iters", str(int(opt.get("warmup_steps", 0)))),
            ("--train-iters", str(int(opt.get("max_steps", 1000)))),
            ("--weight-decay", repr(float(opt.get("weight_decay", 0.0)))),
            ("--adam-beta1", repr(float(betas[0]))), ("--adam-beta2", repr(float(betas[1]))),
            ("--clip-grad", repr(float(opt.get("grad_clip", 1.0) or 0.0)))]


def megatron_notes(plan: Plan) -> list[str]:
    """What of `plan` Megatron-LM's arguments cannot say, and the nearest setting written instead."""
    notes = []
    if plan.pp > 1 and plan.schedule in ("gpipe", "zero-bubble"):
        nearest = "interleaved 1F1B" if plan.vpp > 1 else "1F1B"
        notes.append(f"the {plan.schedule} schedule: Megatron-LM runs 1F1B or interleaved 1F1B; {nearest} "
                     "is the nearest (its bubble is larger than zero-bubble's)." if plan.schedule == "zero-bubble"
                     else f"the gpipe schedule: Megatron-LM runs 1F1B or interleaved 1F1B; {nearest} is the "
                     "nearest (same bubble, fewer micro-batches in flight).")
    if plan.zero_stage in _SHARDING and plan.pp > 1:
        notes.append(f"ZeRO-{plan.zero_stage} with pipeline parallelism: Megatron-FSDP does not run with "
                     "pipelining; --use-distributed-optimizer (ZeRO-1: optimizer states sharded, gradients "
                     "and parameters whole on each data-parallel rank) is the nearest, and needs more memory "
                     "than the plan's estimate.")
    if plan.dp_replicate > 1:
        notes.append(f"HSDP ({plan.dp_replicate} replicas x {plan.dp_shard} shards): the arguments shard over all "
                     f"{plan.dp} data-parallel ranks.")
    if plan.offload in ("params", "both"):
        notes.append(f"offload {plan.offload}: Megatron-LM offloads the optimizer only "
                     "(--optimizer-cpu-offload); parameters stay on the GPU.")
    if plan.async_tp:
        notes.append("async TP (torch's micro-pipelined TP under torch.compile): not written; Megatron-LM's "
                     "--tp-comm-overlap (Transformer Engine userbuffers) pipelines the TP collectives with "
                     "their GEMMs the same way, where Transformer Engine is installed.")
    notes += _float8_notes(plan)
    notes += _recompute_notes(plan)
    return notes


def _float8_notes(plan: Plan) -> list[str]:
    if plan.precision != "fp8":
        return []
    notes = []
    if plan.float8_recipe != "tensorwise":
        notes.append(f"float8 recipe {plan.float8_recipe} (torchao's): Transformer Engine's FP8 recipes are "
                     "its own; its default scaling is the nearest.")
    if plan.float8_all_gather:
        notes.append("float8 weight all-gather (torchao's, with FSDP): Megatron-LM's --fp8-param-gather keeps "
                     "the parameters themselves in FP8 to gather them so; not written, weights gathered in bf16.")
    return notes


def _recompute_notes(plan: Plan) -> list[str]:
    modes = list(plan.recompute.values())
    if len(set(modes)) <= 1:
        return []
    if "full" not in modes:
        return ["per-block selective recomputation: Megatron-LM applies --recompute-granularity selective "
                "to every block (the nearest)."]
    per_stage = _full_per_stage(plan)
    selective = modes.count("selective")
    if len(set(per_stage)) == 1 and not selective and _full_blocks_lead(plan):
        return []
    return [f"per-stage recomputation (full blocks per stage {per_stage}"
            + (f", {selective} selective" if selective else "")
            + f") has no Megatron-LM setting: --recompute-method block --recompute-num-layers {max(per_stage)} "
            "(the first N blocks of every stage) is the nearest."]


def _full_blocks_lead(plan: Plan) -> bool:
    """Whether every stage recomputes its first blocks (what --recompute-method block does)."""
    per_block = plan.recompute  # derived from the plan's config on each access
    for stage in plan.stages or [list(plan.blocks)]:
        modes = [per_block[block] for block in stage]
        full = modes.count("full")
        if modes[:full] != ["full"] * full:
            return False
    return True


def _bare(value: str) -> str:
    """A value as `$(grep ...)` hands it on: word splitting only, so no quotes (they would reach
    Megatron's parser) and no white space."""
    if not value or shlex.split(value) != [value]:
        raise ValueError(f"a Megatron argument value needs quoting: {value!r}")
    return value


def megatron_args(plan: Plan) -> str:
    """megatron.args: a header (how to use it, what could not be expressed), then one argument a line."""
    notes = megatron_notes(plan)
    header = ["Megatron-LM arguments written by autoplan from plan.json",
              f"model {plan.model.name}, {plan.world_size} x {plan.gpu}; add the model, data and "
              "tokenizer arguments of your setup",
              "use: set -f; torchrun ... pretrain_gpt.py $(grep -v '^#' megatron.args)",
              "(set -f: the shell must not expand the * of a pipeline layout; values carry no quotes)",
              "(autoplan estimate MODEL --from-megatron @megatron.args reads it back)"]
    header += ["", "Not expressible in Megatron-LM (nearest setting written):"] + [f"- {n}" for n in notes] \
        if notes else ["", "Everything in the plan is expressed."]
    lines = [f"# {' '.join(line.split())}".rstrip() for line in header]
    lines += [flag if value is None else f"{flag} {_bare(value)}" for flag, value in megatron_arguments(plan)]
    return "\n".join(lines) + "\n"
