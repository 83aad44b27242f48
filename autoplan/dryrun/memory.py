"""Peak memory of one step by category, from torch's MemTracker on fake tensors.

MemTracker sorts every tensor storage into parameters, gradients, optimizer state,
activations, buffers, temporaries and other. Two views are kept: the categories at the
moment the total peaks (what must fit), and each category's own maximum over the step (to
set beside a cost model that adds per-category maxima). Per-module peaks are not needed and
their bookkeeping, which walks every tracked module on every allocation, is skipped: it is
what makes MemTracker slow on an 80-layer model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed._tools.mem_tracker import MemTracker

CATEGORIES = {"Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer",
              "Activation": "activations", "Buffer": "buffers", "Temp": "temporaries",
              "Other": "temporaries"}
TOTAL_KEY = "Total"  # torch.distributed._tools.mem_tracker._TOTAL_KEY


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
    window of the step (`open`), nothing per module."""

    def __init__(self) -> None:
        super().__init__()
        self.category_max: dict[str, int] = {}
        self.windows: dict[str, Window] = {}
        self._window: Window | None = None

    def open(self, name: str) -> None:
        """Start a window: later allocations count towards it until the next one opens."""
        snap = next(iter(self._curr_mem_snap.values()), {})
        self._window = self.windows[name] = Window(at_start=by_category(snap))
        self._window.update(int(snap.get(TOTAL_KEY, 0)), by_category(snap))

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[TOTAL_KEY]:
                self._peak_mem[dev] = snap[TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)
            folded = by_category(snap)
            for name, size in folded.items():
                self.category_max[name] = max(self.category_max.get(name, 0), size)
            if self._window is not None:
                self._window.update(int(snap[TOTAL_KEY]), folded)

    def current(self, name: str) -> int:
        """Bytes of one autoplan category held now."""
        snap = next(iter(self._curr_mem_snap.values()), {})
        return by_category(snap).get(name, 0)

    def peak(self) -> tuple[int, dict[str, int]]:
        """(peak bytes, categories at that moment) of the one device the step ran on."""
        snap = next(iter(self._peak_mem_snap.values()), {})
        return int(snap.get(TOTAL_KEY, 0)), by_category(snap)
