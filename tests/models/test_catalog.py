"""The model catalog (cost_models/models/*.json), `autoplan models`, and published-run configs."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from autoplan.models.catalog import (
    catalog_names,
    catalog_metadata,
    config_from_published,
    count_parameters,
    list_catalog,
    load_catalog_config,
)
from autoplan.errors import UserError
from autoplan.models import MODEL_TYPES, build_model

REQUIRED = ["gpt3-175b", "llama2-7b", "llama2-13b", "llama2-70b", "llama3.1-8b", "llama3.1-70b",
            "llama3.1-405b", "mixtral-8x7b", "mixtral-8x22b", "qwen2.5-72b", "deepseek-v3",
            "tiny-gpt", "tiny-moe"]


def test_catalog_lists_every_required_model_with_source_and_known_family():
    entries = {entry.name: entry for entry in list_catalog()}
    assert set(REQUIRED) <= set(entries)
    for entry in entries.values():
        assert entry.model_type in MODEL_TYPES
        assert len(entry.source) > 20, entry.name  # a real citation, not a placeholder
        assert entry.parameters_b > 0 and entry.description


# Parameter counts of the released checkpoints (HF model cards / safetensors index totals);
# our reference implementations must reproduce them exactly (same tensors, same shapes).
PUBLISHED_EXACT = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "mixtral-8x7b": 46_702_792_704,
    "mistral-7b": 7_241_732_096,
    "gpt-neox-20b": 20_554_567_680,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_EXACT))
def test_catalog_parameter_counts_match_released_checkpoints(name):
    assert count_parameters(load_catalog_config(name)) == PUBLISHED_EXACT[name]


@pytest.mark.parametrize("name", catalog_names())
def test_stored_parameter_counts_are_the_built_models(name):
    """`autoplan models` reads the count stored in the catalog file instead of building the model;
    it must be the count of the model the config builds (edit a config: update the count)."""
    assert catalog_metadata(name)["parameters"] == count_parameters(load_catalog_config(name))


@pytest.mark.parametrize("name, nominal_b, tolerance", [
    ("gpt3-175b", 175.0, 0.01),  # paper's 175.0B; 12*L*h^2 + embeddings = 174.6B
    ("mixtral-8x22b", 141.0, 0.01),  # Mistral: 141B total
    ("deepseek-v3", 671.0, 0.001),  # DeepSeek: 671B main model (MTP excluded)
    ("qwen2.5-72b", 72.7, 0.001),  # Qwen2.5 report: 72.7B
    ("deepseek-v2-lite", 15.7, 0.001),  # DeepSeek-V2-Lite: 15.7B total
])
def test_catalog_parameter_counts_match_nominal_sizes(name, nominal_b, tolerance):
    entry = next(e for e in list_catalog() if e.name == name)
    assert abs(entry.parameters_b / nominal_b - 1) < tolerance


def test_tiny_models_match_the_llama_formula():
    # llama: V*h*2 + L*(2*h*H*d + 2*h*K*d + 3*h*f + 2*h) + h, with V=256 h=64 L=2 H=4 K=2 d=16 f=128
    V, h, L, H, K, d, f = 256, 64, 2, 4, 2, 16, 128
    assert count_parameters(load_catalog_config("tiny-gpt")) == \
        V * h * 2 + L * (2 * h * H * d + 2 * h * K * d + 3 * h * f + 2 * h) + h
    E = 4  # mixtral: experts 3*h*f each plus the h*E router instead of the SwiGLU
    assert count_parameters(load_catalog_config("tiny-moe")) == \
        V * h * 2 + L * (2 * h * H * d + 2 * h * K * d + E * 3 * h * f + h * E + 2 * h) + h


def test_tiny_models_train_forward_backward_on_cpu():
    for name in ("tiny-gpt", "tiny-moe"):
        torch.manual_seed(0)
        model = build_model(load_catalog_config(name))
        model.init_weights()
        tokens = torch.randint(0, 256, (2, 32))
        logits = model(tokens)
        assert logits.shape == (2, 32, 256)
        logits.float().logsumexp(-1).mean().backward()


def test_catalog_lookup_is_case_insensitive_and_strips_private_keys():
    config = load_catalog_config("LLaMA3.1-8B")
    assert config["model_type"] == "llama" and config["hidden_size"] == 4096
    assert not any(key.startswith("_") for key in config)
    assert catalog_metadata("llama3.1-8b")["seq_len"] == 8192
    assert catalog_metadata("deepseek-v3")["seq_len"] == 4096


def test_unknown_catalog_name_lists_the_names():
    with pytest.raises(UserError) as info:
        load_catalog_config("llama-9000")
    message = str(info.value)
    assert "llama-9000" in message and "tiny-gpt" in message and "deepseek-v3" in message


def test_models_command_json_and_table():
    from autoplan.cli import cli

    result = CliRunner().invoke(cli, ["models", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.output)["models"]}
    assert set(REQUIRED) <= set(rows)
    assert rows["llama3.1-8b"]["parameters"] == PUBLISHED_EXACT["llama3.1-8b"]
    assert rows["llama3.1-8b"]["default_seq_len"] == 8192
    assert "maxtext" in rows["llama3.1-8b"]["source"]
    table = CliRunner().invoke(cli, ["models"], terminal_width=200)
    assert table.exit_code == 0 and "mixtral-8x22b" in table.output and "405.9 B" in table.output


# ---------------------------------------------------------------- published runs


def test_every_published_run_builds_with_its_nominal_size(published_runs):
    """All runs build on meta; parameters within 7% of the run's nominal params_b.

    params_b is the size the source names the model by (rounded: "Llama 2 7B" has 6.74B,
    "Nemotron 8B" 8.54B with its untied 256k vocabulary), so 7% covers rounding of names, not
    architecture errors: a missing or extra MLP matrix would be off by 25-50%.
    """
    assert len(published_runs) >= 100
    counts, ratios = {}, {}
    for run in published_runs:
        model = run["model"]
        key = json.dumps({k: v for k, v in model.items() if k not in ("arch_source", "name")},
                         sort_keys=True)
        if key not in counts:
            counts[key] = count_parameters(config_from_published(model))
        if model["params_b"]:
            ratios[run["id"]] = counts[key] / (model["params_b"] * 1e9)
    worst = max(ratios, key=lambda run_id: abs(ratios[run_id] - 1))
    assert abs(ratios[worst] - 1) < 0.07, (worst, ratios[worst])
    # MPT sizes are stated to 5 significant digits (and count s*h positions as gpt2 does)
    for run in published_runs:
        if run["id"].startswith("mpt_"):
            assert abs(ratios[run["id"]] - 1) < 0.01, (run["id"], ratios[run["id"]])


def test_narayanan_gpt_runs_match_the_papers_parameter_formula(published_runs):
    """Narayanan et al. 2021 Eq. 2: P = 12*l*h^2 * (1 + 13/(12h) + (V + s)/(12*l*h)), i.e. per
    layer 12h^2 weights + 13h biases/norms, plus tied V*h and learned s*h embeddings. Ours adds
    only the final LayerNorm (2h), which the paper's formula leaves out."""
    runs = [run for run in published_runs if run["id"].startswith("narayanan21_t1")]
    assert len(runs) == 10
    for run in runs:
        m = run["model"]
        l, h, V, s = m["layers"], m["hidden"], m["vocab"], m["seq_len"]
        paper = 12 * l * h * h + 13 * l * h + (V + s) * h  # Eq. 2 multiplied out
        assert count_parameters(config_from_published(m)) == paper + 2 * h, run["id"]


