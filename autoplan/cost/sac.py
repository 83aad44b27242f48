"""Op-level selective activation checkpointing as torchtitan runs it ("op" SAC).

torchtitan's policy (torchtitan/models/llama3/infra/parallelize.py, `_apply_ac_to_transformer_block`,
selective_ac_option = "op"; its Llama 3 train configs' default): inside each checkpointed
block the outputs of matmuls, SDPA and reduce-scatters are saved, "except every second mm";
everything else (norms, RoPE, activations, products) is recomputed in backward. The mm count
restarts in every block (a fresh `meta` per checkpoint context), so in a Llama block q, v,
gate and down projections are saved and k, o and up are recomputed.

Megatron's selective recomputation (memory.block_activation_bytes) keeps every activation but
the attention core; this keeps far less and recomputes some GEMMs.
"""

from __future__ import annotations

from math import prod

from autoplan.config import ParallelConfig
from autoplan.trace.graph import BlockInfo, ModelGraph

OP_SAC = "op-every-other-mm"


def _ops(graph: ModelGraph, block: BlockInfo) -> list:
    return [graph.graph.nodes[n]["op"] for n in graph.block_nodes(block)]


def _saved_and_recomputed(graph: ModelGraph, block: BlockInfo) -> tuple[float, float, float]:
    """(bytes saved beyond the block input, recomputed linear FLOPs, all linear FLOPs) of one
    block copy as traced (traced batch, dtype)."""
    saved = recomputed = linear_flops = 0.0
    count = 0
    for op in _ops(graph, block):
        out = prod(op.output_shape) * graph.dtype_bytes if op.output_shape else 0
        if op.kind == "linear":
            count += 1
            linear_flops += op.flops
            if count % 2 == 0:
                recomputed += op.flops
            else:
                saved += out
        elif op.kind == "attention":
            saved += out  # the output; the log-sum-exp is (heads x seq) floats, negligible
    return saved, recomputed, linear_flops


def op_sac_activation_bytes(graph: ModelGraph, block: BlockInfo, config: ParallelConfig) -> float:
    """Activation bytes one block copy keeps per micro-batch under op-level SAC: its input
    plus the saved op outputs. TP shards the saved outputs (column-parallel outputs and the
    heads of attention; row-parallel outputs only with sequence parallelism, taken alike here)."""
    saved, _, _ = _saved_and_recomputed(graph, block)
    act = 4 if config.precision == "fp32" else 2
    scale = config.micro_batch / graph.batch_size / config.cp * act / graph.dtype_bytes
    block_input = block.input_bytes * scale / (config.tp if config.sequence_parallel else 1)
    return block_input + saved * scale / config.tp


def op_sac_recompute_fraction(graph: ModelGraph, block: BlockInfo) -> float:
    """Share of the block's GEMM forward work that op-level SAC recomputes (every second mm)."""
    _, recomputed, linear_flops = _saved_and_recomputed(graph, block)
    return recomputed / linear_flops if linear_flops else 0.0


def op_sac_recompute_s(gemm_fwd_s: float, memory_fwd_s: float, fraction: float) -> float:
    """Extra forward seconds per micro-batch: the recomputed GEMMs' share of the forward GEMM
    time and every memory-bound op (norms, RoPE, activations are all recomputed); the
    attention core is saved, not recomputed."""
    return gemm_fwd_s * fraction + memory_fwd_s
