"""MODEL on every command: a Python model file, an HF-style config.json, or a catalog name.

`load_model(spec)` returns the model built on the meta device (no weights allocated) with a
`ModelRef` that says how to build it again (`build_from_ref`, used by generated jobs), and
the inputs to trace it with (`LoadedModel.example_inputs`).

Python files (`*.py`) are executed once, as a module, under `torch.device("meta")`. The model
is, in this order: what `build_model()` returns; a module-level `model`; or the one
`nn.Module` subclass defined in the file that is constructible without arguments and is not
a submodule of another such class (a file with `Block(dim)` and `GPT()` picks GPT; one with
`MLP()` and `GPT()` whose GPT holds an MLP also picks GPT). If `build_model` takes a
`seq_len` parameter it receives the requested sequence length.

Inputs: the inputs of the file's `example_batch(batch_size)` if defined (the batch the job
trains on, models/user_batch.py); else its `example_inputs(batch_size, seq_len)` if defined (a
tuple of tensors, one per positional argument, or a dict of keyword arguments); otherwise, by the model's first
leaf module in registration order (`model.modules()`): nn.Embedding -> token ids (batch, seq)
int64; nn.Linear -> float32 (batch, seq, in_features); nn.Conv2d -> an image batch
(batch, in_channels, side, side), where the second argument is the image side
(`--image-size`) instead of a sequence length. Anything else must define example_inputs.
Catalog and config models take token ids.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import re
import sys
import tokenize
import traceback
import types
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from autoplan.models import catalog
from autoplan.models.hf import HF_PREFIX
from autoplan.errors import UserError
from autoplan.textfile import decode_text
from autoplan.limits import check_config_sizes
from autoplan.models import MODEL_TYPES, ConfigError, build_model
from autoplan.models.user_code import USER_MODULE_PREFIX, user_code
from autoplan.plan import ModelRef
from autoplan.models.user_batch import BATCH_HOOK, call_batch

InputsFn = Callable[[int, int], tuple[torch.Tensor, ...]]
FALLBACK_SEQ_LEN = 2048  # what commands train at when neither the user nor the model says
# attribute names of learned position tables (nanoGPT `wpe`, HF `position_embeddings`, `pos_emb`, ...)
POSITION_TABLE_NAME = re.compile(r"wpe|pos|pos_.*|.*position.*|positional.*")


@dataclass
class LoadedModel:
    module: nn.Module  # on the meta device
    ref: ModelRef
    config: dict[str, Any] | None  # HF-style config for catalog/config sources, None for files
    default_seq_len: int | None  # the model's training sequence length when known
    inputs_fn: InputsFn = field(repr=False, default=None)  # type: ignore[assignment]
    takes_images: bool = False  # inputs_fn's second argument is the image side
    user_batch: bool = False  # inputs_fn gives the inputs of the file's example_batch
    own_loss: bool = False  # the file defines loss(outputs, labels)

    def example_inputs(self, batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...] | dict:
        """Meta tensors to trace the model with, for this batch size and sequence length (the
        image side for an image model): a tuple of positional inputs or a dict of keyword ones."""
        with torch.device("meta"), user_code(f"example_inputs({batch_size}, {seq_len}) of {self.ref.path or self.ref.name}"):
            try:
                inputs = self.inputs_fn(batch_size, seq_len)
            except UserError:
                raise
            except Exception as exc:  # the user's example_inputs failed
                raise UserError(f"example_inputs({batch_size}, {seq_len}) in {self.ref.path} raised "
                                f"{type(exc).__name__}: {exc}{_user_line(exc, self.ref.path)}; "
                                "fix that function") from None
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if isinstance(inputs, dict) and all(isinstance(k, str) for k in inputs):
            return {k: _meta(v) for k, v in inputs.items()}
        if not isinstance(inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise UserError(f"example_inputs in {self.ref.path} returned {type(inputs).__name__}; "
                            "return a tuple of tensors (one per forward argument) or a dict of "
                            "keyword arguments")
        return tuple(_meta(t) for t in inputs)


def _meta(value):
    return value.to("meta") if isinstance(value, torch.Tensor) and not value.is_meta else value


class ModelFileChanged(UserError):
    """A model file's bytes are not those a plan recorded (file_sha256)."""


