"""The search space: every legal outer configuration, and a reason for each value ruled out.

Rules (each a small predicate returning a reason string, reused by the explanation):
- dp * tp * pp * cp == N; EP is carved from dp * cp (Megatron / torchtitan) and divides
  the expert count.
- tp divides the attention heads and the MLP width of every block, divides the KV heads
  or is a multiple of them (each rank computes the K/V head of its q heads), and
  divides the GPUs of a node (a TP group never straddles nodes: its all-reduces are on
  the critical path).
- cp needs SDPA attention (ring attention), divides seq_len / 2 (zig-zag halves), and
  the tp x cp group either fits in a node or spans whole nodes.
- pp <= number of blocks (stages may hold different block counts); interleaved needs
  pp * vpp <= blocks and micro-batches a multiple of pp.
- micro-batch divides the global batch per DP rank.
- an axis autoplan's runtime refused at plan time (`graph.refused`, trace/capability.py)
  is not searched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from autoplan.config import FLOAT8_RECIPES, PRECISIONS, ParallelConfig, async_tp_problem, schedule_problem
from autoplan.errors import UserError
from autoplan.solve.tables import pipeline_units
from autoplan.trace.graph import ModelGraph

FIXABLE = {"dp": int, "tp": int, "pp": int, "cp": int, "ep": int, "zero": int,
           "micro_batch": int, "mb": int, "vpp": int, "schedule": str, "offload": str,
           "recompute": str, "precision": str, "float8_recipe": str}


@dataclass(frozen=True)
class Request:
    """What the user asks `plan` for."""

    num_gpus: int
    gpus_per_node: int
    global_batch: int
    seq_len: int
    precisions: tuple[str, ...] = ("bf16",)
    fixed: dict = field(default_factory=dict)
    objective: str = "time"  # time | cost
    max_micro_batch: int = 16
    allow_offload: bool = True
    # relative step-time difference within which the simpler plan is preferred (preference.py);
    # 0: the fastest plan
    equivalence_band: float = 0.0
    compile: bool = False  # every configuration runs its blocks under torch.compile
    gpu: str = ""  # the GPU file's key: async TP runs on CUDA GPUs, not on "cpu" ranks


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_fix(items: tuple[str, ...]) -> dict:
    """`--fix tp=8 --fix zero=1` -> {"tp": 8, "zero": 1}; contradictions are user errors."""
    fixed: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in FIXABLE:
            raise UserError(f"--fix {item!r} is not KEY=VALUE with KEY one of {', '.join(sorted(FIXABLE))}")
        key = "micro_batch" if key == "mb" else key
        try:
            parsed = FIXABLE[key](value.strip())
        except ValueError:
            raise UserError(f"--fix {item!r}: {key} takes an integer") from None
        if key in fixed and fixed[key] != parsed:
            raise UserError(f"--fix gives {key} twice with different values ({fixed[key]} and {parsed}); keep one")
        fixed[key] = parsed
    return fixed


def tp_reason(graph: ModelGraph, tp: int, gpus_per_node: int) -> str | None:
    if tp == 1:
        return None
    if not graph.tensor_parallel:
        unsplit = "; ".join(f"{u['block']}" + (f".{u['module']}" if u["module"] else "") + f": {u['reason']}"
                            for u in graph.tp_unsplit[:2])
        return "the model has no column/row linear pairs to shard" + (f" ({unsplit})" if unsplit else "")
    if "tp" in graph.refused:
        return f"autoplan's runtime cannot apply tensor parallelism to this model: {graph.refused['tp']}"
    if gpus_per_node % tp:
        return f"tp={tp} would straddle nodes of {gpus_per_node} GPUs"
    for block in graph.blocks:
        for name, value in (("heads", block.heads), ("MLP width", block.ffn)):
            if value and value % tp:
                return f"tp={tp} does not divide the {value} {name} of {block.name}"
        reason = kv_reason(graph, block, tp)
        if reason:
            return reason
    return None


def kv_reason(graph: ModelGraph, block, tp: int) -> str | None:
    """Why `block`'s K/V heads cannot be spread over tp ranks, or None: tp divides them, or
    (tp a multiple of them) each rank computes the K/V head of its q heads from a replicated
    k/v projection (runtime/kv_replication.py), which needs separate k and v linears."""
    kv = block.kv_heads
    if not kv or kv % tp == 0:
        return None
    if tp % kv:
        return f"tp={tp} neither divides nor is a multiple of the {kv} kv heads of {block.name}"
    pairs = [p for p in graph.tensor_parallel if p["block"] == block.name and p["kind"] == "attention"]
    if not pairs or not all(p.get("kv_replicable") for p in pairs):
        return (f"tp={tp} does not divide the {kv} kv heads of {block.name}, and its k and v are "
                "not separate projections that a rank could hold one K/V head of")
    if "tp_kv" in graph.refused:
        return (f"autoplan's runtime cannot share the {kv} kv heads of {block.name} over tp={tp} "
                f"ranks: {graph.refused['tp_kv']}")
    return None


def sequence_parallel(graph: ModelGraph, tp: int) -> bool:
    """SP with TP where the model's inputs let it shard the sequence (graph.sequence_shardable)."""
    return tp > 1 and graph.sequence_shardable


