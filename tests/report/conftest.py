"""One small sweep shared by the report tests: llama3.1-8b on h100 and a100 at 8 and 16 GPUs."""

from __future__ import annotations

import pytest

MODEL, SEQ, BATCH, TOKENS = "llama3.1-8b", 2048, 64, 10**11
PRICES = {"h100-sxm-80gb": 2.5, "a100-sxm4-80gb": 1.25}


@pytest.fixture(scope="session")
def graph8b():
    """(graph, ModelRef, seq_len) of llama3.1-8b at SEQ, traced once."""
    from autoplan.trace.load import load_graph

    return load_graph(MODEL, SEQ)


@pytest.fixture(scope="session")
def small_sweep(graph8b):
    from autoplan.hardware import load_gpu
    from autoplan.report.accuracy import ErrorBand
    from autoplan.report.sweep import run_sweep

    graph, ref, seq = graph8b
    error = ErrorBand(relative=0.2, median=0.1, runs=10, source="test band")
    return run_sweep(graph, ref, [load_gpu("h100"), load_gpu("a100-sxm4-80gb")], [8, 16], seq_len=seq,
                     global_batch=BATCH, tokens=TOKENS, prices=PRICES, error=error, budget_usd=1e5,
                     deadline_days=30)
