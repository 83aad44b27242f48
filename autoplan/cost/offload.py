"""Time of CPU offload: host<->device copies over the GPU's host link and the CPU Adam step.

- Optimizer offload (ZeRO-Offload, Ren et al. 2021 §4.1, Fig. 5): after backward each rank
  copies its (ZeRO-sharded) 16-bit gradients to the host, the CPU runs Adam on its fp32
  master weights and moments, and the updated 16-bit weights are copied back. The gradient
  copy streams during backward (their Fig. 5 overlaps it with the backward pass); the CPU
  step and the copy back are on the critical path (without the one-step delayed update).
- Parameter offload (ZeRO-Infinity, Rajbhandari et al. 2021 §5; FSDP CPUOffload): the
  weights live on the host and are copied in before the forward and again before the
  backward of every micro-batch, and the gradients are copied out after it; prefetching
  hides the copies under the block's compute when compute is longer (as FSDP prefetches
  its all-gathers), so only the excess is exposed.
- CPU Adam runs at the slower of two rates: torch's CPU AdamW measured per core
  (cost_models/cpu_adam.toml) times the host cores each GPU's rank gets (the system's cores /
  its GPUs: 112 / 8 = 14 on a DGX H100), and host DRAM bandwidth per GPU for the same bytes
  per parameter as the GPU update (step.py): memory-bound once enough cores run it
  (DeepSpeed CPU-Adam is SIMD-vectorised and memory-bound, Ren et al. 2021 §5.1).
"""

from __future__ import annotations

from autoplan import hardware

# Host link for a GPU file without `host_link_gb_per_s`: PCIe Gen4 x16 as measured on A100
# (nvbandwidth host-to-device 26.28 GB/s, hardware.md B.2 [AZ-A100]), the slowest host link
# among the catalogue's data-centre GPUs, so a missing value never makes offload look cheap.
DEFAULT_HOST_LINK_BYTES_PER_S = 26.28e9
# Host DRAM bandwidth per GPU: a DGX/HGX H100 host has 2 Xeon 8480C sockets x 8 DDR5-4800
# channels x 38.4 GB/s (JEDEC DDR5-4800: 4800 MT/s x 8 B) = 614 GB/s for 8 GPUs = 77 GB/s per
# GPU peak; achieved taken as ~0.8 of peak, the STREAM/peak ratio of the GPUs' own memories
# (hardware.md B.4: A100 0.79-0.83, H100 0.87) -- an assumption, no host STREAM measured here.
HOST_MEMORY_BYTES_PER_S_PER_GPU = 60e9
# Host cores per GPU for a GPU file without `host_cpu_cores`: the DGX H100's 112 / 8 (an
# assumption for other systems, stated here; cost_models/gpus/h100-sxm-80gb.toml cites it).
DEFAULT_HOST_CORES_PER_GPU = 14


def host_link_bytes_per_s(gpu) -> float:
    """Achieved host<->device copy bandwidth of one GPU (data file, else PCIe Gen4 x16)."""
    measured = getattr(gpu, "host_link_bytes_per_s", None)
    return measured if measured else DEFAULT_HOST_LINK_BYTES_PER_S


def host_cores_per_gpu(gpu) -> float:
    """Host CPU cores per GPU of the GPU's typical system (data file, else DGX H100's)."""
    cores = getattr(gpu, "host_cpu_cores", None)
    return cores / gpu.gpus_per_node if cores else DEFAULT_HOST_CORES_PER_GPU


def cpu_adam_s(params: float, adam_bytes_per_param: float, gpu) -> float:
    """Seconds of the CPU AdamW step on `params` parameters of one rank: the measured per-core
    rate times the rank's host cores, or host DRAM bandwidth, whichever is slower."""
    compute_s = params / (hardware.cpu_adam_params_per_s_per_core() * host_cores_per_gpu(gpu))
    memory_s = params * adam_bytes_per_param / HOST_MEMORY_BYTES_PER_S_PER_GPU
    return max(compute_s, memory_s)


def optimizer_offload_s(params: float, grad_bytes_per_param: float, weight_bytes_per_param: float,
                        adam_bytes_per_param: float, backward_window_s: float, gpu) -> float:
    """Exposed seconds per step of ZeRO-Offload for `params` parameters this rank updates.

    Gradients to host (hidden under `backward_window_s` of backward where it is long enough),
    CPU Adam (cpu_adam_s), updated weights back to the GPU.
    """
    link = host_link_bytes_per_s(gpu)
    to_host = params * grad_bytes_per_param / link
    cpu_step = cpu_adam_s(params, adam_bytes_per_param, gpu)
    to_device = params * weight_bytes_per_param / link
    return max(0.0, to_host - backward_window_s) + cpu_step + to_device


def param_offload_s(params: float, weight_bytes_per_param: float, grad_bytes_per_param: float,
                    fwd_s: float, bwd_s: float, gpu) -> tuple[float, float]:
    """(total, exposed) seconds per micro-batch of parameter offload for one block copy.

    Forward copies the block's weights in; backward copies them in again and the gradients
    out (a PCIe link is full duplex: the slower direction counts). Each is prefetched under
    the same pass's compute.
    """
    link = host_link_bytes_per_s(gpu)
    fwd_copy = params * weight_bytes_per_param / link
    bwd_copy = max(params * weight_bytes_per_param, params * grad_bytes_per_param) / link
    exposed = max(0.0, fwd_copy - fwd_s) + max(0.0, bwd_copy - bwd_s)
    return fwd_copy + bwd_copy, exposed
