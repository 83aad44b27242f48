"""The random streams a training step draws from, captured per rank for a checkpoint.

Batches are a pure function of (seed, step) (data.py) and need no state, but dropout and any
other torch.rand* in forward draw from the process's default generators, which a resumed
process would otherwise restart from the seed. Saved: torch's CPU generator, every CUDA
device's generator (when CUDA is present) and Python's `random` (user models may use it).
Stored as JSON, not pickle: loading a checkpoint must never run code.

Every rank seeds one stream, so a dropout mask on an activation every rank holds whole is the
same on each, as it must be; but ranks that hold shards of one activation (a TP rank's heads,
an SP rank's tokens) draw the same pattern for their own shard. `dropout_layers` counts what
draws such masks, so the job can say so.
"""

from __future__ import annotations

import base64
import random

import torch
import torch.nn as nn


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture() -> dict:
    state = {"torch": _encode(torch.get_rng_state()), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = [_encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore(state: dict) -> None:
    torch.set_rng_state(_decode(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state_all([_decode(s) for s in state["cuda"]])


def dropout_layers(model: nn.Module) -> int:
    """Modules that draw a dropout mask in training: nn.Dropout* with p > 0, and attention
    modules that pass a float `attention_dropout` > 0 to their attention kernel (Hugging Face
    transformers' convention)."""
    return sum(1 for module in model.modules()
               if (isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0)
               or (isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0))
