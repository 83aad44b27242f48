"""ParallelConfig: one point of the search space, the input of every cost function, and the
parallel part of every Plan; with the shared vocabulary of its choice fields.

Standard library only: a plan embeds its ParallelConfig, and plans are read on training nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# Allowed values of the choice fields: the one definition, which plan files, the planner and
# the runtime read.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# torchao's float8 training recipes (Float8LinearConfig.from_recipe_name): one scale per tensor,
# or per row with power-of-2 scales. Not its rowwise_with_gw_hp: under autocast (autoplan's bf16
# compute without FSDP) torchao 0.18's high-precision weight-gradient GEMM multiplies a bf16
# input by an fp32 gradient and fails ("expected m1 and m2 to have the same dtype").
FLOAT8_RECIPES = ("tensorwise", "rowwise")
OFFLOAD = ("none", "optimizer", "params", "both")
# tensor-parallel styles of a plan's tp_styles (autoplan.runtime.tensor_parallel applies them)
TP_STYLES = ("colwise", "rowwise", "rowwise_copy", "sequence_parallel", "final_norm", "prepare_input",
             "vocab_embedding", "whole_embedding", "vocab_head", "head_norm", "colwise_qkv", "colwise_gate_up", "colwise_kv",
             "colwise_heads", "head_embedding", "colwise_qkv_global", "mha_heads", "sharded_rms_norm",
             "replicated", "colwise_local", "head_inputs", "head_parameters", "moe")
# the styles that name their attention's head counts, "<style>:<heads>,<kv_heads>"
HEAD_COUNTED = ("colwise_qkv", "colwise_kv", "colwise_heads", "colwise_qkv_global", "mha_heads")


# the styles as a plan writes them (error messages)
TP_STYLE_FORMS = tuple(f"{s}:<heads>,<kv_heads>" if s in HEAD_COUNTED else
                       f"{s}:<heads>:<input>[+<input>...]" if s == "head_inputs" else s for s in TP_STYLES)


def head_inputs_parts(style: str) -> tuple[int, list[str]] | None:
    """(heads, input names) of a "head_inputs:<heads>:<input>+<input>" style; None if it is
    not one (runtime/head_inputs.py)."""
    name, _, rest = str(style).partition(":")
    heads, _, names = rest.partition(":")
    parts = names.split("+")
    if name != "head_inputs" or not heads.isdigit() or int(heads) < 1 or not all(p.isidentifier() for p in parts):
        return None
    return int(heads), parts


def tp_style_known(style: str) -> bool:
    """A style of TP_STYLES; a fused q/k/v projection's names its head counts,
    "colwise_qkv:<heads>,<kv_heads>" (the runtime splits each part by ranks), and a k or v
    projection's of a grouped-query attention "colwise_kv:<heads>,<kv_heads>" (the runtime
    shards its K/V heads, or gives each rank the one its q heads use), and a plain q, k or v
    projection's "colwise_heads:<heads>,<kv_heads>" where its attention builds a tensor of
    its head count in forward (T5's position bias: the runtime gives it the rank's count),
    a fused q/k/v projection viewed as (..., 3, heads, head_dim) by an attention that
    reads the full width from its input (timm) "colwise_qkv_global:<heads>,<heads>" (the
    attention runs on DTensors with the model's shapes), and an nn.MultiheadAttention's
    "mha_heads:<heads>,<heads>" (split by heads as one module), and an attention handed
    tensors of every head by its model (ALiBi's bias) "head_inputs:<heads>:<input>+<input>"
    (each rank is handed its heads of those inputs)."""
    name, colon, args = str(style).partition(":")
    if name == "head_inputs":
        return head_inputs_parts(style) is not None
    if name in HEAD_COUNTED:
        counts = args.split(",")
        return len(counts) == 2 and all(c.isdigit() and int(c) > 0 for c in counts)
    return name in TP_STYLES and not colon


def schedule_label(pp: int, schedule: str, vpp: int = 1) -> str:
    """The pipeline schedule as shown to a user: "none" without a pipeline (pp=1 runs no
    schedule, whatever the config's default field holds), else the schedule and its vpp."""
    if pp <= 1:
        return "none"
    return schedule + (f" v{vpp}" if vpp > 1 else "")


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees, sharding, batching, schedule, recomputation and precision of a training step.

    dp * tp * pp * cp == world size. EP is carved from dp * cp (Megatron / torchtitan):
    ep divides dp * cp and the experts. `global_batch` is in sequences of `seq_len` tokens.
    `stage_layers` is the number of blocks per pipeline stage (virtual stages in schedule
    order for interleaved); None means as even as possible. `stage_recompute` gives per
    stage (blocks recomputed fully, blocks recomputed selectively); None means `recompute`
    applies to every block. `layer_recompute` (one mode per block, execution order) is what
    the solver writes and a plan holds; it takes precedence over both. The fields before
    `recompute` are a plan file's flat keys, in the file's order (`PER_BLOCK` names the rest).
    """

    global_batch: int
    seq_len: int
    dp: int = 1
    dp_replicate: int = 1  # HSDP: dp = dp_replicate * dp_shard
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0
    offload: str = "none"  # none | optimizer | params | both
    precision: str = "bf16"  # fp32 | bf16 | fp16 | fp8
    micro_batch: int = 1
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved-1f1b | zero-bubble
    vpp: int = 1
    sequence_parallel: bool = True
    # each repeated block under torch.compile (torchtitan's apply_compile: "Apply torch.compile to
    # each TransformerBlock"), so Inductor fuses its memory-bound ops (cost.compute); the embedding,
    # final norm, head and loss stay eager
    compile: bool = False
    # TP plans under compile only: torch's micro-pipelined ("async") TP, an Inductor pass that
    # splits each sequence-parallel all-gather / reduce-scatter into chunks pipelined with the
    # matmul on them over CUDA symmetric memory (torchtitan's enable_async_tensor_parallel)
    async_tp: bool = False
    # fp8 plans only: torchao's scaling recipe, and whether ZeRO-3 all-gathers the float8
    # linears' weights already cast to float8 (torchao's enable_fsdp_float8_all_gather,
    # tensorwise only: 1 byte a parameter instead of 2)
    float8_recipe: str = "tensorwise"
    float8_all_gather: bool = False
    recompute: str = "none"
    stage_layers: tuple[int, ...] | None = None
    stage_recompute: tuple[tuple[int, int], ...] | None = field(default=None)
    layer_recompute: tuple[str, ...] | None = None  # per block in execution order; wins over the above

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    def with_(self, **changes) -> "ParallelConfig":
        return replace(self, **changes)


FLOAT8_KEYS = ("float8_recipe", "float8_all_gather")  # a plan file holds them when it is fp8


def float8_problem(precision: str, zero_stage: int, recipe: str, all_gather: bool) -> str | None:
    """Why these float8 settings cannot go together, or None. The float8 all-gather is
    torchao's for FSDP's ZeRO-3 gathers, and casts a weight with one scale before gathering
    it, which only the tensorwise recipe does (torchao Float8LinearConfig refuses
    enable_fsdp_float8_all_gather with rowwise scaling; torchtitan likewise)."""
    if precision != "fp8" and (recipe != "tensorwise" or all_gather):
        return f"float8_recipe and float8_all_gather apply to fp8 plans only (precision is {precision})"
    if all_gather and zero_stage != 3:
        return f"float8_all_gather needs ZeRO-3, whose FSDP gathers the weights (zero_stage is {zero_stage})"
    if all_gather and recipe != "tensorwise":
        return (f"float8_all_gather needs the tensorwise recipe: torchao casts a weight to float8 "
                f"with one scale before FSDP gathers it, and {recipe} scales each row")
    return None


def schedule_problem(schedule: str, pp: int, num_microbatches: int, zero_stage: int,
                     vpp: int = 1) -> str | None:
    """Why the runtime's pipeline cannot run `schedule` here, or None. torch 2.13's
    Schedule1F1B refuses fewer micro-batches than stages, and its interleaved schedules
    (Interleaved1F1B, InterleavedZeroBubble: pipelining/schedules.py) run them in rounds of
    pp and refuse a count that is not a whole number of its max(1, m // pp) rounds. Its
    zero-bubble schedules split each backward into an input-gradient step and a later
    weight-gradient step, which under FSDP resharding after the forward (ZeRO-3) trains wrong
    weights: measured, a Llama at pp2 x dp2 and at pp2 alone ends 3 steps 7e-4 and 1.3e-3
    (relative loss) away from one rank, where the same plan at ZeRO-1 or ZeRO-2, or under
    GPipe or interleaved 1F1B at ZeRO-3, matches it within 2e-7."""
    if pp < 2:
        return None
    if schedule == "1f1b" and vpp == 1 and num_microbatches < pp:
        return (f"the 1f1b schedule needs at least as many micro-batches as pipeline stages "
                f"({num_microbatches} < pp={pp}); use a smaller micro_batch or gpipe")
    if schedule == "zero-bubble" and zero_stage == 3:
        return ("the zero-bubble schedule's separate weight-gradient step does not train correctly "
                "under ZeRO-3 (FSDP resharding after the forward); use zero_stage 1 or 2, or 1f1b")
    rounds = max(1, num_microbatches // pp)
    if _runs_in_rounds(schedule, vpp) and num_microbatches % rounds:
        return (f"the {schedule} schedule at vpp={vpp} runs micro-batches in rounds of pp={pp}, and "
                f"{num_microbatches} micro-batches are not {rounds} whole rounds; use a number of "
                f"micro-batches that is a multiple of {pp}, or gpipe")
    return None


def _runs_in_rounds(schedule: str, vpp: int) -> bool:
    """Whether runtime/pipeline.build_schedule picks a torch schedule that runs rounds of pp
    micro-batches: interleaved 1F1B, and zero-bubble other than ZB-V (vpp 2)."""
    if schedule == "zero-bubble":
        return vpp != 2
    return schedule != "gpipe" and (vpp > 1 or schedule == "interleaved-1f1b")


def async_tp_problem(async_tp: bool, tp: int, sequence_parallel: bool, compile_: bool,
                     gpu: str) -> str | None:
    """Why async TP cannot run under these settings, or None. Inductor's micro-pipeline TP
    pass rewrites the all-gather before and the reduce-scatter after a sequence-parallel
    block's matmuls, in compiled code (torchtitan refuses it without compile), into fused
    ops on CUDA symmetric memory, which has no CPU backend."""
    if not async_tp:
        return None
    if tp < 2 or not sequence_parallel:
        return f"async_tp needs tp > 1 with sequence parallelism (tp is {tp}, sequence_parallel {sequence_parallel})"
    if not compile_:
        return "async_tp needs compile: it is a pass of torch.compile's Inductor over the compiled blocks"
    if gpu == "cpu":
        return "async_tp needs CUDA GPUs: its fused collectives run on CUDA symmetric memory, which CPU ranks lack"
    return None


# Fields that say how blocks are split and recomputed, rather than one number for the step.
PER_BLOCK = ("recompute", "stage_layers", "stage_recompute", "layer_recompute")
