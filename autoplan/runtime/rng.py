"""The random streams a training step draws from, captured per rank for a checkpoint.

Batches are a pure function of (seed, step) (data.py) and need no state, but dropout and any
other torch.rand* in forward draw from the process's default generators, which a resumed
process would otherwise restart from the seed. Saved: torch's CPU generator, every CUDA
device's generator (when CUDA is present) and Python's `random` (user models may use it).
Stored as JSON, not pickle: loading a checkpoint must never run code.

Every rank of a pipeline stage draws from one stream, so a dropout mask on an activation
every rank holds whole is the same on each, as it must be: replicas that drew different masks
would compute different gradients for one replicated weight. Each pipeline rank forks a stream
of its own once the weights are made (`fork_pipeline_stream`): stages drawing from one stream
would give a later stage's layers the masks (or router noise) an earlier stage's layers drew,
where one process draws anew for every layer; Megatron-LM seeds its pipeline ranks apart too.
Ranks that hold shards of one activation (a TP rank's heads or columns, a CP rank's part of
the sequence) draw their masks from a stream of their own (`ShardDropouts`), as Megatron-LM's model-parallel RNG tracker does for TP, derived from
the shared stream so that nothing more needs saving and checkpointed recomputation draws the
same masks again.
"""

from __future__ import annotations

import base64
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode


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


# The calls that draw an element-wise mask over their input (or, for attention, over its
# probabilities). Other random ops (a drop-path's per-sample draw, router jitter) keep the
# shared stream: their shapes need not follow the shard.
_MASK_DRAWS = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                         F.feature_alpha_dropout, torch.dropout, torch.alpha_dropout,
                         torch.feature_dropout, torch.feature_alpha_dropout})
_ATTENTION = torch._C._nn.scaled_dot_product_attention  # F.scaled_dot_product_attention, whoever rebinds that name
_MIX = 0x9E3779B97F4A7C15  # a 64-bit odd constant (golden ratio): rank seeds spread apart


def _draws_mask(func, args, kwargs) -> bool:
    if func in _MASK_DRAWS:
        return True
    if func is _ATTENTION:
        p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        return p > 0
    return False


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None
                                             else torch.cuda.current_device()]
    return torch.default_generator


def _advance(gen: torch.Generator, device: torch.device) -> int:
    """A number drawn from the shared stream, which moves on alike on every rank. On CUDA the
    Philox offset is moved by hand: a tensor draw would wait for the device to read it."""
    if device.type == "cuda":
        offset = gen.get_offset()
        gen.set_offset(offset + 4)  # Philox offsets advance in fours
        return gen.initial_seed() * 1_000_003 + offset
    return int(torch.randint(2**62, (1,), generator=gen))


def _first_tensor(values) -> torch.Tensor | None:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    return None


def fork_pipeline_stream(pp_rank: int) -> None:
    """Moves this process's generators (CPU and CUDA) to a stream of pipeline rank `pp_rank`'s
    own: a seed mixed from the run's seed and the pipeline rank, so the ranks of one stage
    still share their stream. No tensor is drawn: the dry run makes its trainer under fake
    tensors, which have no values to seed from."""
    torch.manual_seed((torch.initial_seed() * _MIX + pp_rank + 1) % 2**63)


class ShardDropouts(TorchFunctionMode):
    """While active, every dropout call (and an attention kernel's dropout) draws its mask
    from this rank's stream: a seed mixed from a number the shared stream yields, the same
    on every rank, and `shard`, the index of the part of the activation the rank holds
    (ranks holding the same part share it). The shared stream moves on by that one draw on
    every rank alike, and the mask is a pure function of the shared stream's state, so
    torch.utils.checkpoint (which restores that state before recomputing) draws it again.
    Modes nest: inside a TP region under CP, the dropout call this mode makes reaches the CP
    region's mode below it, which forks again from this rank's stream, so the mask depends
    on both ranks."""

    def __init__(self, shard: int) -> None:
        super().__init__()
        self.shard = shard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = _first_tensor(args)
        # a DTensor's random ops follow its placements (DTensor's own RNG tracker on CUDA)
        if not _draws_mask(func, args, kwargs) or tensor is None or isinstance(tensor, DTensor):
            return func(*args, **kwargs)
        device = tensor.device
        gen = _generator(device)
        key = _advance(gen, device)
        shared = gen.get_state()
        gen.manual_seed((key * _MIX + self.shard + 1) % 2**63)
        try:
            return func(*args, **kwargs)
        finally:
            gen.set_state(shared)


class ShardRegions:
    """Opens `ShardDropouts` where this rank's activations are its own shard and closes it
    where they are whole again, from module hooks (tensor_parallel.py and context_parallel.py
    place them; parallelize.py places none on the probe's meta or the dry run's fake model).

    A region is open while its mode is on torch's function-mode stack, which is what the
    hooks test, not a flag: checkpointing stops a recomputation as soon as it has what
    backward needs (torch.utils.checkpoint's early stop), so a region opened there is never
    closed by its hook; the autograd engine restores the stack when backward ends."""

    def __init__(self, shard: int) -> None:
        self.mode = ShardDropouts(shard)

    def open(self) -> None:
        if _stack_index(self.mode) is None:
            self.mode.__enter__()

    def close(self) -> None:
        index = _stack_index(self.mode)
        if index is None:
            return
        if index != torch._C._len_torch_function_stack() - 1:
            raise RuntimeError("autoplan: a torch function mode entered inside a sharded region "
                               "is still active at its end; the dropout streams cannot close")
        self.mode.__exit__(None, None, None)


def _stack_index(mode: TorchFunctionMode) -> int | None:
    for index in range(torch._C._len_torch_function_stack()):
        if torch._C._get_function_stack_at(index) is mode:
            return index
    return None
