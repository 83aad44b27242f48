"""The column-parallel style of a linear that may meet its input whole or as a sequence
shard: a column written inline in its block (nn.TransformerEncoderLayer's linear1) gets this
rank's sequence shard under SP and gathers it, while one behind its module's "prepare_input"
gets the gathered DTensor."""

from __future__ import annotations

from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel


class InlineColwiseParallel(ColwiseParallel):
    """ColwiseParallel whose declared input layout applies to a plain tensor only. A DTensor
    input (gathered by its module's "prepare_input") keeps its placements: redistributing it
    to the same placements would all-reduce its gradient, where the gather's own backward
    reduce-scatters it."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        tensor = inputs[0]
        if isinstance(tensor, DTensor):
            if tensor.placements == tuple(desired_input_layouts):
                return tensor
            return tensor.redistribute(placements=desired_input_layouts, async_op=True)
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs,
                                                 device_mesh)
