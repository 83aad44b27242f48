"""ModelGraph -> the `autoplan analyze` summary (a JSON-able dict) and its rich rendering."""

from __future__ import annotations

from typing import Any

from autoplan.trace.activations import saved_bytes_by_mode
from autoplan.trace.graph import ModelGraph, sequence_loop_notes


def summarize(graph: ModelGraph) -> dict[str, Any]:
    """Everything `analyze --json` prints. FLOPs and bytes are for graph.batch_size x seq_len."""
    tokens = graph.batch_size * graph.seq_len
    forward = graph.forward_flops()
    activation = sum(s.saved_bytes * s.count for s in graph.segments)
    modes = {s.name: saved_bytes_by_mode(graph, s) for s in graph.blocks}
    blocks = [
        {
            "name": s.name, "count": s.count, "kind": s.kind, "parameters": s.parameters,
            "forward_flops": s.forward_flops, "attention_flops": s.attention_flops,
            # autograd's saved tensors as traced (decomposed norms, attention as traced)
            "activation_bytes": s.saved_bytes,
            "activation_bytes_per_token_traced": s.saved_bytes / tokens,
            # what the runtime keeps per mode, as `estimate` costs it (trace/activations.py)
            "activation_bytes_per_token": modes[s.name]["none"] / tokens,
            "activation_bytes_per_token_selective": modes[s.name]["selective"] / tokens,
            "activation_bytes_per_token_full_recompute": modes[s.name]["full"] / tokens,
            "heads": s.heads, "kv_heads": s.kv_heads, "ffn": s.ffn,
            "experts": s.experts, "top_k": s.top_k, "expert_parameters": s.expert_parameters,
            "first": s.paths[0],
        }
        for s in graph.blocks
    ]
    return {
        "model": graph.model_name,
        "fingerprint": graph.fingerprint,
        "batch_size": graph.batch_size,
        "seq_len": graph.seq_len,
        "activation_dtype": "bf16",
        "parameters": graph.parameters,
        "embedding_parameters": graph.embedding_parameters,
        "expert_parameters": sum(s.expert_parameters * s.count for s in graph.blocks),
        "forward_flops": forward,
        # backward of a matmul costs two forward matmuls (input and weight gradients)
        "train_flops": 3 * forward,
        "forward_flops_per_token": forward / tokens,
        "train_flops_per_token": 3 * forward / tokens,
        "elementwise_flops": sum(s.elementwise_flops * s.count for s in graph.segments),
        "activation_bytes": activation,
        "activation_bytes_per_token": activation / tokens,
        "layers": graph.num_layers,
        "blocks": blocks,
        "embedding": {"parameters": graph.pre.parameters, "forward_flops": graph.pre.forward_flops},
        "head": {"parameters": graph.post.parameters, "forward_flops": graph.post.forward_flops},
        "tensor_parallel": graph.tensor_parallel,
        "tp_unsplit": graph.tp_unsplit,
        "tp_whole_moe": tp_whole_moe(graph),
        "refused_by_runtime": graph.refused,
        "capability_probe_s": round(graph.capability_probe_s, 3),
        "context_parallel": graph.context_parallel,
        "expert_parallel": graph.expert_parallel,
        "pipeline_cut_points": [path for path, _ in graph.layer_order],
        "fallback_modules": graph.fallback_modules,
        "sequence_loops": graph.sequence_loops,
        "image_size": graph.image_size,
        "ops": graph.graph.number_of_nodes(),
    }


_MOE_WHOLE = ("a MoE layer (router, routed experts, any shared expert) is not split by TP: it runs "
              "whole on each rank's sequence shard, its weights replicated over the TP ranks; "
              "expert parallelism shards the routed experts")


def tp_whole_moe(graph: ModelGraph) -> list[dict[str, str]]:
    """{block, module, reason} for each MoE layer of a tensor-parallel block class: the
    runtime runs it token-wise on sequence shards (runtime/tensor_parallel.py)."""
    if not graph.tensor_parallel:
        return []
    found = []
    for block in graph.blocks:
        prefix = block.paths[0] + "."
        found += [{"block": block.name, "module": e["module"][len(prefix):], "reason": _MOE_WHOLE}
                  for e in graph.expert_parallel if e["module"].startswith(prefix)]
    return found


