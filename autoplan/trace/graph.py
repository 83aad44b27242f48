"""ModelGraph: what `trace` learns about a model, and all that later stages read.

A ModelGraph is a value object. `trace.trace_model` builds it; `cost`, `solve` and
`analyze` only read it. Every number is for the traced batch and sequence length
(`batch_size`, `seq_len`) in the traced dtype (`dtype_bytes` per float element);
consumers rescale: FLOPs and activation bytes are linear in the batch, and a new
sequence length means tracing again (attention is quadratic in it).

Tracing runs in bf16 (`dtype_bytes` == 2): activation bytes are those of bf16/fp16
mixed-precision training (dropout masks 1 byte, fp32 upcasts kept as traced); scale
float activations by 2 for fp32 training. Routed experts are never TP-sharded (EP
shards them): `tp_parameters`/`tp_flops` cover only what TP divides.

Op kinds (`OpInfo.kind`):
    linear, matmul, conv, attention, embedding, norm, elementwise, moe_router,
    expert, loss, view, other
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import networkx as nx

T = TypeVar("T")


@dataclass(frozen=True)
class OpInfo:
    """One op of the traced graph (an fx node, or a module costed from its structure)."""

    name: str
    module: str  # owning module path, "" for the root
    kind: str
    target: str
    input_shapes: tuple[tuple[int, ...], ...]
    output_shape: tuple[int, ...]
    dtype: str
    parameters: int = 0  # parameters owned by a leaf-module op
    flops: int = 0  # forward FLOPs as torch.utils.flop_counter counts them
    elementwise_flops: int = 0  # one per output element of pointwise work, reported apart
    bytes_read: int = 0
    bytes_written: int = 0
    saved_bytes: int = 0  # activation bytes this op saves for backward (no parameters)
    gemm_mnk: tuple[int, int, int] | None = None  # (M, N, K) of a matmul-like op
    fallback: bool = False  # one op for a whole MoE module (run and measured); the cost
    # model splits its FLOPs into routed-expert GEMMs (M = routed tokens per expert) and the rest
    # (M, N, K, FLOPs) of each GEMM a fallback MoE op ran outside its routed experts (router,
    # shared experts), so the cost model prices each at its own shape
    inner_gemms: tuple[tuple[int, int, int, int], ...] = ()
    # elements the routed experts' GEMMs of a fallback MoE op write: routed token slots x the
    # output features of one expert's matrices (gate + up + down), what a selective
    # checkpoint that saves every matmul output keeps (trace/activations.py sac_output_bytes)
    routed_gemm_output_elements: int = 0
    writes_input: bool = False  # an in-place update of its first input (`x += y`, `x.add_(y)`)
    parameter_reads: tuple[str, ...] = ()  # paths of the parameters it reads itself (not a leaf module's)


@dataclass(frozen=True)
class BlockInfo:
    """A group of identical blocks (layers of a ModuleList/Sequential) or a one-off segment.

    All per-copy numbers are measured on the first copy and stand for every copy.
    `pre` (before the first block: embeddings) and `post` (after the last block: final
    norm, output head, loss) are BlockInfo with count 1 and kind "pre" / "post".
    """

    name: str
    paths: tuple[str, ...]  # module path of each copy, execution order
    kind: str  # "dense" | "moe" | "pre" | "post"
    parameters: int  # per copy
    forward_flops: int  # per copy, traced batch/seq
    attention_flops: int  # part of forward_flops inside attention cores (quadratic in seq)
    elementwise_flops: int
    saved_bytes: int  # per copy: activations saved for backward, no recomputation
    saved_bytes_selective: int  # per copy: with the attention core recomputed
    input_bytes: int  # per copy: the block input, all that full recomputation keeps
    memory_traffic_bytes: int  # per copy: bytes read + written by memory-bound ops
    hidden: int  # last dim of the block input
    kv_bytes: int = 0  # per copy: K and V bytes entering attention (CP ring exchange)
    heads: int = 0
    kv_heads: int = 0
    ffn: int = 0  # width of the dense MLP (or of one expert for MoE)
    experts: int = 0
    top_k: int = 0
    expert_parameters: int = 0  # per copy: parameters inside routed experts (EP shards them)
    tp_parameters: int = 0  # per copy: parameters inside TP-shardable linears
    tp_flops: int = 0  # per copy: forward FLOPs that TP divides (sharded linears + attention cores)
    # the first copy's separate k and v projections of a grouped-query attention, and their
    # parameters: whole on every rank when tp exceeds kv_heads (runtime/kv_replication.py)
    kv_modules: tuple[str, ...] = ()
    kv_parameters: int = 0
    gemm_shapes: tuple[tuple[int, int, int, int], ...] = ()  # (M, N, K, flops) per matmul-like op

    @property
    def count(self) -> int:
        return len(self.paths)


@dataclass(frozen=True)
class SideValue:
    """A value a pipeline cut hands on beside the hidden states: autoplan's runtime splits a
    traced model so that every value live across a cut crosses it (runtime/pipeline.py
    split_stages), such as the rotary cos/sin tables every block reads."""

    elements: int  # at the traced batch and sequence length
    dtype: str  # torch's name, as the model makes it from its own (fp32) weights and buffers
    element_bytes: int
    requires_grad: bool  # its gradient crosses back
    # elements scale as (batch / traced batch) ** batch_power x (tokens a rank holds / traced
    # seq_len) ** seq_power: 0 and 1 for a table sliced by the sequence, 1 and 1 for a hidden state
    batch_power: int = 1
    seq_power: int = 1

    @property
    def floating(self) -> bool:
        return self.dtype.startswith(("float", "bfloat"))


@dataclass
class ModelGraph:
    """The costed graph of one model at one (batch, seq)."""

    graph: nx.DiGraph  # node = op name, attribute "op": OpInfo; edges = data flow
    segments: list[BlockInfo]  # pre, block groups in execution order, post
    layer_order: list[tuple[str, str]]  # (block path, segment name) for every block copy
    batch_size: int
    seq_len: int
    dtype_bytes: int
    parameters: int  # unique parameters, tied weights counted once
    embedding_parameters: int
    vocab: int
    tensor_parallel: list[dict] = field(default_factory=list)
    context_parallel: list[str] = field(default_factory=list)  # attention modules calling SDPA
    cp_buffers: dict[str, int] = field(default_factory=dict)  # position tables sliced by seq -> dim
    expert_parallel: list[dict] = field(default_factory=list)
    fallback_modules: list[str] = field(default_factory=list)  # costed at balanced routing
    # {module, class, ops}: a module running a Python loop over the sequence (transformers'
    # Mamba scan without mamba-ssm); cost/profile.py costs a loop whose class has a fused GPU
    # kernel as that kernel where the GPU runs it, any other op by op as traced
    sequence_loops: list[dict] = field(default_factory=list)
    tp_unsplit: list[dict] = field(default_factory=list)  # {block, module, reason} TP leaves whole
    # TP style table: "" -> {module path: style} for modules outside blocks; a block class
    # ("layers.*", or one block path) -> {path relative to each block: style}
    tp_styles: dict[str, dict[str, str]] = field(default_factory=dict)
    # axis -> why autoplan.runtime cannot apply it to this model (trace/capability.py)
    refused: dict[str, str] = field(default_factory=dict)
    # why sequence parallelism would train this model wrong, read off its facts ("": it would not)
    sp_problem: str = ""
    # why context parallelism would train this model wrong, read off its facts ("": it would not)
    cp_problem: str = ""
    capability_probe_s: float = 0.0
    fingerprint: str = ""
    model_name: str = ""
    image_size: int = 0  # side of the traced image batch for image models (seq_len is then 1)
    image_channels: int = 0  # channels of that batch
    num_classes: int = 0  # an image model's output is (batch, num_classes); 0 when it is not
    # positional inputs of the model file's example_batch, which the job trains on (0: the
    # runtime's own token or image objective)
    user_batch_inputs: int = 0
    user_batch_keywords: bool = False  # ... given by keyword (a dict)
    # the smallest sliding window of a Hugging Face model's attention (0: none), whose mask
    # the model's own code builds from the length it sees (runtime/model_io.attention_window)
    attention_window: int = 0
    # per cut after block copy k (layer_order[k], k < num_layers - 1): what a pipeline stage
    # ending there hands on beside the hidden states (trace/side_values.py); empty where the
    # runtime hands on the hidden states alone (Hugging Face models) or cannot split the model
    pipeline_side_values: list[tuple[SideValue, ...]] = field(default_factory=list)
    # what per_block functions derived from this graph (a graph is not changed once traced)
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def blocks(self) -> list[BlockInfo]:
        return [s for s in self.segments if s.kind not in ("pre", "post")]

    @property
    def pre(self) -> BlockInfo:
        return self.segments[0]

    @property
    def post(self) -> BlockInfo:
        return self.segments[-1]

    @property
    def num_layers(self) -> int:
        return len(self.layer_order)

    @property
    def sequence_shardable(self) -> bool:
        """Whether sequence parallelism may shard what runs between TP regions along dim 1:
        a token model's vocab-parallel embedding hands on its sequence shard; nothing before
        an image model's first block shards its patch sequence, and in the model file's own
        example_batch which dimension is a sequence only the file knows. A sliding-window
        mask (window <= seq_len) is built by the model's own code from the length it sees,
        which under SP would be the shard's. "sp" in `refused`: the capability probe ran TP
        only without SP (trace/capability.py)."""
        return (not self.image_size and not self.user_batch_inputs and not self.window_masked
                and "sp" not in self.refused and not self.sp_problem)

    @property
    def window_masked(self) -> bool:
        """Whether the model's sliding window is short enough that transformers builds its
        mask at this sequence length (model_io.attention_window)."""
        return 0 < self.attention_window <= self.seq_len

    def vocab_parameters(self, block: BlockInfo) -> int:
        """Parameters of `block` in a vocabulary-sized table (the token embedding, an untied
        output head), which tensor parallelism shards by rows; 0 for a tied head."""
        table = self.vocab * block.hidden
        if block.kind not in ("pre", "post") or not table or block.parameters < table:
            return 0
        return table

    def segment(self, name: str) -> BlockInfo:
        return next(s for s in self.segments if s.name == name)

    def block_nodes(self, block: BlockInfo) -> list[str]:
        """Graph nodes of the block's first copy (none for "pre", "post" and hand-built graphs)."""
        return list(_block_nodes(self, block))

    def segment_nodes(self, block: BlockInfo) -> list[str]:
        """block_nodes, and for "pre" / "post" the top-level nodes before the first block node /
        after the last (the split trace/blocks.py makes)."""
        return list(_segment_nodes(self, block))

    def layer_blocks(self) -> list[BlockInfo]:
        """BlockInfo of every block copy, in execution order (len == num_layers)."""
        by_name = {s.name: s for s in self.segments}
        return [by_name[name] for _, name in self.layer_order]

    def forward_flops(self) -> int:
        return sum(s.forward_flops * s.count for s in self.segments)


