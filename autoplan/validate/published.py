"""Check the cost model against published training runs (`autoplan validate`).

Each run of a runs file (format of cost_models/validation/published_runs.json) is turned
into model -> HF-style config (catalog.config_from_published) -> traced ModelGraph ->
ParallelConfig on the run's cluster, and estimated. Settings a run does not state
(micro-batch, recomputation, ZeRO stage, sequence parallelism) take the value the cost
model finds fastest among the feasible ones; the report says which. A run the model cannot
express is reported as skipped with the reason, never dropped.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from autoplan.config import ParallelConfig, RECOMPUTE
from autoplan.cost import Runtime, estimate
from autoplan.cost.compute import RMSNORM_KERNELS
from autoplan.cost.stages import num_virtual_stages, stage_layer_counts
from autoplan.errors import UserError
from autoplan.textfile import read_text
from autoplan.hardware import load_gpu, make_cluster
from autoplan.limits import MAX_GPUS, MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB, MAX_WIDTH, check_at_most
from autoplan.models.catalog import config_from_published
from autoplan.validate.families import by_family, interleaved_default_vpp, layer_sac, run_family, runtime_traits


@dataclass
class RunResult:
    id: str
    predicted: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] = field(default_factory=dict)
    assumed: dict[str, Any] = field(default_factory=dict)
    skipped: str = ""
    family: str = ""  # runtime family (families.run_family)

    def to_dict(self) -> dict[str, Any]:
        out = {"id": self.id, "family": self.family, "predicted": self.predicted,
               "measured": self.measured, "error": self.error, "assumed": self.assumed}
        if self.skipped:
            out["skipped"] = self.skipped
        return out


def load_runs(path: str | Path) -> list[dict[str, Any]]:
    """The runs of a runs file; UserError if it is not one."""
    path = Path(path)
    try:
        data = json.loads(read_text(path, "runs file"))
    except json.JSONDecodeError as exc:
        raise UserError(f"runs file {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list):
        raise UserError(f"runs file {path} must be an object with a \"runs\" list "
                        "(see cost_models/validation/published_runs.json)")
    if not runs:
        raise UserError(f"runs file {path} has an empty \"runs\" list; add at least one run "
                        "(see cost_models/validation/published_runs.json for the format)")
    return runs


# (section, field, what it must be) of every value validate_run reads; "count" is a positive
# integer, "amount" a positive number, "?" allows null; limits bound the work a typo can cause.
_RUN_FIELDS = (
    ("model", "seq_len", "count"), ("model", "layers", "count"), ("model", "hidden", "count"),
    ("model", "heads", "count"), ("model", "vocab", "count"), ("model", "ffn_hidden", "count?"),
    ("model", "kv_heads", "count?"), ("model", "head_dim", "count?"), ("model", "family", "text"),
    ("hardware", "gpu_key", "text"), ("hardware", "n_gpus", "count"),
    ("hardware", "gpus_per_node", "count?"), ("hardware", "interconnect", "text?"),
    ("parallel", "dp", "count"), ("parallel", "global_batch_seqs", "count"),
    ("parallel", "tp", "count?"), ("parallel", "pp", "count?"), ("parallel", "cp", "count?"),
    ("parallel", "ep", "count?"), ("parallel", "vpp", "count?"), ("parallel", "micro_batch", "count?"),
    ("parallel", "zero_stage", "stage?"), ("parallel", "recompute", "recompute?"),
    ("parallel", "sequence_parallel", "flag?"),
    ("truth", "tokens_per_s_per_gpu", "amount?"), ("truth", "mem_gib_per_gpu", "amount?"),
)


def _field_problem(value, kind: str) -> str | None:
    """Why `value` is not a `kind` (see _RUN_FIELDS), or None."""
    if kind.endswith("?"):
        if value is None:
            return None
        kind = kind[:-1]
    # NaN and Infinity parse from JSON as floats; neither is a size or a throughput
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    wants = {"count": "a positive integer", "amount": "a positive number", "text": "a string",
             "stage": "0, 1, 2 or 3", "recompute": f"one of {list(RECOMPUTE)}", "flag": "true or false"}
    ok = {"count": number and value == int(value) and value >= 1,
          "amount": number and value > 0,
          "text": isinstance(value, str),
          "stage": number and value in (0, 1, 2, 3),
          "recompute": value in RECOMPUTE,
          "flag": isinstance(value, bool)}[kind]
    return None if ok else f"is {json.dumps(value)[:40]}, must be {wants[kind]}"


def run_problems(run: Any) -> list[str]:
    """Every field of one runs-file row that validate_run could not use ("section.field: why")."""
    if not isinstance(run, dict):
        return [f"the row is {json.dumps(run)[:40]}, not a JSON object describing a run"]
    problems = []
    for section in dict.fromkeys(section for section, _, _ in _RUN_FIELDS):
        if not isinstance(run.get(section), dict):
            problems.append(f"{section} is missing or not an object")
    if problems:
        return problems
    for section, name, kind in _RUN_FIELDS:
        value = run[section].get(name)
        if value is None and not kind.endswith("?"):
            problems.append(f"{section}.{name} is missing")
        elif (why := _field_problem(value, kind)) is not None:
            problems.append(f"{section}.{name} {why}")
    limits = (("model", "seq_len", MAX_SEQ_LEN), ("model", "layers", MAX_LAYERS),
              ("model", "hidden", MAX_WIDTH), ("model", "vocab", MAX_VOCAB),
              ("hardware", "n_gpus", MAX_GPUS), ("parallel", "dp", MAX_GPUS))
    for section, name, limit in limits:
        try:
            check_at_most(f"{section}.{name}", run[section].get(name), limit)
        except UserError as exc:
            problems.append(str(exc).split(" (far beyond")[0])
    if not isinstance(run.get("precision_key"), str):
        problems.append(f"precision_key {_field_problem(run.get('precision_key'), 'text')}")
    return problems


def _divisors_up_to(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def recompute_implied_by_truth(run: dict[str, Any]) -> str | None:
    """'full' when the run's throughput was derived from a FLOP count that includes a
    recomputation forward (e.g. Narayanan et al. 2021 Eq. 3): the source ran with it, and
    the truth is only consistent with it."""
    truth = run.get("truth", {})
    how = f"{truth.get('how', '')} {run.get('flops_accounting', '')}".lower()
    if truth.get("path") == "tflops_via_source_formula" and (
            "incl. recompute" in how or "assumes activation recomputation" in how):
        return "full"
    return None


def candidate_configs(run: dict[str, Any]) -> list[tuple[ParallelConfig, dict[str, Any]]]:
    """The run's configuration, one per combination of values for its unstated settings."""
    p = run["parallel"]
    seq = run["model"]["seq_len"]
    gb = int(p["global_batch_seqs"])
    dp = int(p["dp"])
    pp = int(p.get("pp") or 1)
    vpp = int(p.get("vpp") or interleaved_default_vpp(run) or 1)
    tp = int(p.get("tp") or 1)
    base = dict(global_batch=gb, seq_len=seq, dp=dp, tp=tp, pp=pp, cp=int(p.get("cp") or 1),
                ep=int(p.get("ep") or 1), vpp=vpp, precision=run["precision_key"],
                schedule="interleaved-1f1b" if vpp > 1 else "1f1b")
    options: dict[str, list[Any]] = {}
    per_dp = gb // dp
    if p.get("micro_batch") is None:
        options["micro_batch"] = _divisors_up_to(per_dp, 16)
    else:
        base["micro_batch"] = int(p["micro_batch"])
    if p.get("recompute") is None:
        implied = recompute_implied_by_truth(run)
        if implied:
            base["recompute"] = implied
        else:
            options["recompute"] = ["none", "selective", "full"]
    else:
        base["recompute"] = p["recompute"]
    if p.get("zero_stage") is None:
        options["zero_stage"] = [0, 1]
    else:
        base["zero_stage"] = int(p["zero_stage"])
    if p.get("sequence_parallel") is None:
        options["sequence_parallel"] = [True, False] if tp > 1 else [False]
    else:
        base["sequence_parallel"] = bool(p["sequence_parallel"]) and tp > 1
    combos: list[dict[str, Any]] = [{}]
    for key, values in options.items():
        combos = [{**c, key: v} for c in combos for v in values]
    return [(ParallelConfig(**{**base, **c}), c) for c in combos]


