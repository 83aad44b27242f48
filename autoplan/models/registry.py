"""model_type -> builder. Each builder validates its config and raises ConfigError."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the builders import torch themselves: listing the catalog needs none of it
    import torch.nn as nn


class ConfigError(ValueError):
    """An invalid or unsupported model config; the message names the field and the fix."""


def _llama(config: dict[str, Any]) -> nn.Module:
    from autoplan.models.llama import build_llama

    return build_llama(config)


def _gpt2(config: dict[str, Any]) -> nn.Module:
    from autoplan.models.gpt2 import build_gpt2

    return build_gpt2(config)


def _gpt_neox(config: dict[str, Any]) -> nn.Module:
    from autoplan.models.gpt_neox import build_gpt_neox

    return build_gpt_neox(config)


def _deepseek(config: dict[str, Any]) -> nn.Module:
    from autoplan.models.deepseek import build_deepseek

    return build_deepseek(config)


MODEL_TYPES: dict[str, Callable[[dict[str, Any]], "nn.Module"]] = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _llama,
    "mixtral": _llama,
    "qwen2_moe": _llama,
    "qwen3_moe": _llama,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "nemotron": _gpt_neox,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
}


def build_model(config: dict[str, Any]) -> nn.Module:
    """Build the reference implementation for an HF-style config (on the current default device)."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"unknown model_type {model_type!r}; autoplan builds {', '.join(sorted(MODEL_TYPES))}. "
            "Give a Python model file instead for other architectures."
        )
    return MODEL_TYPES[model_type](config)


def require_positive(config: dict[str, Any], *keys: str) -> None:
    """Every key present, an int, and > 0."""
    for key in keys:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"config field {key!r} must be a positive integer, got {value!r}")


def require_divides(divisor_key: str, divisor: int, value_key: str, value: int) -> None:
    if value % divisor:
        raise ConfigError(
            f"config field {divisor_key}={divisor} does not divide {value_key}={value}; "
            f"fix the config so that {value_key} is a multiple of {divisor_key}"
        )
