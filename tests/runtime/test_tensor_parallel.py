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
