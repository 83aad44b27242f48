"""The runtime's loss-parity suite on CUDA + NCCL (run on a GPU machine; there is none in CI).

    python benchmarks/runtime_parity_cuda.py [--out benchmarks/runtime_parity_cuda.json]

Runs every plan of tests/runtime/test_parity.py whose world size fits the visible GPUs
(NCCL needs one GPU per rank) inside one torchrun launch per world size, and compares
with the single-process fp32 reference computed on CPU. TF32 is disabled in the ranks
(NVIDIA_TF32_OVERRIDE=0) so fp32 means fp32; tolerance as in the CPU suite (1e-5
relative, 3e-3 for bf16/fp16). Writes one JSON row per plan and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "runtime"
sys.path.insert(0, str(TESTS))


def main() -> None:
    import torch

    from runtime_models import reference_run  # noqa: E402  (tests/runtime on sys.path)
    from test_parity import CONFIGS, FP32_RTOL, LOW_PRECISION_RTOL

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "runtime_parity_cuda.json"))
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise SystemExit(f"needs >= 2 CUDA GPUs (NCCL: one per rank); found {gpus}")
    rows = []
    references = {}
    for world, configs in CONFIGS.items():
        if world > gpus:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            listing = [{"name": n, "kind": k, "plan": p} for n, (k, p) in configs.items()]
            Path(tmp, "c.json").write_text(json.dumps(listing))
            env = dict(os.environ, NVIDIA_TF32_OVERRIDE="0",
                       PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={world}", str(TESTS / "parity_worker.py"),
                   f"{tmp}/c.json", f"{tmp}/r.json", f"{tmp}/run"]
            code = subprocess.call(cmd, env=env, timeout=1800)
            results = json.loads(Path(tmp, "r.json").read_text()) if Path(tmp, "r.json").exists() else {}
        for name, (kind, plan) in configs.items():
            ref = references.setdefault(kind, reference_run(kind))
            got = results.get(name)
            rtol = FP32_RTOL if plan.get("precision", "fp32") == "fp32" else LOW_PRECISION_RTOL
            worst = (max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref[0]))
                     if got else None)
            rows.append({"world": world, "plan": name, "max_rel_loss_diff": worst,
                         "passed": worst is not None and worst <= rtol, "launch_exit": code,
                         "seconds": got["seconds"] if got else None})
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "gpus": gpus,
                                          "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    for row in rows:
        diff = f"{row['max_rel_loss_diff']:.2e}" if row["max_rel_loss_diff"] is not None else "failed"
        print(f"w{row['world']} {row['plan']:28s} {diff:>10s} {'ok' if row['passed'] else 'FAIL'}")


if __name__ == "__main__":
    main()
