"""What torch.autocast from fp32 module weights keeps beyond the traced 16-bit activations
(trace/activations.py autocast_extra_elements), against saved tensors measured on CPU."""

from __future__ import annotations

import torch
import torch.nn as nn

from autoplan.dryrun.kernels import cuda_saved_tensors
from autoplan.models.llama import build_llama
from autoplan.trace import activations
from autoplan.trace.tracer import graph_for_config

CONFIG = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=384, vocab_size=512,
              max_position_embeddings=256)
SEQ = 256


def _saved_bytes(model: nn.Module, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves in one forward."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, CONFIG["vocab_size"], (1, SEQ))
    with cuda_saved_tensors(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(ids)
    return sum(storages.values())


def _per_layer_extra(layers_a: int, layers_b: int) -> float:
    """Autocast's saved bytes over a bf16 model's, per decoder layer (difference of depths)."""
    def extra(layers: int) -> int:
        torch.manual_seed(0)
        model = build_llama(dict(CONFIG, num_hidden_layers=layers))
        fp32 = _saved_bytes(model, autocast=True)
        # the bf16 model's saved weights are its parameters; autocast's 16-bit weight copies
        # are the same bytes, so the difference is the activations alone
        return fp32 - _saved_bytes(model.bfloat16(), autocast=False)

    return (extra(layers_b) - extra(layers_a)) / (layers_b - layers_a)


def test_norm_inputs_and_casts_follow_the_architecture():
    graph = graph_for_config(CONFIG, 1, SEQ)
    block = graph.blocks[0]
    norm_inputs, casts, weights = activations.autocast_extra_elements(graph, block)
    tokens_hidden = SEQ * CONFIG["hidden_size"]
    assert norm_inputs == 2 * tokens_hidden  # input_layernorm, post_attention_layernorm
    assert casts == (3 - 1 + 2 - 1) * tokens_hidden  # q/k/v read one norm, gate/up the other
    linears = [m for m in build_llama(CONFIG).layers[0].modules() if isinstance(m, nn.Linear)]
    assert weights == sum(m.weight.numel() for m in linears)


def test_autocast_extra_matches_measured_saved_tensors():
    graph = graph_for_config(CONFIG, 1, SEQ)
    norm_inputs, casts, _ = activations.autocast_extra_elements(graph, graph.blocks[0])
    predicted = 2 * (norm_inputs + casts)
    measured = _per_layer_extra(1, 3)
    # not modelled, and exactly the rest: RoPE's fp32 cos/sin tables cast to bf16 for q and
    # for k in every layer (a bf16 model shares one table; seq x head_dim/2 each, 2 B), and
    # the two norm weights saved in fp32 (2 B more each): 0.5% of the extra at Llama-8B's
    # sizes, 10% at these tiny ones
    head_dim = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    rope_casts = 4 * SEQ * head_dim // 2 * 2
    norm_weights = 2 * CONFIG["hidden_size"] * 2
    assert measured == predicted + rope_casts + norm_weights
