"""The built-in model catalog: HF-style configs in cost_models/models/<name>.json.

Each file is the config our reference builders take (autoplan.models.build_model), plus two
keys that are not passed to the builder: "_source" (where the architecture comes from) and
"_autoplan" {"seq_len": default training sequence length, "description": one line}.

`config_from_published` turns the `model` object of a published training run (the format of
validation/published_runs.json) into such a config, so validation builds exactly the same
reference implementations as every other command.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from autoplan.errors import UserError
from autoplan.models import build_model
from autoplan.paths import cost_models_dir


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    model_type: str
    description: str
    parameters_b: float  # billions, counted by building the model on the meta device
    source: str
    default_seq_len: int | None


def catalog_dir() -> Path:
    return cost_models_dir() / "models"


def catalog_names() -> list[str]:
    """Sorted catalog names (file stems of cost_models/models/*.json)."""
    directory = catalog_dir()
    return sorted(path.stem for path in directory.glob("*.json")) if directory.is_dir() else []


def catalog_file(name: str) -> Path:
    """The catalog file of a (case-insensitive) name; UserError if unknown."""
    return _catalog_path(name)


def _catalog_path(name: str) -> Path:
    names = catalog_names()
    wanted = name.strip().lower()
    for known in names:
        if known.lower() == wanted:
            return catalog_dir() / f"{known}.json"
    raise UserError(
        f"{name!r} is not a model file, a config.json or a catalog name. Catalog models: "
        f"{', '.join(names) or '(none found)'}. Give one of these names (see `autoplan models`), "
        "a path to a Python model file ending in .py, or a path to an HF-style config ending in .json."
    )


def _read_catalog_file(name: str) -> tuple[str, dict[str, Any]]:
    path = _catalog_path(name)
    try:
        return path.stem, json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"catalog file {path} is not valid JSON (line {exc.lineno}: {exc.msg}); "
                        "fix or remove it") from None


def canonical_name(name: str) -> str:
    """The catalog's own spelling of a (case-insensitive) name; UserError if unknown."""
    return _catalog_path(name).stem


def load_catalog_config(name: str) -> dict[str, Any]:
    """The HF-style config of a catalog model (keys starting with '_' removed)."""
    _, data = _read_catalog_file(name)
    return {key: value for key, value in data.items() if not key.startswith("_")}


def catalog_metadata(name: str) -> dict[str, Any]:
    """{"source", "seq_len", "description", "parameters" (None when not stored)} of a catalog model."""
    _, data = _read_catalog_file(name)
    extra = data.get("_autoplan", {})
    parameters = extra.get("parameters")
    if parameters is not None and (not isinstance(parameters, int) or isinstance(parameters, bool) or parameters < 1):
        raise UserError(f"catalog file {_catalog_path(name)}: _autoplan.parameters must be a positive integer, "
                        f"got {parameters!r}; fix it or remove it (then the model is built to count them)")
    return {"source": data.get("_source", ""), "seq_len": extra.get("seq_len"),
            "description": extra.get("description", ""), "parameters": parameters}


def count_parameters(config: dict[str, Any]) -> int:
    """Parameters of the reference implementation of `config`, built on meta (tied counted once)."""
    import torch

    with torch.device("meta"):
        model = build_model(config)
    return sum(p.numel() for p in model.parameters())


@lru_cache(maxsize=None)
def _parameters_cached(path: str, mtime_ns: int) -> int:
    # keyed by file and modification time: a config edited on disk is counted again
    data = json.loads(Path(path).read_text())
    return count_parameters({k: v for k, v in data.items() if not k.startswith("_")})


def catalog_entry(name: str) -> CatalogEntry:
    path = _catalog_path(name)
    config = load_catalog_config(name)
    meta = catalog_metadata(name)
    # the count stored with the config (tests/models/test_catalog.py builds every model to
    # check it), so listing the catalog needs no torch; a user's own file may leave it out
    parameters = meta["parameters"] or _parameters_cached(str(path), path.stat().st_mtime_ns)
    return CatalogEntry(path.stem, config.get("model_type", "?"), meta["description"],
                        parameters / 1e9, meta["source"], meta["seq_len"])


def list_catalog() -> list[CatalogEntry]:
    """Every catalog model, sorted by name (a model without a stored count is built on meta)."""
    return [catalog_entry(name) for name in catalog_names()]


# ---------------------------------------------------------------- published runs

_GATED_MLPS = ("swiglu", "geglu")


def config_from_published(model: dict[str, Any]) -> dict[str, Any]:
    """HF-style config for the `model` object of a published run (published_runs.json format).

    family gpt: a 2-matrix MLP with multi-head attention and head_dim * heads == hidden maps to
    gpt2 (learned positions over seq_len, n_inner = ffn_hidden); a 2-matrix MLP with GQA or an
    odd head_dim (Nemotron) maps to nemotron; a gated MLP maps to llama. llama -> llama.
    moe -> mixtral, or qwen2_moe when there are shared experts or dense first layers.
    mla -> deepseek_v3. Raises UserError naming the missing field or unknown family.
    """
    try:
        family = model["family"]
        if family == "gpt":
            return _published_gpt(model)
        if family == "llama":
            return _published_llama(model)
        if family == "moe":
            return _published_moe(model)
        if family == "mla":
            return _published_mla(model)
    except KeyError as exc:
        raise UserError(f"published run model {model.get('name', '?')!r} lacks field {exc}; "
                        "add it to the run's model object") from None
    raise UserError(f"published run model family {family!r} is not one of gpt, llama, moe, mla")


def _published_common(model: dict[str, Any]) -> dict[str, Any]:
    return {"num_hidden_layers": model["layers"], "hidden_size": model["hidden"],
            "num_attention_heads": model["heads"],
            "num_key_value_heads": model.get("kv_heads") or model["heads"],
            "vocab_size": model["vocab"], "max_position_embeddings": model["seq_len"],
            "tie_word_embeddings": bool(model.get("tied_embeddings"))}


def _head_dim(model: dict[str, Any]) -> int:
    return model.get("head_dim") or model["hidden"] // model["heads"]


def _published_gpt(model: dict[str, Any]) -> dict[str, Any]:
    mlp = model.get("mlp", "gelu")
    if mlp in _GATED_MLPS:
        return _published_llama(model)
    kv_heads = model.get("kv_heads") or model["heads"]
    if kv_heads == model["heads"] and _head_dim(model) * model["heads"] == model["hidden"] \
            and mlp == "gelu":
        return {"model_type": "gpt2", "n_embd": model["hidden"], "n_layer": model["layers"],
                "n_head": model["heads"], "n_inner": model["ffn_hidden"], "vocab_size": model["vocab"],
                "n_positions": model["seq_len"],
                # null (unknown) -> tied, as GPT-2 and GPT-3 are
                "tie_word_embeddings": model.get("tied_embeddings") is not False}
    act = {"squared-relu": "relu2", "relu": "relu", "gelu": "gelu"}.get(mlp)
    if act is None:
        raise UserError(f"published run model {model.get('name', '?')!r} has mlp {mlp!r}; "
                        "autoplan knows gelu, relu, squared-relu, swiglu and geglu")
    return {"model_type": "nemotron", **_published_common(model), "head_dim": _head_dim(model),
            "intermediate_size": model["ffn_hidden"], "hidden_act": act}


def _published_llama(model: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": "llama", **_published_common(model), "head_dim": _head_dim(model),
            "intermediate_size": model["ffn_hidden"]}


def _published_moe(model: dict[str, Any]) -> dict[str, Any]:
    moe = model["moe"]
    shared_ffn = moe.get("shared_expert_ffn") or (moe.get("shared_experts") or 0) * moe["expert_ffn"]
    dense_first = moe.get("dense_layers_first_k") or 0
    common = {**_published_common(model), "head_dim": _head_dim(model),
              "num_experts_per_tok": moe["top_k"]}
    if not shared_ffn and not dense_first:
        return {"model_type": "mixtral", **common, "intermediate_size": moe["expert_ffn"],
                "num_local_experts": moe["experts"]}
    return {"model_type": "qwen2_moe", **common, "intermediate_size": model["ffn_hidden"],
            "moe_intermediate_size": moe["expert_ffn"], "num_experts": moe["experts"],
            "shared_expert_intermediate_size": shared_ffn, "mlp_only_layers": list(range(dense_first)),
            "decoder_sparse_step": 1, "norm_topk_prob": True, "attention_bias": False}


def _published_mla(model: dict[str, Any]) -> dict[str, Any]:
    moe, mla = model["moe"], model["mla"]
    return {"model_type": "deepseek_v3", **_published_common(model),
            "intermediate_size": model["ffn_hidden"], "moe_intermediate_size": moe["expert_ffn"],
            "n_routed_experts": moe["experts"], "num_experts_per_tok": moe["top_k"],
            "n_shared_experts": moe.get("shared_experts") or 0,
            "first_k_dense_replace": moe.get("dense_layers_first_k") or 0,
            "q_lora_rank": mla.get("q_lora_rank"), "kv_lora_rank": mla["kv_lora_rank"],
            "qk_nope_head_dim": mla["qk_nope_head_dim"], "qk_rope_head_dim": mla["qk_rope_head_dim"],
            "v_head_dim": mla["v_head_dim"]}
