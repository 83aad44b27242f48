"""`autoplan calibrate`: fits, hardware-file writing, launch checks, and real gloo runs (slow)."""

from __future__ import annotations

import json
import math

import pytest

from autoplan.calibrate import error, fit, measure
from autoplan.errors import UserError
from autoplan.hardware import GB, TFLOPS, load_gpu, load_hardware_file, make_cluster


def _points(op, n, alpha_s, busbw, sizes=(1024, 65536, 4 * 2**20, 64 * 2**20), scope="intra"):
    """Exact alpha-beta times, t = alpha + F*S/busbw."""
    return [measure.CommPoint(scope, op, n, s, alpha_s + measure.bus_factor(op, n) * s / busbw) for s in sizes]


def test_bus_factors_are_nccl_tests_conventions():
    assert measure.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert measure.bus_factor("all_gather", 4) == measure.bus_factor("all_to_all", 4) == pytest.approx(3 / 4)
    assert measure.bus_factor("send_recv", 2) == 1.0


def test_fit_recovers_alpha_and_busbw_from_exact_points():
    fitted = measure.fit_alpha_beta(_points("all_reduce", 8, 25e-6, 300 * GB))
    # exact data: only float round-off separates the fit from the truth
    assert fitted.alpha_s == pytest.approx(25e-6, rel=1e-6)
    assert fitted.busbw_bytes_per_s == pytest.approx(300 * GB, rel=1e-6)


def test_fit_falls_back_when_times_do_not_grow():
    pts = [measure.CommPoint("intra", "all_gather", 2, s, t) for s, t in ((1024, 2e-4), (8192, 1e-4))]
    fitted = measure.fit_alpha_beta(pts)
    assert fitted.alpha_s == 1e-4  # the smallest time
    assert fitted.busbw_bytes_per_s == pytest.approx(0.5 * 8192 / 1e-4)  # the best measured busbw


def test_latency_split_recovers_base_and_step():
    base, step = fit._latency_split([(s, 14e-6 + s * 2e-6) for s in (1, 7, 14)])
    assert base == pytest.approx(14e-6) and step == pytest.approx(2e-6)


def _synthetic_h100_result() -> measure.CalibrationResult:
    """8 ranks on one node: GEMMs at 70% of the bf16 peak, collectives at known busbw and latency."""
    env = measure.LaunchEnv(0, 8, 0, 8, True)
    result = measure.CalibrationResult(env=env, device="cuda", device_name="NVIDIA H100 80GB HBM3",
                                   measured_at="2026-12-02T00:00:00Z")
    for n, frac in ((1024, 0.35), (4096, 0.70), (8192, 0.75)):
        flops = 2.0 * n**3
        result.matmul.append(measure.MatmulPoint("bf16", n, n, n, flops / (989 * TFLOPS * frac)))
    result.copy_bytes, result.copy_bytes_per_s = 2**30, 2900 * GB
    for op, bw in (("all_reduce", 480 * GB), ("all_gather", 360 * GB), ("reduce_scatter", 360 * GB),
                   ("all_to_all", 340 * GB), ("send_recv", 380 * GB)):
        steps = measure.ring_steps(op, 8)
        result.comm += _points(op, 8, 14e-6 + steps * 2e-6, bw)
    return result


