"""torch's "fake" process group: one process stands for any rank of any world size.

Collectives return at once without moving data (`torch.testing._internal.distributed.fake_pg`),
so the runtime can be applied and run on fake tensors as rank `rank` of `world_size` ranks.
Used by the plan-time capability probe and by `autoplan check`.
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch.distributed as dist
import torch.nn.functional as F


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """The default process group as rank `rank` of `world_size`, torn down on exit, with
    fake-tensor fallback logs silenced (a failure is reported by the caller, not logged) and
    F.scaled_dot_product_attention restored (the runtime's CP swaps it for the process) and
    sys.excepthook restored (init_process_group wraps it to prefix "[rankN]:" to every line of
    a traceback, once more for each fake world a process has made)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    excepthook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level, fake_log.level = fake_log.level, logging.CRITICAL
    sdpa = F.scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
        sys.excepthook = excepthook
        fake_log.setLevel(level)
        dist.destroy_process_group()
