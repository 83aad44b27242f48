"""Device mesh for a plan: one named axis per parallelism, torchtitan-style.

We say *axis* for a DeviceMesh axis and *dim* for a tensor dimension. The world mesh is
(pp, dp_replicate, dp_shard, cp, tp) in row-major rank order, so tp neighbours are adjacent
ranks (fastest links) and pp is outermost. Derived 1-D views: "dp" (replicate x shard),
"dp_shard_cp" (what FSDP shards over: CP ranks hold the same weights) and "dp_cp" (what
gradients are averaged over). EP is carved from dp_shard x cp: that flat axis is split into
(ep_rest, ep) on a second mesh over the same ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from autoplan.plan import Plan


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class MeshAxis(str, Enum):
    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"


WORLD_AXES = tuple(axis.value for axis in MeshAxis)
EP_AXES = ("pp", "dp_replicate", "ep_rest", "ep", "tp")


@dataclass
class ParallelMesh:
    """The world mesh plus the derived views every parallelism needs."""

    plan: Plan
    world: DeviceMesh
    ep_mesh: DeviceMesh | None  # (pp, dp_replicate, ep_rest, ep, tp), only when ep > 1
    flat: dict[str, DeviceMesh]  # "dp", "dp_shard_cp", "dp_cp": flattened views, kept here

    def axis(self, name: str) -> DeviceMesh:
        return self.flat[name] if name in self.flat else self.world[name]

    def group(self, name: str) -> dist.ProcessGroup:
        return self.axis(name).get_group()

    def expert_replica_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same experts (dp_replicate x ep_rest), where ZeRO-1 shards
        the experts' optimizer states; None without EP or without ZeRO-1."""
        return self.flat["ep_replica"].get_group() if "ep_replica" in self.flat else None

    def expert_dp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards the experts over at ZeRO-2/3: the ranks holding the same
        experts, ep_rest, and with HSDP (dp_replicate, ep_rest), replicated over the first
        axis like the dense parameters. A view of ep_mesh, so FSDP can compose it with the
        experts' ep DTensors (one root mesh, as FSDP + TP). ep_rest may have one rank: FSDP2
        then skips the collectives (copying shard to gathered parameter in the compute dtype)
        but still casts once per gather and divides the gradient (_fsdp_param_group.py)."""
        if self.plan.dp_replicate > 1:
            return self.ep_mesh[("dp_replicate", "ep_rest")]
        return self.ep_mesh["ep_rest"]

    def local_rank(self, name: str) -> int:
        return self.axis(name).get_local_rank()

    @property
    def dp_rank(self) -> int:
        """Index of this rank's slice of the global batch (replicate-major)."""
        return self.local_rank("dp")

    @property
    def cp_rank(self) -> int:
        return self.local_rank("cp")

    @property
    def pp_rank(self) -> int:
        return self.local_rank("pp")


def build_mesh(plan: Plan, device_type: str) -> ParallelMesh:
    """Initialise the world mesh of `plan` on `device_type` (the process group must exist)."""
    sizes = (plan.pp, plan.dp_replicate, plan.dp_shard, plan.cp, plan.tp)
    world = init_device_mesh(device_type, sizes, mesh_dim_names=WORLD_AXES)
    flat = {"dp": world[("dp_replicate", "dp_shard")]._flatten("dp"),
            "dp_shard_cp": world[("dp_shard", "cp")]._flatten("dp_shard_cp"),
            "dp_cp": world[("dp_replicate", "dp_shard", "cp")]._flatten("dp_cp")}
    ep_mesh = None
    if plan.ep > 1:
        dp_shard_cp = plan.dp_shard * plan.cp
        ranks = torch.arange(plan.world_size).reshape(
            plan.pp, plan.dp_replicate, dp_shard_cp // plan.ep, plan.ep, plan.tp)
        ep_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=EP_AXES)
        if plan.zero_stage == 1:
            flat["ep_replica"] = ep_mesh[("dp_replicate", "ep_rest")]._flatten("ep_replica")
    return ParallelMesh(plan, world, ep_mesh, flat)
