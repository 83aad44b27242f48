"""What the cost model reads from a traced block: its GEMMs, attention core and memory-bound bytes.

A BlockProfile is per copy at the traced (batch, seq) in the traced dtype, like BlockInfo.
It is read op by op from `ModelGraph.graph` when the block's ops are there (so attention
is told apart from GEMMs by op kind), else from the BlockInfo sums alone (graphs built by
hand in tests): then `gemm_shapes` minus the attention core, whose FLOPs are
`attention_flops`.

Memory traffic is counted twice: op by op, each op a kernel that reads its inputs from HBM
and writes its output (eager PyTorch), and as torch.compile's Inductor runs the block
(`inductor_fused_traffic`).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.trace.graph import BlockInfo, ModelGraph, per_block
from autoplan.trace.ops import MHA_TARGETS, mha_parts

GEMM_KINDS = ("linear", "matmul", "conv")
# Ops Inductor generates code for and fuses (pointwise, reductions, norms; views are index
# arithmetic inside the kernels that read them). Everything else (GEMMs, attention, MoE
# modules, embeddings, the loss) is an extern kernel between fused regions: Inductor calls
# cuBLAS / the SDPA kernels rather than generating them (Ansel et al. 2024, PyTorch 2, ASPLOS
# '24, §5: "extern kernels" for matmul and convolution; torch.compile's default mode does not
# fuse into GEMM templates).
FUSABLE_KINDS = ("elementwise", "norm", "view")
# Whole-norm ops that eager PyTorch may run as one fused kernel or op by op in fp32
# (compute.decomposed_rmsnorm_bytes_per_element): nn.RMSNorm and F.rms_norm as traced.
RMSNORM_TARGETS = ("RMSNorm", "rms_norm")
# Module classes whose Python loop over the sequence (trace: ModelGraph.sequence_loops) the
# library runs as fused GPU kernels when they are installed: transformers' MambaMixer calls
# mamba-ssm's selective_scan_fn / mamba_inner_fn and causal-conv1d on CUDA
# (transformers/models/mamba/modeling_mamba.py, MambaMixer.cuda_kernels_forward), a scan that
# reads its inputs from HBM once, keeps the state in SRAM and writes the output once (Gu & Dao
# 2023, Mamba, §3.3.2 "hardware-aware algorithm").
FUSED_SCAN_CLASSES = ("MambaMixer",)


@dataclass(frozen=True)
class Gemm:
    m: int
    n: int
    k: int
    flops: float
    expert: bool = False  # routed-expert GEMM: sharded by EP, M = tokens per expert
    kv_heads: int = 0  # a separate k or v projection's K/V heads (cost/kv_heads.py)


@dataclass(frozen=True)
class BlockProfile:
    gemms: tuple[Gemm, ...]
    attention_flops: float  # as counted (non-causal)
    head_dim: int
    memory_bytes: float  # bytes read + written by memory-bound ops, traced dtype
    routed_tokens_per_token: float  # top_k for MoE blocks, else 0
    kernels: int  # ops that launch work (not views)
    norm_saved_excess: float = 0.0  # bytes unfused norms save beyond their input (traced dtype)
    has_loss: bool = False  # the traced forward computes the loss itself
    # memory_bytes and kernels when Inductor fuses the memory-bound ops (inductor_fused_traffic);
    # None unless asked for (block_profile's `fused`) or where the graph has no ops (then the
    # op-by-op figures stand)
    fused_memory_bytes: float | None = None
    fused_kernels: int | None = None
    rmsnorm_elements: float = 0.0  # input elements of whole RMSNorm ops (RMSNORM_TARGETS)
    rmsnorm_ops: int = 0
    # the ops of a fused-kernel sequence loop (FUSED_SCAN_CLASSES): its GEMMs (not in `gemms`),
    # its share of memory_bytes and kernels op by op, and the fused kernel's HBM bytes
    scan_gemms: tuple[Gemm, ...] = ()
    scan_memory_bytes: float = 0.0
    scan_kernels: int = 0
    scan_fused_bytes: float = 0.0
    # the part of memory_bytes that tensor parallelism without sequence parallelism runs whole
    # on every rank (replicated_memory_op); None where the graph has no ops (all of it)
    replicated_memory_bytes: float | None = None


@per_block
def block_profile(graph: ModelGraph, block: BlockInfo, fused: bool = False) -> BlockProfile:
    """GEMMs, attention and memory traffic of one block copy (traced batch/seq/dtype); with
    `fused`, also its traffic and kernels under torch.compile (inductor_fused_traffic)."""
    names = graph.segment_nodes(block)
    ops = [graph.graph.nodes[n]["op"] for n in names]
    head_dim = block.hidden // block.heads if block.heads else 128
    if not ops:
        return _profile_from_sums(block, head_dim)
    gemms: list[Gemm] = []
    attention = 0.0
    memory = 0.0
    fusable = 0.0  # op-by-op bytes of the ops Inductor fuses
    kernels = 0
    norm_excess = 0.0
    rmsnorm_elements = 0.0
    rmsnorm_ops = 0
    loops = {loop["module"] for loop in graph.sequence_loops if loop.get("class") in FUSED_SCAN_CLASSES}
    scan = [n for n, op in zip(names, ops) if op.module in loops and op.kind != "view"]
    in_scan = set(scan)
    scan_gemms: list[Gemm] = []
    scan_memory = 0.0
    replicated = 0.0
    for name, op in zip(names, ops):
        if op.kind == "view":
            continue
        kernels += 1
        if op.kind in FUSABLE_KINDS:
            fusable += op.bytes_read + op.bytes_written
        if name in in_scan:
            if op.kind in GEMM_KINDS and op.gemm_mnk and op.flops > 0:
                scan_gemms.append(Gemm(*op.gemm_mnk, float(op.flops)))
            else:
                scan_memory += op.bytes_read + op.bytes_written
                memory += op.bytes_read + op.bytes_written
            continue
        if op.kind == "norm" and op.target in RMSNORM_TARGETS and op.input_shapes and op.input_shapes[0]:
            rmsnorm_elements += _numel(op.input_shapes[0])
            rmsnorm_ops += 1
        if op.kind == "norm" and op.input_shapes and op.input_shapes[0]:
            # a fused LayerNorm/RMSNorm kernel (Apex, Transformer Engine) saves its input and
            # per-row statistics only; the decomposed reference saves upcast copies as well
            norm_excess += max(0.0, op.saved_bytes - _numel(op.input_shapes[0]) * graph.dtype_bytes)
        if op.kind == "attention" and op.target in MHA_TARGETS:  # projections + core in one op
            core, projections = mha_parts(op)
            attention += core
            gemms.extend(Gemm(*g[:3], float(g[3])) for g in projections)
        elif op.kind == "attention":
            attention += op.flops
            if op.output_shape:
                head_dim = int(op.output_shape[-1])
        elif op.kind in GEMM_KINDS and op.gemm_mnk and op.flops > 0:
            kv_heads = block.kv_heads if op.module in block.kv_modules else 0
            gemms.append(Gemm(*op.gemm_mnk, float(op.flops), kv_heads=kv_heads))
        elif op.kind == "expert" and op.flops > 0:
            gemms.extend(_expert_gemms(op, block))
            traffic = op.bytes_read + op.bytes_written + _permutation_bytes(op, block)
            memory += traffic
            if replicated_memory_op(op, block.hidden):
                replicated += traffic
        else:
            memory += op.bytes_read + op.bytes_written
            if replicated_memory_op(op, block.hidden):
                replicated += op.bytes_read + op.bytes_written
    fused_memory = fused_kernels = None
    if fused:
        fused_bytes, regions = inductor_fused_traffic(graph, names)
        fused_memory = memory - fusable + fused_bytes
        fused_kernels = sum(1 for op in ops if op.kind not in FUSABLE_KINDS) + regions
    return BlockProfile(tuple(gemms), attention, head_dim, memory,
                        float(block.top_k) if block.experts else 0.0, kernels, norm_excess,
                        any(op.kind == "loss" for op in ops), fused_memory_bytes=fused_memory,
                        fused_kernels=fused_kernels, rmsnorm_elements=rmsnorm_elements,
                        rmsnorm_ops=rmsnorm_ops, scan_gemms=tuple(scan_gemms),
                        scan_memory_bytes=scan_memory, scan_kernels=len(scan),
                        scan_fused_bytes=region_traffic_bytes(graph, scan) if scan else 0.0,
                        replicated_memory_bytes=replicated)


def replicated_memory_op(op, hidden: int) -> bool:
    """Whether tensor parallelism without sequence parallelism runs a memory-bound op whole on
    every rank: the norms and the element-wise ops on the residual stream (dropout, residual
    add, bias after a row-parallel linear), whose tensors have the hidden width (Korthikanti et
    al. 2022 §4.2.2 and Eq. 2: the LayerNorms and the dropouts after attention and MLP are
    replicated across the TP ranks, 10sbh of the 34sbh). The ops between a column- and a
    row-parallel linear (rotary on the heads, the MLP activation on the ffn width) work on
    their rank's shard. MoE modules, whose routing runs on every token, count as replicated."""
    width = op.output_shape[-1] if op.output_shape else 0
    return op.kind in ("norm", "expert") or width == hidden


