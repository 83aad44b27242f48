"""Write a candidate's job with `generate`'s code and run it for a few steps on this cluster.

One node: the job's own launch.sh (torchrun --standalone). Several nodes: inside a SLURM
allocation of that many nodes, `srun` starts launch.sh once per node with the first node as
the rendezvous, as the job's slurm.sbatch does. MAX_RESTARTS=0: a candidate that fails is
recorded with its reason, not restarted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from autoplan.codegen.job import ModelSource, render_job, write_job
from autoplan.errors import UserError
from autoplan.files import write_file
from autoplan.plan import Plan
from autoplan.validate.measured import compare_run_dir


@dataclass
class Trial:
    """One candidate plan, its job directory and what its run measured."""

    plan: Plan
    job_dir: Path
    ok: bool = False
    reason: str = ""  # why the run failed (the job's own last words)
    measured: dict = field(default_factory=dict)  # compare_run_dir's "measured"
    seconds: float = 0.0  # wall time of the whole launch

    @property
    def run_dir(self) -> Path:
        return self.job_dir / "runs" / "tune"

    @property
    def predicted_step_s(self) -> float:
        return float(self.plan.estimate["step_time_s"])

    @property
    def measured_step_s(self) -> float | None:
        return self.measured.get("step_time_s")


def write_trial(plan: Plan, source: ModelSource, job_dir: Path, command_line: str) -> Trial:
    write_job(render_job(plan, source, command_line=command_line), job_dir, force=False)
    return Trial(plan, job_dir)


def launch_command(trial: Trial, steps: int, environ: dict[str, str]) -> list[str]:
    """The command that runs the trial's job on this machine or this SLURM allocation."""
    script = ["bash", str(trial.job_dir / "launch.sh"), "--steps", str(steps), "--run-dir", str(trial.run_dir)]
    nodes = trial.plan.world_size // trial.plan.gpus_per_node if trial.plan.world_size > trial.plan.gpus_per_node else 1
    if nodes == 1:
        return script
    allocated = int(environ.get("SLURM_JOB_NUM_NODES", environ.get("SLURM_NNODES", "0")) or 0)
    if allocated < nodes:
        raise UserError(f"the plans need {nodes} nodes; run `autoplan tune` inside a SLURM allocation of {nodes} "
                        f"nodes (salloc -N {nodes} ...), or tune for one node (--gpus {trial.plan.gpus_per_node})")
    head = environ.get("SLURM_LAUNCH_NODE_IPADDR") or environ.get("SLURMD_NODENAME", "localhost")
    exported = f"RDZV_ENDPOINT={head}:29500 RDZV_ID=tune-{trial.job_dir.name} NNODES={nodes}"
    return ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            "bash", "-c", f"{exported} exec \"$@\"", "launch", *script]


def run_trial(trial: Trial, steps: int, timeout_s: float) -> Trial:
    """Run the trial's job; record its measurement, or its failure with the job's reason."""
    import time

    # the job runs with the Python (and its torchrun) that runs autoplan
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, MAX_RESTARTS="0", PYTHON=sys.executable,
               PATH=os.pathsep.join([bin_dir, os.environ.get("PATH", "")]))
    command = launch_command(trial, steps, env)
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        trial.reason = f"no result within {timeout_s:g} s (--timeout)"
        return trial
    finally:
        trial.seconds = time.perf_counter() - start
    write_file(trial.job_dir / "tune.log", (out + err).encode())
    if proc.returncode != 0:
        trial.reason = _last_words(err or out) or f"exit status {proc.returncode}"
        return trial
    report = compare_run_dir(trial.run_dir, trial.job_dir / "plan.json")
    trial.ok, trial.measured = True, dict(report["measured"])
    if report["device"] == "cpu":  # a CPU rank's peak is its process's resident set, not device memory
        trial.measured.pop("peak_memory_gib", None)
    return trial


def _last_words(text: str) -> str:
    """The failure as the job reported it: its error line, else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "error" in line.lower() or "out of memory" in line.lower():
            return line[:300]
    return lines[-1][:300] if lines else ""