def load_model(spec: str, *, seq_len: int | None = None) -> LoadedModel:
    """Build MODEL (file, config.json or catalog name) on meta. Bad input raises UserError."""
    spec = str(spec)
    if spec.startswith(HF_PREFIX):  # build the config with its transformers class
        path = Path(spec[len(HF_PREFIX):])
        if path.is_dir():
            path = path / "config.json"
        return _load_config_file(path, str(path), seq_len, transformers=True)
    if Path(spec).is_dir() and (Path(spec) / "config.json").is_file():  # an HF model directory
        spec = str(Path(spec) / "config.json")
    if spec.endswith(".py"):
        return _load_file(Path(spec), spec, seq_len)
    if spec.endswith(".json"):
        return _load_config_file(Path(spec), spec, seq_len)
    return _load_catalog(spec, seq_len)


def load_model_of_ref(ref: ModelRef, *, seq_len: int | None = None, check_bytes: bool = True) -> LoadedModel:
    """Build the model a plan names (`ref.path` already resolved), by its recorded source, not
    by the path's suffix. With `check_bytes`, the file is read once and its bytes must have
    the plan's file_sha256 before they are parsed or run (ModelFileChanged otherwise)."""
    expected = ref.file_sha256 if check_bytes else None
    path = Path(ref.path or "")
    if ref.source == "catalog":
        return _load_catalog(ref.name, seq_len)
    if ref.source in ("config", "transformers"):
        return _load_config_file(path, str(path), seq_len, transformers=ref.source == "transformers",
                                 expected_sha256=expected)
    if ref.source == "file":
        return _load_file(path, str(path), seq_len, expected_sha256=expected)
    raise UserError(f"model source {ref.source!r} is not one of catalog, config, transformers, file")


def read_model_bytes(path: Path, spec: str, missing: str, expected_sha256: str | None = None) -> bytes:
    """The file's bytes; UserError `missing` if it is not a file, ModelFileChanged if
    `expected_sha256` is given and the bytes' sha256 differs."""
    if not path.is_file():
        raise UserError(missing)
    data = path.read_bytes()
    if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
        raise ModelFileChanged(f"the bytes of {spec} are not those the plan was made with (its "
                               "file_sha256 differs): the file changed, or the plan was edited")
    return data


def build_from_ref(ref: ModelRef, *, seq_len: int | None = None, verify: bool = True) -> nn.Module:
    """Build the model a plan refers to again (generated train.py), on the meta device.

    The caller materialises it (`to_empty(device=...)` then `init_weights()` or
    `reset_parameters()`), after sharding. `seq_len` is passed to a file's
    `build_model(seq_len=...)` as in `load_model`. A file whose bytes differ from the ref's
    file_sha256 (when it has one) is neither parsed nor run (ModelFileChanged). With `verify`,
    a model whose fingerprint differs from the plan's (the file or config changed since
    planning) is a UserError.
    """
    path, spec, expected = Path(ref.path or ""), ref.path or "", ref.file_sha256 or None
    if ref.source == "catalog":
        config = catalog.load_catalog_config(ref.name)
        model = _build_config(config, f"catalog model {ref.name!r}")
    elif ref.source == "config":
        config = _public(_read_config(path, spec, expected)[0])
        model = _build_config(config, spec)
    elif ref.source == "transformers":
        config = _public(_read_config(path, spec, expected)[0])
        model = _build_transformers(config, spec)
    elif ref.source == "file":
        config = None
        model = _find_model(_exec_file(path, spec, expected)[0], spec, seq_len)
    else:
        raise UserError(f"model source {ref.source!r} is not one of catalog, config, transformers, file")
    if verify and ref.fingerprint and fingerprint(model, config) != ref.fingerprint:
        raise UserError(
            f"the model built from {ref.path or ref.name} does not match the plan (fingerprint "
            "differs): it changed since the plan was made. Make the plan again, or restore the model."
        )
    return model


