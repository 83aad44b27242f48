"""Tiny Hugging Face transformers models (built from config objects, never downloaded) and
the plan pieces that name their modules, for the runtime's user-model parity tests.

transformers is imported only when a model is built: a torchrun launch that trains no HF
model pays nothing for it.
"""

from __future__ import annotations

LAYERS = 2
_COMMON = {"hidden_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256,
           "tie_word_embeddings": False, "use_cache": False, "attn_implementation": "sdpa"}
_GPT2_DROPOUT = {"n_embd": 64, "n_layer": LAYERS, "n_head": 4, "vocab_size": 256, "n_positions": 256,
                 "use_cache": False, "bos_token_id": 0, "eos_token_id": 0, "attn_implementation": "sdpa"}
CONFIGS = {
    "hf_llama": ("LlamaConfig", "LlamaForCausalLM", dict(_COMMON, num_key_value_heads=2)),
    "hf_mixtral": ("MixtralConfig", "MixtralForCausalLM",
                   dict(_COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "hf_qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                    dict(_COMMON, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=64, shared_expert_intermediate_size=64,
                         decoder_sparse_step=1, mlp_only_layers=[])),
    # per-head q/k RMSNorms (q_norm, k_norm over head_dim): TP shards them by heads
    "hf_qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_COMMON, num_key_value_heads=2, head_dim=16)),
    # q_norm/k_norm over the whole projection (TP leaves it unsplit; PP splits it)
    "hf_olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(_COMMON, num_key_value_heads=2)),
    "hf_qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_COMMON, num_key_value_heads=2)),  # q/k/v biases
    "hf_gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_COMMON, num_key_value_heads=2, head_dim=16)),
    # one K/V head (Gemma-2B's multi-query attention): tp > 1 replicates it
    "hf_gemma_mqa": ("GemmaConfig", "GemmaForCausalLM", dict(_COMMON, num_key_value_heads=1, head_dim=16)),
    "hf_mistral": ("MistralConfig", "MistralForCausalLM", dict(_COMMON, num_key_value_heads=2)),
    # q/k norms after the transpose to (batch, heads, seq, head_dim), a tied head, and local
    # layers whose sliding window (8) is shorter than the sequence: the model builds a window
    # mask from the length it sees, so TP runs without SP (graph.sequence_shardable)
    "hf_gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                  dict(_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                       tie_word_embeddings=True, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    # tied head and Granite's multipliers (embedding, residual, attention, logits)
    "hf_granite": ("GraniteConfig", "GraniteForCausalLM",
                   dict(_COMMON, num_key_value_heads=2, tie_word_embeddings=True, embedding_multiplier=12.0,
                        logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.25,
                        pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    # DeepSeek-V3's shape: MLA (low-rank q and kv, separate rope/value head dims), a dense
    # first block, then routed experts with a shared one
    "hf_deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                       dict(_COMMON, moe_intermediate_size=32, num_key_value_heads=4, q_lora_rank=32,
                            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                            n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                            first_k_dense_replace=1)),
    # attention and MLP in parallel from one norm, both added to the residual (GPT-J)
    "hf_gptj": ("GPTJConfig", "GPTJForCausalLM",
                {"n_embd": 64, "n_layer": LAYERS, "n_head": 4, "rotary_dim": 8, "vocab_size": 256,
                 "n_positions": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                 "use_cache": False, "tie_word_embeddings": False, "attn_implementation": "sdpa"}),
    "hf_gpt2": ("GPT2Config", "GPT2LMHeadModel",
                {"n_embd": 64, "n_layer": LAYERS, "n_head": 4, "vocab_size": 256, "n_positions": 256,
                 "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": False,
                 "bos_token_id": 0, "eos_token_id": 0,
                 "attn_implementation": "sdpa"}),
    # a state-space model: no attention, a depthwise conv1d and a selective scan per block
    "hf_mamba": ("MambaConfig", "MambaForCausalLM",
                 {"hidden_size": 64, "num_hidden_layers": LAYERS, "vocab_size": 256, "state_size": 8,
                  "expand": 2, "conv_kernel": 4, "time_step_rank": 8, "use_cache": False,
                  "tie_word_embeddings": False, "attn_implementation": "eager"}),
    # learned positions and an embedding dropout before the first block (pipeline_hf's
    # first_stage_only), untied (hf_gpt2 is the tied one)
    "hf_gpt2_untied": ("GPT2Config", "GPT2LMHeadModel",
                       {"n_embd": 64, "n_layer": LAYERS, "n_head": 4, "vocab_size": 256, "n_positions": 256,
                        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": False,
                        "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": False,
                        "attn_implementation": "sdpa"}),
    # fused query_key_value, partial rotary, parallel residual, an embedding dropout
    "hf_gptneox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                   dict(_COMMON, rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0,
                        use_parallel_residual=True)),
    # one query_key_value viewed as (batch, seq, self.num_heads, 3, head_dim), per-head
    # LayerNorms on q and k: TP hands the attention the rank's head count ("colwise_heads")
    "hf_persimmon": ("PersimmonConfig", "PersimmonForCausalLM",
                     dict(_COMMON, hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=0,
                          bos_token_id=0, eos_token_id=0)),
    # tokens flattened to (batch * seq, hidden) between attention and MLP, learned positions
    # with an offset: its code cannot take a sequence shard, so TP runs without SP
    "hf_opt": ("OPTConfig", "OPTForCausalLM",
               {"hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                "vocab_size": 256, "max_position_embeddings": 128, "word_embed_proj_dim": 64,
                "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "layerdrop": 0.0,
                "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0, "use_cache": False,
                "attn_implementation": "sdpa"}),
    # OPT-350m's layout: 32-wide word embeddings projected to the 64-wide blocks and back, layer
    # norms after each sublayer and no final norm (do_layer_norm_before false)
    "hf_opt_350m_layout": ("OPTConfig", "OPTForCausalLM",
                           {"hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                            "vocab_size": 256, "max_position_embeddings": 128, "word_embed_proj_dim": 32,
                            "do_layer_norm_before": False, "dropout": 0.0, "attention_dropout": 0.0,
                            "activation_dropout": 0.0, "layerdrop": 0.0, "pad_token_id": 0, "bos_token_id": 0,
                            "eos_token_id": 0, "use_cache": False, "attn_implementation": "sdpa"}),
    "hf_phi3": ("Phi3Config", "Phi3ForCausalLM",
                dict(_COMMON, num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
    "hf_bert": ("BertConfig", "BertForMaskedLM",
                {"hidden_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                 "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256,
                 "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                 "attn_implementation": "sdpa"}),
    "hf_t5": ("T5Config", "T5ForConditionalGeneration",
              {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": LAYERS, "num_heads": 4,
               "vocab_size": 256, "dropout_rate": 0.0, "use_cache": False,
               "attn_implementation": "sdpa"}),
    # their stock dropouts (0.1): on attention probabilities (GPT-2's in its SDPA call) and
    # between T5's MLP column and row linears, which TP shards, and on the residual, which it
    # does not (a sequence shard under SP)
    "hf_gpt2_dropout": ("GPT2Config", "GPT2LMHeadModel", _GPT2_DROPOUT),
    # context parallelism refuses dropout inside attention: the residual's and embedding's
    "hf_gpt2_dropout_cp": ("GPT2Config", "GPT2LMHeadModel", dict(_GPT2_DROPOUT, attn_pdrop=0.0)),
    "hf_bert_dropout": ("BertConfig", "BertForMaskedLM",
                        {"hidden_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                         "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256,
                         "attention_probs_dropout_prob": 0.0, "attn_implementation": "sdpa"}),
    "hf_t5_dropout": ("T5Config", "T5ForConditionalGeneration",
                      {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": LAYERS, "num_heads": 4,
                       "vocab_size": 256, "use_cache": False, "attn_implementation": "eager"}),
    # families the pipeline split knows by their module names (test_pipeline_hf.py):
    # LayerNorms and partial rotary (StableLM), a logit scale and tied head (Cohere),
    # Starcoder2's embedding dropout (a float its base model applies before the first block),
    # Falcon's word_embeddings / h / ln_f with its grouped query_key_value
    "hf_stablelm": ("StableLmConfig", "StableLmForCausalLM",
                    dict(_COMMON, num_key_value_heads=2, partial_rotary_factor=0.25,
                         pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    "hf_cohere": ("CohereConfig", "CohereForCausalLM",
                  dict(_COMMON, num_key_value_heads=2, tie_word_embeddings=True, logit_scale=0.125,
                       pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    "hf_glm": ("GlmConfig", "GlmForCausalLM",
               dict(_COMMON, num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=0)),
    "hf_starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM",
                      dict(_COMMON, num_key_value_heads=2, embedding_dropout=0.5, residual_dropout=0.0,
                           attention_dropout=0.0, bos_token_id=0, eos_token_id=0)),
    "hf_falcon": ("FalconConfig", "FalconForCausalLM",
                  dict(_COMMON, new_decoder_architecture=True, num_kv_heads=2, hidden_dropout=0.0,
                       attention_dropout=0.0, bos_token_id=0, eos_token_id=0)),
    # Gemma-2: an embedding that scales its own output (a subclass of nn.Embedding, which TP
    # shards row-wise through DTensor), a tied head, soft-capped attention and logits (eager
    # attention: SDPA has no soft-cap), pre- and post-norms around attention and MLP
    "hf_gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
                  dict(_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=8,
                       query_pre_attn_scalar=16, tie_word_embeddings=True, attention_dropout=0.0,
                       pad_token_id=0, bos_token_id=0, eos_token_id=0, attn_implementation="eager")),
    # xIELU, an activation with learned scalars, between the MLP's column and row linears
    "hf_apertus": ("ApertusConfig", "ApertusForCausalLM",
                   dict(_COMMON, num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=0,
                        eos_token_id=0)),
    # Qwen3-MoE (Qwen3-30B-A3B's family): per-head q/k norms, every block's MLP routed
    "hf_qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                    dict(_COMMON, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[])),
    # Llama-4's text model: every block's MLP routed (one expert a token, its score scaling the
    # expert's input) beside a shared expert, q/k norms, layers without rotary; the class names
    # "language_model" as its base model prefix and holds its decoder at `.model`
    "hf_llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
                  dict(_COMMON, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=1, intermediate_size_mlp=128, interleave_moe_layer_step=1,
                       pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    # an attention sink per head (one logit joining each head's softmax), a parameter of the
    # attention module read between its q/k/v columns and its output row; eager attention,
    # the sinks' only path in transformers
    "hf_granite_swa": ("GraniteSWAConfig", "GraniteSWAForCausalLM",
                       dict(_COMMON, num_key_value_heads=2, attn_implementation="eager",
                            layer_types=["full_attention", "sliding_attention"], sliding_window=256,
                            pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    # GPT-OSS: attention sinks, an eager mask the model builds from the length it sees (TP
    # without SP), and routed experts with biases and a clamped SwiGLU, run token-wise
    "hf_gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                   dict(_COMMON, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                        num_experts_per_tok=2, attn_implementation="eager", sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"])),
    # Moshi's text decoder: one fc1 computes [gate | up], which its MLP views as (batch, seq,
    # 2, ffn) and reads [..., 0, :] and [..., 1, :]
    "hf_moshi": ("MoshiConfig", "MoshiForCausalLM",
                 dict(_COMMON, num_key_value_heads=2, head_dim=16, ffn_dim=256, sliding_window=256)),
    # Granite's multipliers with routed experts
    "hf_granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                      dict(_COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                           attention_multiplier=0.25, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    # BitNet b1.58: ternary weights and 8-bit activations through straight-through estimators
    "hf_bitnet": ("BitNetConfig", "BitNetForCausalLM",
                  dict(_COMMON, num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    # an untied masked-LM head: its own `bias` beside the decoder's, which the forward never
    # uses (DDP must not wait for its gradient)
    "hf_roberta_untied": ("RobertaConfig", "RobertaForMaskedLM",
                          {"hidden_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                           "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256,
                           "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                           "tie_word_embeddings": False, "pad_token_id": 1, "attn_implementation": "sdpa"}),
    # ALiBi: the model builds one bias of every head and hands it to each attention (BLOOM's
    # `alibi` of (batch * heads, 1, keys), its heads folded into the batch of baddbmm; MPT's
    # `position_bias` of (heads, 1, max_seq_len) over a written-out attention reading [all q |
    # all k | all v] by chunk; old-layout Falcon's folded into a (batch, heads, q, k) mask)
    "hf_bloom": ("BloomConfig", "BloomForCausalLM",
                 {"hidden_size": 64, "n_layer": LAYERS, "n_head": 4, "vocab_size": 256,
                  "hidden_dropout": 0.0, "attention_dropout": 0.0, "use_cache": False,
                  "tie_word_embeddings": False, "attn_implementation": "eager"}),
    "hf_mpt": ("MptConfig", "MptForCausalLM",
               {"d_model": 64, "n_layers": LAYERS, "n_heads": 4, "vocab_size": 256, "max_seq_len": 256,
                "expansion_ratio": 2, "resid_pdrop": 0.0, "emb_pdrop": 0.0, "use_cache": False,
                "tie_word_embeddings": False, "attn_implementation": "eager"}),
    # a recurrent (RG-LRU) block, then a local attention one; the base model scales the
    # embeddings by its `normalizer` buffer, and the head is tied
    "hf_recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM",
                           dict(_COMMON, num_key_value_heads=1, head_dim=16, lru_width=64,
                                attention_window_size=8, block_types=["recurrent", "attention"],
                                tie_word_embeddings=True, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    "hf_falcon_alibi": ("FalconConfig", "FalconForCausalLM",
                        dict(_COMMON, alibi=True, new_decoder_architecture=False, multi_query=False,
                             parallel_attn=False, num_kv_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                             bos_token_id=0, eos_token_id=0)),
}
BLOCK_LISTS = {"hf_llama": "model.layers", "hf_mixtral": "model.layers",
               "hf_qwen2moe": "model.layers", "hf_qwen3": "model.layers", "hf_olmo2": "model.layers",
               "hf_qwen2": "model.layers", "hf_mistral": "model.layers", "hf_gemma": "model.layers",
               "hf_gemma_mqa": "model.layers", "hf_gemma3": "model.layers",
               "hf_granite": "model.layers", "hf_deepseek_v3": "model.layers",
               "hf_gpt2": "transformer.h", "hf_gptj": "transformer.h",
               "hf_bert": "bert.encoder.layer", "hf_t5": "encoder.block", "hf_mamba": "backbone.layers",
               "hf_gpt2_untied": "transformer.h", "hf_gptneox": "gpt_neox.layers", "hf_phi3": "model.layers",
               "hf_persimmon": "model.layers", "hf_opt": "model.decoder.layers",
               "hf_opt_350m_layout": "model.decoder.layers",
               "hf_gpt2_dropout": "transformer.h", "hf_gpt2_dropout_cp": "transformer.h",
               "hf_bert_dropout": "bert.encoder.layer", "hf_t5_dropout": "encoder.block",
               "hf_stablelm": "model.layers", "hf_cohere": "model.layers", "hf_glm": "model.layers",
               "hf_starcoder2": "model.layers", "hf_falcon": "transformer.h", "hf_gemma2": "model.layers",
               "hf_apertus": "model.layers", "hf_qwen3moe": "model.layers",
               "hf_llama4": "model.layers", "hf_moshi": "model.layers",
               "hf_roberta_untied": "roberta.encoder.layer", "hf_granitemoe": "model.layers",
               "hf_bitnet": "model.layers", "hf_bloom": "transformer.h", "hf_mpt": "transformer.blocks",
               "hf_falcon_alibi": "transformer.h", "hf_granite_swa": "model.layers",
               "hf_recurrent_gemma": "model.layers", "hf_gpt_oss": "model.layers"}


def build(kind: str, **overrides):
    """The tiny model of `kind` (under the caller's device context and seed)."""
    import transformers

    config_name, model_name, kwargs = CONFIGS[kind]
    kwargs = dict(kwargs, **overrides)
    attn = kwargs.pop("attn_implementation")
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = attn
    return getattr(transformers, model_name)(config)


def blocks(kind: str) -> list[str]:
    return [f"{BLOCK_LISTS[kind]}.{i}" for i in range(LAYERS)]


def attention_modules(kind: str) -> list[str]:
    name = {"hf_gpt2": "attn", "hf_gpt2_dropout_cp": "attn", "hf_gptj": "attn",
            "hf_bert": "attention.self", "hf_bert_dropout": "attention.self"}.get(kind, "self_attn")
    return [f"{block}.{name}" for block in blocks(kind)]


def moe_modules(kind: str) -> list[str]:
    return [f"{block}.mlp" for block in blocks(kind)]


def output_with_logits(logits):
    """What a transformers causal LM returns: a ModelOutput holding the logits."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(logits=logits)
