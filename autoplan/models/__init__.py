"""Reference implementations of known model families, built from HF-style configs.

torch and the standard library only: generated train.py files build their model with
these on training nodes, where the planner's dependencies are not installed.
`build_model(config)` dispatches on `config["model_type"]`.
"""

from __future__ import annotations

from autoplan.models.registry import MODEL_TYPES, ConfigError, build_model

__all__ = ["MODEL_TYPES", "ConfigError", "build_model"]
