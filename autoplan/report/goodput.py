"""Goodput: the wall time of a whole training run, with checkpoints, interruptions and restarts.

A synchronous job stops on any GPU's failure, so its mean time between interruptions is the
per-GPU mean divided by the GPU count. It writes a checkpoint every `interval_s` seconds of
training; after an interruption it restarts (`restart_s`) and redoes the work since the last
complete checkpoint. First-order model (Young 1974; Daly 2006, §2):

- interval: Young's rule tau = sqrt(2 * C * M), C = checkpoint write time, M = job MTBF
  (J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9),
  1974; J. T. Daly, "A higher order estimate of the optimum checkpoint interval for
  restart dumps", FGCS 22(3), 2006, whose first-order term is the same).
- work lost per interruption: half a segment, (tau + C) / 2, failures being uniform in time.
- wall time W solves W = T (1 + C / tau) + (W / M) (R + (tau + C) / 2): training T, one
  checkpoint per tau of training, W / M interruptions each costing a restart R and the lost work.

Defaults (each overridable on the command line):
- failure rate: Llama 3 405B pre-training saw 419 unexpected interruptions in 54 days on
  16,384 H100 GPUs (Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, §3.3.4).
- checkpoint write bandwidth: the Llama 3 cluster's storage (Tectonic) sustains 2 TB/s for
  16,384 GPUs (same paper, §3.3.1 "Storage"), i.e. 122 MB/s per GPU writing its shard in
  parallel (DCP). A conservative figure for a dedicated cluster with local NVMe.
- restart time: 10 minutes, an assumption (no published figure found): rescheduling,
  process group start-up and checkpoint load. Override with --restart-minutes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LLAMA3_UNEXPECTED_INTERRUPTIONS = 419  # Dubey et al. 2024 §3.3.4, Table 5
LLAMA3_PERIOD_HOURS = 54 * 24  # "a 54-day snapshot period of pre-training" (§3.3.4)
LLAMA3_GPUS = 16_384  # §3.3.4: 16K H100 GPUs
DEFAULT_FAILURES_PER_GPU_HOUR = LLAMA3_UNEXPECTED_INTERRUPTIONS / (LLAMA3_PERIOD_HOURS * LLAMA3_GPUS)
LLAMA3_STORAGE_SUSTAINED_BYTES_PER_S = 2e12  # §3.3.1: Tectonic, 2 TB/s sustained
DEFAULT_CHECKPOINT_WRITE_BYTES_PER_S_PER_GPU = LLAMA3_STORAGE_SUSTAINED_BYTES_PER_S / LLAMA3_GPUS
DEFAULT_RESTART_S = 600.0  # assumption, see the module docstring

SOURCES = {
    "failures_per_gpu_hour": "Llama 3 (Dubey et al. 2024, arXiv:2407.21783 §3.3.4): 419 unexpected "
                             "interruptions in 54 days on 16,384 GPUs",
    "checkpoint_write_bytes_per_s_per_gpu": "Llama 3 (Dubey et al. 2024 §3.3.1): Tectonic storage, 2 TB/s "
                                            "sustained over 16,384 GPUs",
    "restart_s": "assumption (10 min: reschedule, start-up, checkpoint load); no published figure",
    "interval": "Young 1974 / Daly 2006: sqrt(2 x checkpoint write time x job MTBF)",
}


@dataclass(frozen=True)
class GoodputAssumptions:
    """The reliability parameters of a run; defaults from the sources in SOURCES."""

    failures_per_gpu_hour: float = DEFAULT_FAILURES_PER_GPU_HOUR
    checkpoint_write_bytes_per_s_per_gpu: float = DEFAULT_CHECKPOINT_WRITE_BYTES_PER_S_PER_GPU
    restart_s: float = DEFAULT_RESTART_S


@dataclass(frozen=True)
class Goodput:
    """Whole-run time of one plan under `GoodputAssumptions` (all seconds unless named)."""

    training_s: float  # failure-free time of all steps
    checkpoint_bytes: float
    checkpoint_write_s: float
    job_mtbf_s: float
    interval_s: float  # Young/Daly interval, rounded to whole steps
    interval_steps: int
    wall_s: float  # expected wall time (inf when interruptions outpace progress)
    expected_interruptions: float
    checkpoints: float
    lost_s_per_interruption: float

    @property
    def fraction(self) -> float:
        """Goodput: training time over wall time."""
        return self.training_s / self.wall_s if math.isfinite(self.wall_s) else 0.0


def job_mtbf_s(num_gpus: int, failures_per_gpu_hour: float) -> float:
    """Mean time between interruptions of a job on `num_gpus` GPUs: 3600 / (n * rate)."""
    return 3600.0 / (num_gpus * failures_per_gpu_hour)


def checkpoint_bytes(parameters: float, weight_bytes_per_param: float, optimizer_bytes_per_param: float) -> float:
    """Size of one checkpoint: the weights plus the optimizer states (ZeRO §3 byte counts)."""
    return parameters * (weight_bytes_per_param + optimizer_bytes_per_param)


def checkpoint_write_s(size_bytes: float, num_gpus: int, write_bytes_per_s_per_gpu: float) -> float:
    """Every rank writes its shard in parallel (DCP): size / (n * per-GPU bandwidth)."""
    return size_bytes / (num_gpus * write_bytes_per_s_per_gpu)


def young_daly_interval_s(checkpoint_write_s: float, mtbf_s: float) -> float:
    """Optimal compute time between checkpoints: sqrt(2 C M) (Young 1974, Daly 2006 first order)."""
    return math.sqrt(2.0 * checkpoint_write_s * mtbf_s)


def lost_work_s(interval_s: float, checkpoint_write_s: float) -> float:
    """Expected work redone after an interruption: half a segment, (tau + C) / 2 (Young 1974)."""
    return (interval_s + checkpoint_write_s) / 2.0


def expected_wall_time_s(training_s: float, checkpoint_write_s: float, interval_s: float,
                         mtbf_s: float, restart_s: float) -> float:
    """W = T (1 + C/tau) / (1 - (R + (tau + C)/2) / M); inf if interruptions outpace progress."""
    overhead = (restart_s + lost_work_s(interval_s, checkpoint_write_s)) / mtbf_s
    if overhead >= 1.0:
        return math.inf
    return training_s * (1.0 + checkpoint_write_s / interval_s) / (1.0 - overhead)


def goodput(training_s: float, step_time_s: float, num_gpus: int, size_bytes: float,
            assumptions: GoodputAssumptions = GoodputAssumptions()) -> Goodput:
    """Whole-run wall time of `training_s` seconds of steps, checkpointing at the Young/Daly interval."""
    mtbf = job_mtbf_s(num_gpus, assumptions.failures_per_gpu_hour)
    write = checkpoint_write_s(size_bytes, num_gpus, assumptions.checkpoint_write_bytes_per_s_per_gpu)
    ideal = young_daly_interval_s(write, mtbf)
    steps = max(1, round(ideal / step_time_s))  # a checkpoint can only be taken between steps
    interval = steps * step_time_s
    wall = expected_wall_time_s(training_s, write, interval, mtbf, assumptions.restart_s)
    return Goodput(training_s=training_s, checkpoint_bytes=size_bytes, checkpoint_write_s=write,
                   job_mtbf_s=mtbf, interval_s=interval, interval_steps=steps, wall_s=wall,
                   expected_interruptions=wall / mtbf if math.isfinite(wall) else math.inf,
                   checkpoints=training_s / interval, lost_s_per_interruption=lost_work_s(interval, write))
