"""nn.MultiheadAttention split by heads over tensor-parallel ranks (runtime/mha_parallel.py)."""

from __future__ import annotations

import json

import pytest
import torch.nn as nn

from autoplan.runtime.mha_parallel import mha_split_problem

# fp32 on values of order 1: the split runs the same products, only summed in another order
# (the out_proj partial sums over ranks, the gathered inputs' gradients)
TOLERANCE = 1e-5


def test_unsplittable_modules_are_refused_with_their_reason():
    assert mha_split_problem(nn.MultiheadAttention(32, 4), 2) is None
    assert "does not divide its 4 heads" in mha_split_problem(nn.MultiheadAttention(32, 4), 3)
    assert "kdim/vdim" in mha_split_problem(nn.MultiheadAttention(32, 4, kdim=16, vdim=16), 2)
    assert "add_bias_kv" in mha_split_problem(nn.MultiheadAttention(32, 4, add_bias_kv=True), 2)


@pytest.mark.slow
def test_head_parallel_module_matches_the_whole_one(torchrun, tmp_path):
    """Outputs, attention weights and every gradient of an nn.Transformer (sequence first,
    causal decoder, padded memory, cross-attention) and of lone modules under sequence
    parallelism (3-D per-head mask, padding mask, weights per head or averaged; batch
    first) equal the unsplit module's on 2 gloo ranks."""
    proc = torchrun("mha_worker.py", 2, tmp_path / "diffs.json", timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    diffs = json.loads((tmp_path / "diffs.json").read_text())
    assert set(diffs) == {"transformer_whole_inputs", "masked_weights_sp", "batch_first_sp"}
    assert "weights" in diffs["masked_weights_sp"] and "weights" in diffs["batch_first_sp"]
    worst = {case: max(d, key=d.get) for case, d in diffs.items()}
    print({case: (name, f"{diffs[case][name]:.1e}") for case, name in worst.items()})
    assert all(diffs[case][name] <= TOLERANCE for case, name in worst.items()), diffs
