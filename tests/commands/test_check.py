"""`autoplan check` dry-runs a plan on the runtime with fake tensors (a process per rank, fake group).

Collective bytes are checked against numbers computed by hand from the model's parameters:
ZeRO-0 all-reduces every fp32 gradient once; ZeRO-3 (FSDP2) reduce-scatters every fp32
gradient once and all-gathers every bf16 parameter in the forward and again the blocks'
in the backward (the root module keeps its parameters gathered after the forward); a pipeline
stage hands on one micro-batch of fp32 hidden states (micro_batch x seq / tp x hidden x 4 bytes)
and receives their gradient back. They are also checked against the cost model's own bytes
per kind and dtype (autoplan/cost/volume.py), which must be the dry run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from autoplan.cli import cli
from autoplan.commands.check import check_plan
from autoplan.models.sources import build_from_ref
from autoplan.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "generated" / "tiny-gpt-4xcpu" / "plan.json"


_PIPELINE = {"pp": 2, "dp": 2, "stages": [["layers.0"], ["layers.1"]]}



def _context_parallel(recompute: str) -> dict:
    """Plan fields of the tiny plan over dp 2 x cp 2, both blocks recomputed `recompute`."""
    return {"dp": 2, "cp": 2, "cp_modules": ["layers.0.self_attn", "layers.1.self_attn"],
            "cp_buffers": {"rope_cos": 0, "rope_sin": 0}, "recompute": {"layers.0-1": recompute}}


def _plan_file(tmp_path: Path, **changes) -> str:
    data = json.loads(TINY.read_text())
    data.update(changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


def _param_counts() -> tuple[int, int]:
    """(all parameters, parameters inside the blocks) of the tiny model."""
    model = build_from_ref(Plan.load(str(TINY)).model, verify=False)
    named = dict(model.named_parameters())
    return sum(p.numel() for p in named.values()), \
        sum(p.numel() for name, p in named.items() if name.startswith("layers."))


def _bytes(rank: dict, kind: str, dtype: str) -> int:
    return sum(r["bytes"] for r in rank["collectives"] if (r["kind"], r["dtype"]) == (kind, dtype))


@pytest.fixture(scope="module")
def counts():
    return _param_counts()


_REPORTS: dict[str, dict] = {}


def _checked(tmp_path: Path, **changes) -> dict:
    """The dry run of the tiny plan with `changes`, made once per distinct plan in this module
    (each is a host process and a process per rank)."""
    key = json.dumps(changes, sort_keys=True)
    if key not in _REPORTS:
        _REPORTS[key] = check_plan(_plan_file(tmp_path, **changes), workers=2)
    return _REPORTS[key]


def test_zero0_all_reduces_every_fp32_gradient_once(tmp_path, counts):
    report = _checked(tmp_path, zero_stage=0)
    rank = report["ranks"][0]
    assert _bytes(rank, "all_reduce", "float32") == 4 * counts[0]
    categories = {row["category"]: row for row in rank["memory"]}
    assert categories["parameters"]["dry_run_gib"] * 2**30 == pytest.approx(4 * counts[0])
    assert categories["optimizer"]["dry_run_gib"] > categories["parameters"]["dry_run_gib"]
    assert categories["activations"]["dry_run_gib"] > 0
    assert report["fits"] and report["spare_gib"] > 0


def test_zero3_gathers_parameters_and_scatters_gradients(tmp_path, counts):
    total, blocks = counts
    rank = _checked(tmp_path, zero_stage=3)["ranks"][0]
    assert _bytes(rank, "reduce_scatter", "float32") == 4 * total
    assert _bytes(rank, "all_gather", "bfloat16") == 2 * total + 2 * blocks
    assert not _bytes(rank, "all_reduce", "float32")


def _assert_model_bytes_are_the_dry_runs(rank: dict) -> None:
    """Per (kind, dtype), the cost model's bytes (cost/volume.py over the dry run's window)
    are the dry run's, exactly: the same tensors, counted the same times."""
    for row in rank["collectives"]:
        assert row["bytes"] == row["model_bytes"], (rank["rank"], row)