def _fmt(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def render(summary: dict[str, Any], console) -> None:
    """Rich tables for a human."""
    from rich.table import Table

    extent = (f"{summary['image_size']}x{summary['image_size']} images" if summary["image_size"]
              else f"seq {summary['seq_len']}")
    head = Table(title=f"autoplan analyze: {summary['model']} "
                       f"(batch {summary['batch_size']} x {extent})", show_header=False)
    head.add_row("parameters", f"{summary['parameters']:,} ({_fmt(summary['parameters'])})")
    head.add_row("  embedding", f"{summary['embedding_parameters']:,}")
    if summary["expert_parameters"]:
        head.add_row("  in routed experts", f"{summary['expert_parameters']:,}")
    head.add_row("forward FLOPs / step", _fmt(summary["forward_flops"], "FLOP"))
    head.add_row("training FLOPs / step", _fmt(summary["train_flops"], "FLOP"))
    head.add_row("training FLOPs / token", _fmt(summary["train_flops_per_token"], "FLOP"))
    head.add_row("activations saved (bf16)", _fmt(summary["activation_bytes"], "B"))
    head.add_row("activations / token", _fmt(summary["activation_bytes_per_token"], "B"))
    head.add_row("graph ops", str(summary["ops"]))
    console.print(head)
    blocks = Table(title="Repeated blocks (pipeline cut points at each copy)")
    for col in ("block", "copies", "kind", "params/copy", "fwd FLOPs/copy",
                "act B/token/copy none/sel/full", "heads/kv", "ffn", "experts (top-k)"):
        blocks.add_column(col)
    for b in summary["blocks"]:
        blocks.add_row(b["name"], str(b["count"]), b["kind"], _fmt(b["parameters"]),
                       _fmt(b["forward_flops"]),
                       f"{b['activation_bytes_per_token']:.0f}/{b['activation_bytes_per_token_selective']:.0f}"
                       f"/{b['activation_bytes_per_token_full_recompute']:.0f}",
                       f"{b['heads']}/{b['kv_heads']}", str(b["ffn"] or "-"),
                       f"{b['experts']} ({b['top_k']})" if b["experts"] else "-")
    console.print(blocks)
    console.print("act B/token (bf16, as estimate costs it): none = autograd's saved tensors with "
                  "fused norms and FlashAttention; sel = what autoplan's selective checkpoint keeps "
                  "(matmul and attention outputs, block input); full = the block input")
    tp = summary["tensor_parallel"]
    console.print("[bold]Tensor parallel:[/] " + ("; ".join(
        f"{p['block']}.{p['module']}: column {', '.join(p['column'])} -> row {p['row']} "
        f"(divides {', '.join(f'{k}={v}' for k, v in p['divides'].items())})" for p in tp) or "none found"))
    for item in summary["tp_unsplit"][:4]:
        console.print(f"  not sharded: {item['block']}" + (f".{item['module']}" if item["module"] else "")
                      + f": {item['reason']}")
    for item in summary["tp_whole_moe"]:
        console.print(f"  not sharded: {item['block']}.{item['module']}: {item['reason']}")
    for axis, reason in summary["refused_by_runtime"].items():
        console.print(f"[yellow]Refused by autoplan.runtime ({axis}):[/] {reason}")
    cp = summary["context_parallel"]
    console.print(f"[bold]Context parallel:[/] {len(cp)} SDPA attention modules"
                  + (f" (e.g. {cp[0]})" if cp else " (CP needs F.scaled_dot_product_attention)"))
    ep = summary["expert_parallel"]
    console.print(f"[bold]Expert parallel:[/] {len(ep)} MoE modules"
                  + (f", {ep[0]['experts']} experts, top-{ep[0]['top_k']}" if ep else ""))
    for note in sequence_loop_notes(summary["sequence_loops"], summary.get("seq_len")):
        console.print(f"[yellow]{note}[/]")
    if summary["fallback_modules"]:
        console.print("[yellow]Data-dependent routing, run on meta with balanced routing "
                      "(T*k/E tokens per expert) and measured:[/] "
                      + ", ".join(summary["fallback_modules"][:4])
                      + (" ..." if len(summary["fallback_modules"]) > 4 else ""))
