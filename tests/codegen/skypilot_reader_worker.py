"""Reads sky.yaml files with SkyPilot itself, run with SkyPilot's own environment first on the
path (it pins click < 8.2, so it cannot share autoplan's): argv[1] is a JSON list of YAML texts,
the output one JSON list of what SkyPilot made of each (schema validation, then Task)."""

import json
import sys

import yaml
from sky import Task
from sky.utils import common_utils, schemas


def read(text: str) -> dict:
    config = yaml.safe_load(text)
    common_utils.validate_schema(config, schemas.get_task_schema(), "Invalid task YAML: ")
    task = Task.from_yaml_config(config)
    (resources,) = task.resources
    return {"num_nodes": task.num_nodes, "accelerators": resources.accelerators,
            "cpus": resources.cpus, "use_spot": resources.use_spot,
            "job_recovery": resources.job_recovery,
            "network_tier": getattr(resources.network_tier, "value", resources.network_tier),
            "storage_mounts": {path: storage.name for path, storage in (task.storage_mounts or {}).items()},
            "envs": dict(task.envs), "setup": task.setup, "run": task.run}


if __name__ == "__main__":
    print("RESULT " + json.dumps([read(text) for text in json.loads(sys.argv[1])], default=str), flush=True)
