"""Reads ds_config.json files with DeepSpeed itself, in a process of its own (DeepSpeed sets up
its own process group): argv[1] is a JSON list of {"config", "dp", "pipelined"}; prints one JSON
list of what DeepSpeed made of each.

DeepSpeedConfig gets the plan's data-parallel size through an mpu (what Megatron-DeepSpeed
passes), so its batch identity train = micro x accumulation x dp is checked at the plan's size.
A pipelined plan is also handed to deepspeed.initialize with a PipelineModule on this one gloo
rank: the pipeline engine refuses ZeRO stages it cannot run (the batch is scaled to one rank,
the optimizer is torch's AdamW and bf16 is off: this CPU has no fused Adam or bf16 engine path).
"""

import json
import os
import sys

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=os.environ.get("DS_TEST_PORT", "29613"), DS_ACCELERATOR="cpu")

import deepspeed  # noqa: E402
import torch.nn as nn  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402


class DataParallelOf:
    """The mpu interface DeepSpeedConfig reads the data-parallel size from."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def pipeline_engine_stage(config: dict) -> int:
    one_rank = json.loads(json.dumps(config))
    one_rank["train_batch_size"] = one_rank["train_micro_batch_size_per_gpu"] * one_rank["gradient_accumulation_steps"]
    one_rank["optimizer"]["params"]["torch_adam"] = True
    one_rank["bf16"] = {"enabled": False}
    one_rank["fp16"] = {"enabled": False}
    one_rank["zero_optimization"].pop("offload_optimizer", None)
    one_rank["zero_optimization"].pop("offload_param", None)
    net = PipelineModule(layers=[nn.Linear(8, 8), nn.Linear(8, 8)], num_stages=1, loss_fn=nn.MSELoss())
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=one_rank)
    assert type(engine).__name__ == "PipelineEngine"
    return engine.zero_optimization_stage()


def main() -> None:
    # DeepSpeed's CPU backend compiles its shared-memory all-reduce kernel (C++) on first use:
    # minutes on a fresh 2-core machine, and nothing this test reads (no collective runs)
    # (the module by its full name: `deepspeed.comm.torch` the attribute is PyTorch itself)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed("gloo")
    out = []
    for case in json.loads(sys.argv[1]):
        parsed = DeepSpeedConfig(case["config"], mpu=DataParallelOf(case["dp"]))
        out.append({"train_batch_size": parsed.train_batch_size,
                    "micro_batch": parsed.train_micro_batch_size_per_gpu,
                    "accumulation": parsed.gradient_accumulation_steps,
                    "zero_stage": parsed.zero_optimization_stage,
                    "fp16": parsed.float16_config.enabled, "bf16": parsed.bfloat16_config.enabled,
                    "clip": parsed.gradient_clipping,
                    "pipeline_engine_stage": pipeline_engine_stage(case["config"]) if case["pipelined"] else None})
    print("RESULT " + json.dumps(out), flush=True)
    # The result is out: leave without interpreter teardown, where DeepSpeed's engines and the
    # gloo group it never destroys have aborted the process ("terminate called without an
    # active exception", then SIGSEGV) after a complete run
    os._exit(0)


if __name__ == "__main__":
    main()
