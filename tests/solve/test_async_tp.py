"""Async TP as a plan choice: where it can run (TP with sequence parallelism, compiled, on CUDA),
what the planner turns on, what the cost model hides with it, and the job's refusal on CPU ranks."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import estimate
from autoplan.errors import UserError
from autoplan.hardware import load_gpu, make_cluster
from autoplan.models.catalog import load_catalog_config
from autoplan.plan import ModelRef, Plan, PlanFormatError
from autoplan.runtime.compiling import enable_async_tp
from autoplan.solve.api import plan_job
from autoplan.trace.tracer import graph_for_config

BASE = {"model": {"source": "catalog", "name": "tiny-llama"}, "gpu": "h100-sxm-80gb", "world_size": 4,
        "gpus_per_node": 4, "global_batch": 8, "seq_len": 16, "dp": 2, "tp": 2, "sequence_parallel": True,
        "compile": True, "async_tp": True, "format_version": 3}


def test_an_async_tp_plan_file_round_trips_and_others_do_not_name_it():
    plan = Plan.from_dict(BASE)
    assert plan.async_tp and Plan.from_dict(plan.to_dict()) == plan
    assert "async_tp" not in Plan.from_dict(dict(BASE, async_tp=False)).to_dict()


@pytest.mark.parametrize("changes,message", [
    ({"tp": 1, "dp": 4}, "tp > 1 with sequence parallelism"),
    ({"sequence_parallel": False}, "tp > 1 with sequence parallelism"),
    ({"compile": False}, "needs compile"),
    ({"gpu": "cpu"}, "needs CUDA GPUs"),
    ({"async_tp": "yes"}, "async_tp must be true or false"),
])
def test_a_plan_where_async_tp_cannot_run_is_refused(changes, message):
    with pytest.raises(PlanFormatError, match=message):
        Plan.from_dict(dict(BASE, **changes))


@pytest.fixture(scope="module")
def llama():
    config = load_catalog_config("llama3.1-8b")
    return graph_for_config(config, 1, 4096, probe_runtime=False)


def _planned(graph, gpu: str, compile_blocks: bool):
    cluster = make_cluster(load_gpu(gpu), 8)
    ref = ModelRef("catalog", "llama3.1-8b")
    return plan_job(graph, ref, cluster, global_batch=16, seq_len=4096, fixed={"tp": 2, "pp": 1},
                    compile_blocks=compile_blocks, time_limit_s=20)


def test_the_planner_turns_it_on_only_for_compiled_tp_on_cuda(llama):
    on = _planned(llama, "h100", compile_blocks=True)
    assert on.plan.async_tp and on.plan.tp == 2 and on.plan.sequence_parallel
    assert not _planned(llama, "h100", compile_blocks=False).plan.async_tp
    # what the planner writes, the plan file's own rules accept
    assert Plan.from_dict(json.loads(on.plan.to_json())).async_tp


def test_async_tp_hides_tp_collectives_behind_the_matmuls(llama):
    cluster = make_cluster(load_gpu("h100"), 8)
    config = ParallelConfig(global_batch=16, seq_len=4096, dp=4, tp=2, zero_stage=1, micro_batch=1, compile=True)
    plain = estimate(llama, config, cluster)
    pipelined = estimate(llama, config.with_(async_tp=True), cluster)
    assert 0 < pipelined.comm_breakdown_s["tp"] < plain.comm_breakdown_s["tp"]
    assert pipelined.step_time_s < plain.step_time_s
    assert pipelined.memory_gib_per_gpu == pytest.approx(plain.memory_gib_per_gpu)


def test_the_job_refuses_async_tp_on_cpu_ranks():
    with pytest.raises(UserError, match="CUDA symmetric memory.*\"async_tp\": false"):
        enable_async_tp(SimpleNamespace(device_type="cpu"))
