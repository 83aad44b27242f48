"""The pipeline split of Hugging Face models (runtime/pipeline_hf.py), in one process.

What is family-specific in the split is which modules each stage keeps and what a later
stage leaves out (learned positions, an embedding scale or dropout, an encoder's stem, the
final norm and head). Chaining a tiny model's stage shells must give the whole model's
logits: a module applied on two stages, or on none, changes them by far more than rounding
(Starcoder2's embedding dropout at p=0.5 applied again on stage 1: every logit moves). The
shells run the same kernels on the same inputs as the whole model, so the tolerance is
rounding's (measured: bitwise equal on every family here). Multi-rank training of a split
(schedules, tied weights, TP inside stages) is the parity suite's (test_parity.py).
"""

from __future__ import annotations

import pytest
import torch

import hf_models
from autoplan.runtime.pipeline_hf import SPLIT_MODEL_TYPES, hf_split_problem, split_hf_stages

# one tiny model per family (hf_models.py); gpt2's untied build has learned positions and an
# embedding dropout module that only the first stage may apply
FAMILY_KINDS = {
    "bert": "hf_bert", "cohere": "hf_cohere", "deepseek_v3": "hf_deepseek_v3",
    "falcon": "hf_falcon", "gemma": "hf_gemma", "gemma2": "hf_gemma2", "gemma3_text": "hf_gemma3",
    "glm": "hf_glm", "gpt2": "hf_gpt2_untied", "granitemoe": "hf_granitemoe",
    "gpt_neox": "hf_gptneox", "gptj": "hf_gptj", "granite": "hf_granite", "llama": "hf_llama",
    "mamba": "hf_mamba", "mistral": "hf_mistral", "mixtral": "hf_mixtral", "olmo2": "hf_olmo2",
    "opt": "hf_opt", "phi3": "hf_phi3", "qwen2": "hf_qwen2", "qwen2_moe": "hf_qwen2moe", "qwen3": "hf_qwen3",
    "stablelm": "hf_stablelm", "starcoder2": "hf_starcoder2", "bloom": "hf_bloom", "mpt": "hf_mpt",
    "recurrent_gemma": "hf_recurrent_gemma",
}
TOKENS = 16


def test_every_family_the_split_accepts_is_tested_here():
    assert set(FAMILY_KINDS) == set(SPLIT_MODEL_TYPES)


def _logits(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


# and builds of a family whose layout differs by config: OPT-350m's (word embeddings of another
# width, projected in on the first stage and out on the last; norms after, no final norm)
OTHER_BUILDS = {"opt_350m_layout": "hf_opt_350m_layout"}


@pytest.mark.parametrize("family", sorted(FAMILY_KINDS) + sorted(OTHER_BUILDS))
def test_stages_chained_give_the_whole_models_logits(family):
    torch.manual_seed(0)
    kind = FAMILY_KINDS.get(family) or OTHER_BUILDS[family]
    model = hf_models.build(kind)
    assert model.config.model_type in (family, family.split("_")[0]) and hf_split_problem(model) is None
    ids = torch.randint(0, 256, (2, TOKENS))
    positions = torch.arange(TOKENS)
    model.train()  # dropouts the config sets (Starcoder2's embedding dropout) draw masks
    with torch.no_grad():
        torch.manual_seed(1)
        whole = _logits(model(input_ids=ids, position_ids=positions[None], use_cache=False))
        blocks = hf_models.blocks(kind)
        shells = split_hf_stages(model, [[path] for path in blocks], positions, zigzag=False)
        torch.manual_seed(1)
        x = ids
        for shell in shells:
            x = shell(x)
    assert x.shape == whole.shape
    torch.testing.assert_close(x, whole, rtol=1e-6, atol=1e-6)


# families outside the list, of the common layout (embed_tokens, layers, norm, lm_head): split
# once a tiny copy of their config passes the check above at plan time (tiny_copy_problem)
LAYOUT_FAMILIES = {
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {}),  # xIELU, q/k norms
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),  # parameter-free LayerNorms
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {}),  # LayerNorm1P, squared ReLU
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),  # layers without rotary
    "helium": ("HeliumConfig", "HeliumForCausalLM", {}),
    # routed experts in every block; its class's base_model_prefix ("language_model") is not
    # the attribute that holds its decoder (`model`)
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM",
                    {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 128}),
    # attention layers only (Mamba-2 layers refuse the layout); its config holds an infinite
    # time_step_limit, which to_json_string writes as {"__float__": "Infinity"}
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         {"layer_types": ["attention", "attention"], "num_local_experts": 4,
                          "num_experts_per_tok": 2, "shared_intermediate_size": 64}),
    # a Mamba layer, then an attention layer with routed experts; the final norm named
    # final_layernorm
    "jamba": ("JambaConfig", "JambaForCausalLM",
              {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
               "num_experts": 4, "num_experts_per_tok": 2, "use_mamba_kernels": False}),
    # a short-convolution layer, then an attention layer; the final norm named embedding_norm
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {"layer_types": ["conv", "full_attention"]}),
    # a Mamba-2 layer, then an attention layer, whose mask the base model picks by each layer's
    # block_type; the embedding named embeddings, the final norm norm_f
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", {"layers_block_type": ["mamba", "attention"]}),
    # attention and Mamba-2 side by side in each layer; the base model reads a layer's output as
    # `outputs[0]`, so a layer held by another stage returns a tuple (found by the tiny copy)
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {"mamba_d_ssm": 64, "mamba_n_heads": 4}),
}


