"""`autoplan calibrate`: measure this machine and write a hardware file the cost model reads.

Runs on every rank of a `torchrun` job (or alone for the single-device numbers). Imports
only torch, the standard library and `autoplan.hardware` / `autoplan.errors` (both stdlib)
so it runs on training nodes. What it measures, and how (the conventions of nccl-tests
PERFORMANCE.md, hardware.md B.1/D.1):

* matmul throughput per dtype, `torch.mm` at a standard set of square shapes or the GEMM
  shapes of a model, 2*m*n*k FLOP per call;
* memory bandwidth: `Tensor.copy_` of a large buffer, bytes read + written per second;
* all-reduce, all-gather, reduce-scatter, all-to-all (`all_to_all_single`) and
  send/recv over a range of message sizes, on the process groups the runtime would use:
  one `new_group` per node (ranks of one node, by LOCAL_RANK / LOCAL_WORLD_SIZE) and one per
  local rank across nodes (same LOCAL_RANK on every node, so every NIC is busy at once).
  Bus bandwidth busbw = F * S / t with F = 2(n-1)/n (all-reduce), (n-1)/n (all-gather,
  reduce-scatter, all-to-all on the full array S), 1 (send/recv).

Every timing is the slowest rank's (a synchronous step waits for it): each rank times a loop,
the world all-reduces the per-iteration time with MAX. Each collective's points are fitted
with t = alpha + F*S/beta (`fit_alpha_beta`), and the fits become the cost model's numbers
(`calibrated_gpu`, `calibrated_cluster`): GPU peaks and link rates stay datasheet values and
the measured efficiency fractions replace the shipped ones; on the CPU test device, which has
no datasheet, the measured best values become the peaks and rates themselves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from autoplan.errors import UserError
from autoplan.hardware import GB, GIB, TFLOPS, US, GPU, Cluster, load_gpu, make_cluster, write_hardware_file

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Progress = Callable[[int, int, str], None]  # (steps done, steps in all, what was just measured)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor F: busbw = F * S / t (hardware.md B.1 / D.1)."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def ring_steps(op: str, n: int) -> int:
    """Latency steps of one collective in the cost model's NCCL ring model (hardware.md D.2)."""
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}.get(op, 1)


# ---------------------------------------------------------------- settings and launch

@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits, from the torchrun environment (world of 1 without torchrun)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    under_torchrun: bool

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size


def launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Read RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (set by torchrun)."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return LaunchEnv(0, 1, 0, 1, False)
    world = int(env["WORLD_SIZE"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    if world % local_world:
        raise UserError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local_world}; launch "
                        "the same number of ranks on every node (torchrun --nproc-per-node N on each).")
    return LaunchEnv(int(env["RANK"]), world, int(env.get("LOCAL_RANK", env["RANK"])), local_world, True)


def check_launch(env: LaunchEnv, device_only: bool) -> list[str]:
    """UserError when collectives are wanted but there is no second rank; else what will be skipped."""
    could = "matmul throughput per dtype and memory bandwidth"
    if not device_only and env.world_size < 2:
        how = ("it was not launched by torchrun" if not env.under_torchrun
               else "torchrun started only one rank")
        raise UserError(
            f"autoplan calibrate needs at least 2 ranks to measure all-reduce, all-gather, reduce-scatter, "
            f"all-to-all and send/recv, but {how}. With one rank it can measure only {could}. Launch it "
            f"as `torchrun --nproc-per-node N -m autoplan calibrate ...` (N = GPUs per node; add --nnodes and "
            f"--rdzv-endpoint for several nodes), or pass --device-only to write a file with only the "
            f"single-device numbers (collective numbers are then kept from the base GPU file).")
    skipped = []
    if env.world_size < 2:
        skipped.append("collectives (one rank): kept from the base GPU file")
    else:
        if env.local_world_size < 2:
            skipped.append("intra-node collectives (one rank per node): kept from the base GPU file")
        if env.num_nodes < 2:
            skipped.append("inter-node collectives (one node): kept from the base GPU file")
    return skipped


@dataclass(frozen=True)
class Settings:
    """What to measure and how long to spend on each number."""

    device: str  # "cpu" | "cuda"
    quick: bool = False
    gemm_shapes: tuple[tuple[int, int, int], ...] | None = None  # (m, n, k); None = standard squares
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    device_only: bool = False
    max_gemm_s: float = 2.0  # shapes slower than this at the base peak are skipped (listed)

    @property
    def target_s(self) -> float:
        """Wall time to spend per timed loop: enough iterations to average out timer noise."""
        if self.quick:
            return 0.005
        return 0.05 if self.device == "cuda" else 0.1

    @property
    def trials(self) -> int:
        return 1 if self.quick else 3

    def square_sizes(self) -> tuple[int, ...]:
        if self.device == "cuda":
            return (1024, 2048, 4096) if self.quick else (1024, 2048, 4096, 8192, 16384)
        return (32, 64, 128) if self.quick else (128, 256, 512, 1024)

    def message_sizes(self) -> tuple[int, ...]:
        """Message sizes S in bytes (x8 apart, as a nccl-tests sweep with -f 8)."""
        if self.device == "cuda":
            top = 64 * 2**20 if self.quick else 2**30
        else:
            top = 2**20 if self.quick else 32 * 2**20
        sizes, size = [], 1024
        while size <= top:
            sizes.append(size)
            size *= 8
        return tuple(sizes)

    def copy_bytes(self) -> int:
        if self.device == "cuda":
            return 2**28 if self.quick else 2**30
        return 2**22 if self.quick else 2**26


