"""Units the hardware data converts to once (SI base units), and the precisions it names."""

from __future__ import annotations

GIB = 2**30  # memory_gib: vendors print GiB as "GB" (hardware.md conventions, [STAS-ACC])


GB = 1e9  # bandwidths are decimal (hardware.md conventions)


TFLOPS = 1e12


US = 1e-6


PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")


REQUIRED_PRECISIONS = ("fp32", "fp16")


TOPOLOGIES = ("switch", "mesh", "pcie")
