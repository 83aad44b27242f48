"""How the runtime calls a user model and reads its logits, whatever the model's conventions.

Under a token plan the objective is next-token prediction on token ids, so the model must
read token ids through an nn.Embedding (its size is the vocabulary the data is drawn from);
a model without one is refused with that reason before any process starts talking
(`vocab_size_of`). Image plans train classifiers (objective.py).

Outputs: a logits tensor (autoplan's models, most hand-written ones), an object or dict with
a `logits` entry (Hugging Face `ModelOutput`), or a tuple whose first item is the logits.

Inputs: token ids positionally, plus the keyword inputs the forward accepts:
  position_ids      the absolute positions of the tokens this rank holds. Hugging Face models
                    otherwise derive positions from the length of the input they see, which
                    is wrong on a context-parallel rank (its zig-zag tokens) and inside a
                    sequence-parallel region (the local sequence shard); rotary cos/sin and
                    learned position embeddings are then computed for the right rows. Not
                    given to a model that numbers its tokens itself from their ids (RoBERTa's
                    family: from padding_idx + 1, past padding tokens), where 0, 1, 2, ...
                    would be other positions; context parallelism, which would need them,
                    is refused for it (`numbers_own_positions`).
  use_cache=False   training builds no key/value cache.
  decoder_input_ids encoder-decoder models (T5) read the same tokens on both sides, so the
                    synthetic objective stays next-token prediction.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from autoplan.errors import UserError


@dataclass(frozen=True)
class ModelCall:
    """The keyword inputs a model's forward accepts, read once from the (meta) model."""

    accepted: frozenset[str]
    padding_mask: bool  # `attention_mask` is a Hugging Face 2-D padding mask (1 = real token)
    own_positions: bool = False  # numbers its tokens itself (numbers_own_positions)

    def kwargs(self, inputs: torch.Tensor, positions: torch.Tensor,
               zigzag: bool = False) -> dict[str, object]:
        """Keyword inputs for `inputs` (batch, tokens) holding the tokens at `positions` (1-D);
        `zigzag`: they are a context-parallel rank's (a flag, so fake tensors pass too)."""
        kwargs: dict[str, object] = {}
        if "position_ids" in self.accepted and not self.own_positions:
            kwargs["position_ids"] = positions.to(inputs.device)[None, :]
            # Hugging Face reads a jump in position_ids without a mask as packed sequences
            # and masks across the jump; zig-zag CP tokens jump yet are one sequence.
            if self.padding_mask and zigzag:
                kwargs["attention_mask"] = torch.ones_like(inputs)
        if "use_cache" in self.accepted:
            kwargs["use_cache"] = False
        if "decoder_input_ids" in self.accepted:
            kwargs["decoder_input_ids"] = inputs
        return kwargs


