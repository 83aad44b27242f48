"""sky.yaml and pytorchjob.yaml: the plan's nodes, processes and GPUs, read back by YAML, SkyPilot's
own loader (when installed) and the PyTorchJob v1 schema's fields."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from autoplan.codegen.job import ModelSource, render_job
from autoplan.codegen.launchers import k8s_name
from autoplan.config import ParallelConfig
from autoplan.plan import ModelRef, Plan
from codegen_helpers import generate

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install pyyaml)")
SCHEMA = json.loads((Path(__file__).parent / "data" / "pytorchjob_v1_schema_fields.json").read_text())["schema"]
SKY_VARS = ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE")


def job_files(world_size: int, gpus_per_node: int, gpu: str = "h100-sxm-80gb") -> dict[str, str]:
    plan = Plan(model=ModelRef("catalog", "llama3.1-8b"), gpu=gpu, world_size=world_size,
                gpus_per_node=gpus_per_node, blocks=("layers.0", "layers.1"),
                parallel=ParallelConfig(global_batch=world_size, seq_len=128, dp=world_size,
                                        stage_layers=(2,), layer_recompute=("none", "none")))
    files = render_job(plan, ModelSource("catalog", catalog_name="llama3.1-8b"), command_line="autoplan generate",
                       launchers=("skypilot", "k8s"))
    return {name: content.decode() for name, content in files.items() if not name.endswith(".whl")}


def schema_problems(value, schema: dict, path: str = "") -> list[str]:
    """Where `value` leaves the schema skeleton: unknown keys, wrong types, missing required keys."""
    kind = schema.get("type")
    expected = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool,
                "int-or-string": (int, str)}.get(kind)
    if expected and not isinstance(value, expected) or (kind == "integer" and isinstance(value, bool)):
        return [f"{path}: {type(value).__name__}, schema says {kind}"]
    problems = []
    if isinstance(value, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        problems += [f"{path}.{key}: required" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if props is not None and key in props:
                problems += schema_problems(item, props[key], f"{path}.{key}")
            elif extra is not None:
                problems += schema_problems(item, extra, f"{path}.{key}")
            elif props is not None:
                problems.append(f"{path}.{key}: not a field of the schema")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            problems += schema_problems(item, schema["items"], f"{path}[{i}]")
    return problems


def test_schema_check_finds_unknown_and_mistyped_fields():
    job = yaml.safe_load(job_files(16, 8)["pytorchjob.yaml"])
    job["spec"]["nprocPerNode"] = 8  # the v1 schema has it as a string
    job["spec"]["pytorchReplicaSpecs"]["Master"]["replica"] = 1
    problems = schema_problems(job, SCHEMA)
    assert any("nprocPerNode: int" in p for p in problems)
    assert any("Master.replica: not a field" in p for p in problems)


@pytest.mark.parametrize("world_size,gpus_per_node,workers", [(64, 8, 7), (8, 8, 0), (4, 2, 1)])
def test_pytorchjob_has_the_plans_shape_and_fits_the_schema(world_size, gpus_per_node, workers):
    text = job_files(world_size, gpus_per_node)["pytorchjob.yaml"]
    job = yaml.safe_load(text)
    assert schema_problems(job, SCHEMA) == []
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


def test_sky_yaml_loads_in_skypilot():
    sky = pytest.importorskip("sky", reason="SkyPilot is not installed (not in the test extra: it pins click<8.2)")
    for world_size, per_node in ((64, 8), (8, 8)):
        text = job_files(world_size, per_node)["sky.yaml"]
        task = sky.Task.from_yaml_config(yaml.safe_load(text))
        assert task.num_nodes == world_size // per_node
        (resources,) = task.resources
        assert resources.accelerators == {"H100": per_node}


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