def test_calibrated_file_keeps_datasheet_peaks_and_replaces_fractions(tmp_path):
    base = load_gpu("h100")
    result = _synthetic_h100_result()
    path, cluster = fit.write(result, base, tmp_path / "h100.toml", gpus_per_node=8)
    loaded = load_hardware_file(path)
    gpu = loaded.gpu
    assert loaded.measured_at == result.measured_at and loaded.num_gpus == 8
    assert gpu.peak_flops("bf16") == base.peak_flops("bf16")  # datasheet peak stays (MFU convention)
    assert gpu.efficiency.matmul_fraction["16bit"] == pytest.approx((0.35, 0.70, 0.75))
    assert gpu.matmul_efficiency(2.0 * 4096**3, 4096, "bf16") == pytest.approx(0.70)
    assert gpu.efficiency.hbm_fraction == pytest.approx(2900 / 3350)
    # 8 >= nvls_min_gpus 5: all-reduce busbw sets the NVLS fraction, the rest the ring fraction (median)
    assert gpu.efficiency.intra_node_allreduce_busbw_fraction == pytest.approx(480 / 450)
    assert gpu.efficiency.intra_node_busbw_fraction == pytest.approx(360 / 450)
    assert gpu.collective_base_latency_s == pytest.approx(14e-6, rel=1e-3)
    assert gpu.intra_node_latency_s == pytest.approx(2e-6, rel=1e-3)
    assert len(gpu.efficiency.matmul_fraction["fp8"]) == 3  # kept curve resampled onto the new axis
    sources = dict(gpu.sources)
    assert sources["efficiency.hbm_fraction"].startswith("measured 2026-12-02")
    assert "not measured" in sources["efficiency.inter_node_busbw_fraction"]
    assert "not measured" in loaded.sources["nic_bandwidth_gb_per_s"]
    data = json.loads(fit.measurements_path(path).read_text())
    assert {p["op"] for p in data["comm"]} == set(measure.COLLECTIVES)
    # the collective model reproduces exact alpha-beta data closely (ring/NVLS fractions are shared by ops)
    err = error.measured_error(path)
    assert err is not None and err < 0.1


def test_a_link_where_the_measurements_go_is_refused_before_anything_is_written(tmp_path):
    target = tmp_path / "users_file.json"
    target.write_text("the user's file\n")
    fit.measurements_path(tmp_path / "h100.toml").symlink_to(target)
    with pytest.raises(UserError, match="symbolic link"):
        fit.write(_synthetic_h100_result(), load_gpu("h100"), tmp_path / "h100.toml", gpus_per_node=8)
    assert target.read_text() == "the user's file\n" and not (tmp_path / "h100.toml").exists()


def test_cpu_calibration_sets_peaks_and_rates_from_measurements(tmp_path):
    env = measure.LaunchEnv(0, 2, 0, 2, True)
    result = measure.CalibrationResult(env=env, device="cpu", device_name="CPU", measured_at="2026-12-02T00:00:00Z")
    for dtype, rate in (("fp32", 0.2), ("bf16", 1.5), ("fp16", 0.19)):
        for n, frac in ((128, 0.5), (256, 1.0)):
            result.matmul.append(measure.MatmulPoint(dtype, n, n, n, 2.0 * n**3 / (rate * frac * TFLOPS)))
    result.copy_bytes, result.copy_bytes_per_s = 2**26, 30 * GB
    for op in measure.COLLECTIVES:
        result.comm += _points(op, 2, 600e-6, 1.2 * GB, sizes=(1024, 2**20, 2**25))
    path, _ = fit.write(result, load_gpu("cpu"), tmp_path / "cpu.toml")
    gpu = load_hardware_file(path).gpu
    assert gpu.peak_flops("bf16") == pytest.approx(1.5 * TFLOPS)
    assert gpu.hbm_bandwidth_bytes_per_s == pytest.approx(30 * GB)
    assert gpu.intra_node_bandwidth_bytes_per_s == pytest.approx(1.2 * GB, rel=1e-6)
    assert gpu.efficiency.matmul_fraction["16bit"] == pytest.approx((0.5, 1.0))


def test_launch_checks():
    alone = measure.launch_env({})
    assert (alone.world_size, alone.under_torchrun) == (1, False)
    with pytest.raises(UserError, match="not launched by torchrun.*matmul throughput"):
        measure.check_launch(alone, device_only=False)
    assert "collectives (one rank)" in measure.check_launch(alone, device_only=True)[0]
    one = measure.launch_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    with pytest.raises(UserError, match="only one rank"):
        measure.check_launch(one, device_only=False)
    two = measure.launch_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert measure.check_launch(two, False) == ["inter-node collectives (one node): kept from the base GPU file"]


@pytest.mark.parametrize("device_name, key", [
    ("NVIDIA H200", "h200-sxm-141gb"), ("NVIDIA H100 80GB HBM3", "h100-sxm-80gb"),
    ("NVIDIA H100 PCIe", "h100-pcie-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-sxm4-40gb"),
])
def test_base_gpu_from_the_cuda_device_name(monkeypatch, device_name, key):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: device_name)
    assert fit.base_gpu_for("cuda").key == key
    assert fit.base_gpu_for("cuda", "b200").key == "b200"  # --gpu wins