def model_call(model: nn.Module) -> ModelCall:
    try:
        accepted = frozenset(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        accepted = frozenset()
    is_hf = hasattr(getattr(model, "config", None), "_attn_implementation")
    return ModelCall(accepted, padding_mask=is_hf and "attention_mask" in accepted,
                     own_positions=numbers_own_positions(model))


def numbers_own_positions(model: nn.Module) -> bool:
    """A learned position table with a padding row (RoBERTa's `position_embeddings`, padding_idx
    1): the model counts positions from padding_idx + 1, skipping padding tokens, so they
    depend on the token ids, not only on where a token sits."""
    rows = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return bool(rows) and any(isinstance(m, nn.Embedding) and m.padding_idx is not None
                              and m.num_embeddings == rows and "position" in name
                              for name, m in model.named_modules())


def logits_of(output) -> torch.Tensor:
    """The logits of a model output: a tensor, `.logits`/["logits"], or a tuple's first item."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if logits is not None:
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise UserError(f"the model returned {type(output).__name__}, not logits: return a tensor "
                    "(batch, seq, vocab), an object with `.logits`, or a tuple starting with it.")


def _own_module(model: nn.Module, getter: str) -> nn.Module | None:
    """What a Hugging Face model's `get_input_embeddings` / `get_output_embeddings` returns;
    None for a model without the method or one that does not implement it."""
    own = getattr(model, getter, None)
    if not callable(own):
        return None
    try:
        return own()
    except (NotImplementedError, AttributeError):
        return None


def vocab_embedding(model: nn.Module) -> nn.Embedding | None:
    """The embedding that reads token ids: the model's own `get_input_embeddings()` (Hugging
    Face models), else the first nn.Embedding as wide as an output Linear (the head predicts
    over the same vocabulary), else the first nn.Embedding. Not the largest one: a position
    table may hold more rows than the vocabulary (a character model's 65 tokens, 256 positions)."""
    found = _own_module(model, "get_input_embeddings")
    if isinstance(found, nn.Embedding):
        return found
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    heads = {m.out_features for m in model.modules() if isinstance(m, nn.Linear)}
    return next((e for e in embeddings if e.num_embeddings in heads),
                embeddings[0] if embeddings else None)


def token_vocab(model: nn.Module) -> int:
    """How many token ids the runtime draws (0..n-1; 0 for a model without a token embedding):
    the rows of the embedding that reads them (`vocab_embedding`), no more than a Hugging Face
    model's head predicts over, since every id is also a label (CPM-Ant's embedding holds its
    prompt tokens' rows beside a head of the vocabulary alone)."""
    embedding = vocab_embedding(model)
    if embedding is None:
        return 0
    head = _own_module(model, "get_output_embeddings")
    if isinstance(head, nn.Linear):
        return min(embedding.num_embeddings, head.out_features)
    return embedding.num_embeddings


def vocab_size_of(model: nn.Module) -> int:
    """The vocabulary of a token-id model (`token_vocab`), or a UserError for a model
    without a token embedding."""
    vocab = token_vocab(model)
    if vocab:
        return vocab
    raise UserError(f"{type(model).__name__} has no nn.Embedding, so it does not read token ids "
                    "(an image model?), and the plan trains on token ids (it has no image "
                    "`inputs`). Make the plan for this model with `autoplan plan` (an image "
                    "classifier's plan records its image size and classes), or train it with "
                    "your own loop using the plan's degrees.")


def sliding_window(module: nn.Module) -> int | None:
    """The window of a Hugging Face attention module's sliding-window attention, or None: its
    own `sliding_window` (None on the full-attention layers of a model mixing both, as
    Gemma-2/3 and Qwen2 set it), else its config's (Mistral and Starcoder2 read one window
    for every layer from the config)."""
    if "sliding_window" in vars(module):
        window = module.sliding_window
    else:
        window = getattr(getattr(module, "config", None), "sliding_window", None)
    return window if isinstance(window, int) and window > 0 else None


def attention_window(model: nn.Module) -> int:
    """The smallest sliding window of a Hugging Face model's attention (0: none). transformers
    builds an attention mask for it in the model's own code, from the length of the input the
    model sees, once the window is no longer than the sequence (`_ignore_causal_mask_sdpa`):
    a sequence-parallel or context-parallel rank would get a mask of its shard's length."""
    own = [m for m in model.modules() if "sliding_window" in vars(m)]
    windows = [sliding_window(m) for m in own] if own else [sliding_window(model)]
    return min((w for w in windows if w), default=0)


def without_causal_only_mask(module: nn.Module, kwargs: dict, queries: int | None = None) -> dict:
    """`kwargs` of a Hugging Face SDPA attention module without an attention_mask that
    stands for nothing but causality (or, for an encoder, nothing at all) in a run of the
    runtime's inputs, which carry no padding:
      - a mask of fake tensors: transformers materialises one when it sees them (its
        `is_tracing` check: the plan-time capability probe), with the local length;
    and where the caller knows `queries`, the length of the sequence the module attends
    over (ring attention's entry, after tensor parallelism's gather):
      - a mask for other than `queries` queries: transformers sizes its mask from the input
        the model sees, a sequence-parallel shard, against the positions' or the padding
        mask's length, a context-parallel rank's whole part;
      - the plain causal pattern that a model asking transformers to always build its mask
        (Falcon's `allow_is_causal_skip=False`) gets: over a context-parallel rank's tokens
        it is causal in their local order, not in their positions.
    Without it SDPA applies causality (is_causal=True), or attends to every token (a
    bidirectional encoder's, BERT's), which is what ring attention and the sequence-parallel
    gather of the full sequence rely on. A sliding window no longer than the mask's keys is a
    mask the real run builds too, so a fake one stays; a real one under a window stays too
    (no flag applies a window), and so does a floating-point one, fake or real: under SDPA
    transformers' own masks are boolean, so a float one carries a bias the model adds (Falcon's
    ALiBi, a bias of every head) that no flag stands for; ring attention refuses what stays."""
    config = getattr(module, "config", None)
    window = sliding_window(module)
    causal = bool(getattr(module, "is_causal", False))
    if getattr(config, "_attn_implementation", None) != "sdpa" or not (causal or window is None):
        return kwargs
    for name in ("attention_mask", "mask"):  # "mask": T5Attention's
        mask = kwargs.get(name)
        if isinstance(mask, torch.Tensor) and _stands_for_no_mask(mask, window, causal, queries):
            kwargs = {**kwargs, name: None}
    return kwargs


def _stands_for_no_mask(mask: torch.Tensor, window: int | None, causal: bool,
                        queries: int | None) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(mask, FakeTensor) or mask.is_meta:
        return not (window and mask.shape[-1] >= window) and mask.dtype == torch.bool
    if queries is None or window is not None or mask.dim() != 4:
        return False
    if mask.shape[-2] not in (1, queries):
        return True
    return causal and _is_causal_pattern(mask)


# the last mask checked, its version and the verdict: a model passes one mask to every layer
_LAST_CHECKED: list[tuple[weakref.ref, int, bool]] = []


def _is_causal_pattern(mask: torch.Tensor) -> bool:
    """A boolean (..., q, q) mask that is True exactly on and below the diagonal."""
    q, k = mask.shape[-2:]
    if mask.dtype != torch.bool or q != k:
        return False
    if _LAST_CHECKED and _LAST_CHECKED[0][0]() is mask and _LAST_CHECKED[0][1] == mask._version:
        return _LAST_CHECKED[0][2]
    tril = torch.ones(q, k, dtype=torch.bool, device=mask.device).tril_()
    verdict = bool(torch.equal(mask, tril.expand(mask.shape)))
    _LAST_CHECKED[:] = [(weakref.ref(mask), mask._version, verdict)]
    return verdict


def attended_length(args: tuple, kwargs: dict) -> int | None:
    """The sequence length of an attention module's hidden states (batch, seq, hidden): its
    first tensor input, positional or `hidden_states`."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    return hidden.shape[1] if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 else None


def real_parameters(params) -> bool:
    """False where any parameter is fake (the dry run) or on meta (the plan-time probe):
    what those measure is the plain eager model, so nothing extra is installed on them."""
    from torch._subclasses.fake_tensor import is_fake

    return not any(is_fake(p) or p.is_meta for p in params)