def fingerprint(model: nn.Module, config: dict[str, Any] | None) -> str:
    """sha256 over sorted (parameter name, shape, dtype) and the config (if any)."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        digest.update(f"{name}|{tuple(param.shape)}|{param.dtype}\n".encode())
    if config is not None:
        digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    return digest.hexdigest()


# ---------------------------------------------------------------- catalog and config.json


def _token_inputs(batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    return (torch.zeros(batch_size, seq_len, dtype=torch.int64, device="meta"),)


def _build_config(config: dict[str, Any], where: str) -> nn.Module:
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(
            f"{where}: model_type {model_type!r} is not one autoplan builds "
            f"({', '.join(sorted(MODEL_TYPES))}). Set model_type to one of these, give it as "
            "hf:PATH to build its Hugging Face transformers class, or give a Python model file "
            "(.py) for other architectures."
        )
    try:
        with torch.device("meta"):
            return build_model(config)
    except ConfigError as exc:
        raise UserError(f"{where}: invalid config: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{where}: config for model_type {model_type!r} is missing or has a bad "
                        f"value ({type(exc).__name__}: {exc}); compare it with an HF config.json "
                        "of that family") from None


def _check_seq_len(config: dict[str, Any], seq_len: int | None, where: str) -> None:
    limit = config.get("max_position_embeddings", config.get("n_positions"))
    if seq_len is not None and isinstance(limit, int) and seq_len > limit:
        raise UserError(f"{where}: sequence length {seq_len} exceeds the model's {limit} positions "
                        "(max_position_embeddings / n_positions); use a shorter --seq-len or raise "
                        "that field in the config")


def _default_seq_len(config: dict[str, Any], stated: int | None) -> int | None:
    """The stated training length, else the model's positions where the fallback exceeds them."""
    limit = config.get("max_position_embeddings", config.get("n_positions"))
    if stated is None and isinstance(limit, int) and limit < FALLBACK_SEQ_LEN:
        return limit
    return stated