def _graph_for_run(run: dict[str, Any]):
    config = config_from_published(run["model"])
    # the published layout is given: nothing here chooses what autoplan's runtime applies
    from autoplan.trace.tracer import graph_for_config  # torch: only when a run is costed

    return graph_for_config(config, 1, int(run["model"]["seq_len"]), probe_runtime=False)


def _cluster_for_run(run: dict[str, Any]):
    hardware = run["hardware"]
    gpu = load_gpu(hardware["gpu_key"])
    per_node = hardware.get("gpus_per_node") or None
    return make_cluster(gpu, int(hardware["n_gpus"]), gpus_per_node=per_node,
                        inter_node_bandwidth_gb_per_s=stated_nic_gb_per_s(run, per_node or gpu.gpus_per_node))


# Intel Omni-Path Architecture, its only deployed generation ("100 Series"): 100 Gb/s per port
OMNI_PATH_PORT_GBPS = 100.0


def stated_nic_gb_per_s(run: dict[str, Any], gpus_per_node: int) -> float | None:
    """Scale-out bandwidth per GPU (GB/s, one direction) where the run's `interconnect` states
    it ("8x200 Gb/s HDR InfiniBand per node", "1600 Gbps node-node RoCE", "4x Omni-Path links
    per node", "400 Gb/s per GPU"), else None (the GPU's typical system). Figures are per node
    unless the text says per GPU."""
    import re

    text = (run["hardware"].get("interconnect") or "").lower()
    rate = r"(\d+(?:\.\d+)?)\s*(?:gb/s|gbit/s|gbps|gb\b)"
    gbps = None
    if links := re.search(r"(\d+)\s*[x×]\s*(?:[a-z-]+\s+)?(\d+(?:\.\d+)?)\s*(?:gb/s|gbit/s|gbps|gb\b|g\b)", text):
        gbps = int(links.group(1)) * float(links.group(2))
    elif opa := re.search(r"(\d+)\s*[x×]?\s*omni-?path", text):
        gbps = int(opa.group(1)) * OMNI_PATH_PORT_GBPS
    elif single := re.search(rate, text):
        gbps = float(single.group(1))
    if not gbps:
        return None
    return gbps / 8 / (1 if "per gpu" in text else gpus_per_node)


