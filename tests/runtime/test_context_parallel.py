import json

import pytest

# fp32: summation-order differences only (values ~1, 1e-5 is ~100x fp32 rounding of a sum of
# a few dozen terms); bf16: inputs and output rounded to bf16's 8-bit mantissa (2^-8 = 0.004
# relative), merged in fp32, so a few bf16 ulps of values ~1-3; autocast: bf16 on both sides.
TOLERANCE = {"fp32": 1e-5, "gqa": 1e-5, "unfused": 1e-5, "bf16": 0.05, "autocast": 0.05,
             "encoder": 1e-5, "encoder_unfused": 1e-5}
# (dtype K/V travel in, element bytes, K/V heads) of each case (ring_attention_worker.CASES);
# under bf16 autocast the ring takes autocast's cast of q/k/v, as SDPA would
CASE_KV = {"fp32": ("float32", 4, 4), "bf16": ("bfloat16", 2, 4), "gqa": ("float32", 4, 2),
           "unfused": ("float32", 4, 2), "autocast": ("bfloat16", 2, 2),
           "encoder": ("float32", 4, 2), "encoder_unfused": ("float32", 4, 2)}


def _expected_sends(case: str, cp: int) -> dict[str, list[int]]:
    """{dtype: [messages, bytes]} one rank sends: its K/V chunk (batch 2, 8 rows of head dim
    16 a rank) cp-1 hops forward and cp-1 again in backward, in K/V's own dtype, and cp-1
    hops of an fp32 gradient accumulator of the same shape (the owner keeps its own share)."""
    dtype, size, heads = CASE_KV[case]
    elements = 2 * 2 * heads * 8 * 16  # K and V
    sent = {dtype: [2 * (cp - 1), 2 * (cp - 1) * elements * size]}
    row = sent.setdefault("float32", [0, 0])
    row[0] += cp - 1
    row[1] += (cp - 1) * elements * 4
    return sent


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_sdpa_on_the_whole_sequence(torchrun, tmp_path, cp):
    proc = torchrun("ring_attention_worker.py", cp, tmp_path / "results.json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["errors"]) == set(TOLERANCE)
    for case, error in results["errors"].items():
        assert error <= TOLERANCE[case], (case, error)
    for case, sent in results["sent"].items():
        assert sent == _expected_sends(case, cp), case