# ---------------------------------------------------------------- results

@dataclass
class MatmulPoint:
    dtype: str
    m: int
    n: int
    k: int
    seconds: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds


@dataclass
class CommPoint:
    scope: str  # "intra" | "inter"
    op: str
    group_size: int
    bytes: int  # S of nccl-tests: the full array (all-reduce buffer, gathered output, a2a buffer, message)
    seconds: float

    @property
    def busbw_bytes_per_s(self) -> float:
        return bus_factor(self.op, self.group_size) * self.bytes / self.seconds


@dataclass(frozen=True)
class Fit:
    """t = alpha_s + F * S / busbw_bytes_per_s over the measured sizes (relative least squares)."""

    alpha_s: float
    busbw_bytes_per_s: float
    group_size: int
    points: int


@dataclass
class CalibrationResult:
    """Everything one calibration measured, identical on every rank."""

    env: LaunchEnv
    device: str
    device_name: str
    measured_at: str
    matmul: list[MatmulPoint] = field(default_factory=list)
    copy_bytes_per_s: float | None = None
    copy_bytes: int = 0
    device_memory_bytes: float | None = None
    comm: list[CommPoint] = field(default_factory=list)
    not_measured: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def fits(self) -> dict[tuple[str, str], Fit]:
        """alpha-beta fit per (scope, collective)."""
        out = {}
        for scope in ("intra", "inter"):
            for op in COLLECTIVES:
                pts = [p for p in self.comm if p.scope == scope and p.op == op]
                if pts:
                    out[(scope, op)] = fit_alpha_beta(pts)
        return out

    def method(self) -> str:
        e = self.env
        return (f"autoplan calibrate on {e.world_size} rank(s) ({e.num_nodes} node(s) x {e.local_world_size}), "
                f"{self.device_name}, torch {torch.__version__}; slowest rank's time per op")

    def to_dict(self) -> dict[str, Any]:
        return {
            "measured_at": self.measured_at, "method": self.method(), "device": self.device,
            "device_name": self.device_name, "seconds": self.seconds,
            "env": dataclasses.asdict(self.env),
            "matmul": [dict(dataclasses.asdict(p), tflops=p.flops_per_s / TFLOPS) for p in self.matmul],
            "copy_bytes": self.copy_bytes, "copy_gb_per_s": None if self.copy_bytes_per_s is None
            else self.copy_bytes_per_s / GB,
            "device_memory_gib": None if self.device_memory_bytes is None else self.device_memory_bytes / GIB,
            "comm": [dict(dataclasses.asdict(p), busbw_gb_per_s=p.busbw_bytes_per_s / GB) for p in self.comm],
            "fits": [{"scope": s, "op": o, "alpha_us": f.alpha_s / US, "busbw_gb_per_s": f.busbw_bytes_per_s / GB,
                      "group_size": f.group_size, "points": f.points} for (s, o), f in self.fits().items()],
            "not_measured": list(self.not_measured),
        }


def fit_alpha_beta(points: Sequence[CommPoint]) -> Fit:
    """Fit t = alpha + x / beta, x = F * S, minimising the squared *relative* error.

    Relative weights (1/t^2) let the small messages set alpha and the large ones set beta,
    as nccl-tests readers do by eye. A fit with a negative slope or intercept falls back to
    alpha = the smallest time and beta = the best measured busbw.
    """
    n = points[0].group_size
    xs = [bus_factor(p.op, n) * p.bytes for p in points]
    ts = [p.seconds for p in points]
    ws = [1.0 / t**2 for t in ts]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    mt = sum(w * t for w, t in zip(ws, ts)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mx) * (t - mt) for w, x, t in zip(ws, xs, ts)) / sxx if sxx > 0 else 0.0
    alpha = mt - slope * mx
    best_bw = max(x / t for x, t in zip(xs, ts))
    if slope <= 0 or alpha < 0:
        return Fit(min(ts), best_bw, n, len(points))
    return Fit(alpha, 1.0 / slope, n, len(points))


# ---------------------------------------------------------------- timing helpers