def _seq2seq_inputs(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """An encoder-decoder's keyword inputs: source and target token ids of one length."""
    ids = torch.zeros(batch_size, seq_len, dtype=torch.int64, device="meta")
    return {"input_ids": ids, "decoder_input_ids": ids.clone()}


def _loaded_from_config(config: dict[str, Any], ref: ModelRef, where: str,
                        default_seq_len: int | None, seq_len: int | None) -> LoadedModel:
    check_config_sizes(config, where)
    _check_seq_len(config, seq_len, where)
    default_seq_len = _default_seq_len(config, default_seq_len)
    model = _build_config(config, where)
    ref = replace(ref, fingerprint=fingerprint(model, config))
    return LoadedModel(model, ref, config, default_seq_len, _token_inputs)


def _load_catalog(spec: str, seq_len: int | None) -> LoadedModel:
    name = catalog.canonical_name(spec)
    config = catalog.load_catalog_config(name)
    meta = catalog.catalog_metadata(name)
    return _loaded_from_config(config, ModelRef("catalog", name), f"catalog model {name!r}",
                               meta["seq_len"], seq_len)


def _read_config(path: Path, spec: str, expected_sha256: str | None = None) -> tuple[dict[str, Any], str]:
    """(the config, the sha256 of the file's bytes)."""
    data = read_model_bytes(path, spec, f"config file {spec} does not exist; check the path (or give "
                            "a catalog name, see `autoplan models`)", expected_sha256)
    try:
        config = json.loads(decode_text(data, "config file", path))
    except json.JSONDecodeError as exc:
        raise UserError(f"{spec} is not valid JSON: {exc.msg} at line {exc.lineno}, column "
                        f"{exc.colno}; fix the file") from None
    if not isinstance(config, dict):
        raise UserError(f"{spec} holds a JSON {type(config).__name__}; an HF config is a JSON object "
                        "with model_type and the architecture fields")
    return config, hashlib.sha256(data).hexdigest()


def _public(config: dict[str, Any]) -> dict[str, Any]:
    """The config without autoplan's private keys ("_source", "_autoplan"): what builders see."""
    return {key: value for key, value in config.items() if not key.startswith("_")}


def _load_config_file(path: Path, spec: str, seq_len: int | None, *,
                      transformers: bool = False, expected_sha256: str | None = None) -> LoadedModel:
    config, sha = _read_config(path, spec, expected_sha256)
    name = path.parent.name if path.stem == "config" and path.parent.name else path.stem
    extra = config.get("_autoplan", {}) if isinstance(config.get("_autoplan"), dict) else {}
    config = _public(config)
    if transformers or extra.get("model_source") == "transformers":
        _check_seq_len(config, seq_len, spec)
        model = _build_transformers(config, spec)
        ref = ModelRef("transformers", name, spec, fingerprint(model, config), sha)
        inputs = _seq2seq_inputs if getattr(model.config, "is_encoder_decoder", False) else _token_inputs
        return LoadedModel(model, ref, config, _default_seq_len(config, extra.get("seq_len")), inputs)
    return _loaded_from_config(config, ModelRef("config", name, spec, file_sha256=sha), spec, extra.get("seq_len"),
                               seq_len)


def _build_transformers(config: dict[str, Any], where: str) -> nn.Module:
    from autoplan.models.hf import build_transformers_model

    with torch.device("meta"):
        return build_transformers_model(config, where)


# ---------------------------------------------------------------- Python files


def _user_line(exc: BaseException, path: str | None) -> str:
    """' (line N)' of the deepest traceback frame inside the user's file, if any."""
    if not path:
        return ""
    target = str(Path(path).resolve())
    lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__)
             if frame.filename and str(Path(frame.filename).resolve()) == target]
    return f" (line {lines[-1]})" if lines else ""


def _exec_file(path: Path, spec: str, expected_sha256: str | None = None) -> tuple[Any, str]:
    """Execute the file once as a fresh module under the meta device; (the module, the sha256
    of the bytes run)."""
    source = read_model_bytes(path, spec, f"model file {spec} does not exist; check the path",
                              expected_sha256)
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"{USER_MODULE_PREFIX}{path.stem.replace('-', '_')}_{digest}"
    module = types.ModuleType(module_name)
    module.__file__ = str(path)
    sys.modules[module_name] = module  # dataclasses, pickling and inspect look the module up
    sys.path.insert(0, str(path.resolve().parent))  # so the file can import its neighbours
    try:
        with user_code(f"importing {spec}"):
            _run_module(source, path, spec, module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module, hashlib.sha256(source).hexdigest()


def _source_text(source: bytes, path: Path, spec: str) -> str:
    """The file's bytes (those whose hash was checked), decoded as Python does (UTF-8 unless a
    coding line says otherwise)."""
    try:
        encoding = tokenize.detect_encoding(io.BytesIO(source).readline)[0]
    except SyntaxError as exc:
        raise UserError(f"{spec}: {exc}; save the file as UTF-8") from None
    return decode_text(source, "model file", path, encoding)


def _run_module(source: bytes, path: Path, spec: str, module: types.ModuleType) -> None:
    try:
        # Compiled from the bytes read (and hashed) now, never from a cached .pyc: the bytecode cache
        # keys on mtime and size, so an edit of the same size within a second would load the old model.
        code = compile(_source_text(source, path, spec), str(path), "exec", dont_inherit=True)
        with torch.device("meta"):
            exec(code, module.__dict__)
    except SyntaxError as exc:
        raise UserError(f"syntax error in {spec} at line {exc.lineno}: {exc.msg}; fix the file") from None
    except Exception as exc:
        raise UserError(f"running {spec} failed{_user_line(exc, spec)}: {type(exc).__name__}: {exc}. "
                        "The file is executed once on the meta device; fix the error") from None


def _required_args(cls: type) -> list[str]:
    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return []
    return [name for name, p in list(signature.parameters.items())[1:]
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                   p.KEYWORD_ONLY)]