def _layout_family(family: str):
    import transformers

    config_name, model_name, fields = LAYOUT_FAMILIES[family]
    config = getattr(transformers, config_name)(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
        use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0, **fields)
    return getattr(transformers, model_name)(config)


@pytest.mark.parametrize("family", sorted(LAYOUT_FAMILIES))
def test_a_family_of_the_common_layout_is_split_once_a_tiny_copy_checks_out(family):
    torch.manual_seed(0)
    model = _layout_family(family)
    assert model.config.model_type == family and family not in SPLIT_MODEL_TYPES
    assert hf_split_problem(model) is None
    ids, positions = torch.randint(0, 256, (2, TOKENS)), torch.arange(TOKENS)
    with torch.no_grad():
        whole = model(input_ids=ids, position_ids=positions[None], use_cache=False).logits
        x = ids
        for shell in split_hf_stages(model, [["model.layers.0"], ["model.layers.1"]], positions, zigzag=False):
            x = shell(x)
    torch.testing.assert_close(x, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["hf_granite", "hf_starcoder2"])
def test_the_tiny_copy_refuses_a_family_whose_base_model_acts_on_the_embeddings(kind, monkeypatch):
    # Granite's embedding multiplier and Starcoder2's embedding dropout, applied again by every
    # later stage under the common layout's split: the verified families name them
    import autoplan.runtime.pipeline_hf as pipeline_hf

    with torch.device("meta"):
        model = hf_models.build(kind)
    families = dict(pipeline_hf._FAMILIES)
    del families[model.config.model_type]
    monkeypatch.setattr(pipeline_hf, "_FAMILIES", families)
    monkeypatch.setattr(pipeline_hf, "SPLIT_MODEL_TYPES", tuple(sorted(families)))
    pipeline_hf.tiny_copy_problem.cache_clear()
    problem = hf_split_problem(model)
    assert problem is not None and "other logits chained stage by stage" in problem


def test_the_tiny_copy_holds_a_layer_of_every_kind_the_model_has(monkeypatch):
    # Nemotron-H with its attention layer third: a split that goes wrong for attention layers
    # alone (here, a layer held by another stage doubling them) is refused, though a copy of
    # the first two layers (both Mamba-2) would check out
    import transformers

    import autoplan.runtime.pipeline_hf as pipeline_hf

    config = transformers.NemotronHConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
        use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        layers_block_type=["mamba", "mamba", "attention", "mamba"])
    with torch.device("meta"):
        model = transformers.NemotronHForCausalLM(config)
    assert pipeline_hf.tiny_layers(model) == (3, 2)
    original = pipeline_hf._OtherStageLayer.forward

    def wrong_for_attention(self, hidden_states, *args, **kwargs):
        scale = 2 if getattr(self, "block_type", None) == "full_attention" else 1
        return original(self, hidden_states * scale, *args, **kwargs)

    monkeypatch.setattr(pipeline_hf._OtherStageLayer, "forward", wrong_for_attention)
    pipeline_hf.tiny_copy_problem.cache_clear()
    pipeline_hf._layers_in_tuple.cache_clear()
    assert "other logits" in hf_split_problem(model)
    pipeline_hf.tiny_copy_problem.cache_clear()
    pipeline_hf._layers_in_tuple.cache_clear()