@pytest.mark.parametrize("changes", [{"zero_stage": 0}, {"zero_stage": 2}, {"zero_stage": 3},
                                     {"zero_stage": 2, **_PIPELINE},
                                     {"zero_stage": 0, **_PIPELINE},
                                     {"zero_stage": 0, **_context_parallel("none")},
                                     {"zero_stage": 2, **_context_parallel("selective")},
                                     {"zero_stage": 3, **_context_parallel("full")}],
                         ids=["zero0", "zero2", "zero3", "pp2-zero2", "pp2-zero0", "cp2-zero0",
                              "cp2-zero2-selective", "cp2-zero3-full"])
def test_the_cost_models_collective_bytes_are_the_dry_runs(tmp_path, changes):
    # ZeRO-0 all-reduces the fp32 gradients; ZeRO-2 reduce-scatters them and gathers the bf16
    # weights once a step (in this window: one micro-batch per step); ZeRO-3 gathers every
    # block twice and the root unit (embedding, head) once; a pipelined ZeRO-2 stage keeps
    # its gathered weights from the micro-batch before and reduce-scatters at the step's end;
    # pipeline stages hand on bf16 hidden states under FSDP's bf16 compute, fp32 ones under
    # ZeRO-0's autocast from fp32 weights. Ring attention sends bf16 K/V (autocast's or FSDP's
    # bf16) cp-1 hops forward and cp-1 in backward, the fp32 K/V gradients cp-1 hops, and
    # its forward again when the block is recomputed: full, and selective (the op policy
    # saves the attention kernels' outputs, not the ring's). Beside the hidden states, the
    # first stage hands on the rotary cos/sin tables every block reads, fp32 (the model's
    # buffers), which need no gradient back
    report = _checked(tmp_path, **changes)
    for rank in report["ranks"]:
        assert rank["collectives"] and all(row["bytes"] for row in rank["collectives"])
        _assert_model_bytes_are_the_dry_runs(rank)


def _rope_table_bytes(plan: Plan, dtype_bytes: int) -> int:
    """The rotary cos and sin tables, (seq, head_dim / 2) each, a pipeline stage of a tiny
    model hands on beside the hidden states."""
    config = build_from_ref(plan.model, verify=False).config
    return 2 * plan.seq_len * config["hidden_size"] // config["num_attention_heads"] // 2 * dtype_bytes


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_interleaved_stages_hand_on_the_rotary_tables_as_they_got_them(tmp_path, zero_stage):
    # A 4-layer tiny model over pp 2 x vpp 2: rank 0 holds stages 0 and 2, rank 2 stages 1
    # and 3. Stage 0 slices the fp32 tables from its buffers and sends them; a later stage
    # passes them on as it took them in, which at ZeRO-2 is FSDP's bf16 cast of its forward
    # inputs (cast_forward_inputs), below it fp32. No gradient comes back for them.
    config = json.loads((ROOT / "cost_models" / "models" / "tiny-gpt.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")} | {"num_hidden_layers": 4}
    (tmp_path / "tiny4.json").write_text(json.dumps(config))
    path = tmp_path / "vpp.json"
    made = CliRunner().invoke(cli, ["plan", str(tmp_path / "tiny4.json"), "--gpu", "cpu", "--gpus", "4",
                                    "--global-batch", "8", "--seq-len", "64", "--fix", "pp=2",
                                    "--fix", "vpp=2", "--fix", f"zero={zero_stage}", "--fix",
                                    "schedule=interleaved-1f1b", "-o", str(path)])
    assert made.exit_code == 0, made.output
    plan = Plan.load(str(path))
    assert (plan.pp, plan.vpp, plan.zero_stage, len(plan.stages)) == (2, 2, zero_stage, 4)
    stream = "bfloat16" if zero_stage >= 2 else "float32"  # the hidden states' dtype
    later_dtype = stream  # what a stage after the first hands the tables on in
    hidden = plan.micro_batch * plan.seq_len * config["hidden_size"] * (2 if zero_stage >= 2 else 4)
    first, later = _rope_table_bytes(plan, 4), _rope_table_bytes(plan, 2 if zero_stage >= 2 else 4)
    report = check_plan(str(path), workers=2)
    ranks = {rank["pipeline_rank"]: rank for rank in report["ranks"]}
    assert [ranks[0]["stages"], ranks[1]["stages"]] == [[0, 2], [1, 3]]

    def expected(*parts: tuple[str, str, int]) -> dict:
        out: dict = {}
        for kind, dtype, nbytes in parts:
            out[(kind, dtype)] = out.get((kind, dtype), 0) + nbytes
        return out

    # each rank: 3 hidden states each way (stage 0 or 1's one, the middle stage's two); the
    # tables: stage 0 sends them fp32 to stage 1, stage 1 passes them on to stage 2, stage 2 to 3
    assert {(k, d): _bytes(ranks[0], k, d) for k in ("send", "recv") for d in ("float32", "bfloat16")
            if _bytes(ranks[0], k, d)} == expected(
        ("send", stream, 3 * hidden), ("send", "float32", first), ("send", later_dtype, later),
        ("recv", stream, 3 * hidden), ("recv", later_dtype, later))
    assert {(k, d): _bytes(ranks[1], k, d) for k in ("send", "recv") for d in ("float32", "bfloat16")
            if _bytes(ranks[1], k, d)} == expected(
        ("recv", stream, 3 * hidden), ("recv", "float32", first), ("recv", later_dtype, later),
        ("send", stream, 3 * hidden), ("send", later_dtype, later))
    for rank in report["ranks"]:
        _assert_model_bytes_are_the_dry_runs(rank)


