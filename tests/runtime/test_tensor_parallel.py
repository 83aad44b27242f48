"""The plan's per-block-class TP style table expands to the module paths of the model."""

from __future__ import annotations

from autoplan.runtime.tensor_parallel import expand_tp_styles, uses_loss_parallel

NAMES = ["", "embed", "layers", "layers.0", "layers.0.attn", "layers.0.attn.q", "layers.1",
         "layers.1.attn", "layers.1.attn.q", "layers.10", "layers.10.attn.q", "head",
         "decoder.layers.0", "decoder.layers.0.attn.q"]


def test_a_class_key_expands_to_every_block_of_its_list_and_no_other():
    table = {"": {"embed": "vocab_embedding"}, "layers.*": {"attn.q": "colwise", "": "prepare_input"}}
    assert expand_tp_styles(table, NAMES) == {
        "embed": "vocab_embedding", "layers.0.attn.q": "colwise", "layers.1.attn.q": "colwise",
        "layers.10.attn.q": "colwise", "layers.0": "prepare_input", "layers.1": "prepare_input",
        "layers.10": "prepare_input"}


def test_a_block_path_key_expands_to_that_block_only():
    assert expand_tp_styles({"layers.1": {"attn.q": "colwise"}}, NAMES) == {"layers.1.attn.q": "colwise"}


def test_loss_parallel_is_read_from_any_scope():
    assert uses_loss_parallel({"": {"head": "vocab_head"}})
    assert not uses_loss_parallel({"layers.*": {"attn.q": "colwise"}})


def _embedding_backward_rows(vocab: int, tp: int) -> tuple[list[int], tuple, int]:
    """On the fake group as rank 0 of `tp`: the row counts of every embedding_dense_backward
    output, the weight gradient's placements and its local row count."""
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode

    from autoplan.runtime.tensor_parallel import style_for
    from autoplan.trace.fake_group import fake_process_group

    rows = []

    class Rows(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.embedding_dense_backward.default:
                rows.append(out.shape[0])
            return out

    with fake_process_group(tp, 0):
        mesh = init_device_mesh("cpu", (tp,))
        emb = nn.Embedding(vocab, 32)
        parallelize_module(emb, mesh, style_for("vocab_embedding", sequence_parallel=True))
        out = emb(torch.randint(0, vocab, (2, 16)))
        with Rows():
            out.sum().backward()
        return rows, tuple(emb.weight.grad.placements), emb.weight.grad.to_local().shape[0]


def test_vocab_embedding_backward_builds_only_this_ranks_rows():
    """DTensor's own rowwise embedding backward builds the full-vocabulary gradient on every
    rank (no Shard(0) strategy for embedding_dense_backward); the runtime's style must not."""
    from torch.distributed.tensor import Shard

    rows, placements, local_rows = _embedding_backward_rows(vocab=1000, tp=4)
    assert rows == [250]
    assert placements == (Shard(0),) and local_rows == 250


def test_vocab_parallel_embedding_matches_dtensor_rowwise(torchrun, tmp_path):
    """Same outputs and weight gradients as RowwiseParallel on 2 gloo ranks in fp32. Both
    sum the same rows in the same order (the masked tokens add exact zeros), so the
    tolerance is 0."""
    import json

    proc = torchrun("vocab_embedding_worker.py", 2, tmp_path / "diffs.json", timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    diffs = json.loads((tmp_path / "diffs.json").read_text())
    assert set(diffs) == {"seq_sharded", "replicated", "padding_rank0", "padding_rank1",
                          "uneven_vocab"}
    assert all(d == [0.0, 0.0] for d in diffs.values()), diffs
