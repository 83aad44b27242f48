"""Cost model: pure functions from (ModelGraph, ParallelConfig, Cluster) to time and memory.

`estimate` is built from `stage_cost` and `step_time_s`, which are built from `layer_cost`;
a solver that sums layer and stage costs for a partition reproduces `estimate` exactly.
"""

from autoplan.cost.estimate import Estimate, assemble, check_config, estimate, estimate_partition
from autoplan.cost.layers import LayerCost, layer_cost
from autoplan.cost.stages import StageCost, partition, stage_cost, stage_layer_counts
from autoplan.cost.step import StepTime, step_time_s

__all__ = [
    "Estimate", "LayerCost", "StageCost", "StepTime", "assemble", "check_config", "estimate", "estimate_partition",
    "layer_cost", "partition", "stage_cost", "stage_layer_counts", "step_time_s",
]