class _Timer:
    """Times a callable on every rank and agrees on the slowest rank's time."""

    def __init__(self, device: str, distributed: bool, settings: Settings) -> None:
        self.device = device
        self.distributed = distributed
        self.settings = settings

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def slowest(self, seconds: float) -> float:
        if not self.distributed:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def barrier(self) -> None:
        if self.distributed:
            if self.device == "cuda":
                dist.barrier(device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier()

    def _loop(self, fn: Callable[[], None], iters: int) -> float:
        self.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        self.sync()
        return (time.perf_counter() - start) / iters

    def time(self, fn: Callable[[], None]) -> float:
        """Per-call seconds: warm up, size the loop to `target_s` (same on all ranks), best of trials."""
        for _ in range(2):  # first calls pay for lazy init (oneDNN/cuBLAS handles, gloo pairs)
            fn()
        self.sync()
        first = self.slowest(self._loop(fn, 1))
        iters = max(1, min(1000, int(self.settings.target_s / max(first, 1e-9))))
        return min(self.slowest(self._loop(fn, iters)) for _ in range(self.settings.trials))


# ---------------------------------------------------------------- device numbers

def measure_matmul(timer: _Timer, settings: Settings, shapes: Sequence[tuple[int, int, int]],
                   dtypes: Sequence[str], tick: Callable[[str], None]) -> list[MatmulPoint]:
    """torch.mm throughput per dtype and shape (TF32 only for 'tf32' on CUDA)."""
    points = []
    for name in dtypes:
        if settings.device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        for m, n, k in shapes:
            a = torch.randn(m, k, device=settings.device).to(DTYPES[name])
            b = torch.randn(k, n, device=settings.device).to(DTYPES[name])
            seconds = timer.time(lambda: torch.mm(a, b))
            points.append(MatmulPoint(name, m, n, k, seconds))
            tick(f"matmul {name} {m}x{n}x{k}: {points[-1].flops_per_s / TFLOPS:.3f} TFLOP/s")
            del a, b
    if settings.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    return points


def measure_copy(timer: _Timer, settings: Settings, tick: Callable[[str], None]) -> tuple[float, int]:
    """Bytes read + written per second by `copy_` of a large fp32 buffer (STREAM copy)."""
    nbytes = settings.copy_bytes()
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=settings.device).uniform_()
    dst = torch.empty_like(src)
    seconds = timer.time(lambda: dst.copy_(src))
    bw = 2.0 * nbytes / seconds
    tick(f"memory copy {nbytes / 2**20:.0f} MiB: {bw / GB:.2f} GB/s")
    return bw, nbytes


# ---------------------------------------------------------------- collectives

@dataclass(frozen=True)
class _Group:
    scope: str
    group: Any  # the ProcessGroup this rank belongs to
    ranks: tuple[int, ...]  # global ranks, group order


def build_groups(env: LaunchEnv) -> dict[str, _Group]:
    """One new_group per node and one per local rank across nodes; every rank creates all of them."""
    groups: dict[str, _Group] = {}
    L, N = env.local_world_size, env.num_nodes
    if L >= 2:
        for node in range(N):
            ranks = tuple(range(node * L, (node + 1) * L))
            pg = dist.new_group(list(ranks))
            if env.rank in ranks:
                groups["intra"] = _Group("intra", pg, ranks)
    if N >= 2:
        for local in range(L):
            ranks = tuple(local + node * L for node in range(N))
            pg = dist.new_group(list(ranks))
            if env.rank in ranks:
                groups["inter"] = _Group("inter", pg, ranks)
    return groups


def _collective_fn(op: str, g: _Group, rank: int, nbytes: int, device: str) -> Callable[[], None]:
    """One call of `op` on a full array of about `nbytes` (rounded to whole fp32 elements per member)."""
    n = len(g.ranks)
    per = max(1, nbytes // 4 // n)  # elements per member's share
    full = torch.ones(per * n, dtype=torch.float32, device=device)
    share = torch.ones(per, dtype=torch.float32, device=device)
    pg = g.group
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=pg)
    if op == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(full, share, group=pg)
    if op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(share, full, group=pg)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=pg)
    # send/recv ping-pong between members 2i and 2i+1; an odd last member only waits
    me = g.ranks.index(rank)
    msg = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    if me % 2 == 0 and me + 1 < n:
        peer = g.ranks[me + 1]
        return lambda: (dist.send(msg, peer, group=pg), dist.recv(msg, peer, group=pg))
    if me % 2 == 1:
        peer = g.ranks[me - 1]
        return lambda: (dist.recv(msg, peer, group=pg), dist.send(msg, peer, group=pg))
    return lambda: None


