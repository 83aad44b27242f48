"""A model file's own batch: `example_batch(batch_size)` returns `(inputs, labels)`.

  inputs  the forward's inputs: a tensor, a tuple of tensors (positional), or a dict of
          tensors (keyword: `input_ids`, `attention_mask`, ...)
  labels  a tensor, what the loss compares the output with

Every tensor's first dimension is the batch. The function may take a second parameter, the
plan's sequence length. Without a `loss(outputs, labels)` in the file the loss is
cross-entropy over the output's last dimension, so the labels are then integer classes.

The runtime calls it once per sample (batch_size=1) with torch's RNG seeded from (seed,
step, row) and concatenates the rows, as the image objective draws its images: every DP/PP
split of a step trains on the samples a 1-rank run trains on, and a rank draws only the rows
it trains on. Context parallelism is not offered for such a model: which dimension of the
file's inputs is a sequence only the file knows; nor is pipeline parallelism with several
inputs or keyword ones (the schedule hands the first stage one positional input).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from autoplan.errors import UserError

Inputs = tuple[torch.Tensor, ...] | dict[str, torch.Tensor]
Batch = tuple[Inputs, torch.Tensor]
BATCH_HOOK = "example_batch"


def takes_seq_len(fn: Callable) -> bool:
    """Whether `fn` has a second positional parameter (the sequence length)."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def call_batch(fn: Callable, batch_size: int, seq_len: int, where: str) -> Batch:
    """`fn(batch_size[, seq_len])` checked: (inputs as a tuple or a dict, labels)."""
    call = f"{BATCH_HOOK}({batch_size}{', ' + str(seq_len) if takes_seq_len(fn) else ''})"
    try:
        value = fn(batch_size, seq_len) if takes_seq_len(fn) else fn(batch_size)
    except UserError:
        raise
    except Exception as exc:  # the user's function failed
        raise UserError(f"{call} in {where} raised {type(exc).__name__}: {exc}; fix that "
                        "function") from None
    return checked_batch(value, batch_size, f"{call} in {where}")


def checked_batch(value, batch_size: int, call: str) -> Batch:
    """`value` as (inputs: a tuple or a dict, labels), or a UserError naming what is wrong."""
    shape = ("return (inputs, labels): inputs a tensor, a tuple of tensors (the forward's "
             "positional inputs) or a dict of them (its keyword inputs), labels a tensor, each "
             "with the batch as its first dimension")
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise UserError(f"{call} returned {type(value).__name__}; {shape}")
    inputs, labels = value
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
    keyword = isinstance(inputs, dict) and all(isinstance(k, str) for k in inputs)
    tensors = list(inputs.values()) if keyword else inputs
    if (not (keyword or isinstance(inputs, (tuple, list))) or not tensors
            or not all(isinstance(t, torch.Tensor) for t in tensors) or not isinstance(labels, torch.Tensor)):
        raise UserError(f"{call} returned ({type(value[0]).__name__}, {type(labels).__name__}); {shape}")
    for tensor in (*tensors, labels):
        if tensor.dim() == 0 or tensor.shape[0] != batch_size:
            raise UserError(f"{call} returned a tensor of shape {tuple(tensor.shape)}, whose first "
                            f"dimension is not the batch of {batch_size}; {shape}")
    return (dict(inputs) if keyword else tuple(inputs)), labels


def _input_keys(inputs: Inputs) -> list:
    """The names of keyword inputs, the positions of positional ones."""
    return list(inputs) if isinstance(inputs, dict) else list(range(len(inputs)))


def sample_rows(fn: Callable, seq_len: int, seed: int, step: int, rows: range) -> Batch:
    """Rows `rows` of step `step`'s global batch, each drawn by its own `fn(1)` call."""
    drawn = []
    for row in rows:
        with torch.random.fork_rng(devices=[]):  # the training RNG stream is left as it was
            torch.manual_seed(((seed * 1_000_003 + step) * 1_000_033 + row) % (1 << 63))
            drawn.append(call_batch(fn, 1, seq_len, "the model file"))
    keys = _input_keys(drawn[0][0])
    if any(_input_keys(inputs) != keys for inputs, _ in drawn):
        raise UserError(f"{BATCH_HOOK} in the model file returned different inputs from one call "
                        "to the next; return the same inputs every time.")
    joined = {key: torch.cat([inputs[key] for inputs, _ in drawn]) for key in keys}
    inputs = joined if isinstance(drawn[0][0], dict) else tuple(joined.values())
    return inputs, torch.cat([labels for _, labels in drawn])
