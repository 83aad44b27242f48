"""Build an HF config.json with the Hugging Face transformers class of its family, so the
job trains the class the user ships (`"_autoplan": {"model_source": "transformers"}` in the
config, or MODEL given as `hf:path/config.json`). transformers is optional: autoplan's own
torch-only reference models stay the default, and only this module imports it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from autoplan.errors import UserError

if TYPE_CHECKING:
    import torch.nn as nn

HF_PREFIX = "hf:"


def build_transformers_model(config: dict[str, Any], where: str) -> nn.Module:
    """The transformers model of `config` (no weights: call it under torch.device("meta")),
    with SDPA attention. The class is the config's first `architectures` entry that
    transformers has, else its causal-LM class (AutoModelForCausalLM). A config the class
    refuses, whatever it raises, is the user's error, with what transformers warned about it
    (its warnings name the field; printed before the error, they would split the paragraph)."""
    transformers = _transformers(where)
    with _held_warnings(transformers) as records:
        try:
            return _build(transformers, config, where)
        except UserError:
            raise
        except Exception as exc:
            warned = [record.getMessage() for record in records if record.levelno >= logging.WARNING]
            said = "; transformers warned: " + " ".join(warned).rstrip(".") if warned else ""
            raise UserError(f"{where}: transformers could not build this config ({type(exc).__name__}: "
                            f"{exc}){said}; compare it with a config.json of that family") from None


@contextlib.contextmanager
def _held_warnings(transformers):
    """Collect transformers' log records while building; print them as usual on success."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = transformers.utils.logging.get_logger()
    transformers.utils.logging.disable_default_handler()
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        transformers.utils.logging.enable_default_handler()
    for record in records:  # reached only when the build raised nothing
        logger.handle(record)


def special_floats_read_back(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with the floats JSON has no literal for read back: transformers writes an
    infinite or NaN field as `{"__float__": "Infinity"}` (a Mamba-2 mixer's `time_step_limit`
    of (0, inf) in Falcon-H1, Bamba, Granite-4.0-H) and decodes it in from_pretrained, which a
    config given as a dict skips. Call it where transformers is importable."""
    import transformers

    decode = getattr(transformers.PretrainedConfig, "_decode_special_floats", None)
    return decode(config) if decode else config


def _build(transformers, config: dict[str, Any], where: str) -> nn.Module:
    import torch

    model_type = config.get("model_type")
    fields = {key: value for key, value in special_floats_read_back(config).items() if key != "model_type"}
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError):  # its message lists every family it knows: hundreds
        raise UserError(f"{where}: transformers {transformers.__version__} does not know model_type "
                        f"{model_type!r}; give a config of a family it has (the keys of "
                        "transformers.CONFIG_MAPPING), or drop model_source (and the hf: prefix) "
                        "to build autoplan's reference model") from None
    for name in config.get("architectures") or []:
        cls = getattr(transformers, str(name), None)
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            return _with_attention(lambda attn: cls(_attention(hf_config, attn)))
    try:
        return _with_attention(lambda attn: transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation=attn))
    except ValueError as exc:
        raise UserError(f"{where}: model_type {model_type!r} has no causal-LM class in transformers "
                        f"({exc}); name the class in the config's \"architectures\" list") from None


def _attention(hf_config, implementation: str):
    hf_config._attn_implementation = implementation
    return hf_config


def _with_attention(build):
    """build("sdpa"), or build("eager") for a class that refuses SDPA: a model without
    attention (Mamba's state-space blocks) or one transformers gives no SDPA path; context
    parallelism, which needs SDPA, is then refused for it by the capability probe."""
    try:
        return build("sdpa")
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc):
            raise
        return build("eager")


def _transformers(where: str):
    try:
        import transformers
    except ImportError:
        raise UserError(f"{where} asks for the Hugging Face transformers class, but transformers "
                        "is not installed: pip install 'transformers>=5,<6', or drop model_source "
                        "(and the hf: prefix) to build autoplan's reference model") from None
    return transformers
