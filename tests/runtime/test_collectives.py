"""FSDP issues the collectives the cost model charges, and ZeRO-1/2/3 hold the states it charges (cost/layers.py zero2_comm_s, zero3_comm_s; cost/memory.py model_state_bytes).

Counted over one step on 2 gloo ranks, 4 transformer blocks + root = 5 FSDP units, with 1
and with 4 micro-batches per step: ZeRO-2 gathers its weights once per step and
reduce-scatters every micro-batch (gradients stay sharded); ZeRO-3 gathers and
reduce-scatters every micro-batch. Skipping the per-micro-batch sync (accumulating
unsharded gradients) would show as one reduce-scatter per unit per step.
"""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_fsdp_reduce_scatters_every_microbatch(torchrun, tmp_path):
    proc = torchrun("collectives_worker.py", 2, tmp_path / "counts.json", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads((tmp_path / "counts.json").read_text())
    for zero in (2, 3):
        one, four = counts[f"zero{zero}_m1"], counts[f"zero{zero}_m4"]
        assert four["reduce_scatter"] == 4 * one["reduce_scatter"] > 0, counts
    assert counts["zero2_m4"]["all_gather"] == counts["zero2_m1"]["all_gather"] > 0, counts
    assert counts["zero3_m4"]["all_gather"] == 4 * counts["zero3_m1"]["all_gather"], counts
    # bf16 below ZeRO-2: fp32 module weights and gradients (torch.autocast), the optimizer
    # holds Adam's two fp32 moments, sharded by ZeroRedundancyOptimizer across the 2 ranks
    # (by whole parameters, so compared summed over ranks): what the cost model charges
    # with fp32_module_weights, 8 + 8/dp bytes per parameter, not the ZeRO paper's 4 + 12/dp.
    from autoplan.cost import memory

    z1 = counts["zero1_bf16_states"]
    n = z1["params"]
    states = memory.model_state_bytes(n, "bf16", 1, 2, fp32_module_weights=True)
    assert z1["parameters"] == states["parameters"] == 4 * n
    assert z1["gradients"] == states["gradients"] == 4 * n
    assert z1["optimizer_all_ranks"] == 2 * states["optimizer"] == 8 * n
    # ZeRO-2/3 (FSDP2): fp32 weight shards with fp32 gradient shards and Adam's moments, 16/dp
    # B per parameter in all (summed over the 2 ranks: 4 + 4 + 8); ZeRO-2 also keeps the
    # gathered 16-bit weights from forward to backward (not resident after the step)
    for zero in (2, 3):
        held = counts[f"zero{zero}_bf16_states"]
        states = memory.model_state_bytes(held["params"], "bf16", zero, 2, fp32_module_weights=True)
        gathered = 2 * held["params"] if zero == 2 else 0
        assert held["parameters_all_ranks"] == 2 * (states["parameters"] - gathered) == 4 * held["params"]
        assert held["gradients_all_ranks"] == 2 * states["gradients"] == 4 * held["params"]
        assert held["optimizer_all_ranks"] == 2 * states["optimizer"] == 8 * held["params"]