def image_cp_reason(graph: ModelGraph, cp: int) -> str:
    """Why an image model gets no CP: the runtime shards the sequence a model is fed (token
    ids), and an image model makes its token sequence inside forward; attention within
    windows (Swin: windows folded into the batch) has no sample-long sequence at all."""
    lengths = {op.output_shape[-2] for _, op in graph.graph.nodes(data="op")
               if op.kind == "attention" and op.target == "scaled_dot_product_attention"
               and len(op.output_shape) >= 3 and op.output_shape[0] == graph.batch_size}
    if not lengths:
        return ("context parallelism splits a sample's token sequence across ranks; this image "
                "model's attention runs within windows folded into the batch, not over a sequence of the image")
    tokens = max(lengths)
    reason = (f"context parallelism shards the sequence a model is fed, and an image model is fed "
              f"whole images: this one makes its {tokens}-token sequence inside forward, "
              "which autoplan's runtime does not split (it would have to shard the sequence after "
              "the patch embedding and gather it back for the classifier)")
    if tokens % cp:  # attention over patches is not causal: equal shards, no zig-zag halves
        reason += f"; nor do its {tokens} tokens split evenly over cp={cp} ranks"
    return reason


def cp_reason(graph: ModelGraph, cp: int, tp: int, seq_len: int, gpus_per_node: int) -> str | None:
    if cp == 1:
        return None
    if graph.user_batch_inputs:
        return ("context parallelism shards the token sequence the runtime feeds a model, and this "
                "model is fed the model file's example_batch, whose sequence dimension (if any) "
                "only the file knows")
    if not graph.context_parallel and graph.image_size:
        return image_cp_reason(graph, cp)
    if not graph.context_parallel:
        return ("context parallelism needs attention through F.scaled_dot_product_attention "
                "over the token sequence")
    if "cp" in graph.refused:
        return f"autoplan's runtime cannot apply context parallelism to this model: {graph.refused['cp']}"
    if graph.window_masked:
        return (f"the model's sliding-window attention (a {graph.attention_window}-token window, no "
                f"longer than the {graph.seq_len}-token sequence) needs the window mask the model "
                "builds, and the ring attention of context parallelism runs causal attention "
                "without a mask; plan a sequence shorter than the window, or cp=1")
    if seq_len % (2 * cp):
        return f"cp={cp} does not divide seq_len {seq_len} into 2*cp zig-zag chunks"
    group = tp * cp
    if group > gpus_per_node and group % gpus_per_node:
        return f"tp*cp={group} would split a node of {gpus_per_node} GPUs unevenly"
    return None


def pp_reason(graph: ModelGraph, pp: int, vpp: int, tp: int = 1) -> str | None:
    if pp * vpp > max(graph.num_layers, 1):
        return f"pp*vpp={pp * vpp} exceeds the {graph.num_layers} blocks"
    if pp > 1 and graph.user_batch_keywords:
        return ("the pipeline hands its first stage one positional input, and the model file's "
                "example_batch gives its inputs by keyword")
    if pp > 1 and graph.user_batch_inputs > 1:
        return (f"the pipeline hands its first stage one input, and the model file's example_batch "
                f"gives {graph.user_batch_inputs}")
    if pp > 1 and "pp" in graph.refused:
        return f"autoplan's runtime cannot split this model into pipeline stages: {graph.refused['pp']}"
    if pp > 1 and tp > 1 and "pp_tp" in graph.refused:
        return ("autoplan's runtime cannot run this model's pipeline stages under tensor "
                f"parallelism: {graph.refused['pp_tp']}")
    return None


