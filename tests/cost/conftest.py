"""Fixtures for the cost-model tests: textbook GPT graphs built by hand, a traced GPT block."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

from autoplan.trace.graph import BlockInfo, ModelGraph
from gpt_blocks import Stack


def gpt_graph(layers: int = 4, hidden: int = 1024, heads: int = 16, ffn: int | None = None,
              vocab: int = 32000, seq: int = 1024, batch: int = 1, dtype_bytes: int = 2) -> ModelGraph:
    """A GPT-like ModelGraph from textbook formulas (no op-level graph).

    Block: 4h^2 attention + 2*h*ffn MLP weights (+ biases, LayerNorms); forward FLOPs
    2*tokens*params_matmul + 4*b*s^2*h attention (non-causal, as FlopCounterMode counts);
    saved bytes 34sbh + 5as^2b, selective 34sbh, input 2sbh (Korthikanti et al. 2022).
    """
    ffn = ffn or 4 * hidden
    tokens = batch * seq
    h = hidden
    linear = [(tokens, 3 * h, h), (tokens, h, h), (tokens, ffn, h), (tokens, h, ffn)]
    gemms = tuple((m, n, k, 2 * m * n * k) for m, n, k in linear)
    attention = 4 * batch * seq * seq * h
    matmul_params = 4 * h * h + 2 * h * ffn
    block = BlockInfo(
        name="blocks", paths=tuple(f"blocks.{i}" for i in range(layers)), kind="dense",
        parameters=matmul_params + 4 * h + ffn + 4 * h, forward_flops=sum(g[3] for g in gemms) + attention,
        attention_flops=attention, elementwise_flops=0,
        saved_bytes=34 * seq * batch * h + 5 * heads * seq * seq * batch,
        saved_bytes_selective=34 * seq * batch * h, input_bytes=2 * seq * batch * h,
        memory_traffic_bytes=20 * tokens * h, hidden=h, kv_bytes=2 * tokens * h * dtype_bytes,
        heads=heads, kv_heads=heads, ffn=ffn, tp_parameters=matmul_params,
        gemm_shapes=gemms + ((batch * heads * seq, h // heads, 2 * seq, attention),),
    )
    pre = BlockInfo(name="pre", paths=("",), kind="pre", parameters=vocab * h, forward_flops=0,
                    attention_flops=0, elementwise_flops=0, saved_bytes=0, saved_bytes_selective=0,
                    input_bytes=0, memory_traffic_bytes=4 * tokens * h, hidden=h)
    head = 2 * tokens * h * vocab
    post = BlockInfo(name="post", paths=("",), kind="post", parameters=2 * h, forward_flops=head,
                     attention_flops=0, elementwise_flops=0, saved_bytes=2 * tokens * h,
                     saved_bytes_selective=2 * tokens * h, input_bytes=2 * tokens * h,
                     memory_traffic_bytes=4 * tokens * h, hidden=h,
                     gemm_shapes=((tokens, vocab, h, head),))
    return ModelGraph(graph=nx.DiGraph(), segments=[pre, block, post],
                      layer_order=[(p, "blocks") for p in block.paths], batch_size=batch,
                      seq_len=seq, dtype_bytes=dtype_bytes,
                      parameters=pre.parameters + layers * block.parameters + post.parameters,
                      embedding_parameters=vocab * h, vocab=vocab, model_name="gpt-textbook")


@pytest.fixture
def make_gpt_graph():
    return gpt_graph


@pytest.fixture(scope="session")
def traced_gpt_block():
    """(graph, block, h, a, s, b) of a traced Korthikanti GPT block (meta, bf16)."""
    from autoplan.trace.tracer import trace_model

    h, a, s, b = 64, 4, 128, 2
    with torch.device("meta"):
        model = Stack(h, a, layers=2)
    graph = trace_model(model, (torch.empty(b, s, h, device="meta"),))
    return graph, graph.segment("blocks"), h, a, s, b


@pytest.fixture(scope="session")
def h100_cluster():
    from autoplan.hardware import load_gpu, make_cluster

    return lambda n: make_cluster(load_gpu("h100"), n)
