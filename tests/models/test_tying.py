"""Tied embeddings survive materialisation: Module.to_empty() unties shared parameters,
init_weights() must tie them again (the runtime builds on meta, then materialises)."""

from __future__ import annotations

import pytest
import torch

from autoplan.models.catalog import load_catalog_config
from autoplan.models import build_model

TIED = dict(model_type="llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
            intermediate_size=64, vocab_size=50, tie_word_embeddings=True)


@pytest.mark.parametrize("config", [TIED, dict(load_catalog_config("deepseek-v2-lite"), hidden_size=64,
                                                 num_hidden_layers=2, vocab_size=50, tie_word_embeddings=True,
                                                 n_routed_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, intermediate_size=64,
                                                 num_attention_heads=4, kv_lora_rank=16,
                                                 qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                                 q_lora_rank=None, first_k_dense_replace=1)])
def test_meta_build_materialise_init_keeps_weights_tied(config):
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device="cpu")
    assert model.lm_head.weight is not model.embed_tokens.weight  # to_empty unties
    torch.manual_seed(0)
    model.init_weights()
    assert model.lm_head.weight is model.embed_tokens.weight
    assert len(list(model.parameters())) == len(list(model.named_parameters(remove_duplicate=False))) - 1