# FlashAttention (Dao et al., arXiv:2205.14135, May 2022): runs published before it used an
# unfused attention core (Megatron's fused scale-mask-softmax over a materialised s x s matrix)
FLASH_ATTENTION_ARXIV = (22, 5, 14135)


def uses_flash_attention(run: dict[str, Any]) -> bool:
    """False when the run's source is an arXiv paper older than FlashAttention."""
    import re

    text = f"{run.get('source', '')} {run.get('source_locator', '')}"
    match = re.search(r"arXiv:(\d{2})(\d{2})\.(\d{4,5})", text)
    if not match:
        return True
    return tuple(int(g) for g in match.groups()) >= FLASH_ATTENTION_ARXIV


# Runtimes that can overlap TP collectives with GEMMs (Transformer Engine userbuffers, used by
# Megatron-Core's --tp-comm-overlap and NeMo / Megatron-Bridge's tp_comm_overlap recipes).
TP_OVERLAP_RUNTIMES = ("nemo", "megatron-bridge", "megatron-core", "mcore")
# Where a run says it overlapped: Megatron's flag, and torchtitan's AsyncTP (torch's
# micro-pipelined TP, an Inductor pass that splits each all-gather / reduce-scatter into
# chunks pipelined with the matmul on them, the decomposition of Wang et al. 2023 that
# layers.tp_exposed_s costs).
TP_OVERLAP_WORDS = ("tp-comm-overlap", "tp_comm_overlap", "asynctp", "async tp")


