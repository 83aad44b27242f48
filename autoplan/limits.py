"""Sizes autoplan accepts: far above any real model or cluster, so a typo is refused at once.

Work (tracing, the search, building a model on meta) grows with these numbers; without a bound
a mistyped `num_hidden_layers: 1000000000000` or `--gpus 1000000000` runs for minutes with
growing memory instead of saying what is wrong. Each bound is roughly 100x the largest real
value known when it was set (reasons next to each); raise one here if real systems reach it.
Standard library only: plan files are read on training nodes.
"""

from __future__ import annotations

from autoplan.errors import UserError

# GPUs in one job: the largest reported training clusters are ~100k GPUs (xAI Colossus, 2024).
MAX_GPUS = 1_048_576
# Transformer layers: Llama 3.1 405B has 126, DeepSeek-V3 61 (shared/reference/model_configs.json);
# 1024 is 8x the deepest. Planning cost grows with depth: at 10,000 layers a plan took 98 s.
MAX_LAYERS = 1_024
# Hidden / FFN width: the widest published FFN is ~53k (Llama 3.1 405B); 2^22 is ~80x that.
MAX_WIDTH = 4_194_304
# Vocabulary: the largest in use are ~256k (Gemma); 2^24 is 64x that.
MAX_VOCAB = 16_777_216
# Attention heads and experts: DeepSeek-V3 has 256 routed experts, Llama 405B 128 heads.
MAX_HEADS_OR_EXPERTS = 65_536
# Sequence length and positions in tokens: the longest trained contexts are ~10M (Llama 4 Scout).
MAX_SEQ_LEN = 1 << 30
# Sequences per global batch: real runs use up to ~16k sequences per step.
MAX_GLOBAL_BATCH = 1 << 24

# HF config.json fields (all families autoplan builds) and the bound on each.
CONFIG_FIELDS = {
    "num_hidden_layers": MAX_LAYERS, "n_layer": MAX_LAYERS, "first_k_dense_replace": MAX_LAYERS,
    "hidden_size": MAX_WIDTH, "n_embd": MAX_WIDTH, "intermediate_size": MAX_WIDTH,
    "moe_intermediate_size": MAX_WIDTH, "n_inner": MAX_WIDTH, "head_dim": MAX_WIDTH,
    "vocab_size": MAX_VOCAB,
    "num_attention_heads": MAX_HEADS_OR_EXPERTS, "n_head": MAX_HEADS_OR_EXPERTS,
    "num_key_value_heads": MAX_HEADS_OR_EXPERTS, "num_local_experts": MAX_HEADS_OR_EXPERTS,
    "num_experts": MAX_HEADS_OR_EXPERTS, "n_routed_experts": MAX_HEADS_OR_EXPERTS,
    "num_experts_per_tok": MAX_HEADS_OR_EXPERTS, "n_shared_experts": MAX_HEADS_OR_EXPERTS,
    "max_position_embeddings": MAX_SEQ_LEN, "n_positions": MAX_SEQ_LEN,
}


def check_at_most(what: str, value, limit: int) -> None:
    """UserError naming `what`, its value and the limit when value > limit."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit:
        raise UserError(f"{what} is {value:,}, above autoplan's limit of {limit:,} (far beyond any "
                        "real model or cluster, see autoplan/limits.py); check the number for a typo")


def check_config_sizes(config: dict, where: str) -> None:
    """Every size field of an HF-style config within its bound."""
    for key, limit in CONFIG_FIELDS.items():
        check_at_most(f"{where}: {key}", config.get(key), limit)