def region_traffic_bytes(graph: ModelGraph, names: list[str]) -> float:
    """HBM bytes of `names` (ops of one block copy) run as one kernel: each tensor it takes
    from outside read once (through views, to the op that made it), what it reads that no
    traced op made (parameters, buffers) once per op, and each tensor it makes that an op
    outside reads written once; everything else stays on chip."""
    g = graph.graph
    inside = set(names)

    def op(n: str):
        return g.nodes[n]["op"]

    def source(n: str) -> str:  # the op whose tensor a chain of views reads
        while op(n).kind == "view":
            preds = [p for p in g.predecessors(n) if op(p).output_shape]
            if len(preds) != 1:
                break
            n = preds[0]
        return n

    def read_outside(n: str) -> bool:  # an op outside reads n's tensor, through views
        for s in g.successors(n):
            if s not in inside and (op(s).kind != "view" or read_outside(s) or not list(g.successors(s))):
                return True
        return not list(g.successors(n))

    writes = sum(float(op(n).bytes_written) for n in names if read_outside(n))
    return kernel_reads_bytes(graph, names, source, inside.__contains__) + writes


def inductor_fused_traffic(graph: ModelGraph, names: list[str]) -> tuple[float, int]:
    """(HBM bytes, kernels) of the memory-bound ops among `names` (one block copy, traced
    batch and dtype) when torch.compile's Inductor fuses them.

    Inductor's scheduler fuses two nodes unless the fusion would create a cycle, i.e. unless
    one reaches the other through a node outside the fusion (torch/_inductor/scheduler.py
    `can_fuse`, `will_fusion_create_cycle`); GEMMs and attention are such nodes
    (FUSABLE_KINDS). So the fusable ops split into regions: connected fusable ops that the
    same number of extern kernels precede (`level`). Each region is one kernel that reads
    every tensor it takes from outside once and writes only what is read outside it (by an
    extern kernel, another region or the next block); what stays inside lives in registers.
    Nothing is written for the backward: AOTAutograd's min-cut partitioner recomputes cheap
    fusable ops in the backward's own kernels rather than saving them
    (torch/_functorch/partitioners.py min_cut_rematerialization_partition).
    Inputs from outside the graph's edges (the block input, buffers) are counted per op."""
    g = graph.graph
    inside = set(names)

    def op(n: str):
        return g.nodes[n]["op"]

    def fusable(n: str) -> bool:
        return op(n).kind in FUSABLE_KINDS

    def tensor_preds(n: str) -> list[str]:
        return [p for p in g.predecessors(n) if p in inside and op(p).output_shape]

    root: dict[str, str] = {}  # the tensor a view aliases
    level: dict[str, int] = {}  # extern kernels on the longest path from the block input
    for n in names:
        preds = tensor_preds(n)
        root[n] = root[preds[0]] if op(n).kind == "view" and len(preds) == 1 else n
        level[n] = max((level[p] + (0 if fusable(p) else 1) for p in g.predecessors(n) if p in level),
                       default=0)
    region = {n: n for n in names}

    def find(n: str) -> str:
        while region[n] != n:
            region[n] = region[region[n]]
            n = region[n]
        return n

    for n in names:
        if fusable(n):
            for p in g.predecessors(n):
                if p in inside and fusable(p) and level[p] == level[n]:
                    region[find(p)] = find(n)

    def computes(n: str) -> bool:  # a fusable op that is not a view
        return n in inside and fusable(n) and op(n).kind != "view"

    def readers(n: str) -> list[str]:  # consumers of n's tensor, looking through its views
        out: list[str] = []
        for s in g.successors(n):
            if s not in inside:
                continue
            if op(s).kind == "view" and root[s] == root[n]:
                out += readers(s)
            else:
                out.append(s)
        return out

    members: dict[str, list[str]] = {}
    for n in names:
        if computes(n):
            members.setdefault(find(n), []).append(n)
    total = 0.0
    for rid, ops_ in members.items():
        reads = kernel_reads_bytes(graph, ops_, lambda p: root.get(p, p),
                                   lambda source: computes(source) and find(source) == rid)
        writes = sum(float(op(n).bytes_written) for n in ops_
                     if not (used := readers(n)) or any(not (computes(c) and find(c) == rid) for c in used))
        total += reads + writes
    return total, len(members)