def test_unknown_cuda_device_asks_for_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA GH200 480GB")
    with pytest.raises(UserError, match="--gpu"):
        fit.base_gpu_for("cuda")


def test_cli_without_torchrun_exits_2(run_cli, monkeypatch, tmp_path):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    code, _, err = run_cli("calibrate", "--quick", "-o", str(tmp_path / "x.toml"))
    assert code == 2 and "--device-only" in err
    assert not (tmp_path / "x.toml").exists()


def test_device_only_single_process_writes_a_file_estimate_accepts(run_cli, monkeypatch, tmp_path):
    from autoplan.cost import estimate
    from autoplan.config import ParallelConfig
    from autoplan.trace.load import load_graph

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    out = tmp_path / "cpu.toml"
    code, _, err = run_cli("calibrate", "--device-only", "--quick", "--json", "--model", "tiny-gpt",
                           "-o", str(out))
    assert code == 0, err
    cluster = load_hardware_file(out)
    # timed at the model's own GEMM shapes: the FLOP curve holds the shape effects, no min-dim factor
    assert cluster.gpu.efficiency.matmul_min_dim == (1,)
    assert "collectives (one rank)" in " ".join(json.loads(fit.measurements_path(out).read_text())["not_measured"])
    graph, _, seq = load_graph("tiny-gpt", None)
    est = estimate(graph, ParallelConfig(global_batch=4, seq_len=seq), make_cluster(cluster.gpu, 1))
    assert math.isfinite(est.step_time_s) and est.step_time_s > 0


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_calibrate_on_gloo_ranks_writes_a_file_estimate_accepts(torchrun, tmp_path, nproc):
    from autoplan.cost import estimate
    from autoplan.config import ParallelConfig
    from autoplan.trace.load import load_graph
    from autoplan.hardware import resolve_cluster

    out = tmp_path / f"cpu{nproc}.toml"
    proc = torchrun(nproc, "calibrate", "--quick", "-o", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(fit.measurements_path(out).read_text())
    assert data["env"]["world_size"] == nproc and data["seconds"] < 60
    assert {(p["scope"], p["op"], p["group_size"]) for p in data["comm"]} == {
        ("intra", op, nproc) for op in measure.COLLECTIVES}
    assert all(p["seconds"] > 0 for p in data["comm"] + data["matmul"])
    cluster = resolve_cluster(None, str(out), nproc, None)  # what `estimate --hardware FILE` does
    graph, _, seq = load_graph("tiny-gpt", None)
    est = estimate(graph, ParallelConfig(global_batch=8, seq_len=seq, dp=nproc), cluster)
    assert est.step_time_s > 0
    assert error.measured_error(out) is not None


@pytest.mark.slow
def test_one_torchrun_rank_without_device_only_fails_saying_what_it_could_measure(torchrun, tmp_path):
    proc = torchrun(1, "calibrate", "--quick", "-o", str(tmp_path / "x.toml"))
    assert proc.returncode != 0
    message = " ".join(proc.stderr.split())  # the CLI wraps its error paragraph
    assert "only one rank" in message and "matmul throughput per dtype and memory bandwidth" in message


@pytest.mark.slow
def test_two_simulated_nodes_measure_inter_node_collectives(tmp_path):
    """Two torchrun agents on this machine with 2 ranks each: LOCAL_WORLD_SIZE 2, 2 nodes."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    out = tmp_path / "two.toml"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=cal-test", "-m", "autoplan", "calibrate", "--quick",
         "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1")) for _ in range(2)]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("two-node calibrate hung")
    assert all(p.returncode == 0 for p in procs), results
    cluster = load_hardware_file(out)
    assert (cluster.num_nodes, cluster.gpus_per_node) == (2, 2)
    data = json.loads(fit.measurements_path(out).read_text())
    assert {p["op"] for p in data["comm"] if p["scope"] == "inter"} == set(measure.COLLECTIVES)
    assert cluster.sources["inter_node_latency_us"].startswith("measured")
    assert cluster.gpu.sources["efficiency.inter_node_busbw_fraction"].startswith("measured")
