"""FP8 training with torchao's float8 linears (torchtitan's "float8" model converter).

A plan with precision "fp8" swaps each nn.Linear inside the blocks whose dimensions are
multiples of 16 (what FP8 GEMMs take: torch._scaled_mm) for torchao's Float8Linear, with the
plan's recipe (`Float8LinearConfig.from_recipe_name(plan.float8_recipe)`): tensorwise casts
inputs, weights and output gradients to e4m3/e5m2 with one dynamic scale each per forward,
rowwise to e4m3 with one power-of-2 scale per row.
The embedding, the head and the modules outside the blocks stay in 16 bits, as torchtitan
leaves its output projection out. Everything else computes as bf16 does (autocast or
FSDP2's parameter cast).

On a GPU without FP8 (compute capability below 8.9: H100/L40/Ada and later have it) and on
CPU, torchao's `emulate` mode casts to FP8 and back and multiplies in high precision: the
same rounding, without the speed. The swap runs after the pipeline split and before TP, so
the stage modules and the TP styles act on the Float8Linears; with a DTensor weight the
scale's amax is the whole weight's (DTensor reduces it), so every TP rank casts alike.
torchao is needed only on training nodes running an FP8 plan.

With `plan.float8_all_gather` (tensorwise, ZeRO-3) the Float8Linears' weights are torchao's
WeightWithDynamicFloat8CastTensor: FSDP2 casts each shard to float8 with the whole weight's
scale (an amax all-reduce) and all-gathers 1 byte a parameter, not bf16's 2; after each
optimizer step `precompute_scales` computes every weight's scale in one all-reduce
(torchtitan's precompute_float8_dynamic_scale_for_fsdp). gloo has no float8 types (its
all-gather raises "Invalid scalar type"), so on CPU the gathers go as the same bytes viewed
as uint8 (`ByteAllGather`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather  # FSDP2's all-gather hook (torch 2.13)

from autoplan.errors import UserError
from autoplan.runtime.model_io import real_parameters

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


def apply_float8(part: nn.Module, blocks: list[str], recipe: str = "tensorwise",
                 all_gather: bool = False, keep: frozenset[str] = frozenset()) -> None:
    """Swap the convertible linears inside `blocks` of this (stage) module for Float8Linear
    with torchao's `recipe`; `all_gather`: FSDP gathers their weights in float8 (tensorwise).
    `keep`: paths of linears that stay in 16 bits (a TP style that computes them itself).
    Not on fake or meta parameters (the dry run and the plan-time
    probe measure the bf16 block, as the cost model's FP8 rows assume)."""
    params = list(part.parameters())
    if not params or not real_parameters(params):
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe),
                                 emulate=not fp8_gemms_available(params[0].device),
                                 enable_fsdp_float8_all_gather=all_gather)

    def in_a_block(module: nn.Module, fqn: str) -> bool:
        return convertible(module) and fqn not in keep and any(fqn == b or fqn.startswith(b + ".") for b in blocks)

    convert_to_float8_training(part, module_filter_fn=in_a_block, config=config)


def gather_float8_as_bytes(fsdp_modules: list[nn.Module]) -> None:
    """On gloo, let each FSDP unit all-gather its float8 weight shards as uint8 (ByteAllGather).
    FSDP2 does so itself where a unit mixes float8 with other dtypes; a unit holding float8
    weights only would hand gloo float8 tensors."""
    for module in fsdp_modules:
        module.set_custom_all_gather(ByteAllGather())


def precompute_scales(parts: list[nn.Module]) -> None:
    """The float8 all-gather's weight scales for the next step, one all-reduce for all weights
    (torchao's precompute_float8_dynamic_scale_for_fsdp), after the optimizer step."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        precompute_float8_dynamic_scale_for_fsdp(part)


class ByteAllGather(AllGather):
    """FSDP2's default all-gather (dist.all_gather_single), with 1-byte (float8) buffers
    viewed as uint8: the same bytes, in a dtype gloo has."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        if output_tensor.element_size() == 1:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