def _call_build_model(module: Any, spec: str, seq_len: int | None) -> nn.Module:
    builder = module.build_model
    kwargs = {}
    try:
        if seq_len is not None and "seq_len" in inspect.signature(builder).parameters:
            kwargs["seq_len"] = seq_len
    except (TypeError, ValueError):
        pass
    with torch.device("meta"), user_code(f"build_model() in {spec}"):
        try:
            model = builder(**kwargs)
        except Exception as exc:
            raise UserError(f"build_model() in {spec} raised {type(exc).__name__}: {exc}"
                            f"{_user_line(exc, spec)}; fix it (it runs on the meta device)") from None
    if not isinstance(model, nn.Module):
        raise UserError(f"build_model() in {spec} returned {type(model).__name__}, not an "
                        "nn.Module; return the model")
    return model


def _from_classes(module: Any, spec: str) -> nn.Module:
    classes = [obj for obj in vars(module).values()
               if isinstance(obj, type) and issubclass(obj, nn.Module)
               and obj.__module__ == module.__name__]
    if not classes:
        raise UserError(f"no model found in {spec}: define build_model() returning an nn.Module, a "
                        "module-level `model`, or one nn.Module subclass constructible without arguments")
    constructible = [cls for cls in classes if not _required_args(cls)]
    if not constructible:
        needs = "; ".join(f"{cls.__name__}({', '.join(_required_args(cls))})" for cls in classes)
        raise UserError(f"no model in {spec} can be built without arguments ({needs}). Give the "
                        "constructor arguments defaults, or define build_model() that builds the model")
    instances = {}
    for cls in constructible:
        with torch.device("meta"), user_code(f"{cls.__name__}() in {spec}"):
            try:
                instances[cls] = cls()
            except Exception as exc:
                raise UserError(f"{cls.__name__}() in {spec} raised {type(exc).__name__}: {exc}"
                                f"{_user_line(exc, spec)}; fix the constructor or define build_model()") from None
    inner = {type(sub) for obj in instances.values() for sub in obj.modules() if sub is not obj}
    roots = [cls for cls in constructible if cls not in inner]
    if len(roots) != 1:
        names = ", ".join(cls.__name__ for cls in (roots or constructible))
        raise UserError(f"several candidate models in {spec} ({names}); define build_model() that "
                        "returns the one to plan for, or a module-level `model`")
    return instances[roots[0]]


def _find_model(module: Any, spec: str, seq_len: int | None) -> nn.Module:
    if callable(getattr(module, "build_model", None)):
        return _call_build_model(module, spec, seq_len)
    if hasattr(module, "model"):
        if not isinstance(module.model, nn.Module):
            raise UserError(f"`model` in {spec} is a {type(module.model).__name__}, not an nn.Module; "
                            "assign the model instance to it, or define build_model()")
        return module.model
    return _from_classes(module, spec)