def _exact_bytes(op: str, n: int, nbytes: int) -> int:
    if op == "send_recv":
        return max(1, nbytes // 4) * 4
    return max(1, nbytes // 4 // n) * n * 4


def measure_collectives(timer: _Timer, env: LaunchEnv, groups: dict[str, _Group], settings: Settings,
                        tick: Callable[[str], None]) -> list[CommPoint]:
    """Every collective at every size on the intra-node then the inter-node groups."""
    points = []
    for scope in ("intra", "inter"):
        if scope not in groups:
            continue
        g = groups[scope]
        n = len(g.ranks)
        for op in COLLECTIVES:
            for nbytes in settings.message_sizes():
                fn = _collective_fn(op, g, env.rank, nbytes, settings.device)
                seconds = timer.time(fn)
                if op == "send_recv":
                    seconds /= 2  # a round trip carries the message twice
                p = CommPoint(scope, op, n, _exact_bytes(op, n, nbytes), seconds)
                points.append(p)
                tick(f"{op} {scope}-node x{n} {nbytes / 1024:,.0f} KiB: {p.seconds * 1e6:,.0f} us, "
                     f"busbw {p.busbw_bytes_per_s / GB:.2f} GB/s")
    return points


# ---------------------------------------------------------------- the run

def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} thread(s) per rank)"