def _tp_plan_file(tmp_path: Path, sequence_parallel: bool, zero_stage: int, recompute: str = "none") -> str:
    """The tiny model at dp 2 x tp 2, with the style table the planner writes for it."""
    out = tmp_path / "tp.json"
    result = CliRunner().invoke(cli, ["plan", "tiny-gpt", "--gpu", "cpu", "--gpus", "4",
                                      "--global-batch", "8", "--seq-len", "64", "--fix", "tp=2",
                                      "--fix", "pp=1", "--fix", f"zero={zero_stage}",
                                      "--fix", f"recompute={recompute}", "-o", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["tp"] == 2 and data["dp"] == 2 and data["tp_styles"]
    assert set(data["recompute"].values()) == {recompute}
    data["sequence_parallel"] = sequence_parallel
    out.write_text(json.dumps(data))
    return str(out)


@pytest.mark.parametrize("sequence_parallel, zero_stage, recompute",
                         [(True, 0, "none"), (False, 0, "none"), (True, 2, "none"),
                          (True, 2, "selective"), (True, 0, "full")],
                         ids=["sp-zero0", "no-sp-zero0", "sp-zero2", "sp-zero2-selective", "sp-zero0-full"])
def test_tensor_parallel_collective_bytes_are_the_dry_runs(tmp_path, sequence_parallel, zero_stage, recompute):
    # Below ZeRO-2 the runtime autocasts from fp32 weights: the norms' outputs the attention
    # and MLP gather (and their gradients) are fp32, the row-parallel outputs bf16. The
    # norms' partial gradients under SP are summed once (FSDP per micro-batch in bf16, else
    # the runtime once a step in fp32), and the vocabulary-parallel loss all-reduces three
    # fp32 values per token. Before the column-parallel linears shared one input DTensor,
    # every linear all-reduced its own input gradient (16 all-reduces here, not 10). A
    # recomputed layer, full or selective (whose policy saves matmul outputs, not the
    # collectives'), runs its forward's collectives again up to the last the backward needs:
    # both input all-gathers and the attention's output reduction, not the MLP's (torch's
    # checkpoint stops early), where a whole second forward would be 2 more than logged.
    report = check_plan(_tp_plan_file(tmp_path, sequence_parallel, zero_stage, recompute), workers=1)
    rank = report["ranks"][0]
    kinds = {row["kind"] for row in rank["collectives"]}
    if zero_stage == 0:  # no FSDP gathers: all-gathers and reduce-scatters are SP's
        assert ({"all_gather", "reduce_scatter"} <= kinds) == sequence_parallel
    for row in rank["collectives"]:
        assert row["bytes"] == row["model_bytes"], row


def test_command_prints_the_comparison_and_json(tmp_path):
    path = _plan_file(tmp_path, zero_stage=2)
    text = CliRunner().invoke(cli, ["check", path])
    assert text.exit_code == 0, text.output
    assert "dry run" in text.output and "cost model" in text.output and "this job fits" in text.output
    report = _checked(tmp_path, zero_stage=2)  # the report `--json` prints (its flag: the MoE test)
    assert {row["category"] for row in report["ranks"][0]["memory"]} >= {
        "parameters", "gradients", "optimizer", "activations", "total at peak"}
    assert all(row["model_gib"] is not None for row in report["ranks"][0]["memory"][:4])


# A tiny plan split into two pipeline stages: ranks 0 and 2 are the first and last stage.
def test_offload_keeps_the_sharded_states_in_host_memory(tmp_path, counts):
    # FSDP2's CPUOffloadPolicy (which needs CUDA, so the runtime does not apply it here) keeps
    # each rank's fp32 parameter shard, its fp32 gradient shard and Adam's two fp32 moments in
    # host memory, 16 bytes a parameter / dp, and runs the optimizer step there. The GPU keeps
    # ZeRO-2's gathered bf16 parameters (2 bytes a parameter) and no optimizer state, as the
    # cost model counts it. The host's peak adds the step's temporaries: single-tensor AdamW
    # on CPU tensors frees each parameter's before the next, so they stay below one fp32 copy
    # of the rank's shards (4 bytes a parameter / dp).
    total, _ = counts
    path = _plan_file(tmp_path, zero_stage=2, offload="both")
    dp = Plan.load(path).dp
    rows = {row["category"]: row for row in check_plan(path, workers=1)["ranks"][0]["memory"]}
    assert rows["parameters"]["dry_run_gib"] * 2**30 == 2 * total == rows["parameters"]["model_gib"] * 2**30
    assert rows["optimizer"]["dry_run_gib"] == 0 == rows["optimizer"]["model_gib"]
    host = rows["host (CPU offload)"]
    assert host["model_gib"] * 2**30 == pytest.approx(16 * total / dp)
    assert 16 * total / dp <= host["dry_run_gib"] * 2**30 < 20 * total / dp


_TP_STYLES = {
    "": {"embed_tokens": "vocab_embedding", "norm": "sequence_parallel", "lm_head": "vocab_head"},
    "layers.*": {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                 "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
                 "self_attn": "prepare_input", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                 "mlp.down_proj": "rowwise", "mlp": "prepare_input",
                 "input_layernorm": "sequence_parallel", "post_attention_layernorm": "sequence_parallel"}}


def _boundary_bytes(tp: int) -> int:
    """fp32 bytes of the hidden states one micro-batch hands from stage 0 to stage 1 on one rank
    (sequence parallelism leaves each TP rank its 1/tp of the sequence)."""
    plan = Plan.load(str(TINY))
    hidden = build_from_ref(plan.model, verify=False).embed_tokens.weight.shape[1]
    return plan.micro_batch * (plan.seq_len // tp) * hidden * 4


def _check_pipeline(tmp_path, **changes) -> tuple[dict, dict]:
    report = check_plan(_plan_file(tmp_path, **{**_PIPELINE, **changes}), workers=2)
    assert [(r["rank"], r["pipeline_rank"], r["stages"]) for r in report["ranks"]] == \
        [(0, 0, [0]), (2, 1, [1])]
    for rank in report["ranks"]:
        categories = {row["category"]: row["dry_run_gib"] for row in rank["memory"]}
        assert all(categories[name] > 0 for name in ("parameters", "gradients", "optimizer",
                                                     "activations")), (rank["rank"], categories)
    return report["ranks"][0], report["ranks"][1]


def _assert_boundary_crosses(first: dict, last: dict, activation: int) -> None:
    # the hidden states' gradient is the one tensor that crosses back; forward, stage 0 also
    # hands on what both stages use (the rotary tables), so its send is at least the activation
    assert _bytes(first, "recv", "float32") == activation
    assert _bytes(last, "send", "float32") == activation
    assert _bytes(first, "send", "float32") == _bytes(last, "recv", "float32") >= activation


def test_pipeline_stages_hand_on_one_micro_batch_of_hidden_states(tmp_path):
    first, last = _check_pipeline(tmp_path)
    _assert_boundary_crosses(first, last, _boundary_bytes(tp=1))
    assert _bytes(first, "all_reduce", "float32") > 0  # dp 2 all-reduces each stage's gradients


def test_pipeline_with_tensor_parallelism_checks_every_stage(tmp_path):
    first, last = _check_pipeline(tmp_path, dp=1, tp=2, sequence_parallel=True,
                                  tp_styles=_TP_STYLES)
    _assert_boundary_crosses(first, last, _boundary_bytes(tp=2))
    for rank in (first, last):  # sequence parallelism gathers the sequence before each block
        assert _bytes(rank, "all_gather", "float32") + _bytes(rank, "all_gather", "bfloat16") > 0


def test_a_failed_rank_is_one_user_error_naming_it():
    from concurrent.futures import Future

    from autoplan.dryrun.job import _result
    from autoplan.errors import UserError

    future = Future()
    future.set_exception(RuntimeError("Could not resolve the process group\nregistered under 7"))
    plan = Plan.from_dict(dict(json.loads(TINY.read_text()), **_PIPELINE))
    with pytest.raises(UserError, match=r"rank 2 \(pipeline rank 1 of 2\) failed: RuntimeError: "
                                        r"Could not resolve the process group registered under 7"):
        _result(future, plan, 2)


@pytest.mark.parametrize("ending", ["raises", "exits"])
def test_a_rank_failing_in_its_forked_process_is_one_user_error_naming_it(monkeypatch, ending):
    # the host forks each rank: what the rank raised, or that it ended without a result,
    # comes back as the rank's UserError
    import os

    from autoplan.dryrun import job
    from autoplan.errors import UserError

    def fail(*_args, **_kwargs):
        if ending == "exits":
            os._exit(3)
        raise ValueError("no such stage")

    monkeypatch.setattr(job, "run_rank", fail)
    said = "ValueError: no such stage" if ending == "raises" else "its worker process ended without a result"
    with pytest.raises(UserError, match=rf"rank 0 \(pipeline rank 0 of 1\) failed: {said}"):
        job.run_ranks(json.loads(TINY.read_text()), 1)


def _stage_param_counts(plan: Plan) -> list[tuple[int, int]]:
    """(parameters, parameters of its largest FSDP group) of each pipeline stage of the tiny
    model: stage 0 holds the embedding, the last the final norm and head; each block is its
    own FSDP group, the rest of the stage the root group."""
    named = dict(build_from_ref(plan.model, verify=False).named_parameters())
    counts = []
    for index, blocks in enumerate(plan.stages):
        roots = ("embed_tokens.",) if index == 0 else ("norm.", "lm_head.")
        groups = [sum(p.numel() for name, p in named.items() if name.startswith(block + "."))
                  for block in blocks]
        groups.append(sum(p.numel() for name, p in named.items() if name.startswith(roots)))
        counts.append((sum(groups), max(groups)))
    return counts


def test_pipelined_zero2_holds_unsharded_fp32_gradients_and_gathered_parameters(tmp_path):
    # torch.distributed.pipelining runs every micro-batch's backward with FSDP's gradient sync
    # and reshard-after-backward off, so a stage holds its gradients unsharded in fp32 (4
    # bytes a parameter) and its bf16 parameters gathered (2 bytes) beside the fp32 shard
    # (4 / dp) until the step's reduction. At the peak the gradients are the fp32 sum plus at
    # most the bf16 gradients of the one FSDP group whose backward is folding into it.
    path = _plan_file(tmp_path, zero_stage=2, **_PIPELINE)
    plan = Plan.load(path)
    assert plan.num_microbatches >= 2
    report = check_plan(path, workers=2)
    for rank, (params, largest_group) in zip(report["ranks"], _stage_param_counts(plan)):
        rows = {row["category"]: row for row in rank["memory"]}
        assert rows["parameters"]["dry_run_gib"] * 2**30 == 4 * params // plan.dp + 2 * params
        gradients = rows["gradients"]["at_peak_gib"] * 2**30
        assert 4 * params <= gradients <= 4 * params + 2 * largest_group, rank["rank"]


def test_only_what_a_micro_batch_keeps_is_multiplied_by_those_in_flight():
    # Two stages on one rank (interleaved): the other micro-batches in flight keep both
    # stages' activations (in-flight counts whole-stage micro-batches, as the cost model
    # does); what the last stage allocates after its blocks (logits, loss: 700 - 300 = 400
    # bytes here) is held for the running micro-batch only.
    from autoplan.commands.check import GIB, rank_report
    from autoplan.dryrun.memory import Window
    from autoplan.dryrun.rank import RankRun

    first = Window(peak=1000, at_peak={"activations": 150}, category_max={"activations": 200})
    last = Window(peak=2000, at_peak={"activations": 700}, category_max={"activations": 700})
    drained = Window(peak=2500, at_peak={"gradients": 2500}, category_max={"gradients": 2500})
    run = RankRun(rank=0, pp_rank=0, stage_ids=[3, 7], peak_bytes=2500, at_peak={},
                  category_max={"activations": 700}, microbatches=[(200, first), (300, last)],
                  reduction=drained)
    report = rank_report(run, 0.0, {"in_flight": 2.5, "memory_breakdown_gib": {}}, 80 * GIB)
    rows = {row["category"]: row for row in report["memory"]}
    held = 2.5 * (200 + 300)
    assert rows["activations"]["dry_run_gib"] * GIB == 700 + held - 300
    assert rows["total at peak"]["dry_run_gib"] * GIB == 2000 + held - 300  # > the drained 2500
    assert rows["activations"]["at_peak_gib"] * GIB == 700 + held - 300


def _moe_layers_on(plan: Plan, stage_ids: list[int]) -> int:
    blocks = [b for s in stage_ids for b in plan.stages[s]] if plan.stages else list(plan.blocks)
    return sum(f"{block}.mlp" in plan.ep_modules for block in blocks)


@pytest.mark.parametrize("fixes", [["zero=0"], ["zero=2", "pp=1"], ["zero=3", "pp=1"],
                                   ["zero=2", "pp=2"], ["zero=3", "pp=1", "recompute=selective"]],
                         ids=["zero0", "zero2", "zero3", "pp2-zero2", "zero3-selective"])
def test_a_moe_plan_with_expert_parallelism_dry_runs_with_balanced_routing(tmp_path, fixes):
    # balanced routing (every expert takes tokens x top_k / experts): each all-to-all of a
    # rank's MoE layer moves all of its micro-batch's routed slots, tokens x top_k x hidden.
    # ZeRO-0 autocasts from fp32 weights, so the dispatch sends the fp32 residual stream
    # (and its backward the fp32 gradient), the combine the experts' bf16 outputs (and their
    # bf16 gradient); under FSDP's bf16 parameters both are bf16. The counts' all-to-all
    # sends one int64 per expert. At ZeRO-2/3 the experts are FSDP units on the ranks
    # holding the same experts: dp4 ep2 reduce-scatters their fp32 gradients over two ranks
    # and gathers their bf16 weights, as the cost model counts them; over dp2 ep2 (pp2) each
    # expert has one holder and nothing is exchanged for it. Selective recomputation saves
    # matmul outputs, not the exchanges between them: it runs the forward's again
    path = tmp_path / "moe.json"
    zero = int(fixes[0].split("=")[1])
    made = CliRunner().invoke(cli, ["plan", "tiny-moe", "--gpu", "cpu", "--gpus", "4",
                                    "--global-batch", "8", "--seq-len", "64", "--fix", "ep=2",
                                    *[arg for fix in fixes for arg in ("--fix", fix)],
                                    "-o", str(path)])
    assert made.exit_code == 0, made.output
    plan = Plan.load(str(path))
    assert (plan.ep, plan.zero_stage, plan.tp, plan.cp, plan.precision) == (2, zero, 1, 1, "bf16")
    model = build_from_ref(plan.model, verify=False)
    layer = model.get_submodule(plan.ep_modules[0])
    experts, top_k, hidden = layer.num_experts, layer.top_k, layer.gate.in_features
    slots = plan.micro_batch * plan.seq_len * top_k
    stream = 4 if zero < 2 else 2
    out = CliRunner().invoke(cli, ["check", str(path), "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert "balanced" in report["routing"]
    for rank in report["ranks"]:
        layers = _moe_layers_on(plan, rank["stages"])
        assert layers >= 1, rank["stages"]
        forwards = 1 + (set(plan.recompute.values()) == {"selective"})
        alltoall = {"float32": 0, "bfloat16": 0}
        alltoall["float32" if stream == 4 else "bfloat16"] += (1 + forwards) * layers * slots * hidden * stream
        alltoall["bfloat16"] += (1 + forwards) * layers * slots * hidden * 2
        assert _bytes(rank, "all_to_all", "float32") == alltoall["float32"]
        assert _bytes(rank, "all_to_all", "bfloat16") == alltoall["bfloat16"]
        assert _bytes(rank, "all_to_all", "int64") == forwards * layers * experts * 8
        if zero >= 2 and plan.dp // plan.ep > 1:  # the experts are reduce-scattered too
            assert _bytes(rank, "reduce_scatter", "float32") > 4 * layers * sum(
                p.numel() for p in layer.experts.parameters()) // plan.ep
        # the cost model's volume: the same all-to-alls, the gradients' reductions, the
        # weights' gathers and what crosses pipeline stages
        _assert_model_bytes_are_the_dry_runs(rank)


def test_a_model_sizing_tensors_from_their_values_is_refused_in_one_paragraph(monkeypatch):
    # fake tensors have no values: an op whose output shape depends on them (nonzero in a
    # model's own routing, say) is one paragraph, not a worker's unpicklable torch exception
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    from autoplan.dryrun import job

    def refuse(*_args, **_kwargs):
        raise DynamicOutputShapeException(torch.ops.aten.nonzero.default)

    monkeypatch.setattr(job, "run_rank", refuse)
    with pytest.raises(job.RankFailed) as caught:
        job._run_in_worker(json.loads(TINY.read_text()), 0, [])
    text = " ".join(str(caught.value).split())
    assert "computes a tensor's shape from its values (aten.nonzero" in text
    assert "autoplan estimate" in text


def test_fits_is_judged_against_the_plans_own_budget(tmp_path):
    # the tiny job takes about 1 GiB of the cpu device's 8 GiB (the model's overhead): with the
    # plan keeping 7.5 GiB free its budget is 0.5 GiB, so it fits the device but not the budget
    report = check_plan(_plan_file(tmp_path, memory_headroom_gib=0.0), workers=1)
    assert report["fits"] and report["budget_gib"] == report["gpu_memory_gib"]
    over = CliRunner().invoke(cli, ["check", _plan_file(tmp_path, memory_headroom_gib=7.5)])
    text = " ".join(over.output.split())
    assert over.exit_code == 1, over.output
    assert "over the plan's budget of 0.5 GiB (8 GiB cpu less 7.5 GiB of headroom)" in text


def test_the_checking_process_never_imports_torch():
    # torch is imported once, by the dry run's host; the process running `autoplan check`
    # gets plain values back (autoplan.dryrun.host)
    import subprocess
    import sys

    code = ("import sys; from autoplan.commands.check import check_plan; "
            f"report = check_plan({str(TINY)!r}, workers=1); "
            "print(report['fits'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr[-2000:]