def test_a_tiny_copy_keeps_the_layers_up_to_the_first_of_each_kind():
    import transformers

    from autoplan.runtime.pipeline_hf import tiny_layers

    def jamba(**fields):
        config = transformers.JambaConfig(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=256, num_experts=4, num_experts_per_tok=2, **fields)
        with torch.device("meta"):
            return transformers.JambaForCausalLM(config)

    # routed experts at odd layers, attention at layer 5 only: Mamba with an MLP (layer 0),
    # Mamba with experts (1), attention with experts (5)
    assert tiny_layers(jamba(num_hidden_layers=8, attn_layer_period=8, attn_layer_offset=5,
                             expert_layer_period=2, expert_layer_offset=1)) == (6, 3)
    # one kind of modules, but a per-layer config list: Gemma-3's first full-attention layer
    config = transformers.Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=256, sliding_window_pattern=6)
    with torch.device("meta"):
        model = transformers.Gemma3ForCausalLM(config)
    assert model.config.layer_types[5] == "full_attention" and tiny_layers(model) == (6, 1)
    # a kind brought in deeper than the copy goes: cut at 16 and refused by the copy itself
    assert tiny_layers(jamba(num_hidden_layers=40, attn_layer_period=40, attn_layer_offset=30,
                             expert_layer_period=2, expert_layer_offset=1))[0] == 16


def test_a_size_the_config_derives_is_left_to_it():
    """Falcon's head_dim is a property (hidden size / heads, no setter): the tiny copy sets the
    sizes it is derived from, and the copy is built instead of failing on the assignment."""
    import transformers

    from autoplan.runtime.pipeline_hf import shrink_config

    config = transformers.FalconConfig()
    shrink_config(config)
    assert (config.hidden_size, config.num_attention_heads, config.head_dim) == (64, 4, 16)
    with torch.device("meta"):
        transformers.FalconForCausalLM(config)


# DeepSeek-V2-Lite's published sizes: MLA (rotary 64 and nope 128 per head, a 512 K/V latent,
# no query latent) on 16 heads over a hidden size of 2048, and 64 routed experts
DEEPSEEK_V2_LITE = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
                        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                        intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
                        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
                        num_hidden_layers=27, vocab_size=102400)


def test_a_config_stating_other_head_sizes_is_copied_at_its_own_head_size():
    """Cut to the tiny head size, DeepSeek-V2-Lite's rotary tables (head_dim, its rotary size)
    no longer match its queries and its tiny copy fails; the copy is made again with the
    model's head size and experts, and a real config's pipeline split is accepted instead of
    refused."""
    import transformers

    from autoplan.runtime.pipeline_hf import shrink_config

    config = transformers.DeepseekV2Config(**DEEPSEEK_V2_LITE)
    assert "deepseek_v2" not in SPLIT_MODEL_TYPES
    cut, kept = config.__class__.from_dict(config.to_dict()), config.__class__.from_dict(config.to_dict())
    shrink_config(cut)
    shrink_config(kept, keep_structure=True)
    assert (cut.hidden_size, cut.head_dim) == (64, 16)
    # 4 heads of the model's size; one K/V head per head, as MLA reads them
    assert (kept.hidden_size, kept.head_dim, kept.num_attention_heads, kept.num_key_value_heads) == (256, 64, 4, 4)
    # and its experts: routing that groups them (n_group) is stated in their count
    assert (kept.n_routed_experts, kept.num_experts_per_tok, cut.n_routed_experts) == (64, 6, 4)
    ids = torch.randint(0, 256, (1, TOKENS))
    with pytest.raises(RuntimeError, match="size of tensor"):
        transformers.DeepseekV2ForCausalLM(cut)(input_ids=ids)
    with torch.device("meta"):
        model = transformers.DeepseekV2ForCausalLM(config)
    assert hf_split_problem(model) is None