def kernel_reads_bytes(graph: ModelGraph, names: list[str], source_of, made_inside) -> float:
    """HBM bytes one kernel running the ops `names` reads: each tensor it takes from outside
    once (`source_of(producer)`: the op whose tensor a producer is, through views;
    `made_inside(op)`: whether the kernel itself makes it), and what no traced op made
    (parameters, buffers, the block input) once per op that reads it."""
    g = graph.graph
    reads: dict[str, float] = {}
    unlinked = 0.0
    for n in names:
        linked = 0.0
        for p in g.predecessors(n):
            producer = g.nodes[p]["op"]
            if not producer.output_shape:
                continue
            linked += producer.bytes_written
            source = source_of(p)
            if not made_inside(source):
                reads[source] = float(g.nodes[source]["op"].bytes_written)
        unlinked += max(0.0, g.nodes[n]["op"].bytes_read - linked)
    return sum(reads.values()) + unlinked


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _permutation_bytes(op, block: BlockInfo) -> float:
    """Token permutation around routed experts (Megatron-Core MoE token dispatcher): permute
    reads each token and writes top_k copies; unpermute reads them and writes the weighted
    sum: 2 x (1 + top_k) x tokens x hidden elements."""
    if not block.experts or not op.output_shape:
        return 0.0
    elements = _numel(op.output_shape)
    itemsize = op.bytes_written / elements if elements else 2
    return 2.0 * (1 + block.top_k) * elements * itemsize


