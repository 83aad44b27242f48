"""The k and v projections of a grouped-query attention over more tensor-parallel ranks than
it has K/V heads (autoplan/runtime/kv_replication.py).

Megatron-LM (megatron/core/transformer/attention.py, `num_query_groups` < tp) and vLLM
(QKVParallelLinear, `num_kv_head_replicas = tp // num_kv_heads`) give each rank the one K/V
head its q heads attend with: its k/v GEMMs are 1/kv_heads of the whole, not 1/tp, and the
copies' weight gradients are summed over the ranks sharing a head. autoplan's runtime
computes the same head, from k and v weights kept whole on every rank (a Replicate DTensor,
its gradient summed over the tp group): it holds all kv_heads heads' weights where Megatron
holds one. With tp dividing kv_heads both shard them as any column-parallel linear.
"""

from __future__ import annotations


def replicates_kv(kv_heads: int, tp: int) -> bool:
    """True when tp exceeds what the K/V heads can be split into (tp a multiple of them)."""
    return kv_heads > 0 and tp > 1 and kv_heads % tp != 0


def kv_gemm_ways(kv_heads: int, tp: int) -> int:
    """The parts a k or v projection's GEMM is cut into, one per rank: tp, or kv_heads when
    each rank computes one replicated head."""
    return kv_heads if replicates_kv(kv_heads, tp) else tp


def kv_params_per_rank(kv_parameters: float, kv_heads: int, tp: int) -> float:
    """The k and v projections' parameters one rank holds: a 1/tp share, or all of them when
    their heads are replicated (whole on every rank, as autoplan's runtime keeps them)."""
    return float(kv_parameters) if replicates_kv(kv_heads, tp) else kv_parameters / tp