def _required_forward_args(model: nn.Module) -> list[str]:
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return []
    return [name for name, p in signature.parameters.items()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _default_inputs_fn(model: nn.Module, spec: str) -> InputsFn:
    needed = _required_forward_args(model)
    if len(needed) > 1:
        raise UserError(f"the model in {spec} takes {len(needed)} inputs ({', '.join(needed)}) in "
                        "forward, and autoplan builds only one by default; define "
                        "example_inputs(batch_size, seq_len) in the file returning a tuple of "
                        f"{len(needed)} tensors, one per forward argument")
    first = next((m for m in model.modules() if not list(m.children())), None)
    if isinstance(first, nn.Embedding):
        return _token_inputs
    if isinstance(first, nn.Linear):
        features = first.in_features
        return lambda batch, seq: (torch.zeros(batch, seq, features, device="meta"),)
    if isinstance(first, nn.Conv2d):
        return _image_inputs(first.in_channels)
    kind = type(first).__name__ if first is not None else "no submodule"
    raise UserError(f"cannot tell what inputs the model in {spec} takes (its first module is {kind}); "
                    "define example_inputs(batch_size, seq_len) in the file returning a tuple of tensors")


def position_table(model: nn.Module) -> tuple[str, int] | None:
    """(name, rows) of the model's learned position embedding, the smallest if several; None
    without one (rotary or no positions: no limit the model's structure shows)."""
    tables = [(name, module.num_embeddings) for name, module in model.named_modules()
              if isinstance(module, nn.Embedding) and POSITION_TABLE_NAME.fullmatch(name.rsplit(".", 1)[-1].lower())]
    return min(tables, key=lambda table: table[1]) if tables else None


def _load_file(path: Path, spec: str, seq_len: int | None, *,
               expected_sha256: str | None = None) -> LoadedModel:
    module, sha = _exec_file(path, spec, expected_sha256)
    model = _find_model(module, spec, seq_len)
    table = position_table(model)
    if table and seq_len is not None and seq_len > table[1]:
        raise UserError(f"{spec}: sequence length {seq_len} exceeds the model's {table[1]} positions (its "
                        f"position embedding `{table[0]}` has {table[1]} rows); use --seq-len {table[1]} or "
                        "less, or enlarge that table in the file")
    user_batch = getattr(module, BATCH_HOOK, None)
    user_inputs = getattr(module, "example_inputs", None)
    if callable(user_batch):
        inputs_fn = _batch_inputs_fn(user_batch, spec, callable(getattr(module, "loss", None)))
    else:
        inputs_fn = user_inputs if callable(user_inputs) else _default_inputs_fn(model, spec)
    ref = ModelRef("file", path.stem, spec, fingerprint(model, None), sha)
    return LoadedModel(model, ref, None, table[1] if table else None, inputs_fn,
                       takes_images=getattr(inputs_fn, "image_channels", 0) > 0,
                       user_batch=callable(user_batch), own_loss=callable(getattr(module, "loss", None)))


def _batch_inputs_fn(batch: Callable, spec: str, has_loss: bool) -> InputsFn:
    """The inputs of the file's example_batch; its labels checked against the loss."""
    def inputs(batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...]:
        values, labels = call_batch(batch, batch_size, seq_len, spec)
        if labels.is_floating_point() and not has_loss:
            raise UserError(f"{BATCH_HOOK} in {spec} returns {str(labels.dtype).replace('torch.', '')} "
                            "labels, and without a loss(outputs, labels) in the file the loss is "
                            "cross-entropy, which takes integer class labels. Define "
                            "loss(outputs, labels) in the file, or return class indices (int64).")
        return values

    return inputs


def _image_inputs(channels: int) -> InputsFn:
    """An image batch (batch, channels, side, side); the second argument is the side."""
    def inputs(batch_size: int, side: int) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(batch_size, channels, side, side, device="meta"),)

    inputs.image_channels = channels  # type: ignore[attr-defined]
    return inputs


def default_image_size(model: nn.Module) -> int:
    """The model's own image side (an `image_size` / `img_size` attribute of it or of a
    submodule, as timm's patch_embed.img_size), else 224 (ImageNet)."""
    for sub in model.modules():
        for name in ("image_size", "img_size"):
            value = getattr(sub, name, None)
            if isinstance(value, (tuple, list)) and value:
                value = value[0]
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 224
