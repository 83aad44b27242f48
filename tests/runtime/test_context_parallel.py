import json

import pytest

# fp32: summation-order differences only (values ~1, 1e-5 is ~100x fp32 rounding of a sum of
# a few dozen terms); bf16: inputs and output rounded to bf16's 8-bit mantissa (2^-8 = 0.004
# relative), merged in fp32, so a few bf16 ulps of values ~1-3.
TOLERANCE = {"fp32": 1e-5, "gqa": 1e-5, "unfused": 1e-5, "bf16": 0.05}


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_sdpa_on_the_whole_sequence(torchrun, tmp_path, cp):
    proc = torchrun("ring_attention_worker.py", cp, tmp_path / "errors.json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    errors = json.loads((tmp_path / "errors.json").read_text())
    assert set(errors) == set(TOLERANCE)
    for case, error in errors.items():
        assert error <= TOLERANCE[case], (case, error)