def tp_comm_overlap_options(run: dict[str, Any]) -> list[bool]:
    """TP/GEMM overlap: on where the run says it (TP_OVERLAP_WORDS); where it does not say and its
    runtime has the feature, both are tried and the faster kept (an unstated setting); off for
    other runtimes (Megatron-LM of 2021-22 papers, Megatron-DeepSpeed, FSDP). Only with TP > 1."""
    if int(run["parallel"].get("tp") or 1) <= 1:
        return [False]
    text = json.dumps(run).lower()
    if any(word in text for word in TP_OVERLAP_WORDS):
        return [True]
    source = f"{run.get('source', '')} {run.get('source_locator', '')}".lower()
    if any(name in source for name in TP_OVERLAP_RUNTIMES):
        return [False, True]
    return [False]


# Runtimes whose published benchmarks ran the 2022 FlashAttention Triton kernel: MosaicML
# llm-foundry's benchmark sweep (scripts/train/benchmarking/submit_benchmarks.py: `--attn_impl`
# defaults to 'triton' in every revision that produced its MPT tables, 2023-05 to 2024-01; the
# MPT pretraining yamls say `attn_impl: triton` over the same period, `flash` by 2025, when the
# MosaicML name was gone).
TRITON_FLASH_RUNTIMES = ("llm-foundry", "mosaicml")


def flash_kernel(run: dict[str, Any]) -> str:
    """The FlashAttention kernel of a run (compute.FLASH_KERNEL_SLOWDOWN): "triton" where its
    runtime's benchmarks default to the Triton kernel, else "flash2"."""
    source = f"{run.get('source', '')} {run.get('source_locator', '')}".lower()
    return "triton" if any(name in source for name in TRITON_FLASH_RUNTIMES) else "flash2"


# How a run's FP8 recipe scales its float8 casts (compute.FLOAT8_CAST_BYTES), from its
# precision text: Megatron-Bridge's "FP8-CS" is Transformer Engine's current (per-tensor)
# scaling and "FP8-MX" its MXFP8 block scaling; block-wise recipes (DeepSeek-V3's 1x128 and
# 128x128 tiles, Megatron-Bridge's block granularity) quantize an activation along its rows
# for the forward and again along its columns for the weight gradient, as torchao's rowwise;
# NeMo 24.07's FP8 is Transformer Engine's DelayedScaling (its recipes set fp8_amax_history_len
# and fp8_amax_compute_algo, the delayed recipe's fields); torchao float8 linears (torchtitan)
# take the plan's recipe, "" here.
FLOAT8_SCALING_WORDS = (("fp8-cs", "tensorwise"), ("current scaling", "tensorwise"),
                        ("fp8-mx", "mxfp8"), ("block", "rowwise"), ("transformer engine", "delayed"))


def float8_scaling(run: dict[str, Any]) -> str:
    """Runtime.float8_scaling of an fp8 run ("" for torchao's plan recipe or a 16-bit run)."""
    if run.get("precision_key") != "fp8":
        return ""
    text = str(run.get("precision", "")).lower()
    return next((scaling for word, scaling in FLOAT8_SCALING_WORDS if word in text), "")


# DeepSpeed ZeRO-3 as measured in 2021 (Narayanan et al. 2021 §5.2, Table 2): gathers at one
# NIC per GPU, not overlapped. Identified by a ZeRO-3 run whose source is an arXiv paper from
# before PyTorch FSDP / DeepSpeed's hierarchical, prefetched ZeRO-3 (2022).
FLAT_ZERO3_BEFORE_ARXIV = (22, 1, 0)


def zero3_flat_gather(run: dict[str, Any]) -> bool:
    """True for a ZeRO-3 run reported by a paper older than FLAT_ZERO3_BEFORE_ARXIV."""
    import re

    if int(run["parallel"].get("zero_stage") or 0) < 3:
        return False
    text = f"{run.get('source', '')} {run.get('source_locator', '')}"
    match = re.search(r"arXiv:(\d{2})(\d{2})\.(\d{4,5})", text)
    return bool(match) and tuple(int(g) for g in match.groups()) < FLAT_ZERO3_BEFORE_ARXIV


