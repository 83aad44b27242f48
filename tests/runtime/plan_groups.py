"""Workers that train many plans in one launch give each plan's process groups back after it.

Every plan builds its own device mesh, and with it new gloo groups, each with its own threads
and sockets. Kept, they pile up over a launch: the world-4 parity launch ended with 422 groups
per rank, and its later cases ran 3-13x slower than alone (the launch took 308 s wall, 267 s of
it system time). Destroyed after each plan, the same launch took 155 s, with bitwise the same
losses and grad norms; freed too (the caches below let go of the meshes that hold them), 116 s.

DTensor caches sharding decisions by mesh *value*, so a later plan's mesh, equal to an earlier
one's, would be handed specs that name the destroyed groups: those caches are cleared first.
"""

from __future__ import annotations

import contextlib
import gc

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.tensor import _redistribute
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.distributed.tensor.debug import _clear_sharding_prop_cache


@contextlib.contextmanager
def groups_given_back():
    """Destroys the process groups created inside the block (on success only: a failed plan's
    peers may still be inside a collective of them), and frees them."""
    before = set(c10d._world.pg_map)
    # what lives now (torch's modules, earlier plans' survivors) is never garbage: frozen, the
    # collections below and the runtime's own at the end of training skip it (~0.15 s a pass
    # per rank otherwise, twice a plan)
    gc.freeze()
    yield
    # DTensor's caches hold the plan's meshes (its cost model's topology by mesh, its
    # tensor-meta cache's specs), and a mesh holds its groups (DeviceMesh._pg_registry): kept,
    # no destroyed group is ever freed, and its gloo threads and sockets stay (538 threads per
    # rank after 30 parity plans)
    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()
    ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    gc.collect()  # the plan's FSDP/DTensor cycles, which hold its groups
    for group in [g for g in c10d._world.pg_map if g not in before]:
        dist.destroy_process_group(group)
