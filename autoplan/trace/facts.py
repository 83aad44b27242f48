"""Parallelism facts read off a traced graph: TP column/row pairs and styles, CP, EP.

A tensor-parallel pair is found by data flow inside a block: walking back from a linear
through views, elementwise ops and attention (but not through norms or block inputs)
reaches the linears that feed it. Those are column-parallel, it is row-parallel
(Megatron: q,k,v -> attention -> o; gate,up -> act*mul -> down). A pair whose
column outputs are split or chunked (a fused qkv projection) is not sharded, since
slicing the fused output per rank would mix q, k and v.
"""

from __future__ import annotations

from collections import defaultdict

import torch.fx as fx
import torch.nn as nn

from autoplan.trace.fallback import moe_facts
from autoplan.trace.graph import ModelGraph, OpInfo

_STOP_KINDS = {"linear", "norm", "embedding", "expert", "other", "conv"}
_SPLITS = {"split", "chunk", "split_with_sizes", "unbind"}


def linear_pairs(ops: list[OpInfo], edges: list[tuple[str, str]]) -> list[dict]:
    """Column/row linear pairs of one block's ops (names relative to nothing: full op names)."""
    by_name = {op.name: op for op in ops}
    inputs: dict[str, list[str]] = defaultdict(list)
    for src, dst in edges:
        if src in by_name and dst in by_name:
            inputs[dst].append(src)
    pairs = []
    for op in ops:
        if op.kind != "linear":
            continue
        feeders, through, stack, seen = set(), [], list(inputs[op.name]), set()
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            src = by_name[name]
            if src.kind == "linear":
                feeders.add(name)
            elif src.kind not in _STOP_KINDS:
                through.append(src)
                stack.extend(inputs[name])
        if not feeders or not any(t.kind in ("attention", "elementwise", "matmul") for t in through):
            continue
        widths = {by_name[f].output_shape[-1] for f in feeders if by_name[f].output_shape}
        # a split of a linear's whole output width = a fused projection (qkv / gate_up)
        fused = any(t.target in _SPLITS and t.input_shapes and t.input_shapes[0]
                    and t.input_shapes[0][-1] in widths for t in through)
        kind = "attention" if any(t.kind == "attention" or t.kind == "matmul" for t in through) else "mlp"
        attention = [t for t in through if t.kind == "attention"]
        pairs.append({"column": sorted(feeders, key=list(by_name).index), "row": op.name,
                      "kind": kind, "fused": fused, "attention": attention})
    return pairs


