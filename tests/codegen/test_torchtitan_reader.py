"""torchtitan.toml read by torchtitan 0.3.0 itself: its ConfigManager with the model's own
config_registry function and the file's overrides (the Trainer.Config validation runs there:
CUDA graphs against pipeline and expert parallelism, micro-batch divisibility), and its own
pipeline split (`_split_module`) of the real model built on meta: every module name of
module_fqns_per_model_part exists, the parts hold every layer once, and the last stage
returns logits, not hidden states.

torchtitan's model packages import triton at import time; triton installs and imports on CPU
(the test extra pins it), nothing here runs a kernel.
"""

from __future__ import annotations

import shlex
import tomllib

import pytest
import torch

from autoplan.codegen.torchtitan import torchtitan_config, torchtitan_overrides, torchtitan_toml
from autoplan.config import ParallelConfig
from autoplan.plan import ModelRef, Plan

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")
manager = pytest.importorskip("torchtitan.config.manager", reason="torchtitan is not installed")
pipeline_parallel = pytest.importorskip("torchtitan.distributed.pipeline_parallel")

# catalog model -> (torchtitan module, config_registry function, layers)
MODELS = {"llama3.1-8b": ("llama3", "llama3_8b", 32), "llama3.1-70b": ("llama3", "llama3_70b", 80),
          "deepseek-v2-lite": ("deepseek_v3", "deepseek_v3_16b", 27)}


def make_plan(model: str, counts: list[int] | None = None, dp: int = 8, modes: tuple[str, ...] = (), **kw) -> Plan:
    layers = MODELS[model][2]
    pp, vpp = kw.get("pp", 1), kw.get("vpp", 1)
    counts = counts or [layers // (pp * vpp)] * (pp * vpp)
    assert sum(counts) == layers
    world = dp * kw.get("tp", 1) * pp * kw.get("cp", 1)
    base = Plan(model=ModelRef("catalog", model), gpu="h100-sxm-80gb", world_size=world, gpus_per_node=8,
                parallel=ParallelConfig(global_batch=64, seq_len=4096, dp=dp, zero_stage=3, micro_batch=1))
    names = tuple(f"layers.{i}" for i in range(layers))
    plan = base.with_(**kw, blocks=names, stage_layers=tuple(counts),
                      layer_recompute=modes or ("none",) * layers)
    plan.check()
    return plan


PLANS = {
    "dense-fsdp": make_plan("llama3.1-8b"),
    "tp-pp": make_plan("llama3.1-70b", dp=4, tp=4, pp=4, schedule="1f1b", counts=[19, 20, 21, 20]),
    "uneven": make_plan("llama3.1-8b", dp=4, pp=2, schedule="1f1b", counts=[15, 17]),
    "interleaved": make_plan("llama3.1-8b", dp=2, pp=2, vpp=2, schedule="interleaved-1f1b", micro_batch=2),
    "moe-ep": make_plan("deepseek-v2-lite", dp=8, ep=8),
    "moe-ep-pp": make_plan("deepseek-v2-lite", dp=4, ep=4, pp=2, schedule="1f1b", counts=[13, 14]),
    "cp": make_plan("llama3.1-8b", dp=4, cp=2),
    "full-recompute": make_plan("llama3.1-8b", modes=("full",) * 32),
    "selective-recompute": make_plan("llama3.1-8b", dp=4, tp=2, modes=("selective",) * 32),
    "mixed-recompute": make_plan("llama3.1-8b", modes=("full", "none", "none", "none") * 8),
    "compiled": make_plan("llama3.1-8b", dp=4, tp=2, compile=True),
    # CompileConfig's own check: async TP needs compile with "model" among the components
    "async-tp": make_plan("llama3.1-8b", dp=4, tp=2, compile=True, async_tp=True),
}
AC_CLASS = {"none": "NoneType", "full": "FullAC.Config", "selective": "SelectiveAC.Config"}


def header_command(text: str) -> list[str]:
    """The overrides the file's header tells the user to pass (the line after its run line)."""
    lines = [line[2:] for line in text.splitlines() if line.startswith("# ")]
    run = next(i for i, line in enumerate(lines) if line.startswith("run: "))
    return shlex.split(lines[run + 1])


def parse(plan: Plan):
    module, function, _ = MODELS[plan.model.name]
    text = torchtitan_toml(plan)
    data = tomllib.loads(text)
    assert header_command(text) == torchtitan_overrides(data)
    return data, manager.ConfigManager().parse_args(["--module", module, "--config", function,
                                                     *header_command(text)])


@pytest.mark.parametrize("case", PLANS)
def test_torchtitan_accepts_the_file_and_reads_the_same_plan(case):
    plan = PLANS[case]
    data, config = parse(plan)  # raises on what torchtitan refuses
    for section in ("training", "parallelism", "compile"):
        for key, value in data.get(section, {}).items():
            assert getattr(getattr(config, section), key) == value, (section, key)
    par = config.parallelism
    assert (par.tensor_parallel_degree, par.pipeline_parallel_degree, par.context_parallel_degree,
            par.expert_parallel_degree) == (plan.tp, plan.pp, plan.cp, plan.ep)
    assert par.data_parallel_shard_degree * par.data_parallel_replicate_degree == plan.dp
    assert config.training.global_batch_size == plan.global_batch
    assert config.compile.enable == plan.compile
    assert not plan.compile or config.compile.components == ["model"]
    assert config.compile.enable_async_tensor_parallel == plan.async_tp
    modes = set(plan.recompute.values())
    written = "full" if len(modes) > 1 else modes.pop()  # a mix with full blocks: full, and noted
    assert type(config.activation_checkpoint).__qualname__ == AC_CLASS[written]
    if plan.pp > 1:
        assert par.pipeline_parallel_microbatch_size == plan.micro_batch
        assert [sum(n.startswith("layers.") for n in part) for part in par.module_fqns_per_model_part] == \
            [len(stage) for stage in plan.stages]


@pytest.mark.parametrize("case", [c for c in PLANS if PLANS[c].pp > 1])
def test_torchtitans_own_split_of_the_real_model_gives_logits_at_the_end(case):
    plan = PLANS[case]
    _, config = parse(plan)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    parts = config.parallelism.module_fqns_per_model_part
    names = {name for name, _ in model.named_modules()}
    assert [n for part in parts for n in part if n not in names] == []
    layers = [n for part in parts for n in part if n.startswith("layers.")]
    assert sorted(layers) == sorted(f"layers.{i}" for i in range(len(model.layers)))
    last = pipeline_parallel._split_module(model, parts[-1])
    # the stage's own forward after its blocks (their attention wants real masks): norm, then head
    last.layers = type(last.layers)()
    hidden = torch.empty(1, 8, model.tok_embeddings.weight.shape[1], device="meta", dtype=torch.float32)
    with torch.device("meta"):
        out = last(hidden)
    assert out.shape[-1] == model.tok_embeddings.weight.shape[0], "the last stage returns hidden states"


def test_the_legacy_head_name_is_what_release_0_3_drops():
    """Written for 0.2 (`output`), torchtitan 0.3's split keeps no head: the mistake this guards."""
    plan = PLANS["uneven"]
    parts = torchtitan_config(plan, "0.2.2")["parallelism"]["module_fqns_per_model_part"]
    _, config = parse(plan)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    assert pipeline_parallel._split_module(model, parts[-1]).lm_head is None
