"""CPU offload costs time: host<->device copies and the CPU Adam step (ZeRO-Offload / -Infinity)."""

from __future__ import annotations

import pytest

from autoplan.config import ParallelConfig
from autoplan.cost import estimate, offload
from autoplan.hardware import load_gpu


def test_optimizer_offload_is_copies_plus_cpu_adam():
    gpu = load_gpu("h100")
    params = 1e9
    # 2 B gradients out, 2 B weights back over the 51 GB/s host link (hardware.md B.2 [AZ-H100]),
    # 28 B/param CPU Adam at 60 GB/s host DRAM; no backward to hide the gradient copy under
    expected = 2e9 / 51e9 + 28e9 / 60e9 + 2e9 / 51e9
    assert offload.optimizer_offload_s(params, 2, 2, 28, 0.0, gpu) == pytest.approx(expected, rel=1e-9)
    # a backward longer than the gradient copy hides it; the rest stays
    hidden = offload.optimizer_offload_s(params, 2, 2, 28, 1.0, gpu)
    assert hidden == pytest.approx(28e9 / 60e9 + 2e9 / 51e9, rel=1e-9)


def test_param_offload_copies_weights_twice_and_hides_under_compute():
    gpu = load_gpu("a100-sxm4-80gb")  # PCIe Gen4: 26.28 GB/s
    total, exposed = offload.param_offload_s(1e9, 2, 2, 0.0, 0.0, gpu)
    assert total == pytest.approx(2 * 2e9 / 26.28e9, rel=1e-9)
    assert exposed == pytest.approx(total)
    _, hidden = offload.param_offload_s(1e9, 2, 2, 10.0, 10.0, gpu)
    assert hidden == 0.0


def test_gpu_without_host_link_uses_the_slowest_default():
    assert offload.host_link_bytes_per_s(load_gpu("cpu")) == offload.DEFAULT_HOST_LINK_BYTES_PER_S


@pytest.mark.parametrize("mode", ["optimizer", "params", "both"])
def test_offload_makes_a_step_slower_never_free(make_gpt_graph, h100_cluster, mode):
    # The planner must not get memory savings for free: each offload mode adds step time.
    graph = make_gpt_graph(layers=4, seq=1024)
    base = dict(global_batch=8, seq_len=1024, dp=8, micro_batch=1)
    cluster = h100_cluster(8)
    plain = estimate(graph, ParallelConfig(**base), cluster)
    off = estimate(graph, ParallelConfig(**base, offload=mode), cluster)
    assert off.step_time_s > plain.step_time_s
    assert off.memory_gib_per_gpu < plain.memory_gib_per_gpu
    if mode in ("params", "both"):
        assert off.comm_breakdown_s.get("offload", 0.0) > 0.0
