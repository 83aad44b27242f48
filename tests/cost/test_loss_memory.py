"""The loss's memory on the last stage (memory.loss_bytes), from the tensors torch's eager
cross entropy and Megatron's fused one hold at the log-softmax backward, per logit."""

from __future__ import annotations

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import memory

SEQ, VOCAB, MICRO = 1024, 32000, 2


def _config(**kw) -> ParallelConfig:
    base = dict(global_batch=8, seq_len=SEQ, dp=4, micro_batch=MICRO)
    return ParallelConfig(**{**base, **kw})


def test_eager_loss_keeps_logits_and_log_probs_and_makes_two_fp32_gradients(make_gpt_graph):
    graph = make_gpt_graph(seq=SEQ, vocab=VOCAB)
    logits = MICRO * SEQ * VOCAB
    got = memory.loss_bytes(graph, _config())
    # bf16 logits (2 B) + fp32 log-softmax output (4 B); nll and log-softmax gradients (4 + 4 B)
    assert got == {"activations": 6 * logits, "temporaries": 8 * logits}


def test_runtime_that_frees_the_logits_keeps_only_the_log_probs(make_gpt_graph):
    graph = make_gpt_graph(seq=SEQ, vocab=VOCAB)
    got = memory.loss_bytes(graph, _config(), keeps_logits=False)
    assert got["activations"] == 4 * MICRO * SEQ * VOCAB


def test_loss_parallel_splits_the_vocabulary_and_adds_an_fp32_exp(make_gpt_graph):
    graph = make_gpt_graph(seq=SEQ, vocab=VOCAB)
    got = memory.loss_bytes(graph, _config(dp=1, tp=4))
    per_rank = MICRO * SEQ * VOCAB / 4
    assert got == {"activations": pytest.approx(6 * per_rank), "temporaries": pytest.approx(12 * per_rank)}


def test_fp32_training_holds_fp32_logits(make_gpt_graph):
    graph = make_gpt_graph(seq=SEQ, vocab=VOCAB)
    got = memory.loss_bytes(graph, _config(precision="fp32"))
    assert got["activations"] == 8 * MICRO * SEQ * VOCAB


def test_megatron_fused_cross_entropy_is_the_4sbv_softmax_and_a_16_bit_gradient(make_gpt_graph):
    graph = make_gpt_graph(seq=SEQ, vocab=VOCAB)
    got = memory.loss_bytes(graph, _config(), fused_vocab_cross_entropy=True)
    assert got == {"activations": 4 * MICRO * SEQ * VOCAB, "temporaries": 2 * MICRO * SEQ * VOCAB}


def test_estimate_charges_the_loss_on_the_last_stage_only(make_gpt_graph):
    from autoplan.cost import estimate
    from autoplan.hardware import load_gpu, make_cluster

    graph = make_gpt_graph(seq=SEQ, vocab=VOCAB)
    cluster = make_cluster(load_gpu("h100-sxm-80gb"), 8, 8)
    est = estimate(graph, _config(dp=4, pp=2, global_batch=8), cluster)
    first, last = (s["memory_breakdown_gib"]["temporaries"] for s in est.per_stage)
    assert first == 0
    assert last * 2**30 == pytest.approx(8 * MICRO * SEQ * VOCAB)


def test_autoplans_step_frees_the_logits_but_a_pipeline_schedule_keeps_them(make_gpt_graph):
    # runtime/loop.py drops the model output before backward; torch.distributed.pipelining
    # holds each stage's output until that micro-batch's backward
    from autoplan.cost.layers import DEFAULT_RUNTIME
    from autoplan.cost.stages import last_stage_loss_bytes

    graph = make_gpt_graph(seq=SEQ, vocab=VOCAB)
    logits = MICRO * SEQ * VOCAB
    assert last_stage_loss_bytes(graph, _config(), DEFAULT_RUNTIME)["activations"] == 4 * logits
    pipelined = _config(dp=2, pp=2)
    assert last_stage_loss_bytes(graph, pipelined, DEFAULT_RUNTIME)["activations"] == 6 * logits