def stack_settings(run: dict[str, Any]) -> dict[str, Any]:
    """How the run's stack executed its blocks, from the row's `runtime` object (each value
    sourced in the row): `torch_compile` (torch.compile of each block; ParallelConfig.compile)
    and `rmsnorm` (how an eager RMSNorm ran, "fused" or "decomposed"; Runtime.rmsnorm_kernel). A row without it ran eagerly with fused norms
    (Megatron's Apex / Transformer Engine kernels). UserError on a value not understood."""
    stack = run.get("runtime") or {}
    compiled = stack.get("torch_compile", False) if isinstance(stack, dict) else None
    norm = stack.get("rmsnorm", "fused") if isinstance(stack, dict) else None
    if not isinstance(compiled, bool) or norm not in RMSNORM_KERNELS:
        raise UserError(f"runtime {json.dumps(stack)[:80]} must be an object with torch_compile "
                        f"true/false and rmsnorm one of {list(RMSNORM_KERNELS)}")
    return {"compile": compiled, "rmsnorm_kernel": norm}


def _partial_recompute(graph, config: ParallelConfig, cluster, flash: bool, runtime, est,
                       assumed: dict[str, Any]):
    """Where recomputation is unstated and none does not fit: the fewest blocks per pipeline
    stage recomputed fully that fit (Megatron's --recompute-method block
    --recompute-num-layers k; the planner chooses per-block recomputation the same way),
    found by bisection (memory falls and time rises with k). Unchanged when no k fits."""
    from dataclasses import replace

    stages = num_virtual_stages(config)
    most = max(stage_layer_counts(graph.num_layers, config))
    low, high, found = 1, most - 1, None
    while low <= high:
        k = (low + high) // 2
        trial = estimate(graph, replace(config, stage_recompute=((k, 0),) * stages), cluster,
                         flash_attention=flash, runtime=runtime)
        if trial.feasible:
            found, high = (k, trial), k - 1
        else:
            low = k + 1
    if found is None:
        return est, assumed
    k, trial = found
    return trial, {**assumed, "recompute": f"full on {k} of {most} blocks per stage"}


