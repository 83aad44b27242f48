"""Pipeline schedules: bubble time and micro-batches in flight per stage.

Sources:
- GPipe / 1F1B (PipeDream-Flush): bubble = (p - 1) stage-times per flush, so the idle
  fraction of the step is (p - 1) / (m + p - 1) (Narayanan et al. 2021, §2.2: bubble
  (p - 1)/m relative to the ideal time, i.e. (p - 1)/(m + p - 1) of the whole step).
- Interleaved 1F1B with v virtual stages per rank: bubble (p - 1)/v stage-times
  (Narayanan et al. 2021, §2.2.2); rank r holds (p - r - 1)*2 + (v - 1)*p + 1 chunk
  micro-batches in flight (Megatron-LM schedules.py warm-up count + 1), which on rank 0
  is the activation factor 1 + (p - 1)/(p*v) of Korthikanti et al. 2022, §4.2.3.
- Zero-bubble ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3): splitting
  backward into input- and weight-gradient passes leaves about one third of the 1F1B
  bubble at the same activation memory as 1F1B.
- In flight: GPipe keeps all m micro-batches; 1F1B keeps p - stage_index (Galvatron
  layer_cost; Megatron min(m, p) at stage 0).
"""

from __future__ import annotations

from autoplan.config import SCHEDULES

# Qi et al. 2023 §3: ZB-H1 bubble (p-1)(T_F + T_B - T_W) vs 1F1B (p-1)(T_F + T_B + T_W),
# with T_F = T_B = T_W that is 1/3 of the 1F1B bubble. A schedule fact, not a fitted constant.
ZERO_BUBBLE_REMAINING = 1.0 / 3.0


def bubble_stage_times(schedule: str, pp: int, vpp: int = 1) -> float:
    """Idle time of one step in units of one (physical) stage's time per micro-batch."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}")
    if pp <= 1:
        return 0.0
    if schedule == "interleaved-1f1b":
        return (pp - 1) / max(vpp, 1)
    if schedule == "zero-bubble":
        return (pp - 1) * ZERO_BUBBLE_REMAINING
    return float(pp - 1)  # gpipe and 1f1b


def bubble_fraction(schedule: str, pp: int, num_microbatches: int, vpp: int = 1) -> float:
    """Fraction of the step the pipeline is idle: (p-1)/(m+p-1) for 1F1B/GPipe."""
    bubble = bubble_stage_times(schedule, pp, vpp)
    return bubble / (num_microbatches + bubble) if bubble else 0.0


def microbatches_in_flight(schedule: str, pp: int, stage_index: int, num_microbatches: int,
                           vpp: int = 1) -> float:
    """Micro-batches whose activations a physical stage holds at its peak.

    For interleaved-1f1b the count is in units of whole-stage micro-batches (chunk
    micro-batches divided by v), so activation memory = count x the stage's per-micro-batch
    activations for all its chunks.
    """
    m = num_microbatches
    if pp <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved-1f1b" and vpp > 1:
        chunks = (pp - stage_index - 1) * 2 + (vpp - 1) * pp + 1
        return min(chunks, m * vpp) / vpp
    return float(min(m, pp - stage_index))
