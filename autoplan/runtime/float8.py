"""FP8 training with torchao's float8 linears (torchtitan's "float8" model converter).

A plan with precision "fp8" swaps each nn.Linear inside the blocks whose dimensions are
multiples of 16 (what FP8 GEMMs take: torch._scaled_mm) for torchao's Float8Linear, with
tensorwise dynamic scaling (`Float8LinearConfig.from_recipe_name("tensorwise")`):
inputs, weights and output gradients are cast to e4m3/e5m2 with one scale each per step.
The embedding, the head and the modules outside the blocks stay in 16 bits, as torchtitan
leaves its output projection out. Everything else computes as bf16 does (autocast or
FSDP2's parameter cast).

On a GPU without FP8 (compute capability below 8.9: H100/L40/Ada and later have it) and on
CPU, torchao's `emulate` mode casts to FP8 and back and multiplies in high precision: the
same rounding, without the speed. The swap runs after the pipeline split and before TP, so
the stage modules and the TP styles act on the Float8Linears; with a DTensor weight the
scale's amax is the whole weight's (DTensor reduces it), so every TP rank casts alike.
torchao is needed only on training nodes running an FP8 plan.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from autoplan.errors import UserError

FP8_GEMM_MULTIPLE = 16  # torch._scaled_mm takes dimensions that are multiples of 16


def require_torchao() -> None:
    """Refuse an FP8 plan where torchao is not installed, before any process group."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise UserError("the plan trains in fp8, which autoplan's runtime runs with torchao's float8 "
                        "linears, and torchao is not installed on this node: `pip install torchao` "
                        "(0.18 is tested), or make the plan with --precision bf16") from None


def fp8_gemms_available(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def convertible(module: nn.Module) -> bool:
    return (isinstance(module, nn.Linear) and module.in_features % FP8_GEMM_MULTIPLE == 0
            and module.out_features % FP8_GEMM_MULTIPLE == 0)


def apply_float8(part: nn.Module, blocks: list[str]) -> None:
    """Swap the convertible linears inside `blocks` of this (stage) module for Float8Linear.
    Not on fake or meta parameters (the dry run and the plan-time
    probe measure the bf16 block, as the cost model's FP8 rows assume)."""
    params = list(part.parameters())
    if not params or any(is_fake(p) or p.is_meta for p in params):
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"),
                                 emulate=not fp8_gemms_available(params[0].device))

    def in_a_block(module: nn.Module, fqn: str) -> bool:
        return convertible(module) and any(fqn == b or fqn.startswith(b + ".") for b in blocks)

    convert_to_float8_training(part, module_filter_fn=in_a_block, config=config)
