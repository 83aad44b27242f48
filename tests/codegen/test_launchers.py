"""sky.yaml, pytorchjob.yaml and trainjob.yaml: the plan's nodes, processes and GPUs, read back by
YAML, SkyPilot's own loader (when installed) and the CRDs' own openAPI schemas under strict field
validation (tests/codegen/k8s_schema.py)."""

from __future__ import annotations

import subprocess

import pytest

from autoplan.codegen.job import ModelSource, render_job
from autoplan.codegen.launchers import k8s_name
from autoplan.config import ParallelConfig
from autoplan.plan import ModelRef, Plan
from codegen_helpers import generate
from k8s_schema import load_crd, problems

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install pyyaml)")
PYTORCHJOB = load_crd("kubeflow_pytorchjob_v1.9.0.schema.json")
TRAINJOB = load_crd("kubeflow_trainjob_v2.3.0.schema.json")
SKY_VARS = ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE")


def job_files(world_size: int, gpus_per_node: int, gpu: str = "h100-sxm-80gb") -> dict[str, str]:
    plan = Plan(model=ModelRef("catalog", "llama3.1-8b"), gpu=gpu, world_size=world_size,
                gpus_per_node=gpus_per_node, blocks=("layers.0", "layers.1"),
                parallel=ParallelConfig(global_batch=world_size, seq_len=128, dp=world_size,
                                        stage_layers=(2,), layer_recompute=("none", "none")))
    files = render_job(plan, ModelSource("catalog", catalog_name="llama3.1-8b"), command_line="autoplan generate",
                       launchers=("skypilot", "k8s", "trainjob"))
    return {name: content.decode() for name, content in files.items() if not name.endswith(".whl")}


def test_strict_schema_check_finds_unknown_and_mistyped_fields():
    job = yaml.safe_load(job_files(16, 8)["pytorchjob.yaml"])
    job["spec"]["nprocPerNode"] = 8
    job["spec"]["pytorchReplicaSpecs"]["Master"]["replica"] = 1
    found = problems(job, PYTORCHJOB)
    assert any(p.startswith("spec.nprocPerNode:") for p in found), found
    assert any("'replica' was unexpected" in p for p in found), found


@pytest.mark.parametrize("world_size,gpus_per_node,workers", [(64, 8, 7), (8, 8, 0), (4, 2, 1)])
def test_pytorchjob_has_the_plans_shape_and_fits_the_schema(world_size, gpus_per_node, workers):
    text = job_files(world_size, gpus_per_node)["pytorchjob.yaml"]
    job = yaml.safe_load(text)
    assert problems(job, PYTORCHJOB) == []
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    assert specs.get("Worker", {}).get("replicas", 0) == workers
    assert job["spec"]["nprocPerNode"] == str(gpus_per_node)
    for role, spec in specs.items():
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"  # the operator's default container name
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus_per_node
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [f"{job['metadata']['name']}-shared"]
        script = container["args"][0]
        assert all(f"${{PET_{v}}}" in script for v in ("NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR"))
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)


@pytest.mark.parametrize("world_size,gpus_per_node,gpu", [(64, 8, "h100-sxm-80gb"), (8, 8, "h100-sxm-80gb"),
                                                        (4, 2, "cpu")])
def test_trainjob_has_the_plans_shape_and_fits_the_schema(world_size, gpus_per_node, gpu):
    job = yaml.safe_load(job_files(world_size, gpus_per_node, gpu=gpu)["trainjob.yaml"])
    assert problems(job, TRAINJOB) == []
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (world_size // gpus_per_node, gpus_per_node)
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    limits = trainer.get("resourcesPerNode", {}).get("limits", {})
    assert limits.get("nvidia.com/gpu") == (None if gpu == "cpu" else gpus_per_node)
    (patch,) = job["spec"]["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"  # the torch-distributed runtime's job and container name
    pod = node["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["name"] == "node"
    assert [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v] \
        == [f"{job['metadata']['name']}-shared"]
    script = trainer["args"][0]
    assert all(f"${{PET_{v}}}" in script for v in ("NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR"))
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_sky_yaml_has_the_plans_shape():
    task = yaml.safe_load(job_files(32, 8)["sky.yaml"])
    assert task["resources"]["accelerators"] == "H100:8"
    assert task["num_nodes"] == 4
    assert "${AUTOPLAN_PIP_SPEC}" in task["setup"]
    assert task["envs"]["AUTOPLAN_PIP_SPEC"] == "./autoplan_runtime-0.1.0-py3-none-any.whl"
    assert all(f"${{{v}}}" in task["run"] for v in SKY_VARS)
    assert task["envs"]["NCCL_DEBUG"] == "WARN"
    for step in ("setup", "run"):
        subprocess.run(["bash", "-n"], input=task[step], text=True, check=True)


def test_cpu_jobs_ask_for_no_gpus():
    files = job_files(4, 4, gpu="cpu")
    task = yaml.safe_load(files["sky.yaml"])
    assert "accelerators" not in task["resources"] and task["resources"]["cpus"] == "4+"
    job = yaml.safe_load(files["pytorchjob.yaml"])
    assert "resources" not in job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]


def test_k8s_names_are_dns_labels():
    assert k8s_name("llama3.1-70b-64xh100-sxm-80gb") == "llama3-1-70b-64xh100-sxm-80gb"
    assert k8s_name("9_Odd Name" + "x" * 80) == "odd-name" + "x" * 37
    assert k8s_name("...") == "autoplan-job"


def test_generate_writes_launch_files_on_request(tmp_path):
    out = tmp_path / "job"
    code, stdout, stderr = generate("tiny-gpt", "--gpu", "cpu", "--gpus", "4", "--gpus-per-node", "2",
                                    "--global-batch", "8", "--seq-len", "64", "--launcher", "k8s", "-o", str(out))
    assert code == 0, stdout + stderr
    assert (out / "pytorchjob.yaml").is_file() and not (out / "sky.yaml").exists()
    assert {"torchtitan.toml", "megatron.args"} <= {p.name for p in out.iterdir()}
    assert "torchtitan.toml: not expressible there" in stderr  # tiny-gpt is no torchtitan model
    readme = (out / "README.md").read_text()
    assert "| pytorchjob.yaml | kubectl apply -f pytorchjob.yaml" in readme
    assert "sky.yaml (not written) | generate again with --launcher skypilot" in readme
    assert "--launcher k8s" in readme.split("## Regenerate")[1]


def test_generate_command_gives_back_the_same_plan(tiny_job, tmp_path):
    """The command `report` prints for a cluster writes that cluster's plan, with both launch files."""
    import shlex

    from autoplan.codegen.launchers import generate_command

    plan = Plan.load(tiny_job / "plan.json")
    words = shlex.split(generate_command(plan))
    assert words[:3] == ["autoplan", "generate", "tiny-gpt"]
    out = tmp_path / "again"
    code, stdout, stderr = generate(*words[2:], "-o", str(out))
    assert code == 0, stdout + stderr
    assert Plan.load(out / "plan.json") == plan
    assert (out / "sky.yaml").is_file() and (out / "pytorchjob.yaml").is_file()
