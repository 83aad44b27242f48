"""The cloud launch files of a job: sky.yaml (SkyPilot), pytorchjob.yaml and trainjob.yaml
(Kubernetes, Kubeflow's v1 training-operator and its successor, Kubeflow Trainer v2).

All start the same train.py under torchrun as launch.sh does, with the plan's nodes and
processes per node. The nodes install autoplan's runtime from the wheel `generate` writes
beside them (runtime_wheel.py), by path and without dependencies, and torch pinned to the
release the plan was made with: nothing is installed by a bare package name.

- sky.yaml is a SkyPilot task (docs.skypilot.co, "YAML spec" and "Distributed jobs"):
  resources.accelerators NAME:COUNT, num_nodes, envs, setup, run; every node's run step gets
  SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS (one IP a line, the head first) and
  SKYPILOT_NUM_GPUS_PER_NODE. It is written for `sky jobs launch` (managed jobs): spot
  instances with job_recovery, network_tier best for several nodes (sky/utils/
  resources_utils.py NetworkTier), and a bucket mounted at /checkpoints (file_mounts with a
  storage name; ${CHECKPOINT_BUCKET} is filled from envs, sky/task.py _fill_in_env_vars) that
  every start resumes from.
- pytorchjob.yaml is a Kubeflow training-operator PyTorchJob (kubeflow.org/v1; schema of
  manifests/base/crds/kubeflow.org_pytorchjobs.yaml at v1.9.0): one Master and nodes-1 Worker
  replicas, nprocPerNode, nvidia.com/gpu limits, a shared volume (a PersistentVolumeClaim,
  the parameter CHECKPOINT_CLAIM) holding the job directory and its checkpoints. The operator
  sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT
  (pkg/controller.v1/pytorch/envvar.go).
- trainjob.yaml is a Kubeflow Trainer TrainJob (trainer.kubeflow.org/v1alpha1; schema of
  manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml at v2.3.0) on the torch-distributed
  ClusterTrainingRuntime: trainer.numNodes / numProcPerNode / resourcesPerNode, and the shared
  volume patched into the runtime's `node` job (runtimePatches). The torch plugin sets the same
  PET_* variables (pkg/constants/constants.go).
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any

from autoplan.codegen.runtime_wheel import wheel_name
from autoplan.plan import Plan

LAUNCHERS = ("torchrun", "slurm", "skypilot", "k8s", "trainjob")
LAUNCH_FILES = {"skypilot": "sky.yaml", "k8s": "pytorchjob.yaml", "trainjob": "trainjob.yaml"}
# autoplan GPU key -> SkyPilot accelerator name (`sky show-gpus -a`,
# docs.skypilot.co/en/stable/compute/gpus.html).
SKYPILOT_ACCELERATORS = {
    "a100-sxm4-40gb": "A100", "a100-sxm4-80gb": "A100-80GB", "h100-sxm-80gb": "H100", "h100-pcie-80gb": "H100",
    "h200-sxm-141gb": "H200", "b200": "B200", "gh200": "GH200", "l40s": "L40S", "v100-sxm2-32gb": "V100-32GB",
    "mi300x": "MI300X",
}
TORCH_FALLBACK_VERSION = "2.6.0"  # the oldest torch the runtime supports
K8S_IMAGE = "pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime"  # Docker Hub's official PyTorch image
K8S_MOUNT = "/shared"


def torch_pip_spec() -> str:
    """torch pinned to this installation's release (its local build tag, such as +cpu, dropped:
    the index's default build for the node's platform is the one to install)."""
    try:
        version = importlib.metadata.version("torch").split("+", 1)[0]
    except importlib.metadata.PackageNotFoundError:
        version = TORCH_FALLBACK_VERSION
    return f"torch=={version}"


def skypilot_accelerator(gpu: str) -> tuple[str | None, str | None]:
    """(accelerator name or None for CPU ranks, a note when the name is a guess)."""
    if gpu == "cpu":
        return None, None
    if gpu in SKYPILOT_ACCELERATORS:
        return SKYPILOT_ACCELERATORS[gpu], None
    guess = gpu.split("-")[0].upper()
    return guess, (f"{gpu} has no SkyPilot accelerator name autoplan knows; {guess} is written, check it "
                   "with `sky show-gpus -a`.")


def k8s_name(job_name: str) -> str:
    """A DNS-1035 label for the PyTorchJob: lower-case letters, digits and '-', short enough for
    the operator's '-worker-N' pod and service names to stay under 63 characters."""
    name = re.sub(r"[^a-z0-9-]+", "-", job_name.lower()).strip("-")
    name = re.sub(r"^[^a-z]+", "", name)[:45].rstrip("-")
    return name or "autoplan-job"


def launcher_context(plan: Plan, job_name: str, nnodes: int, nproc: int) -> dict[str, Any]:
    """The values sky.yaml.j2 and pytorchjob.yaml.j2 lay out."""
    accelerator, note = skypilot_accelerator(plan.gpu)
    name = k8s_name(job_name)
    return {"accelerator": accelerator, "launcher_notes": [note] if note else [], "k8s_name": name,
            "autoplan_pip": f"./{wheel_name()}", "torch_pip": torch_pip_spec(), "k8s_image": K8S_IMAGE,
            "claim": f"{name}-shared", "mount": K8S_MOUNT, "workers": nnodes - 1,
            "replica_specs": [("Master", 1)] + ([("Worker", nnodes - 1)] if nnodes > 1 else []),
            "gpus_per_pod": 0 if plan.gpu == "cpu" else nproc}


def generate_command(plan: Plan) -> str:
    """The `autoplan generate` command that writes this plan's job with its cloud launch files.

    Every choice the search made is fixed (--fix), so planning again gives this plan: the
    block partition and recomputation follow from the fixed degrees by the exact inner solver."""
    import shlex

    model = plan.model.name if plan.model.source == "catalog" else (plan.model.path or plan.model.name)
    if plan.model.source == "transformers":
        model = f"hf:{model}"
    fixed = {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "cp": plan.cp, "ep": plan.ep, "zero": plan.zero_stage,
             "micro_batch": plan.micro_batch, "schedule": plan.schedule, "vpp": plan.vpp, "offload": plan.offload}
    parts = ["autoplan", "generate", model, "--gpu", plan.gpu, "--gpus", str(plan.world_size),
             "--gpus-per-node", str(plan.gpus_per_node), "--global-batch", str(plan.global_batch),
             "--seq-len", str(plan.seq_len), "--precision", plan.precision]
    if plan.memory_headroom_gib:
        parts += ["--memory-headroom", f"{plan.memory_headroom_gib:g}"]
    if plan.inter_node_bandwidth_gb_per_s is not None:
        parts += ["--inter-node-bandwidth", f"{plan.inter_node_bandwidth_gb_per_s:g}"]
    for key, value in fixed.items():
        parts += ["--fix", f"{key}={value}"]
    parts += ["--launcher", "skypilot", "--launcher", "k8s", "--launcher", "trainjob"]
    return " ".join(shlex.quote(part) for part in parts)