def _every_second_block_full(graph, config: ParallelConfig) -> ParallelConfig:
    """Half of each stage's blocks (rounded down) recomputed fully, the rest not at all."""
    from dataclasses import replace

    counts = stage_layer_counts(graph.num_layers, config)
    return replace(config, recompute="none",
                   stage_recompute=tuple((n // 2, 0) for n in counts[:num_virtual_stages(config)]))


def validate_run(run: dict[str, Any]) -> RunResult:
    """Estimate one published run; the best value under the model for unstated settings."""
    truth = run.get("truth", {})
    result = RunResult(id=str(run.get("id", "?")), family=run_family(run))
    # how the run's runtime keeps weights, recomputes and reports memory (families.runtime_traits)
    traits = runtime_traits(result.family)
    result.measured = {"tokens_per_s_per_gpu": truth.get("tokens_per_s_per_gpu"),
                       "memory_gib_per_gpu": truth.get("mem_gib_per_gpu")}
    try:
        graph = _graph_for_run(run)
        cluster = _cluster_for_run(run)
        candidates = candidate_configs(run)
        flash = uses_flash_attention(run)
        overlaps = tp_comm_overlap_options(run)
        flat = zero3_flat_gather(run)
        kernel = flash_kernel(run)
        scaling = float8_scaling(run)
        stack = stack_settings(run)
        compiled = stack.pop("compile")
        best = None
        for config, assumed in candidates:
            config = config.with_(compile=compiled)
            if layer_sac(run):
                config = _every_second_block_full(graph, config)
                assumed = {**assumed, "recompute": "full on every second block (layer SAC)"}
            for overlap in overlaps:
                runtime = Runtime(tp_comm_overlap=overlap, zero3_flat_gather=flat, flash_kernel=kernel,
                                  float8_scaling=scaling, **traits, **stack)
                est = estimate(graph, config, cluster, flash_attention=flash, runtime=runtime)
                if not est.feasible and assumed.get("recompute") == "none":
                    est, assumed = _partial_recompute(graph, config, cluster, flash, runtime, est,
                                                      assumed)
                key = (est.feasible, est.tokens_per_s_per_gpu if est.feasible else -est.memory_gib_per_gpu)
                if best is None or key > best[0]:
                    best = (key, est, {**assumed, **({"tp_comm_overlap": overlap} if len(overlaps) > 1 else {})})
    except (UserError, KeyError, ValueError) as exc:
        result.skipped = f"{type(exc).__name__}: {exc}"
        return result
    _, est, assumed = best
    if run["parallel"].get("recompute") is None and recompute_implied_by_truth(run):
        assumed = {**assumed, "recompute": "full (implied by the source's FLOP accounting)"}
    if default_vpp := interleaved_default_vpp(run):
        assumed = {**assumed, "vpp": f"{default_vpp} (the runtime's default stages per rank)"}
    if not flash:
        assumed = {**assumed, "attention": "unfused (source predates FlashAttention)"}
    elif kernel != "flash2":
        assumed = {**assumed, "attention": f"FlashAttention {kernel} kernel (the runtime's benchmark default)"}
    result.assumed = assumed
    result.predicted = {"tokens_per_s_per_gpu": est.tokens_per_s_per_gpu, "mfu": est.mfu,
                        "memory_gib_per_gpu": est.memory_gib_per_gpu, "feasible": est.feasible,
                        "step_time_s": est.step_time_s,
                        "time_breakdown_s": est.time_breakdown_s}
    measured = result.measured["tokens_per_s_per_gpu"]
    if measured:
        result.error["tokens_per_s_per_gpu"] = est.tokens_per_s_per_gpu / measured - 1
    mem = result.measured["memory_gib_per_gpu"]
    if mem:
        result.error["memory_gib_per_gpu"] = est.memory_gib_per_gpu / mem - 1
    return result


def summarize(results: Iterable[RunResult]) -> dict[str, Any]:
    results = list(results)
    errors = [abs(r.error["tokens_per_s_per_gpu"]) for r in results
              if not r.skipped and "tokens_per_s_per_gpu" in r.error]
    memory = [abs(r.error["memory_gib_per_gpu"]) for r in results
              if not r.skipped and "memory_gib_per_gpu" in r.error]
    return {
        "count": len(results),
        "compared": len(errors),
        "skipped": sum(1 for r in results if r.skipped),
        "predicted_infeasible": sum(1 for r in results if r.predicted and not r.predicted["feasible"]),
        "median_abs_rel_error": statistics.median(errors) if errors else None,
        "max_abs_rel_error": max(errors) if errors else None,
        "within_25pct_fraction": sum(e <= 0.25 for e in errors) / len(errors) if errors else None,
        "memory_compared": len(memory),
        "memory_median_abs_rel_error": statistics.median(memory) if memory else None,
    }


def validate_row(index: int, run: Any) -> RunResult:
    """One row: skipped with every malformed field named (row number from 1, and its id), or
    estimated."""
    problems = run_problems(run)
    if not problems:
        return validate_run(run)
    run_id = run.get("id") if isinstance(run, dict) and isinstance(run.get("id"), str) else None
    name = f"row {index + 1}" + (f" ({run_id})" if run_id else "")
    return RunResult(id=run_id or f"row {index + 1}",
                     skipped=f"{name} is malformed: {'; '.join(problems[:6])}")


def validate_file(path: str | Path) -> dict[str, Any]:
    """{"runs": [...], "summary": {...}} for every run of a runs file; malformed rows are
    reported as skipped with the fields named, the others estimated."""
    rows = load_runs(path)
    results = [validate_row(index, run) for index, run in enumerate(rows)]
    malformed = [r.skipped for r in results if r.skipped.startswith("row ") and " is malformed: " in r.skipped]
    skipped = [r.skipped if r.skipped in malformed else f"{r.id}: {r.skipped}" for r in results if r.skipped]
    if len(skipped) == len(results):
        raise UserError(f"no run in {path} can be validated: {' | '.join(skipped[:3])}"
                        + (f" | and {len(skipped) - 3} more" if len(skipped) > 3 else "")
                        + ". Fix the fields named (format: cost_models/validation/published_runs.json)")

    runs = [r.to_dict() for r in results]
    return {"runs": runs, "summary": summarize(results), "by_family": by_family(runs),
            "malformed": malformed}
