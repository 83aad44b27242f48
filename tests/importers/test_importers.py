"""Importers of DeepSpeed / Megatron-LM / torchtitan configurations (examples/configs/ samples)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from autoplan.errors import UserError
from autoplan.importers import (chosen_import, compare_with_option, import_options, load_imported,
                                parse_compare_with)

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


# ---------------------------------------------------------------- Megatron-LM

def test_megatron_sample_maps_every_parallel_setting():
    imp = load_imported("megatron", f"@{CONFIGS / 'megatron_llama2_7b.args'}", num_gpus=16)
    c = imp.config
    # 16 GPUs / (tp 2 x pp 2) = dp 4; 32 layers / (pp 2 x 4 layers per virtual stage) = vpp 4
    assert (c.dp, c.tp, c.pp, c.cp, c.ep) == (4, 2, 2, 1, 1)
    assert (c.micro_batch, c.global_batch, c.seq_len) == (1, 512, 4096)
    assert (c.vpp, c.schedule) == (4, "interleaved-1f1b")
    assert (c.recompute, c.precision, c.zero_stage, c.sequence_parallel) == ("selective", "bf16", 1, True)
    assert imp.unsupported == []  # every flag of a stock Megatron launch is known
    assert any("--hidden-size" in n for n in imp.notes)  # model flags are listed, not dropped


def test_megatron_inline_string_unknown_and_unsupported_flags_are_listed():
    args = ("--tensor-model-parallel-size=4 --context-parallel-size 2 --expert-model-parallel-size 4 "
            "--micro-batch-size 2 --global-batch-size 64 --recompute-granularity full --recompute-method block "
            "--recompute-num-layers 3 --fp8-format hybrid --bf16 --decoder-first-pipeline-num-layers 5 "
            "--my-secret-flag 7 --optimizer-cpu-offload")
    imp = load_imported("megatron", args, num_gpus=16)
    c = imp.config
    assert (c.dp, c.tp, c.cp, c.ep, c.micro_batch, c.global_batch) == (2, 4, 2, 4, 2, 64)
    assert c.precision == "fp8" and c.offload == "optimizer"
    assert c.stage_recompute == ((3, 0),) and c.recompute == "none"  # block: first 3 blocks of the stage
    text = " ".join(imp.unsupported)
    assert "--my-secret-flag" in text and "--decoder-first-pipeline-num-layers" in text


def test_megatron_layers_per_virtual_stage_resolved_against_the_model():
    imp = load_imported("megatron", "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
                        "--global-batch-size 8 --fp16", num_gpus=2)
    assert imp.layers_per_virtual_stage == 1
    config = imp.resolve(4, seq_len=128)  # 4 blocks / (pp 2 x 1 per virtual stage) = vpp 2
    assert (config.vpp, config.schedule, config.precision, config.seq_len) == (2, "interleaved-1f1b", "fp16", 128)
    with pytest.raises(UserError, match="virtual stage"):
        imp.resolve(3)


@pytest.mark.parametrize("args, gpus, match", [
    ("--tensor-model-parallel-size 4", 6, "does not divide --gpus 6"),
    ("--tensor-model-parallel-size 2 --global-batch-size 7", 4, "global batch of 7"),
    ("torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py --tensor-model-parallel-size 2", 8, "16 processes"),
    ("--tensor-model-parallel-size 2 stray", 4, "unexpected value"),
    ("--tensor-model-parallel-size 'two", 4, "does not parse"),
    ("--tensor-model-parallel-size zero", 4, "positive integer"),
    ("--expert-model-parallel-size 3", 4, "expert-parallel size 3"),
])
def test_megatron_bad_input_is_a_user_error(args, gpus, match):
    with pytest.raises(UserError, match=match):
        load_imported("megatron", args, num_gpus=gpus)


# ---------------------------------------------------------------- DeepSpeed

def test_deepspeed_sample_maps_batch_zero_offload_and_checkpointing():
    imp = load_imported("deepspeed", str(CONFIGS / "ds_config.json"), num_gpus=8)
    c = imp.config
    assert (c.dp, c.tp, c.pp, c.micro_batch, c.global_batch) == (8, 1, 1, 4, 256)  # 4 x 8 accumulation x 8
    assert (c.zero_stage, c.offload, c.recompute, c.precision) == (3, "optimizer", "full", "bf16")
    assert imp.unsupported == []


def test_deepspeed_unknown_keys_and_autotp(tmp_path):
    data = json.loads((CONFIGS / "ds_config.json").read_text())
    data.update({"tensor_parallel": {"autotp_size": 2}, "train_batch_size": 128, "my_plugin": {"x": 1},
                 "sparse_attention": {"mode": "fixed"}})
    data["zero_optimization"]["zero_hpz_partition_size"] = 8
    data["zero_optimization"]["offload_param"] = {"device": "cpu"}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    imp = load_imported("deepspeed", str(path), num_gpus=8)
    assert (imp.config.tp, imp.config.dp, imp.config.offload) == (2, 4, "both")  # 128 = 4 x 8 x dp 4
    text = " ".join(imp.unsupported)
    assert "my_plugin" in text and "sparse_attention" in text and "zero_hpz_partition_size" in text


def test_deepspeed_auto_values_take_the_command_line(tmp_path):
    path = tmp_path / "hf.json"
    path.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"},
                                "zero_optimization": {"stage": 2}}))
    imp = load_imported("deepspeed", str(path), num_gpus=4, global_batch=16, seq_len=512)
    assert (imp.config.global_batch, imp.config.micro_batch, imp.config.zero_stage) == (16, 1, 2)
    assert imp.config.seq_len == 512 and imp.config.precision == "bf16"
    assert any('"auto"' in n for n in imp.notes)


@pytest.mark.parametrize("content, gpus, match", [
    (None, 4, "train_batch_size 256 != .* = 128"),  # the sample's batch keys were written for 8 GPUs
    ("{not json", 8, "not valid JSON"),
    ('{"zero_optimization": {"stage": 5}}', 8, "stage must be"),
    ('{"fp16": {"enabled": true}, "bf16": {"enabled": true}}', 8, "both fp16 and bf16"),
])
def test_deepspeed_bad_input_is_a_user_error(tmp_path, content, gpus, match):
    path = CONFIGS / "ds_config.json"
    if content is not None:
        path = tmp_path / "bad.json"
        path.write_text(content)
    with pytest.raises(UserError, match=match):
        load_imported("deepspeed", str(path), num_gpus=gpus)


def test_deepspeed_missing_file():
    with pytest.raises(UserError, match="does not exist"):
        load_imported("deepspeed", "/nonexistent/ds.json", num_gpus=8)


# ---------------------------------------------------------------- torchtitan

def test_torchtitan_sample_maps_parallelism_training_and_ac():
    imp = load_imported("torchtitan", str(CONFIGS / "torchtitan_llama3_8b.toml"), num_gpus=16)
    c = imp.config
    # shard -1: 16 / (tp 2 x pp 2); torchtitan's default reshard policy under PP keeps the
    # parameters gathered after the forward (reshard_after_forward = not pp_enabled): ZeRO-2
    assert (c.dp, c.tp, c.pp, c.cp, c.zero_stage) == (4, 2, 2, 1, 2)
    assert any("default with PP" in note for note in imp.notes), imp.notes
    assert (c.micro_batch, c.global_batch, c.seq_len) == (2, 64, 8192)
    assert (c.recompute, c.precision, c.schedule) == ("selective", "fp8", "interleaved-1f1b")
    assert imp.unsupported == []
    assert imp.resolve(32).vpp == 4  # 32 blocks / 4 per stage = 8 stages over pp 2


def test_torchtitan_every_nth_block_and_unknown_keys(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[training]\nlocal_batch_size = 2\nseq_len = 256\nmy_knob = 3\n'
                    '[parallelism]\ndata_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 2\n'
                    '[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "2"\n[weird]\nx = 1\n')
    imp = load_imported("torchtitan", str(path), num_gpus=4)
    c = imp.config
    assert (c.dp, c.dp_replicate, c.global_batch, c.micro_batch, c.precision) == (4, 2, 8, 2, "bf16")
    resolved = imp.resolve(4)  # every 2nd of 4 blocks fully recomputed
    assert resolved.stage_recompute == ((2, 0),) and resolved.recompute == "none"
    text = " ".join(imp.unsupported)
    assert "training.my_knob" in text and "[weird]" in text


@pytest.mark.parametrize("content, compiled", [
    ("", False),
    ("[compile]\nenable = true\n", True),  # torchtitan's default components: model and loss
    ("[compile]\nenable = true\ncomponents = ['loss']\n", False),  # the blocks stay eager
    ("[compile]\nenable = false\ncomponents = ['model']\n", False),
    ("[training]\ncompile = true\n", True),  # torchtitan before the [compile] section
])
def test_torchtitan_compile_of_the_model_is_the_plans_compile(tmp_path, content, compiled):
    path = tmp_path / "job.toml"
    path.write_text(content + "[parallelism]\ndata_parallel_shard_degree = 2\n")
    assert load_imported("torchtitan", str(path), num_gpus=2).config.compile is compiled


@pytest.mark.parametrize("content, gpus, match", [
    ("[parallelism]\ndata_parallel_shard_degree = 8\ntensor_parallel_degree = 2\n", 8, "16 ranks, but --gpus is 8"),
    ("[parallelism]\ntensor_parallel_degree = 3\n", 8, "does not divide --gpus 8"),
    ("[parallelism\n", 8, "not valid TOML"),
    ("[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = 'Bogus'\n", 8, "unknown pipeline"),
    ("[training]\nlocal_batch_size = 4\nglobal_batch_size = 6\n", 2, "not a multiple"),
])
def test_torchtitan_bad_input_is_a_user_error(tmp_path, content, gpus, match):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    with pytest.raises(UserError, match=match):
        load_imported("torchtitan", str(path), num_gpus=gpus)


# ---------------------------------------------------------------- estimate of an imported configuration

def test_imported_configuration_estimates_on_tiny_gpt():
    from autoplan.hardware import load_gpu, make_cluster
    from autoplan.importers.compare import estimate_imported_model

    est, imp = estimate_imported_model(
        "tiny-gpt", make_cluster(load_gpu("cpu"), 4), "megatron",
        "--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 8 --recompute-granularity full "
        "--seq-length 64 --bf16")
    assert est.step_time_s > 0 and imp.config.tp == 2
    assert (est.config["tp"], est.config["recompute"], est.config["seq_len"]) == (2, "full", 64)


# ---------------------------------------------------------------- CLI pieces

def test_cli_pieces_parse_and_attach():
    @click.command()
    @import_options
    @compare_with_option
    def cmd(from_deepspeed, from_megatron, from_torchtitan, compare_with):
        click.echo(repr((chosen_import(from_deepspeed, from_megatron, from_torchtitan),
                         parse_compare_with(compare_with) if compare_with else None)))

    result = CliRunner().invoke(cmd, ["--from-megatron", "--tensor-model-parallel-size 2",
                                      "--compare-with", "torchtitan=job.toml"])
    assert result.exit_code == 0, result.output
    assert "('megatron', '--tensor-model-parallel-size 2')" in result.output
    assert "('torchtitan', 'job.toml')" in result.output
    with pytest.raises(UserError, match="only one"):
        chosen_import("a.json", "--tp 2", None)
    with pytest.raises(UserError, match="KIND=VALUE"):
        parse_compare_with("nemo=cfg.yaml")


GENERATED_DS = Path(__file__).resolve().parents[2] / "generated" / "tiny-gpt-4xcpu"


@pytest.mark.skipif(not (GENERATED_DS / "ds_config.json").is_file(), reason="generated tiny job not present")
def test_generated_jobs_ds_config_reads_back_as_its_plan():
    from autoplan.plan import Plan

    plan = Plan.load(GENERATED_DS / "plan.json")
    imp = load_imported("deepspeed", str(GENERATED_DS / "ds_config.json"), num_gpus=plan.world_size)
    c = imp.config
    assert (c.dp, c.micro_batch, c.global_batch, c.precision) == (plan.dp, plan.micro_batch, plan.global_batch,
                                                                  plan.precision)


def test_compare_with_plan_sets_yours_next_to_the_best_plan():
    from rich.console import Console

    from autoplan.hardware import load_gpu, make_cluster
    from autoplan.importers.compare import compare_with_plan, render_comparison
    from autoplan.solve.api import plan_job
    from autoplan.trace.load import load_graph

    graph, ref, seq = load_graph("tiny-gpt", None)
    job = plan_job(graph, ref, make_cluster(load_gpu("cpu"), 4), global_batch=8, seq_len=seq)
    cmp = compare_with_plan(job, "megatron=--tensor-model-parallel-size 2 --micro-batch-size 1 "
                                 "--global-batch-size 8 --seq-length 4096 --bf16")
    assert cmp["yours"]["config"]["tp"] == 2 and cmp["yours"]["config"]["seq_len"] == seq  # the plan's length
    # same cost model, same graph and cluster: the optimal plan is at least as fast as any configuration
    # it could have chosen (float round-off only)
    assert cmp["speedup"] >= 1 - 1e-9
    assert cmp["speedup"] == pytest.approx(cmp["yours"]["step_time_s"] / job.plan.estimate["step_time_s"])
    assert any("4096" in n for n in cmp["imported"]["notes"])
    console = Console(record=True, width=160)
    render_comparison(cmp, console)
    assert "predicted gain" in console.export_text() or "faster" in console.export_text()
