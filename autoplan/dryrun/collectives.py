"""Every collective a dry run issues, with the bytes of its full (unsharded) buffer.

A TorchDispatchMode sees the c10d and functional collective ops the runtime dispatches (FSDP2,
DTensor redistributions, DDP buckets, pipeline send/recv) before the fake process group
answers them. "Bytes" is the larger side of each op: the gathered output of an all-gather,
the unreduced input of a reduce-scatter, the buffer of an all-reduce, broadcast, send or
recv, the input of an all-to-all. That is the size a user can check against parameter bytes
(one ZeRO-3 forward all-gathers every parameter once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# name fragment of the op -> collective kind; first match wins ("reduce_scatter" before
# "reduce"), wait/barrier ops match nothing
_KINDS = (("reduce_scatter", "reduce_scatter"), ("all_gather", "all_gather"),
          ("allgather", "all_gather"), ("all_reduce", "all_reduce"), ("allreduce", "all_reduce"),
          ("all_to_all", "all_to_all"), ("alltoall", "all_to_all"), ("broadcast", "broadcast"),
          ("recv", "recv"), ("send", "send"))
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


def collective_kind(op) -> str | None:
    """The collective an op is, or None for every other op (waits and barriers included)."""
    namespace = getattr(op, "namespace", "")
    if namespace not in _NAMESPACES:
        return None
    name = op._schema.name.split("::")[-1]
    return next((kind for fragment, kind in _KINDS if fragment in name), None)


def _bytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


@dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int
    dtype: str


class CollectiveLog(TorchDispatchMode):
    """Records (kind, bytes, dtype) of every collective op run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is not torch.Tensor and t.__name__ != "FakeTensor" for t in types):
            # a tensor subclass (DTensor) dispatches first; the collectives its implicit
            # redistributions issue come back through this mode on plain tensors
            return NotImplemented
        out = func(*args, **kwargs)
        kind = collective_kind(func)
        if kind is not None:
            sides = [args[0] if args else None, args[1] if len(args) > 1 else None, out]
            tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
            dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "?"
            self.calls.append(Collective(kind, max(_bytes(side) for side in sides), dtype))
        return out


def summarise(calls: list[Collective]) -> list[dict]:
    """One row per (kind, dtype): count and total bytes, largest first."""
    rows: dict[tuple[str, str], dict] = {}
    for call in calls:
        row = rows.setdefault((call.kind, call.dtype), {"kind": call.kind, "dtype": call.dtype,
                                                        "count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += call.bytes
    return sorted(rows.values(), key=lambda r: -r["bytes"])
