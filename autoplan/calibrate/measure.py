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
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from autoplan.errors import UserError
from autoplan.hardware import GB, GIB, TFLOPS, US, GPU


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