def _expert_gemms(op, block: BlockInfo) -> list[Gemm]:
    """A MoE module costed from its structure: routed-expert GEMMs + router/shared experts.

    Routed FLOPs = tokens x top_k x 2 x (parameters of one expert) (fallback.py); the rest of
    the op's FLOPs (router, shared experts) sees every token once, each GEMM at the shape it
    ran with (`OpInfo.inner_gemms`): a 256-expert router is a (tokens, 256, hidden) GEMM and a
    shared expert three (tokens, ffn, hidden) ones (DeepSeek-V3 tech report arXiv:2412.19437
    §2.1.2), not one GEMM of the summed FLOPs.
    """
    m, n, k = op.gemm_mnk if op.gemm_mnk else (1, block.ffn or block.hidden, block.hidden)
    tokens = 1
    for d in op.output_shape[:-1]:
        tokens *= d
    per_expert = block.expert_parameters / block.experts if block.experts else 0.0
    routed = 2.0 * tokens * block.top_k * per_expert
    routed = min(routed, float(op.flops)) if routed else float(op.flops)
    out = [Gemm(m, n, k, routed, expert=True)]
    rest = float(op.flops) - routed
    for gm, gn, gk, flops in op.inner_gemms:
        if 0 < flops <= rest:
            out.append(Gemm(gm, gn, gk, float(flops)))
            rest -= flops
    if rest > 0:
        out.append(Gemm(tokens, max(block.ffn, 1), block.hidden, rest))
    return out


def _profile_from_sums(block: BlockInfo, head_dim: int) -> BlockProfile:
    gemms = []
    attention = float(block.attention_flops)
    remaining_attention = attention
    for m, n, k, flops in block.gemm_shapes:
        if remaining_attention > 0 and abs(flops - remaining_attention) <= 0.01 * attention + 1:
            remaining_attention -= flops
            continue
        gemms.append(Gemm(m, n, k, float(flops)))
    return BlockProfile(tuple(gemms), attention, head_dim, float(block.memory_traffic_bytes),
                        float(block.top_k) if block.experts else 0.0,
                        len(block.gemm_shapes) * 3)
