"""Parameters of an attention module that hold one value per head (GraniteSWA's attention
sinks, one logit per head that joins each head's softmax), under tensor parallelism.

A rank runs its share of the heads: its q, k and v columns are those heads' (colwise), and
the attention module reads its own per-head parameter between them and the row-parallel
output projection. The parameter is sharded by heads (a Shard(0) DTensor, each rank the
values of its own heads, as the column linears hold theirs), and the module sees the local
shard while it runs: its forward mixes the parameter with the plain tensors the column
linears hand back (`use_local_output`), which a DTensor would refuse. `to_local` is
differentiable, so each rank's gradient lands on its own heads' values.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

HEAD_PARAMETERS = "head_parameters"


def shard_head_parameters(module: nn.Module, mesh: DeviceMesh) -> None:
    """`module`'s own parameters sharded by their first dimension (the heads) over `mesh`,
    each handed to the forward as this rank's plain shard."""
    names = []
    for name, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            table = distribute_tensor(param.detach(), mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(table, requires_grad=param.requires_grad))
        names.append(name)
    held: dict[str, nn.Parameter] = {}

    def local(module, args):
        # the parameter as it is now (FSDP swaps its own gathered copy in before the block runs)
        for name in names:
            held[name] = module._parameters[name]
            module._parameters[name] = held[name].to_local()

    def restore(module, args, output):
        for name in names:
            module._parameters[name] = held.pop(name)

    module.register_forward_pre_hook(local)
    module.register_forward_hook(restore)
