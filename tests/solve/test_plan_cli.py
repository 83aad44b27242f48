"""`autoplan plan` through the CLI: JSON contract, plan file round trip, bad input, nothing fits."""

from __future__ import annotations

import json

import pytest

from autoplan.plan import expand_runs

ARGS = ["tiny-gpt", "--gpu", "cpu", "--gpus", "4", "--global-batch", "8", "--seq-len", "64"]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    from click.testing import CliRunner

    from autoplan.cli import cli

    out = tmp_path_factory.mktemp("plan") / "plan.json"
    result = CliRunner().invoke(cli, ["plan", *ARGS, "--json", "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), out


def test_json_contract(planned):
    data, _ = planned
    assert set(data) >= {"plan", "estimate", "alternatives", "solver", "explanation"}
    assert data["solver"]["status"] == "OPTIMAL"
    assert data["solver"]["configurations_considered"] > 1
    plan = data["plan"]
    assert plan["dp"] * plan["tp"] * plan["pp"] * plan["cp"] == 4
    assert sum(len(s) for s in plan["stages"]) == 2  # tiny-gpt has 2 blocks
    assert set(expand_runs(plan["recompute"])) == {p for s in plan["stages"] for p in s}
    assert plan["model"]["fingerprint"]
    assert data["estimate"]["feasible"] is True
    # the chosen plan is at least as fast as every runner-up
    assert all(a["step_time_s"] >= data["estimate"]["step_time_s"] for a in data["alternatives"])


def test_plan_file_is_the_plan_and_reestimates_exactly(planned, run_cli):
    data, path = planned
    assert json.loads(path.read_text()) == data["plan"]
    code, out, err = run_cli("estimate", "--plan", str(path), "--json")
    assert code == 0, err
    again = json.loads(out)
    assert again["step_time_s"] == pytest.approx(data["estimate"]["step_time_s"], rel=1e-9)
    assert again["memory_gib_per_gpu"] == pytest.approx(data["estimate"]["memory_gib_per_gpu"], rel=1e-9)


def test_fix_is_respected(run_cli):
    code, out, _ = run_cli("plan", *ARGS, "--fix", "pp=2", "--fix", "tp=2", "--json")
    assert code == 0
    plan = json.loads(out)["plan"]
    assert (plan["pp"], plan["tp"], plan["dp"]) == (2, 2, 1)
    assert plan["tp_styles"] and len(plan["stages"]) == 2


@pytest.mark.parametrize("recipe,all_gather", [("tensorwise", True), ("rowwise", False)])
def test_an_fp8_zero3_plan_gathers_its_weights_in_float8_with_the_tensorwise_recipe(run_cli, recipe, all_gather):
    code, out, err = run_cli("plan", "tiny-gpt", "--gpu", "h100-sxm-80gb", "--gpus", "4", "--global-batch", "8",
                             "--seq-len", "64", "--precision", "fp8", "--fix", "zero=3", "--fix", "dp=4",
                             "--fix", f"float8_recipe={recipe}", "--json")
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert (plan["float8_recipe"], plan["float8_all_gather"]) == (recipe, all_gather)


@pytest.mark.parametrize("extra", [
    ["--fix", "tp=8"],  # more than the heads of tiny-gpt and than the GPUs
    ["--fix", "tp=2", "--fix", "tp=4"],  # contradictory
    ["--fix", "banana=3"],
    ["--fix", "zero=7"],
    ["--fix", "float8_recipe=blockwise"],
])
def test_bad_fix_exit_2(run_cli, extra):
    code, _, err = run_cli("plan", *ARGS, *extra)
    assert code == 2 and err.startswith("error:"), err


def test_bad_sizes_exit_2(run_cli):
    for args in (["tiny-gpt", "--gpu", "cpu", "--gpus", "0", "--global-batch", "8"],
                 ["tiny-gpt", "--gpu", "cpu", "--gpus", "4", "--global-batch", "-1"],
                 ["tiny-gpt", "--gpu", "nosuchgpu", "--gpus", "4", "--global-batch", "8"],
                 ["tiny-gpt", "--gpu", "cpu", "--gpus", "4", "--global-batch", "6", "--fix", "dp=4"]):
        code, _, err = run_cli("plan", *args)
        assert code == 2, (args, err)
        assert "Traceback" not in err


def test_nothing_fits_exits_1_with_numbers(run_cli):
    code, out, err = run_cli("plan", "llama3.1-8b", "--gpu", "a100-sxm4-40gb", "--gpus", "1",
                             "--global-batch", "8", "--seq-len", "4096")
    assert code == 1
    assert "No plan fits" in err and "GiB" in err and "the first on which a plan fits" in err


def test_nothing_fits_names_host_memory_and_a_count_that_does_fit(run_cli):
    # 405B on 8 H100: without offload each GPU would need far more than 80 GiB; with offload the
    # GPUs fit but the node's host memory (2 TiB) does not. Doubling, 16 GPUs still fit nothing
    # (the offloaded states need 3 TiB per node), 32 do; the count named is one `plan` plans.
    args = ["llama3.1-405b", "--gpu", "h100", "--gpus", "8", "--global-batch", "64", "--seq-len", "8192"]
    code, _, err = run_cli("plan", *args)
    text = " ".join(err.split())
    assert code == 1, err
    assert "GPU memory per rank is the limit without CPU offload" in text
    assert "Host memory per node is the limit with CPU offload" in text and "2048 GiB" in text
    assert "--fix offload=both" not in text  # offload is what host memory rules out
    assert "the first on which a plan fits is 32 x h100-sxm-80gb (on 16 no plan fits)" in text
    code, out, err = run_cli("plan", *args[:3], "--gpus", "32", *args[5:], "--json")
    assert code == 0, err
    assert json.loads(out)["plan"]["dp"] * json.loads(out)["plan"]["tp"] * json.loads(out)["plan"]["pp"] \
        * json.loads(out)["plan"]["cp"] == 32


def test_nothing_fits_because_of_the_fixes_names_them(run_cli):
    # selective recompute at micro-batch 2 and seq 8192 on dp8 needs more than 72 GiB while
    # the unfixed search fits: the report blames the fixes, not the GPU
    code, _, err = run_cli("plan", "llama3.1-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "32",
                           "--seq-len", "8192", "--fix", "recompute=selective", "--fix", "pp=1",
                           "--fix", "tp=1", "--fix", "cp=1", "--fix", "micro-batch=2")
    text = " ".join(err.split())
    assert code == 1, err
    assert "No configuration with --fix recompute=selective" in text and "--fix micro-batch=2" in text
    assert "drop or change a --fix" in text


def test_output_not_overwritten_without_force(run_cli, tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("mine")
    code, _, err = run_cli("plan", *ARGS, "-o", str(target))
    assert code == 2 and "--force" in err and target.read_text() == "mine"


def test_plan_with_recomputation_reestimates_exactly(run_cli, tmp_path):
    # Memory pressure makes the solver recompute some blocks (tp fixed at 2: with tp 4 the
    # loss and activations fit without); the plan file must carry them per block so
    # `estimate --plan` reproduces the plan's numbers exactly.
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli("plan", "llama3.1-8b", "--gpu", "a100-sxm4-40gb", "--gpus", "8",
                                "--global-batch", "64", "--seq-len", "8192", "--fix", "offload=none",
                                "--fix", "zero=3", "--fix", "tp=2", "--json", "-o", str(out))
    assert code == 0, err
    data = json.loads(stdout)
    modes = list(data["plan"]["recompute"].values())
    assert any(m != "none" for m in modes)
    assert data["estimate"]["memory_gib_per_gpu"] <= 40.0
    code, again, err = run_cli("estimate", "--plan", str(out), "--json")
    assert code == 0, err
    assert json.loads(again)["step_time_s"] == pytest.approx(data["estimate"]["step_time_s"], rel=1e-9)


def test_no_neighbour_of_the_plan_is_faster():
    # Regression: the family bound once assumed the least ZeRO stage has the least per-block
    # time; under the cost model ZeRO-2 accumulates gradients more cheaply, so the bound
    # pruned faster plans. Every neighbour the explanation evaluates (tp/pp/cp x2 or /2,
    # other ZeRO stages) is in the search space, so none may be faster than the fastest plan
    # (band 0: no preference for a simpler, slower one).
    from autoplan.hardware import resolve_cluster
    from autoplan.solve.api import plan_job
    from autoplan.trace.load import load_graph
    from autoplan.solve.explain import explain

    graph, ref, seq = load_graph("llama3.1-70b", None)
    job = plan_job(graph, ref, resolve_cluster("h100", None, 64, None, memory_headroom_gib=0),
                   global_batch=256, seq_len=seq, equivalence_band=0.0)
    assert job.result.status == "OPTIMAL" and job.result.best is job.result.fastest
    faster = [line for line in explain(job) if " step time" in line and "instead: -" in line]
    assert not faster, faster


def test_memory_headroom_is_left_free_and_kept_by_the_plan_file(run_cli, tmp_path):
    # With --memory-headroom 0 the 8B plan on 8 A100-40GB fills the GPU; asking for 6 GiB free
    # gives a plan that leaves at least that (and is no faster), and its plan file carries the
    # headroom, so `estimate --plan` judges it against the same usable memory.
    base = ["plan", "llama3.1-8b", "--gpu", "a100-sxm4-40gb", "--gpus", "8", "--global-batch", "64",
            "--seq-len", "8192", "--json"]
    code, out, err = run_cli(*base, "--memory-headroom", "0")
    assert code == 0, err
    full_job = json.loads(out)
    full = full_job["estimate"]
    # the plan fills the GPU (so the headroom binds), and the explanation points at the option
    # (with no headroom the estimate may fill 40 GiB less its measured error, 5%:
    # cost_models/memory_model_error.toml)
    assert full["memory_gib_per_gpu"] > 0.95 * 40 / 1.05
    assert any("--memory-headroom GIB" in line for line in full_job["explanation"])
    path = tmp_path / "plan.json"
    code, out, err = run_cli(*base, "--memory-headroom", "6", "-o", str(path))
    assert code == 0, err
    data = json.loads(out)
    assert data["estimate"]["memory_gib_per_gpu"] <= 40 - 6
    assert data["estimate"]["step_time_s"] >= full["step_time_s"]
    assert data["plan"]["memory_headroom_gib"] == 6
    assert any("6 GiB of --memory-headroom" in line for line in data["explanation"])
    code, again, err = run_cli("estimate", "--plan", str(path), "--json")
    assert code == 0, err
    assert json.loads(again)["step_time_s"] == pytest.approx(data["estimate"]["step_time_s"], rel=1e-9)


def test_default_memory_headroom_is_a_tenth_of_the_gpu_and_recorded(run_cli, tmp_path):
    # The estimate does not count the caching allocator's fragmentation: by default a plan
    # keeps 10% of each GPU free (cost_models/memory_headroom.toml), 4 GiB of an A100-40GB,
    # and the plan file records it for `estimate --plan`.
    path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", "llama3.1-8b", "--gpu", "a100-sxm4-40gb", "--gpus", "8",
                             "--global-batch", "64", "--seq-len", "8192", "--json", "-o", str(path))
    assert code == 0, err
    data = json.loads(out)
    assert data["plan"]["memory_headroom_gib"] == pytest.approx(4.0)
    assert data["estimate"]["memory_gib_per_gpu"] <= 36.0
    assert json.loads(path.read_text())["memory_headroom_gib"] == pytest.approx(4.0)


@pytest.mark.parametrize("headroom", ["-1", "8"])  # negative; all of the cpu device's 8 GiB
def test_memory_headroom_out_of_range_exits_2(run_cli, headroom):
    code, _, err = run_cli("plan", *ARGS, "--memory-headroom", headroom)
    assert code == 2 and "--memory-headroom" in err and "Traceback" not in err


def test_inter_node_bandwidth_from_the_command_line(run_cli, tmp_path):
    # a cluster's inter-node bandwidth defaults to the GPU's typical system and is
    # overridable on the command line. A quarter of the NIC rate slows the cross-node gradient
    # sync of a dp-across-nodes layout, and a plan made with it keeps it for estimate --plan.
    # --memory-headroom 0 and full recomputation: only this layout's bandwidth is under test
    config = ["llama3.1-8b", "--gpu", "h100", "--gpus", "16", "--global-batch", "32", "--seq-len", "4096",
              "--dp", "16", "--zero", "2", "--recompute", "full", "--memory-headroom", "0", "--json"]
    code, out, err = run_cli("estimate", *config)
    assert code == 0, err
    default = json.loads(out)
    code, out, err = run_cli("estimate", *config, "--inter-node-bandwidth", "12.5")
    assert code == 0, err
    slow = json.loads(out)
    assert slow["comm_breakdown_s"]["dp"] > 2 * default["comm_breakdown_s"]["dp"]
    assert slow["step_time_s"] > default["step_time_s"]
    path = tmp_path / "plan.json"
    code, out, err = run_cli("plan", "llama3.1-8b", "--gpu", "h100", "--gpus", "16", "--global-batch", "32",
                             "--seq-len", "4096", "--inter-node-bandwidth", "12.5", "--json", "-o", str(path))
    assert code == 0, err
    data = json.loads(out)
    assert data["plan"]["inter_node_bandwidth_gb_per_s"] == 12.5
    code, again, err = run_cli("estimate", "--plan", str(path), "--json")
    assert code == 0, err
    assert json.loads(again)["step_time_s"] == pytest.approx(data["estimate"]["step_time_s"], rel=1e-9)
    code, _, err = run_cli("estimate", *config, "--inter-node-bandwidth", "0")
    assert code == 2 and "--inter-node-bandwidth" in err and "Traceback" not in err


@pytest.mark.parametrize("fix", [["--fix", "offload=optimizer"], ["--fix", "offload=params"],
                                 ["--fix", "offload=both", "--fix", "zero=1"]])
def test_offloads_the_runtime_cannot_apply_exit_2(run_cli, fix):
    # the runtime offloads with FSDP2 (parameters, gradients and optimizer together, ZeRO-2/3):
    # a plan it would silently run without offload must not be made
    code, _, err = run_cli("plan", *ARGS, *fix)
    assert code == 2 and "offload" in err and "Traceback" not in err


def test_clusters_the_explanation_resizes_keep_the_nic_and_headroom():
    # "one more node" and "the smallest count that fits" are the same kind of cluster: an
    # --inter-node-bandwidth or --memory-headroom given for the plan must carry over
    from autoplan.hardware import resolve_cluster, with_num_gpus

    cluster = resolve_cluster("h100", None, 16, None, memory_headroom_gib=4, inter_node_bandwidth_gb_per_s=12.5)
    bigger = with_num_gpus(cluster, 32)
    assert bigger.num_gpus == 32 and bigger.inter_node_bandwidth_bytes_per_s == 12.5e9
    assert bigger.memory_headroom_bytes == cluster.memory_headroom_bytes == 4 * 2**30
    default = with_num_gpus(resolve_cluster("h100", None, 16, None), 32)
    assert default.inter_node_override_gb_per_s is None


def test_more_memory_never_gives_a_slower_optimal_plan(run_cli):
    # Regression: the partition solver ignored the step-end DP sync and optimizer, which depend
    # on how many blocks each stage holds; with the whole GPU it kept a partition 17 ms slower
    # than the one it found with 8 GiB kept free. Every plan that fits in 72 GiB fits in 80.
    steps = {}
    for headroom in ("0", "8"):
        code, out, err = run_cli("plan", "llama3.1-70b", "--gpu", "h100", "--gpus", "64",
                                 "--global-batch", "256", "--memory-headroom", headroom, "--json")
        assert code == 0, err
        data = json.loads(out)
        assert data["solver"]["status"] == "OPTIMAL"
        steps[headroom] = data["estimate"]["step_time_s"]
    assert steps["0"] <= steps["8"]


def test_objective_cost_is_read_and_on_one_cluster_picks_the_fastest_plan(run_cli):
    plans = {}
    for objective in ("time", "cost"):
        code, out, err = run_cli("plan", *ARGS, "--objective", objective, "--json")
        assert code == 0, err
        plans[objective] = json.loads(out)
    assert plans["cost"]["plan"]["stages"] == plans["time"]["plan"]["stages"]
    assert plans["cost"]["estimate"]["step_time_s"] == plans["time"]["estimate"]["step_time_s"]
    assert any(line.startswith("objective cost:") for line in plans["cost"]["explanation"])
    assert not any(line.startswith("objective cost:") for line in plans["time"]["explanation"])


def test_an_unknown_objective_is_a_user_error():
    from autoplan.errors import UserError
    from autoplan.hardware import load_gpu, make_cluster
    from autoplan.solve.search import search
    from autoplan.solve.space import Request
    from autoplan.trace.tracer import graph_for_config

    graph = graph_for_config(dict(model_type="llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, intermediate_size=64, vocab_size=256), 1, 32)
    request = Request(num_gpus=1, gpus_per_node=1, global_batch=1, seq_len=32, objective="money")
    with pytest.raises(UserError, match="objective 'money'"):
        search(graph, make_cluster(load_gpu("cpu"), 1, 1), request)
