"""Megatron-LM command-line arguments -> ParallelConfig (names as in megatron/training/arguments.py).

Accepts the argument string as pasted from a launch script (backslash line breaks, a leading
`torchrun ... pretrain_gpt.py`, `--flag=value` or `--flag value`), or `@FILE` / a path to a
file holding it (lines starting with # are comments). Every flag is either mapped, known to
describe the model (the estimate uses MODEL), known not to change the step time or memory
(data, logging, checkpoint paths, learning-rate schedule), known and assumed on as autoplan's
runtime does it (fused kernels, overlapped communication), or listed as not modelled.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from autoplan.config import ParallelConfig
from autoplan.errors import UserError
from autoplan.textfile import read_text
from autoplan.importers import (ImportedConfig, check_batch, check_ep, data_parallel, finish_seq_len, pick,
                                positive_int)

MAPPED = {
    "tensor-model-parallel-size", "pipeline-model-parallel-size", "context-parallel-size",
    "expert-model-parallel-size", "expert-tensor-parallel-size", "sequence-parallel",
    "use-distributed-optimizer", "micro-batch-size", "global-batch-size", "recompute-granularity",
    "recompute-method", "recompute-num-layers", "recompute-activations", "num-layers-per-virtual-pipeline-stage",
    "num-virtual-stages-per-pipeline-rank", "virtual-pipeline-model-parallel-size", "bf16", "fp16", "fp8-format",
    "seq-length", "num-layers", "optimizer-cpu-offload", "optimizer-offload-fraction", "use-torch-fsdp2",
    "use-megatron-fsdp", "use-custom-fsdp", "data-parallel-sharding-strategy", "optimizer",
    "pipeline-model-parallel-layout",
}
MODEL = {  # describe the architecture; the estimate uses MODEL
    "hidden-size", "ffn-hidden-size", "num-attention-heads", "num-query-groups", "group-query-attention",
    "kv-channels", "max-position-embeddings", "position-embedding-type", "rotary-base", "rotary-percent",
    "use-rotary-position-embeddings", "normalization", "norm-epsilon", "layernorm-epsilon", "swiglu",
    "untie-embeddings-and-output-weights", "disable-bias-linear", "add-qkv-bias", "vocab-size",
    "make-vocab-size-divisible-by", "num-experts", "moe-router-topk", "moe-ffn-hidden-size",
    "moe-shared-expert-intermediate-size", "moe-layer-freq", "multi-latent-attention", "q-lora-rank",
    "kv-lora-rank", "qk-head-dim", "qk-pos-emb-head-dim", "v-head-dim", "apply-layernorm-1p", "attention-dropout",
    "hidden-dropout", "init-method-std", "qk-layernorm", "use-mcore-models", "transformer-impl", "spec",
    "moe-router-load-balancing-type", "moe-aux-loss-coeff", "moe-grouped-gemm", "moe-token-dispatcher-type",
    "moe-router-score-function", "moe-router-topk-scaling-factor", "moe-z-loss-coeff", "moe-router-dtype",
    "moe-router-pre-softmax", "moe-router-enable-expert-bias", "moe-router-bias-update-rate", "num-layers-per-stage",
    "no-position-embedding", "use-rope-scaling", "rope-scaling-factor", "rotary-seq-len-interpolation-factor",
    "squared-relu", "openai-gelu", "onnx-safe", "bert-no-binary-head", "no-rope-fusion",
}
NEUTRAL = {  # no effect on step time or memory per GPU
    "train-iters", "train-samples", "lr", "min-lr", "lr-decay-style", "lr-decay-iters", "lr-decay-samples",
    "lr-warmup-iters", "lr-warmup-fraction", "lr-warmup-samples", "lr-warmup-init", "weight-decay",
    "start-weight-decay", "end-weight-decay", "weight-decay-incr-style", "clip-grad", "adam-beta1", "adam-beta2",
    "adam-eps", "sgd-momentum", "data-path", "train-data-path", "valid-data-path", "test-data-path",
    "data-cache-path", "split", "tokenizer-type", "tokenizer-model", "vocab-file", "merge-file", "save", "load",
    "save-interval", "eval-interval", "eval-iters", "log-interval", "tensorboard-dir", "wandb-project",
    "wandb-exp-name", "wandb-save-dir", "seed", "distributed-backend", "distributed-timeout-minutes",
    "exit-duration-in-mins", "exit-interval", "exit-signal-handler", "no-load-optim", "no-load-rng", "finetune",
    "ckpt-format", "log-throughput", "log-timers-to-tensorboard", "log-validation-ppl-to-tensorboard",
    "log-memory-to-tensorboard", "log-world-size-to-tensorboard", "log-batch-size-to-tensorboard",
    "log-learning-rate-to-tensorboard", "log-loss-scale-to-tensorboard", "timing-log-level", "timing-log-option",
    "log-params-norm", "log-num-zeros-in-grad", "num-workers", "dataloader-type", "mock-data",
    "no-mmap-bin-files", "reset-position-ids", "reset-attention-mask", "eod-mask-loss", "initial-loss-scale",
    "min-loss-scale", "loss-scale-window", "hysteresis", "loss-scale", "use-checkpoint-args", "manual-gc",
    "manual-gc-interval", "async-save", "ckpt-fully-parallel-save", "ckpt-fully-parallel-load",
    "dist-ckpt-strictness", "fp8-amax-history-len", "fp8-amax-compute-algo", "fp8-margin", "fp8-interval",
    "use-cpu-initialization", "perform-initialization", "data-parallel-random-init", "tensorboard-log-interval",
    "tensorboard-queue-size", "object-storage-cache-path", "use-dist-ckpt", "auto-detect-ckpt-format",
    "num-dataset-builder-threads", "create-attention-mask-in-dataloader", "no-create-attention-mask-in-dataloader",
    "legacy-tokenizer", "full-validation", "skip-train", "wandb-entity", "logging-level", "local-rank",
}
ASSUMED = {  # performance features autoplan's cost model and runtime take as on
    "use-flash-attn", "attention-backend", "overlap-grad-reduce", "overlap-param-gather", "tp-comm-overlap",
    "delay-grad-reduce", "align-grad-reduce", "align-param-gather", "overlap-p2p-communication",
    "defer-embedding-wgrad-compute", "cross-entropy-loss-fusion", "bias-swiglu-fusion", "bias-gelu-fusion",
    "masked-softmax-fusion", "bias-dropout-fusion", "gradient-accumulation-fusion", "persist-layer-norm",
    "no-persist-layer-norm", "attention-softmax-in-fp32", "accumulate-allreduce-grads-in-fp32",
    "use-fused-weighted-squared-relu", "microbatch-group-size-per-virtual-pipeline-stage", "ddp-bucket-size",
    "ddp-average-in-collective", "no-gradient-accumulation-fusion", "no-masked-softmax-fusion",
    "no-bias-gelu-fusion", "no-bias-dropout-fusion", "no-bias-swiglu-fusion",
    "overlap-param-gather-with-optimizer-step",
    "cp-comm-type", "calculate-per-token-loss", "moe-permute-fusion", "use-precision-aware-optimizer",
    "main-grads-dtype", "main-params-dtype", "exp-avg-dtype", "exp-avg-sq-dtype", "first-last-layers-bf16",
}
UNSUPPORTED = {  # known, change the estimate, not modelled
    "decoder-first-pipeline-num-layers": "uneven first pipeline stage: stages are modelled as even",
    "decoder-last-pipeline-num-layers": "uneven last pipeline stage: stages are modelled as even",
    "account-for-embedding-in-pipeline-split": "embedding counted as a layer in the pipeline split",
    "account-for-loss-in-pipeline-split": "loss counted as a layer in the pipeline split",
    "pipeline-model-parallel-layout": "explicit pipeline layout: stages are modelled as even",
    "cpu-offloading": "activation / weight offload to CPU (Transformer Engine)",
    "cpu-offloading-num-layers": "activation / weight offload to CPU (Transformer Engine)",
    "rampup-batch-size": "batch-size ramp-up: the estimate is for the final global batch",
    "fp4-format": "FP4 training",
    "num-distributed-optimizer-instances": "several distributed-optimizer instances (partial sharding)",
    "hierarchical-context-parallel-sizes": "hierarchical context parallelism",
    "encoder-num-layers": "encoder-decoder models", "encoder-seq-length": "encoder-decoder models",
    "decoder-seq-length": "encoder-decoder models", "encoder-tensor-model-parallel-size": "encoder-decoder models",
    "encoder-pipeline-model-parallel-size": "encoder-decoder models",
    "moe-expert-capacity-factor": "token dropping with an expert capacity factor",
    "recompute-modules": "selective recomputation of a chosen module list",
    "fp8-param-gather": "FP8 parameter all-gather",
}
VALUE_FLAGS = {  # flags that take a value (everything else in the known sets is a switch)
    *(f for f in MAPPED if f not in {"sequence-parallel", "use-distributed-optimizer", "recompute-activations",
                                      "bf16", "fp16", "optimizer-cpu-offload", "use-torch-fsdp2",
                                      "use-megatron-fsdp", "use-custom-fsdp"}),
}
_TORCHRUN_COUNTS = {"nproc-per-node", "nproc_per_node", "nnodes"}


def split_args(text: str) -> list[str]:
    """Tokens of a pasted command line: line continuations joined, comment lines dropped."""
    lines = [line for line in text.replace("\\\r\n", " ").replace("\\\n", " ").splitlines()
             if not line.lstrip().startswith("#")]
    try:
        return shlex.split(" ".join(lines))
    except ValueError as exc:
        raise UserError(f"the Megatron-LM argument string does not parse as a shell command line ({exc}); "
                        "quote it as one argument: --from-megatron \"--tensor-model-parallel-size 8 ...\"") from None


def parse(tokens: list[str]) -> tuple[dict[str, str | bool], dict[str, str]]:
    """({flag: value or True}, {torchrun option: value}); a leading launcher and script are skipped."""
    launcher: dict[str, str] = {}
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
    if script is not None:
        head, tokens = tokens[:script], tokens[script + 1:]
        for i, t in enumerate(head):
            name, _, inline = t.lstrip("-").partition("=")
            if name in _TORCHRUN_COUNTS:
                launcher[name.replace("_", "-")] = inline or (head[i + 1] if i + 1 < len(head) else "")
    flags: dict[str, str | bool] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise UserError(f"unexpected value {token!r} in the Megatron-LM arguments (after "
                            f"{tokens[i - 1] if i else 'the start'}); each option is --name [value]")
        name, eq, inline = token[2:].partition("=")
        name = name.replace("_", "-")
        if eq:
            flags[name] = inline
        # mapped switches (--bf16) never take a value; any other flag takes the next token unless it is an option
        elif (name in VALUE_FLAGS or name not in MAPPED) and i + 1 < len(tokens) and _looks_like_value(tokens[i + 1]):
            flags[name] = tokens[i + 1]
            i += 1
            while name in ("data-path", "train-data-path", "valid-data-path", "test-data-path") and \
                    i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                i += 1  # --data-path takes a list of weights and prefixes
        else:
            flags[name] = True
        i += 1
    return flags, launcher


def _looks_like_value(token: str) -> bool:
    return not token.startswith("-") or token[1:2].isdigit()


def read(value: str, *, num_gpus: int, global_batch: int | None, seq_len: int | None) -> ImportedConfig:
    text, source = _text(value)
    flags, launcher = parse(split_args(text))
    if not flags:
        raise UserError(f"{source}: no Megatron-LM options found; give them as --from-megatron \"--tensor-model-"
                        "parallel-size 8 --pipeline-model-parallel-size 4 --micro-batch-size 1 ...\"")
    notes: list[str] = []
    unsupported: list[str] = []
    num = lambda name, default=None: (positive_int(flags[name], f"--{name}", source)  # noqa: E731
                                      if name in flags else default)
    _check_launcher(launcher, num_gpus, source)
    tp, pp = num("tensor-model-parallel-size", 1), num("pipeline-model-parallel-size", 1)
    cp = num("context-parallel-size", 1)
    ep = num("expert-model-parallel-size", 1)
    dp = data_parallel(num_gpus, tp, pp, cp, source)
    if num("expert-tensor-parallel-size", 1) != 1:
        unsupported.append(f"--expert-tensor-parallel-size {flags['expert-tensor-parallel-size']}: experts are "
                           "modelled with expert-TP 1")
    check_ep(ep, dp, cp, tp, source)
    micro = num("micro-batch-size", 1)
    if "micro-batch-size" not in flags:
        notes.append("no --micro-batch-size: Megatron's default 1")
    gb = pick(num("global-batch-size"), global_batch, "global batch", notes)
    if gb is None:
        gb = micro * dp
        notes.append(f"no --global-batch-size: Megatron's default micro-batch x dp = {gb}")
    check_batch(gb, dp, micro, source)
    seq = pick(num("seq-length"), seq_len, "sequence length", notes)
    zero, offload = _sharding(flags, notes, unsupported)
    recompute, full_layers = _recompute(flags, num, notes, unsupported)
    vpp, per_stage = _virtual(flags, num, pp, notes)
    stage_layers = _layout(flags.get("pipeline-model-parallel-layout"), pp, source)
    if stage_layers is not None:
        vpp, per_stage = len(stage_layers) // pp, None
    precision = _precision(flags, notes)
    sp = bool(flags.get("sequence-parallel")) and tp > 1
    if flags.get("sequence-parallel") and tp == 1:
        notes.append("--sequence-parallel has no effect with tensor-parallel size 1")
    if "optimizer" in flags and str(flags["optimizer"]).lower() not in ("adam", "adamw"):
        unsupported.append(f"--optimizer {flags['optimizer']}: optimizer state is modelled as Adam's")
    _classify(flags, notes, unsupported)
    config = ParallelConfig(
        global_batch=gb, seq_len=finish_seq_len(seq, notes), dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=zero,
        offload=offload, micro_batch=micro, recompute=recompute,
        schedule="interleaved-1f1b" if (vpp or 1) > 1 else "1f1b", vpp=vpp or 1, precision=precision,
        sequence_parallel=sp, stage_layers=stage_layers)
    if full_layers is not None:
        config = config.with_(recompute="none", stage_recompute=((full_layers, 0),) * (pp * (vpp or 1)))
    return ImportedConfig(config=config, unsupported=unsupported, notes=notes, source=source, seq_len=seq,
                          num_layers=num("num-layers"), layers_per_virtual_stage=per_stage,
                          recompute_block_layers=full_layers)


def _text(value: str) -> tuple[str, str]:
    """The argument string, from the option itself or from @FILE / an existing file path."""
    raw = value.strip()
    path = Path(raw[1:]) if raw.startswith("@") else Path(raw)
    if raw.startswith("@") or (not raw.startswith("-") and "\n" not in raw and len(raw) < 4096 and path.is_file()):
        return read_text(path, "Megatron-LM argument file"), f"megatron: {path}"
    short = raw if len(raw) <= 60 else raw[:57] + "..."
    return raw, f"megatron: {short}"


def _check_launcher(launcher: dict[str, str], num_gpus: int, source: str) -> None:
    if "nproc-per-node" not in launcher:
        return
    try:
        total = int(launcher["nproc-per-node"]) * int(launcher.get("nnodes", "1").split(":")[-1])
    except ValueError:
        return  # $VARIABLES from a script: nothing to check
    if total != num_gpus:
        raise UserError(f"{source}: the torchrun line starts {total} processes, but --gpus is {num_gpus}; "
                        f"give --gpus {total}")


def _sharding(flags, notes, unsupported) -> tuple[int, str]:
    zero = 0
    if flags.get("use-distributed-optimizer"):
        zero = 1
        notes.append("--use-distributed-optimizer: optimizer state sharded over data-parallel ranks (ZeRO-1)")
    if flags.get("use-torch-fsdp2") or flags.get("use-megatron-fsdp") or flags.get("use-custom-fsdp"):
        strategy = str(flags.get("data-parallel-sharding-strategy", "optim_grads_params"))
        zero = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}.get(strategy, 3)
        notes.append(f"FSDP with sharding strategy {strategy}: ZeRO-{zero}")
    offload = "none"
    if flags.get("optimizer-cpu-offload"):
        offload = "optimizer"
        fraction = flags.get("optimizer-offload-fraction")
        if fraction not in (None, True) and float(fraction) < 1.0:
            unsupported.append(f"--optimizer-offload-fraction {fraction}: modelled as the whole optimizer offloaded")
    return zero, offload


def _recompute(flags, num, notes, unsupported) -> tuple[str, int | None]:
    granularity = flags.get("recompute-granularity")
    if flags.get("recompute-activations") and not granularity:
        granularity = "selective"
        notes.append("--recompute-activations is the old spelling of --recompute-granularity selective")
    if granularity in (None, True):
        return "none", None
    if granularity == "selective":
        return "selective", None
    if granularity != "full":
        raise UserError(f"--recompute-granularity must be full or selective, got {granularity!r}")
    method = flags.get("recompute-method")
    layers = num("recompute-num-layers", 1)
    if method == "block":
        notes.append(f"--recompute-method block: the first {layers} layers of every (virtual) stage recomputed")
        return "full", layers
    if method == "uniform" and layers > 1:
        notes.append(f"--recompute-method uniform with {layers} layers per checkpoint: modelled as every block "
                     "recomputed (same compute, activation memory counted per block)")
    return "full", None


def _virtual(flags, num, pp, notes) -> tuple[int | None, int | None]:
    """(vpp, layers per virtual stage deferred to the model's block count)."""
    vpp = num("num-virtual-stages-per-pipeline-rank") or num("virtual-pipeline-model-parallel-size")
    per_stage = num("num-layers-per-virtual-pipeline-stage")
    if per_stage and num("num-layers"):
        layers = num("num-layers")
        if layers % (per_stage * pp):
            raise UserError(f"--num-layers {layers} is not a multiple of pp {pp} x --num-layers-per-virtual-"
                            f"pipeline-stage {per_stage}; Megatron-LM rejects this too")
        vpp, per_stage = layers // (per_stage * pp), None
    if (vpp or 1) > 1 and pp == 1:
        raise UserError("a virtual pipeline size needs --pipeline-model-parallel-size > 1")
    return vpp, per_stage


def _layout(layout, pp: int, source: str) -> tuple[int, ...] | None:
    """Transformer layers per (virtual) stage of --pipeline-model-parallel-layout.

    The syntax of megatron/core/transformer/pipeline_parallel_layer_layout.py (parse_str_to_list):
    commas are cosmetic, "(...)*n" and "x*n" repeat, "|" ends a stage, "t" is a transformer layer."""
    if layout in (None, True):
        return None
    text = str(layout).replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    if set(text) - set("ELtm|") or len(stages) % pp:
        raise UserError(f"{source}: --pipeline-model-parallel-layout {layout!r} is not a layout of {pp} pipeline "
                        "ranks (stages of E, t, m, L split by |, as many as a multiple of the pipeline size)")
    return tuple(stage.count("t") for stage in stages)


def _precision(flags, notes) -> str:
    fp8 = flags.get("fp8-format")
    if fp8 not in (None, True):
        notes.append(f"--fp8-format {fp8}: FP8 GEMMs (Transformer Engine), bf16/fp16 elsewhere")
        return "fp8"
    if flags.get("bf16"):
        return "bf16"
    if flags.get("fp16"):
        return "fp16"
    notes.append("neither --bf16 nor --fp16: Megatron-LM trains in fp32")
    return "fp32"


def _classify(flags, notes, unsupported) -> None:
    model = sorted(f for f in flags if f in MODEL or f == "num-layers")
    if model:
        notes.append("model options read as a description of MODEL (the estimate uses MODEL's own shapes): "
                     + ", ".join(f"--{f}" for f in model))
    assumed = sorted(f for f in flags if f in ASSUMED)
    if assumed:
        notes.append("taken as autoplan's runtime does them (fused kernels, overlapped communication): "
                     + ", ".join(f"--{f}" for f in assumed))
    neutral = sorted(f for f in flags if f in NEUTRAL)
    if neutral:
        notes.append("no effect on step time or memory: " + ", ".join(f"--{f}" for f in neutral))
    for name in sorted(flags):
        if name in UNSUPPORTED:
            unsupported.append(f"--{name}: {UNSUPPORTED[name]}")
        elif name not in MAPPED | MODEL | NEUTRAL | ASSUMED:
            unsupported.append(f"--{name}: not a Megatron-LM option autoplan knows; ignored in the estimate")
