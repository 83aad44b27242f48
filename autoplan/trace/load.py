"""Load a MODEL spec (catalog name, config.json, model.py) and trace it: the planner's entry."""

from __future__ import annotations

from pathlib import Path

from autoplan.errors import UserError
from autoplan.models.hf import HF_PREFIX
from autoplan.plan import ModelRef
from autoplan.trace import store
from autoplan.trace.graph import ModelGraph


def load_graph(model_spec: str, seq_len: int | None, image_size: int | None = None,
               batch_size: int = 1) -> tuple[ModelGraph, ModelRef, int]:
    """Load and trace MODEL at `batch_size` and the training sequence length (an image model
    at its image size; its sequence length is then 1: a sample is one image). A graph traced
    before from the same bytes by the same code comes from the disk cache (trace/store.py),
    without importing torch."""
    if seq_len is not None and seq_len <= 0:
        raise UserError(f"--seq-len must be a positive number of tokens, got {seq_len}")
    if batch_size <= 0:
        raise UserError(f"--batch-size must be positive, got {batch_size}")
    model_bytes = _model_bytes(str(model_spec))
    key = store.graph_key(str(model_spec), model_bytes, seq_len, image_size, batch_size) if model_bytes else None
    stored = store.read(key) if key else None
    if stored is not None:
        graph, ref = stored
        return graph, ref, graph.seq_len
    from autoplan.models.sources import load_model
    from autoplan.trace.tracer import trace_model

    loaded = load_model(model_spec, seq_len=seq_len)
    seq = input_extent(loaded, seq_len, image_size)
    graph = trace_model(loaded.module, loaded.example_inputs(batch_size, seq), name=loaded.ref.name,
                        user_batch=loaded.user_batch,
                        token_labels=not (loaded.user_batch or loaded.takes_images or loaded.own_loss))
    if key:
        store.write(key, graph, loaded.ref)
    return graph, loaded.ref, graph.seq_len


def _model_bytes(spec: str) -> list[bytes] | None:
    """The bytes MODEL is built from, found as `models.sources.load_model` finds them; None
    when they cannot be read (load_model then says why) or are not cacheable."""
    from autoplan.models import catalog

    try:
        if spec.startswith(HF_PREFIX):
            path = Path(spec[len(HF_PREFIX):])
            return [(path / "config.json" if path.is_dir() else path).read_bytes()]
        path = Path(spec)
        if path.is_dir():
            return [(path / "config.json").read_bytes()]
        if spec.endswith(".py"):
            return store.model_file_bytes(path)
        if spec.endswith(".json"):
            return [path.read_bytes()]
        return [catalog.catalog_file(spec).read_bytes()]
    except (OSError, UserError):
        return None


def require_blocks(graph: ModelGraph, model_spec: str) -> None:
    """UserError when the model has no repeated blocks: plans are built from them (the pipeline
    stages, recomputation and memory are per block), so without them nothing can be planned."""
    if not graph.layer_order:
        raise UserError(
            f"{model_spec} has no repeated blocks: autoplan plans a model by its repeated layers (an "
            "nn.ModuleList or nn.Sequential of two or more structurally equal modules, such as "
            "transformer blocks: what pipeline stages, recomputation and the memory plan are made of) "
            f"and found none. Put the model's layers in an nn.ModuleList; `autoplan analyze {model_spec}` "
            "shows the structure autoplan sees")


def input_extent(loaded, seq_len: int | None, image_size: int | None) -> int:
    """The second argument of `loaded.example_inputs`: the image side of an image model, else
    the sequence length (the model's, else 2048)."""
    from autoplan.models.sources import FALLBACK_SEQ_LEN, default_image_size

    if loaded.takes_images:
        side = image_size if image_size is not None else default_image_size(loaded.module)
        if side <= 0:
            raise UserError(f"--image-size must be a positive number of pixels, got {side}")
        return side
    if image_size is not None:
        raise UserError(f"--image-size applies to image models; {loaded.ref.name} takes token "
                        "ids, so give its sequence length with --seq-len instead")
    seq = seq_len if seq_len is not None else (loaded.default_seq_len or FALLBACK_SEQ_LEN)
    if seq <= 0:
        raise UserError(f"--seq-len must be a positive number of tokens, got {seq}")
    return seq
