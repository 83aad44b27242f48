"""Peak memory of one step by category, from torch's MemTracker on fake tensors.

MemTracker sorts every tensor storage into parameters, gradients, optimizer state,
activations, buffers, temporaries and other. Two views are kept: the categories at the
moment the total peaks (what must fit), and each category's own maximum over the step (to
set beside a cost model that adds per-category maxima). Per-module peaks are not needed and
their bookkeeping, which walks every tracked module on every allocation, is skipped: it is
what makes MemTracker slow on an 80-layer model.
"""

from __future__ import annotations

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


class StepMemoryTracker(MemTracker):
    """MemTracker keeping the whole-device peak and each category's maximum, nothing per module."""

    def __init__(self) -> None:
        super().__init__()
        self.category_max: dict[str, int] = {}

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[TOTAL_KEY]:
                self._peak_mem[dev] = snap[TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)
            for name, size in by_category(snap).items():
                self.category_max[name] = max(self.category_max.get(name, 0), size)

    def current(self, name: str) -> int:
        """Bytes of one autoplan category held now."""
        snap = next(iter(self._curr_mem_snap.values()), {})
        return by_category(snap).get(name, 0)

    def peak(self) -> tuple[int, dict[str, int]]:
        """(peak bytes, categories at that moment) of the one device the step ran on."""
        snap = next(iter(self._peak_mem_snap.values()), {})
        return int(snap.get(TOTAL_KEY, 0)), by_category(snap)
