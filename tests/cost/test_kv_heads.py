"""The cost of k and v projections over more tp ranks than K/V heads (cost/kv_heads.py): one
head's GEMM a rank, the whole weights held; with tp dividing the heads, a 1/tp share."""

from __future__ import annotations

from autoplan.cost.compute import _sharded_gemm
from autoplan.cost.kv_heads import kv_gemm_ways, kv_params_per_rank, replicates_kv
from autoplan.cost.profile import Gemm


def test_replication_starts_where_tp_passes_the_kv_heads():
    assert not replicates_kv(8, 8) and not replicates_kv(8, 1) and not replicates_kv(0, 16)
    assert replicates_kv(8, 16) and replicates_kv(1, 2)
    assert [kv_gemm_ways(8, tp) for tp in (2, 8, 16, 64)] == [2, 8, 8, 8]


def test_a_rank_holds_the_whole_kv_weights_once_replicated():
    assert kv_params_per_rank(1024, 8, 4) == 256
    assert kv_params_per_rank(1024, 8, 16) == 1024


def test_the_kv_gemm_of_one_head_per_rank():
    # 2 K/V heads of 16 over tp=4: each rank runs a 16-wide k projection, half the GEMM
    k_proj = Gemm(m=256, n=32, k=64, flops=2.0 * 256 * 32 * 64, kv_heads=2)
    m, n, k, flops = _sharded_gemm(k_proj, 1.0, 4, 1, 64, 0.0, 0)
    assert (n, k, flops) == (16, 64, k_proj.flops / 2)
    q_proj = Gemm(m=256, n=64, k=64, flops=2.0 * 256 * 64 * 64)  # q heads: a 1/tp share as before
    assert _sharded_gemm(q_proj, 1.0, 4, 1, 32, 0.0, 0)[1:] == (16, 64, q_proj.flops / 4)