def ep_reason(graph: ModelGraph, ep: int, dp: int, cp: int) -> str | None:
    if ep == 1:
        return None
    experts = [b.experts for b in graph.blocks if b.experts]
    if not experts:
        return "expert parallelism needs MoE layers"
    if "ep" in graph.refused:
        return f"autoplan's runtime cannot apply expert parallelism to this model: {graph.refused['ep']}"
    if (dp * cp) % ep:
        return f"ep={ep} does not divide dp*cp={dp * cp}"
    if any(e % ep for e in experts):
        return f"ep={ep} does not divide the {experts[0]} experts"
    return None


def schedules(pp: int, num_microbatches: int, num_layers: int, zero_stage: int) -> list[tuple[str, int]]:
    """(schedule, vpp) options for a pipeline of pp stages."""
    if pp == 1:
        return [("1f1b", 1)]
    options = [(s, 1) for s in ("gpipe", "1f1b", "zero-bubble")
               if schedule_problem(s, pp, num_microbatches, zero_stage) is None]
    if num_microbatches % pp == 0:
        options += [("interleaved-1f1b", v) for v in (2, 4) if pp * v <= num_layers]
    return options


def outer_configs(graph: ModelGraph, request: Request) -> Iterator[ParallelConfig]:
    """Every legal configuration without the partition and per-stage recomputation."""
    n, fixed = request.num_gpus, request.fixed
    pick = lambda key, values: [fixed[key]] if key in fixed else values  # noqa: E731
    for tp in pick("tp", divisors(min(n, request.gpus_per_node))):
        if n % tp or tp_reason(graph, tp, request.gpus_per_node):
            continue
        for cp in pick("cp", divisors(n // tp)):
            if (n // tp) % cp or cp_reason(graph, cp, tp, request.seq_len, request.gpus_per_node):
                continue
            for pp in pick("pp", divisors(n // (tp * cp))):
                if (n // (tp * cp)) % pp or pp_reason(graph, pp, 1, tp):
                    continue
                if "pp" not in fixed and pp > pipeline_units(graph):
                    continue  # the search cuts a periodic stack between periods (tables.block_units)
                dp = n // (tp * cp * pp)
                if "dp" in fixed and fixed["dp"] != dp:
                    continue
                yield from _inner(graph, request, dp, tp, pp, cp)


def _inner(graph: ModelGraph, request: Request, dp: int, tp: int, pp: int, cp: int):
    fixed = request.fixed
    pick = lambda key, values: [fixed[key]] if key in fixed else values  # noqa: E731
    if request.global_batch % dp:
        return
    per_rank = request.global_batch // dp
    moe = any(b.experts for b in graph.blocks)
    eps = [e for e in divisors(dp * cp) if not ep_reason(graph, e, dp, cp)] if moe else [1]
    zeros = [0, 1, 2, 3] if dp > 1 else [0]
    sp = sequence_parallel(graph, tp)
    for ep in pick("ep", eps):
        if ep_reason(graph, ep, dp, cp):
            continue
        for zero in pick("zero", zeros):
            for mb in pick("micro_batch", [d for d in divisors(per_rank) if d <= request.max_micro_batch]):
                if per_rank % mb:
                    continue
                m = per_rank // mb
                units = graph.num_layers if "vpp" in fixed else pipeline_units(graph)
                for schedule, vpp in _schedule_options(pp, m, units, zero, fixed):
                    for precision in request.precisions:
                        for offload in _offloads(zero, fixed, request.allow_offload):
                            yield ParallelConfig(
                                global_batch=request.global_batch, seq_len=request.seq_len,
                                dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=zero,
                                offload=offload, micro_batch=mb, schedule=schedule, vpp=vpp,
                                precision=precision, sequence_parallel=sp, compile=request.compile,
                                async_tp=async_tp_setting(request.compile, tp, sp, request.gpu),
                                recompute=fixed.get("recompute", "none"),
                                **float8_settings(precision, zero, fixed),
                            )


def async_tp_setting(compile_: bool, tp: int, sequence_parallel: bool, gpu: str) -> bool:
    """Async TP wherever it can run (config.async_tp_problem): it only hides TP collectives
    behind the matmuls that consume or produce them (cost.layers.tp_exposed_s), as torchtitan
    turns it on with compile and TP."""
    return async_tp_problem(True, tp, sequence_parallel, compile_, gpu) is None


def float8_settings(precision: str, zero: int, fixed: dict) -> dict:
    """An fp8 configuration's recipe (tensorwise unless fixed) and, at ZeRO-3 with tensorwise
    scaling, FSDP's float8 all-gather: torchtitan's recommended tensorwise setting, half the
    bytes of each weight gather."""
    if precision != "fp8":
        return {}
    recipe = fixed.get("float8_recipe", "tensorwise")
    return {"float8_recipe": recipe, "float8_all_gather": zero == 3 and recipe == "tensorwise"}


def _schedule_options(pp: int, m: int, layers: int, zero: int, fixed: dict) -> list[tuple[str, int]]:
    options = schedules(pp, m, layers, zero)
    if "schedule" in fixed:
        options = [(s, v) for s, v in options if s == fixed["schedule"]]
    if "vpp" in fixed:
        options = [(s, v) for s, v in options if v == fixed["vpp"]]
    return options


# What autoplan's runtime can offload: FSDP2's CPUOffloadPolicy moves the sharded parameters,
# their gradients and the optimizer step to the CPU together, so only "both", and only with
# ZeRO-2/3 (runtime/data_parallel.py). DeepSpeed's optimizer-only ZeRO-Offload is not a plan
# the runtime could run; `autoplan estimate --offload optimizer` still costs it.
RUNTIME_OFFLOADS = ("none", "both")


def _offloads(zero: int, fixed: dict, allow: bool) -> list[str]:
    if "offload" in fixed:
        return [fixed["offload"]] if fixed["offload"] == "none" or zero >= 2 else []
    if not allow or zero < 2:
        return ["none"]
    return list(RUNTIME_OFFLOADS)


def check_fixed(graph: ModelGraph, request: Request) -> None:
    """A --fix outside the space is a user error naming the rule it breaks."""
    fixed, n = request.fixed, request.num_gpus
    if fixed.get("offload", "none") not in RUNTIME_OFFLOADS:
        raise UserError(f"--fix offload={fixed['offload']}: autoplan's runtime offloads with FSDP2, which moves "
                        "parameters, gradients and the optimizer step to the CPU together; use offload=both "
                        "(with zero 2 or 3) or offload=none")
    if fixed.get("offload") == "both" and fixed.get("zero", 2) < 2:
        raise UserError(f"--fix offload=both needs zero 2 or 3 (FSDP2), not zero={fixed['zero']}")
    for key in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "vpp"):
        if key in fixed and fixed[key] < 1:
            raise UserError(f"--fix {key}={fixed[key]}: degrees and sizes are positive integers")
        if key in ("dp", "tp", "pp", "cp") and key in fixed and n % fixed[key]:
            raise UserError(f"--fix {key}={fixed[key]} does not divide the {n} GPUs")
    reason = None
    if "tp" in fixed:
        reason = tp_reason(graph, fixed["tp"], request.gpus_per_node)
    if not reason and "cp" in fixed:
        reason = cp_reason(graph, fixed["cp"], fixed.get("tp", 1), request.seq_len, request.gpus_per_node)
    if not reason and "pp" in fixed:
        reason = pp_reason(graph, fixed["pp"], fixed.get("vpp", 1), fixed.get("tp", 1))
    if not reason and "ep" in fixed and fixed["ep"] > 1:
        if not any(b.experts for b in graph.blocks):
            reason = f"ep={fixed['ep']} but the model has no MoE layers"
        elif "ep" in graph.refused:
            reason = ep_reason(graph, fixed["ep"], 1, 1)
        elif any(b.experts % fixed["ep"] for b in graph.blocks if b.experts):
            reason = f"ep={fixed['ep']} does not divide the experts"
    if not reason and "zero" in fixed and fixed["zero"] not in (0, 1, 2, 3):
        reason = f"zero={fixed['zero']} is not a ZeRO stage (0-3)"
    if not reason and "precision" in fixed and fixed["precision"] not in PRECISIONS:
        reason = f"precision {fixed['precision']!r} is not one of {', '.join(PRECISIONS)}"
    if not reason and "float8_recipe" in fixed and fixed["float8_recipe"] not in FLOAT8_RECIPES:
        reason = f"float8_recipe {fixed['float8_recipe']!r} is not one of {', '.join(FLOAT8_RECIPES)}"
    if not reason:
        product = 1
        for key in ("dp", "tp", "pp", "cp"):
            product *= fixed.get(key, 1)
        if all(k in fixed for k in ("dp", "tp", "pp", "cp")) and product != n:
            reason = f"dp*tp*pp*cp = {product} != {n} GPUs"
    if reason:
        raise UserError(f"--fix is outside the search space: {reason.rstrip('.')}. Drop or change that --fix.")
