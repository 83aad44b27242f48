"""`autoplan gpus [--json]`: the GPU catalogue (cost_models/gpus/*.toml) with default prices."""

from __future__ import annotations

import json
from typing import Any

import click

from autoplan.commands.options import json_option
from autoplan.hardware import list_gpus, load_prices


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


# headers of the number columns: they break between words, values never break
COLUMNS = ("memory GiB", "bf16 TFLOP/s", "fp8 TFLOP/s", "HBM GB/s", "scale-up GB/s", "NIC GB/s", "GPUs per node",
           "USD per GPU-h")
ALIASES_MIN_WIDTH = 24  # narrower than this, the aliases go under the table, one GPU a line


def _cells(row: dict[str, Any]) -> list[str]:
    peaks = row["peak_tflops"]
    return [_fmt(row["memory_gib"]),
            _fmt(peaks.get("bf16", peaks.get("fp16")), 1) + ("" if "bf16" in peaks else "*"),
            _fmt(peaks.get("fp8"), 1), _fmt(row["hbm_bandwidth_gb_per_s"]),
            _fmt(row["intra_node_bandwidth_gb_per_s"]), _fmt(row["nic_bandwidth_gb_per_s"], 2),
            str(row["gpus_per_node"]), _fmt(row["usd_per_gpu_hour"], 2)]


def _links(row: dict[str, Any]) -> str:
    return f"{row['intra_node_topology']} scale-up domain of {row['scaleup_domain_gpus']} GPUs"


def gpu_table(rows: list[dict[str, Any]], width: int):
    """(rich Table with one line per GPU that fits `width` columns, the lines to print under it).

    Every column is as wide as its widest value (no value ever breaks); the aliases and the
    scale-up topology take the room left, or go under the table when it is too narrow.
    """
    from rich.table import Table

    cells = [_cells(row) for row in rows]
    widths = [max(len(r["key"]) for r in rows)] + [
        max(max(len(c[i]) for c in cells), max(len(w) for w in header.split())) for i, header in enumerate(COLUMNS)]
    room = width - sum(widths) - 2 * len(widths)  # two spaces between columns (no box, no edge padding)
    table = Table(title="autoplan GPUs (dense peaks; link bandwidths per GPU, one direction)",
                  caption="* fp16 (no bf16)" if any("bf16" not in r["peak_tflops"] for r in rows) else None,
                  box=None, pad_edge=False, header_style="bold underline")
    table.add_column("key", width=widths[0], no_wrap=True)
    for header, column_width in zip(COLUMNS, widths[1:]):
        table.add_column(header, justify="right", width=column_width)
    wide = room >= ALIASES_MIN_WIDTH + 2
    if wide:
        table.add_column("aliases; scale-up links", ratio=1)
    for row, values in zip(rows, cells):
        table.add_row(row["key"], *values, *([f"{', '.join(row['aliases'])}; {_links(row)}"] if wide else []))
    below = [] if wide else [f"{r['key']}: {', '.join(r['aliases']) or 'no aliases'}; {_links(r)}" for r in rows]
    return table, below


@click.command("gpus")
@json_option
def command(as_json: bool) -> None:
    """List the known GPUs: key, aliases, memory, dense bf16/fp8 TFLOP/s, HBM, links and price.

    Any key or alias works with --gpu (case-insensitive). Numbers and their sources live in
    cost_models/gpus/<key>.toml; prices (USD per GPU-hour) in cost_models/prices/default.toml,
    overridable with --price KEY=USD where a command reports cost.
    """
    prices = load_prices()
    rows = [_row(gpu, prices) for gpu in list_gpus()]
    if as_json:
        click.echo(json.dumps({"gpus": rows, "price_list": prices.name}, indent=2))
        return
    from rich.console import Console

    console = Console()
    table, below = gpu_table(rows, console.width)
    console.print(table)
    for line in below:
        console.print(line, highlight=False)
    click.echo(f"Prices: list '{prices.name}' (see --json for date and source); '-' = none documented, "
               "give one with --price KEY=USD. Sources of every number: cost_models/gpus/<key>.toml.")
