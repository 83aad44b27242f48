"""Repeated-block detection and the per-segment sums (pre, block groups, post) of a trace."""

from __future__ import annotations

from collections import OrderedDict

import torch.nn as nn

from autoplan.trace.facts import block_tp_facts
from autoplan.trace.fallback import expert_matrices, moe_layer_facts
from autoplan.trace.graph import BlockInfo, OpInfo
from autoplan.trace.ops import MHA_TARGETS, mha_parts


def _signature(module: nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    kinds = tuple(type(m).__name__ for m in module.modules())
    return type(module).__name__, params, kinds


def find_block_groups(model: nn.Module) -> "OrderedDict[str, list[str]]":
    """Group name -> module paths of identical blocks, in execution (registration) order.

    The blocks are the children of every outermost ModuleList / Sequential whose children
    have parameters and are copies of one class or share structures (HF `model.layers`,
    T5's encoder and decoder stacks, ResNet stages); children sharing a structure form one
    group (DeepSeek's dense first layers and its MoE layers, T5's first block with the
    relative-position table and the rest, a ResNet stage's downsampling first block and the
    rest). Lists nested inside a block (experts) are part of the block.
    """
    groups: OrderedDict[str, list[str]] = OrderedDict()
    taken: list[str] = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) == 0:
            continue
        if any(path == t or path.startswith(t + ".") for t in taken):
            continue
        children = [(f"{path}.{name}" if path else name, child)
                    for name, child in module.named_children()]
        if not all(any(True for _ in c.parameters()) for _, c in children):
            continue
        signatures: OrderedDict[tuple, list[str]] = OrderedDict()
        for child_path, child in children:
            signatures.setdefault(_signature(child), []).append(child_path)
        if max(len(v) for v in signatures.values()) < 2 and len(children) > 1:
            one_class = len({type(c) for _, c in children}) == 1
            if not one_class or any(_holds_repeats(c) for _, c in children):
                continue  # different layers (or stages of stacks): not a stack of blocks
        many = len(signatures) > 1
        for sig, paths in signatures.items():
            name = f"{path}[{sig[0]}]" if many else path
            while name in groups:
                name += "'"
            groups[name] = paths
        taken.append(path)
    return groups


def _holds_repeats(module: nn.Module) -> bool:
    """Does `module` contain a ModuleList/Sequential with two structurally equal children?"""
    for sub in module.modules():
        if isinstance(sub, (nn.ModuleList, nn.Sequential)) and sub is not module:
            signatures = [_signature(c) for c in sub.children() if any(True for _ in c.parameters())]
            if len(signatures) != len(set(signatures)):
                return True
    return False


def _block_ops(ops: list[OpInfo], path: str) -> list[OpInfo]:
    prefix = path + "."
    return [op for op in ops if op.name.startswith(prefix)]


def _sum_segment(name: str, kind: str, paths: tuple[str, ...], ops: list[OpInfo],
                 saved_quadratic: dict[str, int], parameters: int, hidden: int,
                 input_bytes: int) -> BlockInfo:
    attention_ops = [op for op in ops if op.kind == "attention" or
                     (op.kind == "matmul" and len(op.output_shape) >= 2 and
                      op.output_shape[-1] == op.output_shape[-2])]
    saved = sum(op.saved_bytes for op in ops)
    quadratic = sum(saved_quadratic.get(op.name, 0) for op in ops)
    # an nn.MultiheadAttention op counts its projections too: only its core is attention
    mha = {op.name: mha_parts(op) for op in attention_ops if op.target in MHA_TARGETS}
    return BlockInfo(
        name=name, paths=paths, kind=kind, parameters=parameters,
        forward_flops=sum(op.flops for op in ops),
        attention_flops=sum(mha[op.name][0] if op.name in mha else op.flops for op in attention_ops),
        elementwise_flops=sum(op.elementwise_flops for op in ops),
        saved_bytes=saved, saved_bytes_selective=saved - quadratic, input_bytes=input_bytes,
        memory_traffic_bytes=sum(op.bytes_read + op.bytes_written for op in ops
                                 if op.kind in ("elementwise", "norm", "embedding", "loss")),
        hidden=hidden,
        gemm_shapes=tuple((*op.gemm_mnk, op.flops) for op in ops if op.gemm_mnk and op.name not in mha)
        + tuple(g for core, gemms in mha.values() for g in gemms),
    )


