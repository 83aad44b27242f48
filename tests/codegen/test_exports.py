"""torchtitan.toml and megatron.args: export a plan, import it with autoplan's own importers, and
get the same configuration back, axis by axis; what a stack cannot express is named in the
file's header instead (and then the nearest setting is what comes back)."""

from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path

import pytest

from autoplan.codegen.megatron import megatron_args, megatron_notes, pipeline_layout
from autoplan.codegen.torchtitan import torchtitan_config, torchtitan_notes, torchtitan_toml
from autoplan.errors import UserError
from autoplan.importers import load_imported
from autoplan.config import ParallelConfig
from autoplan.plan import ModelRef, Plan

BLOCKS = 8
DATA = Path(__file__).parent / "data"


def make_plan(counts: list[int] | None = None, modes: list[str] | None = None, **kw) -> Plan:
    """A plan of BLOCKS blocks named layers.<i>; `counts` blocks per (virtual) stage."""
    base = Plan(model=ModelRef("catalog", "llama3.1-8b"), gpu="h100-sxm-80gb", world_size=8, gpus_per_node=8,
                parallel=ParallelConfig(global_batch=16, seq_len=128, dp=8, zero_stage=3, micro_batch=1))
    pp, vpp = kw.get("pp", 1), kw.get("vpp", 1)
    counts = counts or [BLOCKS // (pp * vpp)] * (pp * vpp)
    names = tuple(f"layers.{i}" for i in range(sum(counts)))
    plan = base.with_(**kw, blocks=names, stage_layers=tuple(counts),
                      layer_recompute=tuple(modes or ["none"] * len(names)))
    plan.check()
    return plan


def export_import(plan: Plan, kind: str, tmp_path: Path):
    """(the ParallelConfig read back, the exported text)."""
    if kind == "torchtitan":
        text, path = torchtitan_toml(plan), tmp_path / "torchtitan.toml"
        value = str(path)
    else:
        text, path = megatron_args(plan), tmp_path / "megatron.args"
        value = f"@{path}"
    path.write_text(text)
    imported = load_imported(kind, value, num_gpus=plan.world_size, num_layers=len(plan.recompute))
    return imported.config, text


def stage_recompute(config, counts: list[int]) -> list[tuple[int, int]]:
    """(full, selective) blocks per stage as the imported configuration says."""
    if config.stage_recompute is not None:
        return list(config.stage_recompute)
    full, sel = config.recompute == "full", config.recompute == "selective"
    return [(c if full else 0, c if sel else 0) for c in counts]


def plan_recompute(plan: Plan) -> list[tuple[int, int]]:
    return [(sum(plan.recompute[b] == "full" for b in s), sum(plan.recompute[b] == "selective" for b in s))
            for s in plan.stages]


def same_configuration(plan: Plan, config) -> dict[str, tuple]:
    """Every axis where the configuration read back differs from the plan: {axis: (plan, read)}."""
    counts = [len(s) for s in plan.stages]
    pairs = {
        "dp": (plan.dp, config.dp), "tp": (plan.tp, config.tp), "pp": (plan.pp, config.pp),
        "cp": (plan.cp, config.cp), "ep": (plan.ep, config.ep), "zero": (plan.zero_stage, config.zero_stage),
        "dp_replicate": (plan.dp_replicate if plan.zero_stage else 1, config.dp_replicate),
        "micro_batch": (plan.micro_batch, config.micro_batch), "global_batch": (plan.global_batch, config.global_batch),
        "seq_len": (plan.seq_len, config.seq_len), "precision": (plan.precision, config.precision),
        "sequence_parallel": (plan.tp > 1 and plan.sequence_parallel, config.sequence_parallel),
        "offload": (plan.offload, config.offload),
        "schedule": ((plan.schedule, plan.vpp) if plan.pp > 1 else None,
                     (config.schedule, config.vpp) if config.pp > 1 else None),
        "stages": (counts if plan.pp > 1 else None,
                   (list(config.stage_layers) if config.stage_layers else [BLOCKS // (config.pp * config.vpp)]
                    * (config.pp * config.vpp)) if config.pp > 1 else None),
        "recompute": (plan_recompute(plan), stage_recompute(config, counts)),
        "float8": ((plan.float8_recipe, plan.float8_all_gather), (config.float8_recipe, config.float8_all_gather)),
        "async_tp": (plan.async_tp, config.async_tp),
    }
    return {axis: pair for axis, pair in pairs.items() if pair[0] != pair[1]}


# (case, plan options, {format: axis that comes back as the nearest setting, named in the header})
CASES = [
    ("dp-fsdp", {}, {}),
    ("hsdp", dict(dp_replicate=2), {"megatron": "dp_replicate"}),
    ("ddp", dict(zero_stage=0), {}),
    ("zero1", dict(zero_stage=1), {"torchtitan": "zero"}),
    ("zero2", dict(zero_stage=2), {}),
    ("tp-sp", dict(dp=4, tp=2, sequence_parallel=True), {}),
    ("tp-no-sp", dict(dp=4, tp=2, sequence_parallel=False), {}),
    ("tp-async", dict(dp=4, tp=2, sequence_parallel=True, compile=True, async_tp=True), {"megatron": "async_tp"}),
    ("pp-1f1b", dict(dp=4, pp=2, schedule="1f1b"), {}),
    ("pp-gpipe", dict(dp=4, pp=2, schedule="gpipe"), {"megatron": "schedule"}),
    ("pp-uneven", dict(dp=4, pp=2, schedule="1f1b", counts=[3, 5]), {}),
    ("pp-interleaved-uneven", dict(dp=4, pp=2, vpp=2, schedule="interleaved-1f1b", counts=[1, 2, 2, 3]), {}),
    ("pp-zero-bubble", dict(dp=4, pp=2, schedule="zero-bubble"), {"megatron": "schedule"}),
    ("pp-zbv", dict(dp=4, pp=2, vpp=2, schedule="zero-bubble"), {"megatron": "schedule"}),
    ("cp", dict(dp=4, cp=2), {}),
    ("ep", dict(ep=4), {}),
    ("ep-with-tp", dict(dp=4, tp=2, ep=4), {}),
    ("micro-global-batch", dict(micro_batch=2, global_batch=64, seq_len=256), {}),
    ("pp-micro-batch", dict(dp=4, pp=2, micro_batch=2, global_batch=32), {}),
    ("fp32", dict(precision="fp32"), {}),
    ("fp16", dict(precision="fp16"), {"torchtitan": "precision"}),
    ("fp8", dict(precision="fp8"), {}),
    ("fp8-all-gather", dict(precision="fp8", float8_all_gather=True), {"megatron": "float8"}),
    ("fp8-rowwise", dict(precision="fp8", float8_recipe="rowwise"), {"megatron": "float8"}),
    ("offload-all", dict(offload="both"), {"megatron": "offload"}),
    ("offload-optimizer", dict(offload="optimizer"), {"torchtitan": "offload"}),
    ("recompute-full", dict(modes=["full"] * BLOCKS), {}),
    ("recompute-selective", dict(modes=["selective"] * BLOCKS), {}),
    ("recompute-first-per-stage", dict(dp=4, pp=2, modes=["full", "none", "none", "none"] * 2),
     {"torchtitan": "recompute"}),
    ("recompute-mixed", dict(modes=["full", "selective", "none", "none"] * 2),
     {"torchtitan": "recompute", "megatron": "recompute"}),
]


@pytest.mark.parametrize("kind", ["torchtitan", "megatron"])
@pytest.mark.parametrize("case,options,nearest", CASES, ids=[c[0] for c in CASES])
def test_round_trip_gives_the_same_configuration(kind, case, options, nearest, tmp_path):
    plan = make_plan(**options)
    config, text = export_import(plan, kind, tmp_path)
    differences = same_configuration(plan, config)
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    allowed = {nearest[kind]} if kind in nearest else set()
    if kind == "megatron" and plan.pp > 1 and plan.zero_stage >= 2:
        allowed.add("zero")  # Megatron-FSDP does not pipeline: the distributed optimizer is written
    if allowed:
        assert set(differences) <= allowed, differences
        assert "Not expressible" in header, header
    else:
        assert differences == {}, differences
        assert "Everything in the plan is expressed." in header, header


def test_nearest_settings_are_named_on_the_notes_lists():
    mixed = make_plan(modes=["full", "selective", "none", "none"] * 2)
    assert any("per-block recomputation" in n and "selective 4" in n for n in torchtitan_notes(mixed))
    assert any("--recompute-method block" in n for n in megatron_notes(mixed))
    zbv = make_plan(dp=4, pp=2, vpp=2, schedule="zero-bubble")
    assert any("zero-bubble" in n and "interleaved 1F1B" in n for n in megatron_notes(zbv))
    assert torchtitan_config(zbv)["parallelism"]["pipeline_parallel_schedule"] == "ZBVZeroBubble"


@pytest.mark.parametrize("options", [dict(dp=4, pp=2, vpp=2, schedule="interleaved-1f1b", counts=[1, 2, 2, 3]),
                                     dict(dp=4, pp=2, vpp=2, schedule="interleaved-1f1b"),
                                     dict(zero_stage=2, offload="both"), dict(zero_stage=3)])
def test_megatron_arguments_pass_megatrons_cross_checks(options):
    """The rules of validate_args (megatron/training/arguments.py, core_v0.16.1) the exports can meet:
    at most one of the layout / virtual-stage flags, Megatron-FSDP with --ckpt-format fsdp_dtensor,
    --optimizer-cpu-offload with --use-precision-aware-optimizer."""
    args = megatron_args(make_plan(**options)).splitlines()
    flags = {line.split()[0]: line.split()[1] if " " in line else None for line in args if line.startswith("--")}
    virtual = {"--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
               "--pipeline-model-parallel-layout"}
    assert len(virtual & set(flags)) <= 1
    assert "--use-megatron-fsdp" not in flags or flags["--ckpt-format"] == "fsdp_dtensor"
    assert "--optimizer-cpu-offload" not in flags or "--use-precision-aware-optimizer" in flags


def test_experts_are_not_tensor_parallel_in_megatron():
    """Megatron-LM's --expert-tensor-parallel-size defaults to the TP size (arguments.py, core_v0.16.1)."""
    assert "--expert-tensor-parallel-size 1" in megatron_args(make_plan(dp=4, tp=2, ep=4)).splitlines()
    assert "--expert-tensor-parallel-size" not in megatron_args(make_plan(ep=4))


def test_uneven_stages_use_megatron_layout_and_torchtitan_model_parts():
    plan = make_plan(dp=4, pp=2, counts=[3, 5])
    assert "--pipeline-model-parallel-layout Et*3|t*5,L\n" in megatron_args(plan)
    parts = torchtitan_config(plan)["parallelism"]["module_fqns_per_model_part"]
    assert parts == [["tok_embeddings", "layers.0", "layers.1", "layers.2"],
                     ["layers.3", "layers.4", "layers.5", "layers.6", "layers.7", "norm", "lm_head"]]
    legacy = torchtitan_config(plan, "0.2.2")["parallelism"]["module_fqns_per_model_part"]
    assert legacy[-1][-1] == "output"


def test_pipeline_layout_matches_megatrons_parser_when_installed():
    """Megatron-core's own layout parser counts the same transformer layers per stage."""
    layout_module = pytest.importorskip(
        "megatron.core.transformer.pipeline_parallel_layer_layout",
        reason="megatron-core is not installed (pip install megatron-core)")
    parsed = layout_module.PipelineParallelLayerLayout.parse_str_to_list(pipeline_layout([1, 2, 0, 3]))
    assert [sum(t.name == "decoder" for t in stage) for stage in parsed] == [1, 2, 0, 3]
    assert parsed[0][0].name == "embedding" and parsed[-1][-1].name == "loss"


# ---------------------------------------------------------------- the real readers


def test_megatron_arguments_are_megatron_lm_arguments():
    """Every flag exists in Megatron-LM core_v0.16.1's parser and takes a value exactly when the parser's does."""
    known = json.loads((DATA / "megatron_lm_core_v0.16.1_arguments.json").read_text())["arguments"]
    plans = [make_plan(**options) for _, options, _ in CASES]
    checked = set()
    for plan in plans:
        tokens = shlex.split(" ".join(l for l in megatron_args(plan).splitlines() if not l.startswith("#")))
        for i, token in enumerate(tokens):
            if not token.startswith("--"):
                continue
            assert token in known, f"{token} is not a Megatron-LM argument"
            takes_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
            assert takes_value == known[token], f"{token}: value {'given' if takes_value else 'missing'}"
            checked.add(token)
    assert len(checked) >= 25


def test_plan_format_prints_the_export_and_its_notes():
    from click.testing import CliRunner

    from autoplan.cli import cli

    args = ["plan", "tiny-gpt", "--gpu", "cpu", "--gpus", "4", "--gpus-per-node", "4", "--global-batch", "8",
            "--seq-len", "64"]
    result = CliRunner().invoke(cli, [*args, "--format", "torchtitan"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = tomllib.loads(result.stdout)
    assert data["training"]["global_batch_size"] == 8 and data["training"]["seq_len"] == 64
    assert "torchtitan has no model family for tiny-gpt" in result.stderr
    result = CliRunner().invoke(cli, [*args, "--format", "megatron"], catch_exceptions=False)
    assert "--global-batch-size 8" in result.stdout.splitlines()
    with pytest.raises(UserError, match="two outputs"):
        CliRunner().invoke(cli, [*args, "--format", "megatron", "--json"], catch_exceptions=False)


@pytest.mark.parametrize("layout", ["Et*3|t*x", "Et*3|t*2|t*3,L"])
def test_a_layout_that_is_no_pipeline_of_this_size_is_a_user_error(layout):
    with pytest.raises(UserError, match="pipeline-model-parallel-layout"):
        load_imported("megatron", f"--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout '{layout}'",
                      num_gpus=8)


def test_pipelined_zero3_is_written_as_what_megatron_and_deepspeed_run():
    """Megatron-FSDP does not pipeline and DeepSpeed's pipeline engine asserts ZeRO < 2: both files
    say ZeRO-1 (the nearest) and name the difference in their headers."""
    from autoplan.codegen.deepspeed import ds_config, ds_config_notes
    from autoplan.codegen.megatron import megatron_args

    plan = make_plan(dp=4, pp=2, schedule="1f1b")
    assert plan.zero_stage == 3
    text = megatron_args(plan)
    assert "--use-distributed-optimizer" in text and "--use-megatron-fsdp" not in text
    assert "# - ZeRO-3 with pipeline parallelism: Megatron-FSDP does not run with pipelining" in text
    assert ds_config(plan)["zero_optimization"]["stage"] == 1
    assert any("pipeline engine runs ZeRO stage 0 or 1 only" in note for note in ds_config_notes(plan))
    assert ds_config(make_plan())["zero_optimization"]["stage"] == 3  # no pipeline: as planned


def test_megatron_args_reach_the_parser_unquoted(tmp_path):
    """The file's own usage line, `set -f; ... $(grep -v '^#' megatron.args)`, hands every value on
    as written: quotes would reach Megatron's parser inside the value."""
    import subprocess

    from autoplan.codegen.megatron import megatron_args

    path = tmp_path / "megatron.args"
    path.write_text(megatron_args(make_plan(dp=4, pp=2, schedule="1f1b", counts=[3, 5])))
    (tmp_path / "Et-glob-bait|t").write_text("")  # a file the layout's * would match without set -f
    words = subprocess.run(["bash", "-c", "set -f; printf '%s\\n' $(grep -v '^#' megatron.args)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split("\n")
    layout = words[words.index("--pipeline-model-parallel-layout") + 1]
    assert layout == "Et*3|t*5,L"


def test_torchtitan_release_names_follow_the_stack_version():
    """0.3 (the default) names the head lm_head, has enable_sequence_parallel and needs CUDA graphs
    off for pipelined or expert-parallel plans; 0.2 has neither key and reads the file itself."""
    tp_pp = make_plan(dp=2, tp=2, pp=2, schedule="1f1b", sequence_parallel=False)
    current = torchtitan_config(tp_pp)
    assert current["training"]["disable_cuda_graphs"] is True
    assert current["parallelism"]["enable_sequence_parallel"] is False
    assert "disable_cuda_graphs = true (torchtitan 0.3 refuses CUDA graphs" in torchtitan_toml(tp_pp)
    assert "disable_cuda_graphs" not in torchtitan_config(make_plan())["training"]
    assert torchtitan_config(make_plan(ep=4))["training"]["disable_cuda_graphs"] is True
    legacy = torchtitan_config(tp_pp, "0.2.2")
    assert "disable_cuda_graphs" not in legacy["training"]
    assert "enable_sequence_parallel" not in legacy["parallelism"]
    assert any("always shards the sequence" in n for n in torchtitan_notes(tp_pp, "0.2.2"))
    assert "--job.config_file torchtitan.toml" in torchtitan_toml(tp_pp, "0.2.2")


@pytest.mark.parametrize("option,fragment", [("torchtitan", "STACK=VERSION"), ("nemo=1.0", "STACK=VERSION"),
                                             ("torchtitan=0.1", "releases 0.2, 0.3"),
                                             ("torchtitan=latest", "releases 0.2, 0.3"),
                                             ("megatron=core_v0.19.0", "no release-specific names")])
def test_a_stack_version_autoplan_cannot_write_is_refused(option, fragment):
    from autoplan.codegen.exports import parse_stack_versions

    with pytest.raises(UserError, match=fragment):
        parse_stack_versions((option,))


def test_plan_format_writes_the_release_asked_for():
    from click.testing import CliRunner

    from autoplan.cli import cli

    args = ["plan", "llama3.1-8b", "--gpu", "h100", "--gpus", "16", "--global-batch", "64", "--seq-len", "4096",
            "--fix", "pp=2", "--fix", "tp=2", "--format", "torchtitan"]
    legacy = CliRunner().invoke(cli, [*args, "--stack-version", "torchtitan=0.2.2"], catch_exceptions=False)
    assert legacy.exit_code == 0, legacy.output
    assert tomllib.loads(legacy.stdout)["parallelism"]["module_fqns_per_model_part"][-1][-1] == "output"
    current = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert tomllib.loads(current.stdout)["parallelism"]["module_fqns_per_model_part"][-1][-1] == "lm_head"
