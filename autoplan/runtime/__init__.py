"""autoplan.runtime: apply a Plan to a model and train it under torchrun.

Imports torch and the standard library only (training nodes need nothing else).

    from autoplan.runtime import parse_args, train
    losses = train(lambda: MyModel(...), plan_dict, parse_args())

Advanced: `build_mesh(plan, device_type)` -> ParallelMesh, `apply_plan(model, plan, mesh)`
-> Parallelized (this rank's stage modules, wrapped), `Trainer` for callers that own the
process group.
"""

from autoplan.runtime.args import TrainArgs, parse_args
from autoplan.runtime.loop import Trainer, init_distributed, lr_at, train
from autoplan.runtime.mesh import ParallelMesh, build_mesh
from autoplan.runtime.parallelize import Parallelized, apply_plan, validate_plan

__all__ = ["ParallelMesh", "Parallelized", "TrainArgs", "Trainer", "apply_plan", "build_mesh",
           "init_distributed", "lr_at", "parse_args", "train", "validate_plan"]