def build_segments(model: nn.Module, rec, groups, first_path: dict[str, str],
                   block_of: dict[str, str]) -> tuple[list[BlockInfo], list[tuple[str, str]]]:
    """Sum the recorded ops into pre / block groups / post, and the block execution order."""
    ops: list[OpInfo] = rec.ops
    block_nodes = [i for i, op in enumerate(ops) if any(op.name.startswith(p + ".") for p in first_path.values())]
    top_ops = [op for op in ops if not any(op.name.startswith(p + ".") for p in first_path.values())]
    layer_order = [(path, block_of[path]) for path in execution_order(model, block_of)]
    first_block = min(block_nodes) if block_nodes else len(ops)
    pre_ops = [op for op in top_ops if ops.index(op) < first_block]
    post_ops = [op for op in top_ops if ops.index(op) >= first_block]
    block_params = 0
    segments: list[BlockInfo] = []
    hidden = _hidden(ops)
    for group, paths in groups.items():
        if group not in first_path:
            continue
        path = first_path[group]
        module = model.get_submodule(path)
        bops = _block_ops(ops, path)
        params = sum(p.numel() for p in module.parameters())
        block_params += params * len(paths)
        input_bytes = _first_input_bytes(bops)
        info = _sum_segment(group, "dense", tuple(paths), bops, rec.saved_quadratic, params,
                            hidden, input_bytes)
        segments.append(_with_block_facts(info, module, bops, rec.edges))
    if rec.direct_parameters:  # each op carries the parameters it reads, each counted once
        pre_params = sum(op.parameters for op in pre_ops)
    else:
        pre_params = _segment_params(model, pre_ops)
    post_params = sum(p.numel() for p in model.parameters()) - pre_params - block_params
    pre = _sum_segment("pre", "pre", ("",), pre_ops, rec.saved_quadratic, pre_params, hidden, 0)
    post = _sum_segment("post", "post", ("",), post_ops, rec.saved_quadratic, post_params,
                        hidden, _first_input_bytes(post_ops))
    return [pre, *segments, post], layer_order


def execution_order(model: nn.Module, block_of: dict[str, str]) -> list[str]:
    """Every block copy in call order: the order the model registers them in, which is the
    call order for the stacks autoplan recognises (a ModuleList iterated in a for loop).
    `block_of` lists copies group by group, and a stack may interleave its groups (Jamba's
    Mamba and attention layers, Llama-4's dense and MoE layers)."""
    position = {path: index for index, (path, _) in enumerate(model.named_modules(remove_duplicate=False))}
    return sorted(block_of, key=position.__getitem__)


def _hidden(ops: list[OpInfo]) -> int:
    for op in ops:
        if op.kind == "embedding" and op.output_shape:
            return int(op.output_shape[-1])
    for op in ops:
        if op.kind == "linear" and op.input_shapes and op.input_shapes[0]:
            return int(op.input_shapes[0][-1])
    return 0


def _first_input_bytes(ops: list[OpInfo]) -> int:
    for op in ops:
        if op.input_shapes and op.input_shapes[0]:
            numel = 1
            for dim in op.input_shapes[0]:
                numel *= dim
            return numel * 2  # bf16 trace dtype
    return 0


def _segment_params(model: nn.Module, ops: list[OpInfo]) -> int:
    seen: set[int] = set()
    total = 0
    for op in ops:
        if op.parameters and op.module:
            for p in model.get_submodule(op.module).parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
    return total


def _with_block_facts(info: BlockInfo, module: nn.Module, ops: list[OpInfo],
                      edges: list[tuple[str, str]]) -> BlockInfo:
    from dataclasses import replace

    experts, top_k = 0, 0
    expert_params = 0
    for sub in module.modules():
        e, k = moe_layer_facts(sub) if sub is not module else (0, 0)
        if e:
            experts, top_k = e, k

            _, ids = expert_matrices(sub, e)
            expert_params = sum(p.numel() for p in sub.parameters() if id(p) in ids)
            break
    tp = block_tp_facts(module, ops, edges)
    return replace(
        info, kind="moe" if experts else "dense", experts=experts, top_k=top_k,
        expert_parameters=expert_params, heads=tp["heads"], kv_heads=tp["kv_heads"],
        ffn=tp["ffn"], kv_bytes=tp["kv_bytes"], tp_parameters=tp["tp_parameters"],
        tp_flops=tp["tp_flops"], kv_modules=tp["kv_modules"], kv_parameters=tp["kv_parameters"],
    )
