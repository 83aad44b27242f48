"""ds_config.json read by DeepSpeed 0.19 itself (tests/codegen/deepspeed_reader_worker.py): each
plan's file parses with the plan's data-parallel size and reads back as the same batch,
micro-batch, accumulation, ZeRO stage, precision and clipping; a pipelined plan's file starts
DeepSpeed's pipeline engine (which refuses ZeRO-2/3: the file says ZeRO-1 and its notes why)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from autoplan.codegen.deepspeed import ds_config, ds_config_notes
from autoplan.config import ParallelConfig
from autoplan.plan import ModelRef, Plan
from codegen_helpers import free_port
from multirank import run_killable

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the test extra installs it)")
WORKER = Path(__file__).with_name("deepspeed_reader_worker.py")


def make_plan(dp: int, counts: tuple[int, ...] = (8,), **kw) -> Plan:
    pp, vpp = kw.get("pp", 1), kw.get("vpp", 1)
    counts = counts if len(counts) == pp * vpp else (8 // (pp * vpp),) * (pp * vpp)
    world = dp * kw.get("tp", 1) * pp * kw.get("cp", 1)
    base = Plan(model=ModelRef("catalog", "llama3.1-8b"), gpu="h100-sxm-80gb", world_size=world, gpus_per_node=8,
                parallel=ParallelConfig(global_batch=64, seq_len=4096, dp=dp, zero_stage=3, micro_batch=1))
    names = tuple(f"layers.{i}" for i in range(sum(counts)))
    plan = base.with_(**kw, blocks=names, stage_layers=counts, layer_recompute=("none",) * len(names))
    plan.check()
    return plan


PLANS = {
    "dense": make_plan(8),
    "tp-pp": make_plan(4, tp=4, pp=4, zero_stage=2, schedule="1f1b"),
    "uneven": make_plan(4, counts=(3, 5), pp=2, schedule="1f1b", micro_batch=2),
    "interleaved": make_plan(2, pp=2, vpp=2, schedule="interleaved-1f1b"),
    "moe-ep": make_plan(8, ep=8, zero_stage=1),
    "cp": make_plan(4, cp=2, precision="fp16"),
    "offload": make_plan(8, offload="both"),
    "ddp": make_plan(8, zero_stage=0, precision="fp32"),
}


@pytest.fixture(scope="module")
def read_back() -> dict[str, dict]:
    cases = [{"config": ds_config(plan), "dp": plan.dp, "pipelined": plan.pp > 1} for plan in PLANS.values()]
    done = run_killable([sys.executable, str(WORKER), json.dumps(cases)], timeout=300,
                        env={"DS_TEST_PORT": str(free_port())})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (line,) = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
    return dict(zip(PLANS, json.loads(line[len("RESULT "):])))


@pytest.mark.parametrize("case", PLANS)
def test_deepspeed_reads_the_same_plan(read_back, case):
    plan, got = PLANS[case], read_back[case]
    assert (got["train_batch_size"], got["micro_batch"], got["accumulation"]) == \
        (plan.global_batch, plan.micro_batch, plan.num_microbatches)
    assert (got["fp16"], got["bf16"]) == (plan.precision == "fp16", plan.precision in ("bf16", "fp8"))
    assert got["clip"] == float(plan.optimizer.get("grad_clip") or 0.0)
    if plan.pp > 1:  # DeepSpeed's pipeline engine ran the stage written, and the header says it differs
        assert got["zero_stage"] == got["pipeline_engine_stage"] == min(plan.zero_stage, 1)
        if plan.zero_stage > 1:
            assert any("pipeline engine runs ZeRO stage 0 or 1 only" in n for n in ds_config_notes(plan))
    else:
        assert got["zero_stage"] == plan.zero_stage