def test_published_families_map_to_the_right_builders(published_runs):
    by_id = {run["id"]: run["model"] for run in published_runs}
    types = {run_id: config_from_published(model)["model_type"] for run_id, model in by_id.items()}
    assert types["narayanan21_t1_gpt1.7b_32gpu"] == "gpt2"
    assert types["nemo2407_nemotron_340b_128gpu_fp8"] == "nemotron"  # squared-ReLU + GQA
    assert types["nemo2407_llama2_70b_64gpu_fp8"] == "llama"
    assert types["mcore_moe_readme_mixtral8x7b_64gpu"] == "mixtral"
    assert types["deepseekv3_2048h800_pretrain"] == "deepseek_v3"
    # the Mixtral run has no params_b; it must equal the released checkpoint
    assert count_parameters(config_from_published(by_id["mcore_moe_readme_mixtral8x7b_64gpu"])) \
        == PUBLISHED_EXACT["mixtral-8x7b"]


def test_published_moe_with_shared_experts_and_dense_layers_maps_to_qwen2_moe():
    model = {"family": "moe", "layers": 4, "hidden": 64, "ffn_hidden": 256, "heads": 4, "kv_heads": 4,
             "head_dim": 16, "vocab": 128, "seq_len": 64, "tied_embeddings": False,
             "moe": {"experts": 8, "top_k": 2, "expert_ffn": 32, "shared_experts": 2,
                     "dense_layers_first_k": 1}}
    config = config_from_published(model)
    assert config["model_type"] == "qwen2_moe"
    h, V, E = 64, 128, 8
    attn = 4 * h * h
    moe = E * 3 * h * 32 + h * E + 3 * h * 64  # routed + router + shared (2 x 32)
    assert count_parameters(config) == 2 * V * h + 4 * (attn + 2 * h) + 3 * h * 256 + 3 * moe + h


def test_published_bad_family_is_a_user_error():
    with pytest.raises(UserError, match="family"):
        config_from_published({"family": "rnn", "name": "x"})
    with pytest.raises(UserError, match="hidden"):
        config_from_published({"family": "llama", "name": "x", "layers": 2})
