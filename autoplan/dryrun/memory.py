"""Peak memory of one step by category, from torch's MemTracker on fake tensors.

MemTracker sorts every tensor storage into parameters, gradients, optimizer state,
activations, buffers, temporaries and other. Two views are kept: the categories at the
moment the total peaks (what must fit), and each category's own maximum over the step (to
set beside a cost model that adds per-category maxima). Per-module peaks are not needed and
their bookkeeping, which walks every tracked module on every allocation, is skipped: it is
what makes MemTracker slow on an 80-layer model.

All of the dry run's tensors are fake CPU tensors standing for the GPU's. What CPU offload
keeps in host memory is booked apart (`to_host`, `host_step`): under a device of its own,
so that it counts towards the host figure (`host_peak`) and not the GPU's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker, _RefType, _UpdateType
from torch.utils._pytree import tree_leaves

CATEGORIES = {"Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer",
              "Activation": "activations", "Buffer": "buffers", "Temp": "temporaries",
              "Other": "temporaries"}
TOTAL_KEY = "Total"  # torch.distributed._tools.mem_tracker._TOTAL_KEY


@dataclass(frozen=True)
class _Host:
    """The key host memory is booked under in MemTracker's per-device snapshots (it reads only
    `.type` of a device, to round CUDA allocations, which host memory is not)."""
    type: str = "host"


HOST = _Host()


def by_category(snapshot: dict) -> dict[str, int]:
    """MemTracker's reference types folded into autoplan's category names (bytes)."""
    folded: dict[str, int] = {}
    for key, name in CATEGORIES.items():
        folded[name] = folded.get(name, 0) + int(snapshot.get(key, 0))
    return folded


@dataclass
class Window:
    """The peak of one part of the step (a stage's micro-batch, the reduction and optimizer
    step): its total, the categories at that moment and each category's own maximum."""
    peak: int = 0
    at_peak: dict[str, int] = field(default_factory=dict)
    category_max: dict[str, int] = field(default_factory=dict)
    at_start: dict[str, int] = field(default_factory=dict)

    def update(self, total: int, folded: dict[str, int]) -> None:
        if total > self.peak:
            self.peak, self.at_peak = total, dict(folded)
        for name, size in folded.items():
            self.category_max[name] = max(self.category_max.get(name, 0), size)


class StepMemoryTracker(MemTracker):
    """MemTracker keeping the whole-device peak and each category's maximum, overall and per
    window of the step (`open`), nothing per module, and host memory apart from the GPU's."""

    def __init__(self) -> None:
        super().__init__()
        self.category_max: dict[str, int] = {}
        self.windows: dict[str, Window] = {}
        self._window: Window | None = None
        self._host_step = False  # inside host_step
        self._host_inputs = False  # the op being tracked reads host memory
        self._seen: dict = {}  # device -> its snapshot's values when last folded in

    def open(self, name: str) -> None:
        """Start a window: later allocations count towards it until the next one opens."""
        snap = self._gpu(self._curr_mem_snap)
        self._window = self.windows[name] = Window(at_start=by_category(snap))
        self._window.update(int(snap.get(TOTAL_KEY, 0)), by_category(snap))

    @staticmethod
    def _gpu(snapshots: dict) -> dict:
        """The snapshot of the one device the step runs on (all fake tensors are on "cpu")."""
        return next((snap for dev, snap in snapshots.items() if dev != HOST), {})

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            values = tuple(snap.values())
            if self._seen.get(dev) == values:  # most ops move no memory: nothing new to fold
                continue
            self._seen[dev] = values
            if self._peak_mem.get(dev, 0) < snap[TOTAL_KEY]:
                self._peak_mem[dev] = snap[TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)
            if dev == HOST:
                continue
            folded = by_category(snap)
            for name, size in folded.items():
                self.category_max[name] = max(self.category_max.get(name, 0), size)
            if self._window is not None:
                self._window.update(int(snap[TOTAL_KEY]), folded)

    def current(self, name: str) -> int:
        """Bytes of one autoplan category held on the GPU now."""
        return by_category(self._gpu(self._curr_mem_snap)).get(name, 0)

    def peak(self) -> tuple[int, dict[str, int]]:
        """(peak bytes, categories at that moment) of the one device the step ran on."""
        snap = self._gpu(self._peak_mem_snap)
        return int(snap.get(TOTAL_KEY, 0)), by_category(snap)

    def host_peak(self) -> tuple[int, dict[str, int]]:
        """(peak bytes, categories at that moment) of what was booked as host memory."""
        snap = self._peak_mem_snap.get(HOST, {})
        return int(snap.get(TOTAL_KEY, 0)), by_category(snap)

    # -- host memory ------------------------------------------------------------------
    def to_host(self, tensor: torch.Tensor, reftype: _RefType | None = None) -> None:
        """Book the storages of `tensor` (a DTensor: its local shard) as host memory from now
        on, in their category (`reftype` for a storage not yet tracked)."""
        for storage in get_untyped_storages(tensor):
            winfo, _ = self._WINFO.get(storage, (None, None))
            if winfo is None:
                if reftype is None:
                    raise KeyError("a tensor not tracked yet needs a reftype to be booked")
                self._update_and_maybe_create_winfos(tensor, reftype)
                winfo, _ = self._WINFO[storage]
            self._move_to_host(winfo)

    def _move_to_host(self, winfo) -> None:
        if winfo.device == HOST:
            return
        if winfo.mem_consumed > 0:
            self._update_snap(_UpdateType.DEL, winfo)
        winfo.device = HOST
        if winfo.mem_consumed > 0:
            self._update_snap(_UpdateType.ADD, winfo)

    def _on_host(self, tensor: torch.Tensor) -> bool:
        return any(self._WINFO.get(st, (None, None))[0] is not None
                   and self._WINFO[st][0].device == HOST for st in get_untyped_storages(tensor))

    @contextlib.contextmanager
    def host_step(self):
        """A stretch that runs where its operands live, as eager torch does: an op reading host
        memory makes its new tensors in host memory (an optimizer step on offloaded states)."""
        self._host_step = True
        try:
            yield
        finally:
            self._host_step = self._host_inputs = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._host_step:
            return super().__torch_dispatch__(func, types, args, kwargs)
        self._host_inputs = any(self._on_host(t) for t in tree_leaves((args, kwargs))
                                if isinstance(t, torch.Tensor))
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._host_inputs = False

    def _track(self, reftype, t: torch.Tensor) -> None:
        if not self._host_inputs:
            super()._track(reftype, t)
            return
        new = [st for st in get_untyped_storages(t) if self._WINFO.get(st, (None, None))[0] is None]
        super()._track(reftype, t)
        for storage in new:
            self._move_to_host(self._WINFO[storage][0])
