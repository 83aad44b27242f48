"""The fake process group leaves the process as it found it."""

from __future__ import annotations

import sys

import torch.distributed as dist

from autoplan.trace.fake_group import fake_process_group


def test_fake_world_is_torn_down_with_the_excepthook_restored():
    hook = sys.excepthook
    with fake_process_group(4, 3):
        assert (dist.get_rank(), dist.get_world_size()) == (3, 4)
        assert sys.excepthook is not hook  # torch prefixes tracebacks with the rank meanwhile
    assert sys.excepthook is hook and not dist.is_initialized()
