"""The pipeline schedule of a plan as a timeline: when each stage runs each forward/backward.

Per-rank operation orders follow the published schedules; start times come from simulating
the data dependencies (a forward needs the previous stage's forward of the same micro-batch,
a backward the next stage's backward) with each rank running its ops in order.
- gpipe: all forwards, then all backwards (Huang et al. 2019, GPipe).
- 1f1b: p - s - 1 warm-up forwards on rank s, then one forward one backward, then the
  remaining backwards (PipeDream-Flush; Narayanan et al. 2021, §2.2.1).
- interleaved-1f1b: v model chunks per rank, micro-batches in groups of p, warm-up
  (p - s - 1) * 2 + (v - 1) * p chunk forwards (Narayanan et al. 2021 §2.2.2; Megatron-LM
  schedules.py forward_backward_pipelining_with_interleaving).
- zero-bubble is drawn as 1f1b (its split backward is not modelled here).
A backward takes twice a forward (Narayanan et al. 2021 §3.1: backward ~ 2x forward FLOPs),
so a stage's time per micro-batch splits 1/3 forward, 2/3 backward.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """One forward ('F') or backward ('B') of one micro-batch through one model chunk of a rank."""

    rank: int
    kind: str  # "F" | "B"
    microbatch: int
    chunk: int
    start_s: float
    end_s: float


def rank_order(schedule: str, pp: int, rank: int, m: int, vpp: int = 1) -> list[tuple[str, int, int]]:
    """(kind, micro-batch, chunk) in the order rank `rank` runs them."""
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule == "interleaved-1f1b" and vpp > 1:
        return _interleaved_order(pp, rank, m, vpp)
    warm = min(pp - rank - 1, m)
    order = [("F", i, 0) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i, 0), ("B", i, 0)]
    return order + [("B", i, 0) for i in range(m - warm, m)]


def _chunk_sequence(pp: int, m: int, vpp: int, backward: bool) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of the k-th chunk op: groups of pp micro-batches per chunk."""
    seq = []
    for start in range(0, m, pp):
        group = range(start, min(start + pp, m))
        for chunk in (reversed(range(vpp)) if backward else range(vpp)):
            seq += [(i, chunk) for i in group]
    return seq


def _interleaved_order(pp: int, rank: int, m: int, vpp: int) -> list[tuple[str, int, int]]:
    fwd, bwd = _chunk_sequence(pp, m, vpp, False), _chunk_sequence(pp, m, vpp, True)
    total = m * vpp
    warm = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    order = [("F", *fwd[k]) for k in range(warm)]
    for k in range(total - warm):
        order += [("F", *fwd[warm + k]), ("B", *bwd[k])]
    return order + [("B", *bwd[k]) for k in range(total - warm, total)]


def _dependency(kind: str, i: int, chunk: int, rank: int, pp: int, vpp: int) -> tuple | None:
    """The op (kind, micro-batch, chunk, rank) that must finish first; None if none."""
    if kind == "F":
        if rank > 0:
            return ("F", i, chunk, rank - 1)
        return ("F", i, chunk - 1, pp - 1) if chunk > 0 else None
    if rank < pp - 1:
        return ("B", i, chunk, rank + 1)
    return ("B", i, chunk + 1, 0) if chunk < vpp - 1 else ("F", i, vpp - 1, pp - 1)


def simulate(schedule: str, pp: int, m: int, stage_time_s: list[float], vpp: int = 1) -> list[Op]:
    """Start and end of every op; `stage_time_s[r]` is rank r's forward+backward per micro-batch."""
    v = vpp if schedule == "interleaved-1f1b" else 1
    orders = [rank_order(schedule, pp, r, m, v) for r in range(pp)]
    ends: dict[tuple, float] = {}
    free = [0.0] * pp
    nxt = [0] * pp
    ops: list[Op] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while nxt[r] < len(orders[r]):
                kind, i, chunk = orders[r][nxt[r]]
                dep = _dependency(kind, i, chunk, r, pp, v)
                if dep is not None and dep not in ends:
                    break
                duration = stage_time_s[r] / v * (1 / 3 if kind == "F" else 2 / 3)
                start = max(free[r], ends[dep] if dep else 0.0)
                ends[(kind, i, chunk, r)] = free[r] = start + duration
                ops.append(Op(r, kind, i, chunk, start, start + duration))
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule} deadlocks for pp={pp}, m={m}, vpp={vpp}")
    return ops


def shown_microbatches(schedule: str, pp: int, m: int) -> int:
    """Micro-batches to draw: all up to 4 x pp (whole groups of pp for interleaving)."""
    cap = max(4 * pp, 8)
    return m if m <= cap else cap


def makespan_s(ops: list[Op]) -> float:
    """End of the last op."""
    return max(op.end_s for op in ops) if ops else 0.0
