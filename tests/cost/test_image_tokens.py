"""Tensor-parallel payloads of an image model count the tokens its blocks run on (a
ViT's patches plus the class token), not one token per image."""

from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corpus  # noqa: E402

from autoplan.config import ParallelConfig  # noqa: E402
from autoplan.cost.volume import tokens_per_rank  # noqa: E402
from autoplan.trace.tracer import trace_model  # noqa: E402


def test_vit_blocks_run_on_patches_and_the_class_token():
    entry = corpus.ENTRIES["vit_b16"]
    model = entry.build("tiny")  # 32 px images, 8 px patches
    inputs = {k: v.to("meta") for k, v in entry.example_inputs("tiny", batch=2, seq=16, device="cpu").items()}
    graph = trace_model(model, (), example_kwargs=inputs, name="vit")
    config = ParallelConfig(global_batch=8, seq_len=graph.seq_len, dp=2, tp=2, micro_batch=4,
                            sequence_parallel=True)
    tokens = (32 // 8) ** 2 + 1
    assert tokens_per_rank(graph, config, graph.blocks[0]) == 4 * tokens
    assert tokens_per_rank(graph, config) == 4 * graph.seq_len == 4  # a sample is one image
