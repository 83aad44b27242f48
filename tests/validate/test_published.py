"""`autoplan validate` on the repo's copy of the published runs: the accuracy targets, overall
and per runtime family."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.validate.families import runtime_traits
from autoplan.validate.published import (candidate_configs, float8_scaling, load_runs, uses_flash_attention,
                                         validate_file)

RUNS = Path(__file__).resolve().parents[2] / "cost_models" / "validation" / "published_runs.json"


@pytest.fixture(scope="module")
def report():
    return validate_file(RUNS)


def test_no_run_skipped_or_predicted_infeasible(report):
    # every published run ran, so none may be predicted not to fit (torchtitan's 8B rows did
    # before its runtime's op-level SAC and fp32 FSDP2 shards were modelled)
    s = report["summary"]
    assert s["count"] == len(load_runs(RUNS)) == 118
    assert s["skipped"] == 0, [r["id"] for r in report["runs"] if r.get("skipped")]
    assert s["predicted_infeasible"] == 0, [r["id"] for r in report["runs"] if not r["predicted"]["feasible"]]


def test_throughput_error_targets(report):
    # the "Numbers it must reach": median |error| <= 10%
    assert report["summary"]["median_abs_rel_error"] <= 0.10


def test_nine_in_ten_runs_within_25pct(report):
    # 109 of 118 pass; torchtitan's three 8B rows (+34..+55%) ran on H100 HBM2e capped at 500 W,
    # which no GPU data file describes
    assert report["summary"]["within_25pct_fraction"] >= 0.90


def test_throughput_error_does_not_regress(report):
    # Where the model stands (118 runs: median 7.4%, 109 within 25%) less a small margin (half
    # a point of median, one run); a change that makes it worse fails.
    s = report["summary"]
    assert s["median_abs_rel_error"] <= 0.080
    assert s["within_25pct_fraction"] >= 108 / 118


# Per runtime family where it stands, less the same margins: megatron 6.4% (76 of 81 within
# 25%), llm-foundry 10.9% (27 of 27); the torchtitan bar is the aim for autoplan's own family.
FAMILY_BARS = {"megatron": (0.069, 75 / 81), "llm-foundry": (0.114, 26 / 27), "torchtitan": (0.15, 5 / 8)}


@pytest.mark.parametrize("family", sorted(FAMILY_BARS))
def test_family_error_bars(report, family):
    median_bar, within_bar = FAMILY_BARS[family]
    f = report["by_family"][family]
    assert f["median_abs_rel_error"] <= median_bar
    assert f["within_25pct_fraction"] >= within_bar
    assert f["predicted_infeasible"] == 0


def test_torchtitan_memory_is_the_reserved_figure(report):
    # torchtitan publishes peak reserved memory; the prediction adds the allocator's reserve to
    # the tensors. Median |error| 18% over its 5 rows with memory (op-level SAC under-counts the
    # fp32 loss and recompute transients; 36% and 3 rows not fitting before); bar 20%.
    f = report["by_family"]["torchtitan"]
    assert f["memory_compared"] == 5
    assert f["memory_median_abs_rel_error"] <= 0.20


def test_band_of_autoplans_runtime_is_its_family_from_this_validation(report):
    # the stored error band (plan / report) is the torchtitan family's, as measured here
    from autoplan.report.accuracy import published_runs_error

    errors = [abs(r["error"]["tokens_per_s_per_gpu"]) for r in report["runs"] if r["family"] == "torchtitan"]
    band = published_runs_error()
    assert band.family == "torchtitan" and band.runs == len(errors) == 8
    assert band.median == pytest.approx(report["by_family"]["torchtitan"]["median_abs_rel_error"], rel=1e-9)
    assert band.median != pytest.approx(report["summary"]["median_abs_rel_error"], rel=1e-3)


def test_unstated_settings_are_reported(report):
    runs = {r["id"]: r for r in report["runs"]}
    # Narayanan Table 1 leaves the micro-batch unstated: the chosen one is reported
    assert "micro_batch" in runs["narayanan21_t1_gpt1.7b_32gpu"]["assumed"]
    # MPT rows state every setting; the attention kernel is their runtime's default
    assert set(runs["mpt_7b_h100_80gb_8gpu_seq2048_gbs48"]["assumed"]) == {"attention"}


def test_unstated_recompute_may_be_partial(report):
    # H100 Qwen3-235B-A22B FP8 (EP 32, TP 2) fits only with recomputation; the best under the
    # model recomputes some blocks of every stage (Megatron --recompute-num-layers), which is
    # faster than recomputing all of them and slower than none (which does not fit)
    run = next(r for r in report["runs"] if r["id"] == "mbridge_2511_dgx_h100_qwen3_235b_a22b_256gpu_fp8cs")
    assert run["assumed"]["recompute"].startswith("full on ")
    from autoplan.cost import Runtime, estimate
    from autoplan.validate.published import _cluster_for_run, _graph_for_run

    raw = next(r for r in load_runs(RUNS) if r["id"] == run["id"])
    graph, cluster = _graph_for_run(raw), _cluster_for_run(raw)
    runtime = Runtime(tp_comm_overlap=run["assumed"].get("tp_comm_overlap", True),
                      float8_scaling=float8_scaling(raw), **runtime_traits("megatron"))
    uniform = {c.recompute: estimate(graph, c, cluster, runtime=runtime)
               for c, a in candidate_configs(raw) if a["sequence_parallel"] and a["zero_stage"] == 1}
    assert not uniform["none"].feasible and uniform["full"].feasible
    partial = run["predicted"]
    assert partial["feasible"]
    assert uniform["full"].tokens_per_s_per_gpu < partial["tokens_per_s_per_gpu"] < uniform["none"].tokens_per_s_per_gpu


def test_torchtitan_rows_say_how_their_blocks_ran():
    from autoplan.errors import UserError
    from autoplan.validate.published import stack_settings

    runs = {r["id"]: r for r in load_runs(RUNS)}
    eager = stack_settings(runs["torchtitan_t1_llama31_8b_8gpu_fsdp"])
    assert eager == {"compile": False, "rmsnorm_kernel": "decomposed"}
    assert stack_settings(runs["torchtitan_t1_llama31_8b_8gpu_fsdp_torchcompile"])["compile"]
    assert stack_settings(runs["torchtitan_t5_llama31_405b_512gpu_1f1b"])["compile"]
    # the A100 rows ran eagerly with torchtitan's Triton fused_rmsnorm
    assert stack_settings(runs["torchtitan_a100_llama213b_64gpu_lbs2_no"]) == {
        "compile": False, "rmsnorm_kernel": "fused"}
    # every row that says how it ran gives the source; the others ran eagerly with fused norms
    assert all(r["runtime"]["source"] for r in runs.values() if "runtime" in r)
    assert stack_settings(runs["narayanan21_t1_gpt1.7b_32gpu"]) == {
        "compile": False, "rmsnorm_kernel": "fused"}
    with pytest.raises(UserError, match="rmsnorm"):
        stack_settings({"runtime": {"torch_compile": True, "rmsnorm": "triton"}})


def test_compiled_rows_are_faster_than_eager_by_the_fused_traffic(report):
    # torchtitan Table 1 (8B, 8 H100, same config): torch.compile 6667 tok/s against 5762 eager,
    # 1.157x. The model's 1.202x comes from the memory traffic alone: 1.125x from the eager
    # RMSNorms' fp32 ops, 1.068x from fusing the rest. Bar: within 5% of the measured ratio,
    # which a model that costs both alike (1.000x) misses by 14%
    runs = {r["id"]: r for r in report["runs"]}
    eager, compiled = (runs[f"torchtitan_t1_llama31_8b_8gpu_fsdp{s}"] for s in ("", "_torchcompile"))
    measured = compiled["measured"]["tokens_per_s_per_gpu"] / eager["measured"]["tokens_per_s_per_gpu"]
    predicted = compiled["predicted"]["tokens_per_s_per_gpu"] / eager["predicted"]["tokens_per_s_per_gpu"]
    assert predicted == pytest.approx(measured, rel=0.05)


def test_candidates_enumerate_only_unstated_settings():
    run = next(r for r in load_runs(RUNS) if r["id"] == "narayanan21_t1_gpt1.7b_32gpu")
    configs = candidate_configs(run)
    assert {c.recompute for c, _ in configs} == {"full"}  # stated
    assert {c.zero_stage for c, _ in configs} == {0, 1}  # unstated
    assert not uses_flash_attention(run)  # arXiv:2104 predates FlashAttention (arXiv:2205.14135)


def test_cli_json(tmp_path):
    runs = load_runs(RUNS)[:2]
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": runs}))
    out = subprocess.run([sys.executable, "-m", "autoplan", "validate", str(path), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data["summary"]) >= {"median_abs_rel_error", "max_abs_rel_error", "within_25pct_fraction",
                                    "count", "skipped", "predicted_infeasible"}
    first = data["runs"][0]
    assert set(first) >= {"id", "family", "predicted", "measured", "error", "assumed"}
    assert data["by_family"][first["family"]]["count"] >= 1
    assert set(first["predicted"]) >= {"tokens_per_s_per_gpu", "mfu", "memory_gib_per_gpu", "feasible"}


@pytest.mark.parametrize("columns", [80, 200])
def test_table_keeps_every_number_on_any_terminal(tmp_path, columns):
    # a pipe is 80 columns wide: the numbers must survive it whole (the run id folds and the
    # assumed settings are left out, with a note); a wide terminal shows everything
    runs = load_runs(RUNS)[:1]
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": runs}))
    out = subprocess.run([sys.executable, "-m", "autoplan", "validate", str(path)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "COLUMNS": str(columns)})
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if "%" in line and "│" in line)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    result = validate_file(path)["runs"][0]
    assert cells[1] == f"{result['predicted']['tokens_per_s_per_gpu']:,.0f}"
    assert cells[3] == f"{result['error']['tokens_per_s_per_gpu']:+.0%}"
    assert ("micro_batch=" in out.stdout) == (columns == 200)
    assert ("wider terminal" in out.stdout) == (columns == 80)


def test_bad_runs_file_exits_2(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{\"no_runs\": 1}")
    out = subprocess.run([sys.executable, "-m", "autoplan", "validate", str(path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "runs" in out.stderr