def per_block(func: Callable[..., T]) -> Callable[..., T]:
    """Memoise `func(graph, block, *args)`, a pure function of the traced graph, one block and
    hashable arguments, on the graph: the search asks for the same block's derived numbers
    (its nodes, its saved bytes) for every configuration it costs. The block is held with its
    value, so its id() is never another block's while the graph lives."""
    @functools.wraps(func)
    def memoised(graph: ModelGraph, block: BlockInfo, *args, **kwargs):
        key = (func.__qualname__, id(block), args, tuple(sorted(kwargs.items())))
        try:
            return graph.memo[key][1]
        except KeyError:
            value = func(graph, block, *args, **kwargs)
            graph.memo[key] = (block, value)
            return value
    return memoised


@per_block
def _block_nodes(graph: ModelGraph, block: BlockInfo) -> tuple[str, ...]:
    prefix = block.paths[0] + "." if block.paths and block.paths[0] else None
    return tuple(n for n in graph.graph.nodes if n.startswith(prefix)) if prefix else ()


@per_block
def _segment_nodes(graph: ModelGraph, block: BlockInfo) -> tuple[str, ...]:
    if block.kind not in ("pre", "post"):
        return _block_nodes(graph, block)
    firsts = tuple(b.paths[0] + "." for b in graph.blocks if b.paths)
    names = list(graph.graph.nodes)
    in_block = [n.startswith(firsts) for n in names]
    first = in_block.index(True) if True in in_block else len(names)
    last = len(in_block) - 1 - in_block[::-1].index(True) if True in in_block else -1
    if block.kind == "pre":
        return tuple(n for i, n in enumerate(names) if i < first and not in_block[i])
    return tuple(n for i, n in enumerate(names) if i > last and not in_block[i])


def sequence_loop_notes(loops: list[dict], seq_len, fused_classes: tuple[str, ...] | None = None) -> list[str]:
    """One sentence for the modules that loop over the sequence in Python (sequence_loops).
    `fused_classes`: the classes the plan costs as their library's fused kernel on its device
    (None: no device chosen, as in `analyze`)."""
    if not loops:
        return []
    first, more = loops[0], len(loops) - 1
    what = (f"{first['module']} ({first.get('class', '?')}){f' and {more} more' if more else ''} "
            f"loops over the sequence in Python ({first['ops']:,} torch ops per forward at {seq_len} tokens)")
    if fused_classes is None:
        return [f"{what}: `plan` costs it as one fused kernel where its library has one for the "
                "GPU (transformers' Mamba: mamba-ssm's selective scan), else op by op as traced"]
    if first.get("class") in fused_classes:
        return [f"{what}: costed as one fused kernel, mamba-ssm's selective scan, which transformers "
                "calls on CUDA when mamba-ssm and causal-conv1d are installed on the training nodes; "
                "without them it runs this loop, far slower than this estimate"]
    return [f"{what}: costed op by op as traced (no fused kernel of it is modelled on this device)"]