def block_tp_facts(module: nn.Module, ops: list[OpInfo], edges: list[tuple[str, str]]) -> dict:
    """heads, kv_heads, ffn, kv_bytes, tp_parameters, tp_flops and the pairs of one block copy."""
    by_name = {op.name: op for op in ops}
    facts = {"heads": 0, "kv_heads": 0, "ffn": 0, "kv_bytes": 0, "tp_parameters": 0,
             "tp_flops": 0, "pairs": []}
    for pair in linear_pairs(ops, edges):
        if pair["fused"]:
            continue
        linears = [by_name[n] for n in pair["column"]] + [by_name[pair["row"]]]
        facts["tp_parameters"] += sum(op.parameters for op in linears)
        facts["tp_flops"] += sum(op.flops for op in linears)
        if pair["kind"] == "attention":
            sdpa = pair["attention"][0] if pair["attention"] else None
            head_dim = sdpa.input_shapes[0][-1] if sdpa else 0
            if sdpa:
                facts["heads"] = int(sdpa.input_shapes[0][1])
                facts["tp_flops"] += sum(a.flops for a in pair["attention"])
            widths = [by_name[n].output_shape[-1] for n in pair["column"]]
            if head_dim:
                facts["kv_heads"] = int(min(widths) // head_dim)
                tokens = _tokens(by_name[pair["row"]])
                facts["kv_bytes"] = 2 * tokens * facts["kv_heads"] * head_dim * 2
        else:
            facts["ffn"] = max(facts["ffn"], max(by_name[n].output_shape[-1] for n in pair["column"]))
        facts["pairs"].append(pair)
    return facts


def _tokens(op: OpInfo) -> int:
    shape = op.output_shape
    numel = 1
    for dim in shape[:-1]:
        numel *= dim
    return numel


def _common_parent(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths]
    common = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        common.append(items[0])
    return ".".join(common)


def _retarget(path: str, first: str, copy: str) -> str:
    return copy + path[len(first):] if path.startswith(first) else path


def add_parallelism_facts(mg: ModelGraph, model: nn.Module, gm: fx.GraphModule, groups: dict,
                          first_path: dict[str, str], edges: list[tuple[str, str]]) -> None:
    """Fill tensor_parallel, tp_styles, context_parallel, cp_buffers and expert_parallel."""
    ops = [mg.graph.nodes[n]["op"] for n in mg.graph.nodes]
    styles: dict[str, str] = {}
    for group, first in first_path.items():
        block_ops = [op for op in ops if op.name.startswith(first + ".")]
        facts = block_tp_facts(model.get_submodule(first), block_ops, edges)
        block = mg.segment(group)
        for pair in facts["pairs"]:
            columns = [next(o.module for o in block_ops if o.name == n) for n in pair["column"]]
            row = next(o.module for o in block_ops if o.name == pair["row"])
            parent = _common_parent(columns + [row])
            divides = ({"heads": block.heads, "kv_heads": block.kv_heads} if pair["kind"] == "attention"
                       else {"ffn": block.ffn})
            mg.tensor_parallel.append({
                "block": group, "kind": pair["kind"], "module": parent[len(first) + 1:],
                "column": [c[len(first) + 1:] for c in columns], "row": row[len(first) + 1:],
                "divides": divides,
            })
            for copy in block.paths:
                for column in columns:
                    styles[_retarget(column, first, copy)] = "colwise"
                styles[_retarget(row, first, copy)] = "rowwise"
                styles[_retarget(parent, first, copy)] = "prepare_input"
        norms = [op.module for op in block_ops if op.kind == "norm" and op.module]
        for copy in block.paths:
            for norm in norms:
                styles[_retarget(norm, first, copy)] = "sequence_parallel"
        attention_modules = sorted({op.module for op in block_ops if op.kind == "attention"
                                    and op.target == "scaled_dot_product_attention"})
        moe = _moe_module(model.get_submodule(first))
        for copy in block.paths:
            mg.context_parallel += [_retarget(a, first, copy) for a in attention_modules]
            if moe is not None:
                path = ".".join(p for p in (copy, moe[0]) if p)
                mg.expert_parallel.append({"module": path, "experts": moe[1], "top_k": moe[2]})
    if mg.tensor_parallel:
        styles.update(_pre_post_styles(mg, model, ops, first_path))
    mg.tp_styles = styles
    mg.cp_buffers = _sliced_buffers(gm) if mg.context_parallel else {}


def _moe_module(block: nn.Module) -> tuple[str, int, int] | None:
    for path, sub in block.named_modules():
        if path == "":
            continue
        experts, top_k = moe_facts(sub)
        if experts:
            return path, experts, top_k
    return None


def _pre_post_styles(mg: ModelGraph, model: nn.Module, ops: list[OpInfo],
                     first_path: dict[str, str]) -> dict[str, str]:
    styles = {}
    in_block = tuple(p + "." for p in first_path.values())
    for op in ops:
        if op.name.startswith(in_block) or not op.module:
            continue
        module = model.get_submodule(op.module)
        if op.kind == "embedding" and getattr(module, "num_embeddings", 0) == mg.vocab:
            styles[op.module] = "vocab_embedding"
        elif op.kind == "norm":
            styles[op.module] = "sequence_parallel"
        elif op.kind == "linear" and getattr(module, "out_features", 0) == mg.vocab:
            styles[op.module] = "vocab_head"
    return styles


def _sliced_buffers(gm: fx.GraphModule) -> dict[str, int]:
    """Buffers the root slices along dim 0 (RoPE / position tables indexed by position)."""
    buffers = dict(gm.named_buffers())
    found = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in buffers:
            for user in node.users:
                index = user.args[1] if len(user.args) > 1 else None
                if user.op == "call_function" and getattr(user.target, "__name__", "") == "getitem" \
                        and isinstance(index, slice):
                    found[str(node.target)] = 0
    return found