def run(settings: Settings, env: LaunchEnv, base: GPU, progress: Progress | None = None) -> CalibrationResult:
    """Measure on every rank (same calls everywhere); the result is the same on all ranks.

    Initialises the default process group from the torchrun environment when there are
    several ranks (nccl on CUDA, gloo on CPU) and destroys it at the end.
    """
    started = time.perf_counter()
    skipped = check_launch(env, settings.device_only)
    distributed = env.world_size > 1
    if settings.device == "cuda":
        torch.cuda.set_device(env.local_rank)
    if distributed and not dist.is_initialized():
        dist.init_process_group("nccl" if settings.device == "cuda" else "gloo")
    try:
        timer = _Timer(settings.device, distributed, settings)
        shapes, too_slow = _gemm_shapes(settings, base)
        dtypes = [d for d in settings.dtypes if d in base.peak_flops_by_precision]
        if settings.device != "cuda":
            dtypes = [d for d in dtypes if d != "tf32"]  # TF32 is a tensor-core mode
        groups = build_groups(env) if distributed and not settings.device_only else {}
        if settings.device_only and distributed:
            skipped.append("collectives (--device-only): kept from the base GPU file")
        sizes = settings.message_sizes()
        total = len(shapes) * len(dtypes) + 1 + len(groups) * len(COLLECTIVES) * len(sizes)
        done = [0]

        def tick(text: str) -> None:
            done[0] += 1
            if progress is not None and env.rank == 0:
                progress(done[0], total, text)

        result = CalibrationResult(env=env, device=settings.device, device_name=_device_name(settings.device),
                                   measured_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        result.not_measured += skipped + too_slow
        result.not_measured += [f"{p}: no measurement (autoplan calibrate times torch.mm in fp32, tf32, bf16, "
                                f"fp16 only); the base GPU file's curve is kept"
                                for p in base.peak_flops_by_precision if p not in DTYPES]
        result.matmul = measure_matmul(timer, settings, shapes, dtypes, tick)
        result.copy_bytes_per_s, result.copy_bytes = measure_copy(timer, settings, tick)
        if settings.device == "cuda":
            result.device_memory_bytes = float(torch.cuda.get_device_properties(env.local_rank).total_memory)
        result.comm = measure_collectives(timer, env, groups, settings, tick) if groups else []
        timer.barrier()
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()
    result.seconds = time.perf_counter() - started
    return result


def _gemm_shapes(settings: Settings, base: GPU) -> tuple[list[tuple[int, int, int]], list[str]]:
    """Shapes to time, without those that would take longer than max_gemm_s at the base's best peak."""
    shapes = list(settings.gemm_shapes or [(s, s, s) for s in settings.square_sizes()])
    best = max(base.peak_flops_by_precision.values())
    keep = [s for s in shapes if 2.0 * s[0] * s[1] * s[2] / best <= settings.max_gemm_s]
    skipped = [f"matmul {m}x{n}x{k}: would take over {settings.max_gemm_s:g} s per call at {best / TFLOPS:g} "
               f"TFLOP/s" for m, n, k in shapes if (m, n, k) not in keep]
    if not keep:
        raise UserError("every GEMM shape to calibrate is too large to time here ("
                        + "; ".join(skipped[:3]) + "); use a model with a shorter --seq-len, or the standard shapes.")
    return keep, skipped


# ---------------------------------------------------------------- turning results into a hardware file

def base_gpu_for(device: str, name: str | None = None) -> GPU:
    """The catalogue GPU whose datasheet numbers the measurement refines.

    --gpu NAME wins; on CUDA the device name is matched against the catalogue keys and aliases
    (e.g. 'NVIDIA H200' -> h200-sxm-141gb); CPU ranks use the 'cpu' test device.
    """
    if name:
        return load_gpu(name)
    if device != "cuda":
        return load_gpu("cpu")
    from autoplan.hardware import list_gpus

    words = torch.cuda.get_device_name().lower().replace("nvidia", "").replace("amd", "").split()
    label = "-".join(words)
    gpus = list_gpus()
    candidates = [g for g in gpus if g.key == label or label in g.aliases] or [
        g for g in gpus if any(alias in label.split("-") for alias in (g.key, *g.aliases))]
    if len(candidates) == 1:
        return candidates[0]
    raise UserError(f"cannot tell which catalogue GPU '{torch.cuda.get_device_name()}' is "
                    f"({'several match: ' + ', '.join(g.key for g in candidates) if candidates else 'none matches'}); "
                    "name it with --gpu (see `autoplan gpus`).")


def _source(result: CalibrationResult, what: str) -> str:
    return f"measured {result.measured_at}: {what} ({result.method()})"


def _kept(base: GPU, key: str, why: str) -> str:
    return f"not measured ({why}); kept from {base.key}: {base.sources.get(key, 'base GPU file')}"


def _matmul_updates(result: CalibrationResult, base: GPU, standard: bool) -> dict[str, Any]:
    """Peaks and efficiency curves from the matmul points (file units, dotted keys)."""
    by_dtype: dict[str, dict[float, list[tuple[float, int]]]] = {}
    for p in result.matmul:
        by_dtype.setdefault(p.dtype, {}).setdefault(p.flops, []).append((p.flops_per_s, min(p.m, p.n, p.k)))
    if not by_dtype:
        return {}
    axis = sorted({f for points in by_dtype.values() for f in points})
    cpu = result.device == "cpu"
    updates: dict[str, Any] = {"efficiency.matmul_gflop": [f / 1e9 for f in axis]}
    sources = {"efficiency.matmul_gflop": _source(result, "GEMM sizes timed, 2*m*n*k FLOP")}
    peaks = dict(base.peak_flops_by_precision)
    for dtype, points in by_dtype.items():
        rates = {f: statistics.mean(r for r, _ in pts) for f, pts in points.items()}
        if cpu:  # no datasheet: the best measured rate is the peak
            peaks[dtype] = max(rates.values())
            updates[f"peak_tflops.{dtype}"] = peaks[dtype] / TFLOPS
            sources[f"peak_tflops.{dtype}"] = _source(result, f"best torch.mm {dtype} rate over the sizes timed")
    curves: dict[str, tuple[str, list[float]]] = {}
    sixteen = "bf16" if "bf16" in by_dtype else ("fp16" if "fp16" in by_dtype else None)
    for cls, dtype in (("16bit", sixteen), ("fp32", "fp32" if "fp32" in by_dtype else None)):
        if dtype is None or any(f not in by_dtype[dtype] for f in axis):
            continue
        rates = {f: statistics.mean(r for r, _ in pts) for f, pts in by_dtype[dtype].items()}
        curves[cls] = (dtype, [rates[f] / peaks[dtype] for f in axis])
    if "16bit" not in curves:
        raise UserError("calibrate measured no 16-bit matmul on every shape, which the hardware file needs")
    for cls, (dtype, curve) in curves.items():
        updates[f"efficiency.matmul_fraction_{cls}"] = curve
        sources[f"efficiency.matmul_fraction_{cls}"] = _source(
            result, f"torch.mm {dtype} rate / peak_tflops.{dtype} at each matmul_gflop")
    for cls in base.efficiency.matmul_fraction:
        if cls not in curves:  # e.g. fp8: resample the shipped curve onto the new size axis
            precision = {"fp8": "fp8", "fp32": "fp32"}.get(cls, "bf16")
            updates[f"efficiency.matmul_fraction_{cls}"] = [
                base.matmul_efficiency(f, 10**9, precision) for f in axis]
            sources[f"efficiency.matmul_fraction_{cls}"] = _kept(
                base, f"efficiency.matmul_fraction_{cls}",
                f"{cls} not timed; shipped curve resampled at the measured sizes")
    if not standard:  # model shapes: the FLOP curve already holds the shape effects
        updates["efficiency.matmul_min_dim"] = [1]
        sources["efficiency.matmul_min_dim"] = _source(
            result, "GEMMs timed at the model's own shapes, so no separate shape factor")
        for cls in base.efficiency.matmul_min_dim_factor:
            updates[f"efficiency.matmul_min_dim_factor_{cls}"] = [1.0]
            sources[f"efficiency.matmul_min_dim_factor_{cls}"] = sources["efficiency.matmul_min_dim"]
    return {"values": updates, "sources": sources}


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def _latency_split(alphas: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(base, per-step) from (steps, alpha) pairs: non-negative least squares of alpha = base + steps*step."""
    n = len(alphas)
    ms = sum(s for s, _ in alphas) / n
    ma = sum(a for _, a in alphas) / n
    sxx = sum((s - ms) ** 2 for s, _ in alphas)
    slope = sum((s - ms) * (a - ma) for s, a in alphas) / sxx if sxx > 0 else 0.0
    base = ma - slope * ms
    if slope < 0:
        return max(0.0, ma), 0.0
    if base < 0:
        return 0.0, sum(s * a for s, a in alphas) / sum(s * s for s, _ in alphas)
    return base, slope


def _comm_updates(result: CalibrationResult, base: GPU) -> dict[str, Any]:
    """Link rates, busbw fractions and latencies from the collective fits (file units)."""
    fits = result.fits()
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    cpu = result.device == "cpu"
    eff = base.efficiency
    intra = {op: f for (scope, op), f in fits.items() if scope == "intra"}
    if intra:
        n = next(iter(intra.values())).group_size
        nvls = eff.nvls_min_gpus and n >= eff.nvls_min_gpus
        link = max(f.busbw_bytes_per_s for f in intra.values()) if cpu else base.intra_node_bandwidth_bytes_per_s
        ring_ops = [op for op in intra if op != "all_reduce" or not nvls]
        what = f"intra-node group of {n} ranks"
        if cpu:
            values["intra_node_bandwidth_gb_per_s"] = link / GB
            sources["intra_node_bandwidth_gb_per_s"] = _source(result, f"best fitted busbw of the collectives, {what}")
        values["efficiency.intra_node_busbw_fraction"] = _median([intra[o].busbw_bytes_per_s for o in ring_ops]) / link
        sources["efficiency.intra_node_busbw_fraction"] = _source(
            result, f"median fitted busbw of {', '.join(ring_ops)} / intra_node_bandwidth_gb_per_s, {what}")
        if nvls or not eff.nvls_min_gpus:
            values["efficiency.intra_node_allreduce_busbw_fraction"] = intra["all_reduce"].busbw_bytes_per_s / link
            sources["efficiency.intra_node_allreduce_busbw_fraction"] = _source(
                result, f"fitted all_reduce busbw / intra_node_bandwidth_gb_per_s, {what}")
        else:
            sources["efficiency.intra_node_allreduce_busbw_fraction"] = _kept(
                base, "efficiency.intra_node_allreduce_busbw_fraction",
                f"group of {n} < nvls_min_gpus {eff.nvls_min_gpus}, so the NVLS all-reduce did not run")
        base_s, step_s = _latency_split([(ring_steps(op, n), f.alpha_s) for op, f in intra.items()])
        values["collective_base_latency_us"] = base_s / US
        values["intra_node_latency_us"] = step_s / US
        how = ("alpha of every collective fitted as base + steps x per-step "
               "(steps: all_reduce 2(n-1), AG/RS n-1, a2a/p2p 1)")
        sources["collective_base_latency_us"] = _source(result, f"{how}, {what}")
        sources["intra_node_latency_us"] = sources["collective_base_latency_us"]
    else:
        for key in ("intra_node_bandwidth_gb_per_s", "efficiency.intra_node_busbw_fraction",
                    "efficiency.intra_node_allreduce_busbw_fraction", "collective_base_latency_us",
                    "intra_node_latency_us"):
            sources[key] = _kept(base, key, "fewer than 2 ranks per node")
        base_s = base.collective_base_latency_s
    inter = {op: f for (scope, op), f in fits.items() if scope == "inter"}
    if inter:
        k = next(iter(inter.values())).group_size
        nic = max(f.busbw_bytes_per_s for f in inter.values()) if cpu else base.nic_bandwidth_bytes_per_s
        what = f"one rank per node, {k} nodes, every local rank at once"
        if cpu:
            values["nic_bandwidth_gb_per_s"] = nic / GB
            sources["nic_bandwidth_gb_per_s"] = _source(result, f"best fitted busbw across nodes, {what}")
        ring = [op for op in inter if op != "all_to_all"]
        values["efficiency.inter_node_busbw_fraction"] = _median([inter[o].busbw_bytes_per_s for o in ring]) / nic
        sources["efficiency.inter_node_busbw_fraction"] = _source(
            result, f"median fitted busbw of {', '.join(ring)} / nic_bandwidth_gb_per_s, {what}")
        values["efficiency.inter_node_alltoall_busbw_fraction"] = inter["all_to_all"].busbw_bytes_per_s / nic
        sources["efficiency.inter_node_alltoall_busbw_fraction"] = _source(
            result, f"fitted all_to_all busbw / nic_bandwidth_gb_per_s, {what}")
        pairs = [(ring_steps(op, k), f.alpha_s - base_s) for op, f in inter.items()]
        step = max(0.0, sum(s * a for s, a in pairs) / sum(s * s for s, _ in pairs))
        values["inter_node_latency_us"] = step / US
        sources["inter_node_latency_us"] = _source(result, f"(alpha - collective base) per inter-node step, {what}")
    else:
        for key in ("nic_bandwidth_gb_per_s", "efficiency.inter_node_busbw_fraction",
                    "efficiency.inter_node_alltoall_busbw_fraction", "inter_node_latency_us"):
            sources[key] = _kept(base, key, "one node: no inter-node group")
    return {"values": values, "sources": sources}


def calibrated_gpu(result: CalibrationResult, base: GPU, standard_shapes: bool = True) -> GPU:
    """`base` with every measured number replaced and every kept number's source saying so."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for part in (_matmul_updates(result, base, standard_shapes), _comm_updates(result, base)):
        values.update(part.get("values", {}))
        sources.update(part.get("sources", {}))
    if result.copy_bytes_per_s:
        mib = result.copy_bytes / 2**20
        if result.device == "cpu":
            values["hbm_bandwidth_gb_per_s"] = result.copy_bytes_per_s / GB
            values["efficiency.hbm_fraction"] = 1.0
            sources["hbm_bandwidth_gb_per_s"] = _source(
                result, f"Tensor.copy_ of {mib:.0f} MiB fp32, bytes read+written / time")
            sources["efficiency.hbm_fraction"] = ("1.0 because hbm_bandwidth_gb_per_s is itself the measured "
                                                  "copy bandwidth")
        else:
            values["efficiency.hbm_fraction"] = result.copy_bytes_per_s / base.hbm_bandwidth_bytes_per_s
            sources["efficiency.hbm_fraction"] = _source(
                result, f"Tensor.copy_ of {mib:.0f} MiB fp32, bytes read+written / time / hbm_bandwidth_gb_per_s")
    if result.device_memory_bytes:
        values["memory_gib"] = result.device_memory_bytes / GIB
        sources["memory_gib"] = _source(result, "torch.cuda.get_device_properties().total_memory")
    gpu = base.with_values({k: _finite(k, v) for k, v in values.items()}, "measured")
    merged = dict(gpu.sources)
    merged.update(sources)
    return dataclasses.replace(gpu, key=base.key, name=f"{base.name} (calibrated {result.measured_at[:10]})",
                               sources=merged)


def _finite(key: str, value: Any) -> Any:
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 or (v == 0 and key.endswith("_us"))
               for v in values):
        raise UserError(f"calibrate measured an unusable value for {key}: {value!r}; the machine may be "
                        "overloaded, run it again with fewer other jobs.")
    return value


def calibrated_cluster(result: CalibrationResult, base: GPU, gpu: GPU, gpus_per_node: int | None = None) -> Cluster:
    """A cluster of the measured nodes: ranks per node from torchrun (CUDA: the node's GPU count)."""
    env = result.env
    if gpus_per_node is None:
        gpus_per_node = env.local_world_size
        if result.device == "cuda":
            gpus_per_node = max(gpus_per_node, torch.cuda.device_count())
        elif env.num_nodes == 1:  # the CPU test device's convention: up to base.gpus_per_node ranks per host
            gpus_per_node = max(gpus_per_node, base.gpus_per_node)
    if gpu.scaleup_domain_gpus == base.gpus_per_node:
        gpu = dataclasses.replace(gpu, gpus_per_node=gpus_per_node, scaleup_domain_gpus=gpus_per_node)
    else:
        gpu = dataclasses.replace(gpu, gpus_per_node=gpus_per_node)
    cluster = make_cluster(gpu, env.num_nodes * gpus_per_node, gpus_per_node)
    src = gpu.sources
    per_node = ("torchrun LOCAL_WORLD_SIZE / the node's device count" if result.device == "cuda" else
                "LOCAL_WORLD_SIZE, or the cpu device's convention (ranks sharing one host) on one node")
    domain = (src.get("scaleup_domain_gpus", "base GPU file") if base.scaleup_domain_gpus > base.gpus_per_node
              else "one scale-up domain per node (as the base GPU's board)")
    sources = {
        "gpus_per_node": f"{per_node}, calibration {result.measured_at}",
        "num_nodes": f"nodes in the calibration run (WORLD_SIZE / LOCAL_WORLD_SIZE), {result.measured_at}",
        "scaleup_domain_gpus": domain,
    }
    for key in ("intra_node_bandwidth_gb_per_s", "intra_node_latency_us", "nic_bandwidth_gb_per_s",
                "inter_node_latency_us"):
        sources[key] = src.get(key, "base GPU file")
    return dataclasses.replace(cluster, name=f"calibrated-{gpu.key}-{result.measured_at[:10]}", sources=sources,
                               measured_at=result.measured_at, method=result.method())


def measurements_path(hardware_file: str | Path) -> Path:
    """The raw measurements written beside a calibrated hardware file."""
    path = Path(hardware_file)
    return path.with_name(path.stem + ".measurements.json")


def write(result: CalibrationResult, base: GPU, path: str | Path, standard_shapes: bool = True,
          gpus_per_node: int | None = None) -> tuple[Path, Cluster]:
    """Write the hardware file (cost_models format) and its raw measurements beside it."""
    gpu = calibrated_gpu(result, base, standard_shapes)
    cluster = calibrated_cluster(result, base, gpu, gpus_per_node)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_hardware_file(cluster, path, measured_at=result.measured_at, method=result.method())
    data = result.to_dict()
    data["base_gpu"] = base.key
    measurements_path(path).write_text(json.dumps(data, indent=2) + "\n")
    return path, cluster


# ---------------------------------------------------------------- error band

def measured_error(path: str | Path) -> float | None:
    """The cost model's measured relative error on this hardware, or None if nothing was measured.

    `path` is a calibrated hardware file (its `.measurements.json` beside it: the median
    |predicted - measured| / measured over every GEMM, copy and collective timed, predictions
    from the file's own numbers through the cost model's functions) or a run directory with
    metrics.jsonl next to its job's plan.json (the relative error of the step time, see
    `autoplan.validate.measured.compare_run_dir`). The report uses it as the half-width of its range.
    """
    details = measured_error_details(path)
    return None if details is None else details["median_abs_rel_error"]


def measured_error_details(path: str | Path) -> dict[str, Any] | None:
    """`measured_error` with its parts: median, 90th percentile, count, source."""
    path = Path(path)
    if path.is_dir():
        if not (path / "metrics.jsonl").is_file():
            return None
        from autoplan.validate.measured import compare_run_dir

        report = compare_run_dir(path)
        err = report["error"].get("step_time_s")
        if err is None:
            return None
        return {"median_abs_rel_error": abs(err), "p90_abs_rel_error": abs(err), "count": report["steps_used"],
                "source": f"validated run {path}: step time predicted vs measured"}
    side = measurements_path(path)
    if not side.is_file():
        return None
    # GEMM and copy numbers are read off the same measurements (in-sample error ~0), so only
    # the collectives, whose alpha-beta form has to fit several sizes and ops at once, count.
    errors = [e for e in primitive_errors(path) if e["kind"] == "collective"]
    if not errors:
        return None
    values = sorted(abs(e["rel_error"]) for e in errors)
    return {"median_abs_rel_error": statistics.median(values),
            "p90_abs_rel_error": values[min(len(values) - 1, int(0.9 * len(values)))],
            "count": len(values),
            "source": f"calibration {side}: cost-model collective times vs measured (a lower bound of the step error)"}


def primitive_errors(hardware_file: str | Path) -> list[dict[str, Any]]:
    """Each measured GEMM, copy and collective next to what the cost model predicts from the file."""
    from autoplan.cost import comm, hw
    from autoplan.hardware import load_hardware_file

    cluster = load_hardware_file(hardware_file)
    gpu = cluster.gpu
    fabric = hw.fabric(cluster)
    data = json.loads(measurements_path(hardware_file).read_text())
    out = []
    for p in data.get("matmul", []):
        precision = "fp32" if p["dtype"] == "tf32" and not gpu.supports("tf32") else p["dtype"]
        flops = 2.0 * p["m"] * p["n"] * p["k"]
        rate = gpu.peak_flops(precision) * gpu.matmul_efficiency(flops, min(p["m"], p["n"], p["k"]), precision)
        out.append({"kind": "matmul", "what": f"matmul {p['dtype']} {p['m']}x{p['n']}x{p['k']}",
                    "measured_s": p["seconds"], "predicted_s": flops / rate})
    if data.get("copy_gb_per_s"):
        nbytes = data["copy_bytes"]
        measured = 2.0 * nbytes / (data["copy_gb_per_s"] * GB)
        out.append({"kind": "copy", "what": f"copy {nbytes} B", "measured_s": measured,
                    "predicted_s": 2.0 * nbytes / hw.hbm_bytes_per_s(gpu)})
    for p in data.get("comm", []):
        n = p["group_size"]
        span = comm.GroupSpan(n, n, 1) if p["scope"] == "intra" else comm.GroupSpan(n, 1, n)
        size = p["bytes"]
        predict = {"all_reduce": lambda: comm.allreduce_time_s(size, span, fabric),
                   "all_gather": lambda: comm.allgather_time_s(size, span, fabric),
                   "reduce_scatter": lambda: comm.reduce_scatter_time_s(size, span, fabric),
                   "all_to_all": lambda: comm.alltoall_time_s(size, span, fabric),
                   "send_recv": lambda: comm.p2p_time_s(size, p["scope"] == "inter", fabric)}[p["op"]]
        out.append({"kind": "collective", "what": f"{p['op']} {p['scope']} x{n} {size} B", "measured_s": p["seconds"],
                    "predicted_s": predict()})
    for e in out:
        e["rel_error"] = (e["predicted_s"] - e["measured_s"]) / e["measured_s"]
    return out
