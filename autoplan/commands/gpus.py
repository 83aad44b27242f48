"""`autoplan gpus [--json]`: the GPU catalogue (cost_models/gpus/*.toml) with default prices."""

from __future__ import annotations

import json
from typing import Any

import click

from autoplan.commands.options import json_option


def _row(gpu: Any, prices: Any) -> dict[str, Any]:
    """One GPU in file units (as its data file writes them) plus its default price, if any."""
    table = gpu.to_table()
    price = prices.entry(gpu.key) if prices.has(gpu.key) else None
    return {
        "key": gpu.key, "name": gpu.name, "aliases": list(gpu.aliases),
        "memory_gib": table["memory_gib"], "hbm_bandwidth_gb_per_s": table["hbm_bandwidth_gb_per_s"],
        "peak_tflops": table["peak_tflops"],
        "intra_node_topology": gpu.intra_node_topology,
        "intra_node_bandwidth_gb_per_s": table["intra_node_bandwidth_gb_per_s"],
        "nic_bandwidth_gb_per_s": table["nic_bandwidth_gb_per_s"],
        "gpus_per_node": gpu.gpus_per_node, "scaleup_domain_gpus": gpu.scaleup_domain_gpus,
        "usd_per_gpu_hour": price.usd_per_gpu_hour if price else None,
        "price_date": price.date if price else None,
        "price_source": price.source if price else None,
    }


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits if value >= 10 else max(digits, 2)}f}"  # CPU-sized numbers keep 2 decimals


@click.command("gpus")
@json_option
def command(as_json: bool) -> None:
    """List the known GPUs: key, aliases, memory, dense bf16/fp8 TFLOP/s, HBM, links and price.

    Any key or alias works with --gpu (case-insensitive). Numbers and their sources live in
    cost_models/gpus/<key>.toml; prices (USD per GPU-hour) in cost_models/prices/default.toml,
    overridable with --price KEY=USD where a command reports cost.
    """
    from autoplan.hardware import list_gpus, load_prices

    prices = load_prices()
    rows = [_row(gpu, prices) for gpu in list_gpus()]
    if as_json:
        click.echo(json.dumps({"gpus": rows, "price_list": prices.name}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="autoplan GPUs (dense peaks; link bandwidths per GPU, one direction)")
    headers = ("key", "aliases", "memory GiB", "bf16 TFLOP/s", "fp8 TFLOP/s", "HBM GB/s",
               "scale-up GB/s", "NIC GB/s", "GPUs/node", "USD/GPU-h")
    for header in headers:
        table.add_column(header, justify="left" if header in ("key", "aliases") else "right", overflow="fold")
    for row in rows:
        peaks = row["peak_tflops"]
        scaleup = f"{_fmt(row['intra_node_bandwidth_gb_per_s'])} ({row['intra_node_topology']}, {row['scaleup_domain_gpus']})"
        table.add_row(row["key"], ", ".join(row["aliases"]), _fmt(row["memory_gib"]),
                      _fmt(peaks.get("bf16", peaks.get("fp16")), 1) + ("" if "bf16" in peaks else " (fp16)"),
                      _fmt(peaks.get("fp8"), 1), _fmt(row["hbm_bandwidth_gb_per_s"]), scaleup,
                      _fmt(row["nic_bandwidth_gb_per_s"], 2), str(row["gpus_per_node"]),
                      _fmt(row["usd_per_gpu_hour"], 2))
    Console().print(table)
    click.echo(f"Prices: list '{prices.name}' (see --json for date and source); '-' = none documented, "
               "give one with --price KEY=USD. Sources of every number: cost_models/gpus/<key>.toml.")
