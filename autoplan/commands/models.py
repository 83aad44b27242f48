"""`autoplan models [--json]`: the built-in model catalog (cost_models/models/*.json)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict

import click

from autoplan.commands.options import json_option


def _format_params(billions: float) -> str:
    if billions >= 1:
        return f"{billions:,.1f} B"
    return f"{billions * 1e3:,.2f} M"


@click.command("models")
@json_option
def command(as_json: bool) -> None:
    """List the built-in model catalog: name, family, parameters, default sequence length, source.

    Any name listed here can be given as MODEL to the other commands (case-insensitive).
    Parameters are counted by building each model on the meta device.
    """
    from autoplan.models.catalog import list_catalog

    entries = list_catalog()
    if as_json:
        rows = []
        for entry in entries:
            row = asdict(entry)
            row["parameters"] = round(entry.parameters_b * 1e9)
            rows.append(row)
        click.echo(json.dumps({"models": rows}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="autoplan model catalog", show_lines=False)
    for header, justify, wrap in (("name", "left", False), ("family", "left", False),
                                  ("parameters", "right", False), ("seq len", "right", False),
                                  ("description", "left", True), ("source", "left", True)):
        table.add_column(header, justify=justify, no_wrap=not wrap, overflow="fold")
    for entry in entries:
        table.add_row(entry.name, entry.model_type, _format_params(entry.parameters_b),
                      str(entry.default_seq_len or "-"), entry.description, _short_source(entry.source))
    Console().print(table)
    click.echo("Full sources: autoplan models --json. Use any name as MODEL (case-insensitive).")


def _short_source(source: str, limit: int = 60) -> str:
    """The first citation of a source text, cut to `limit` characters."""
    first = re.sub(r"@[0-9a-f]{7,40}", "", source.split(";")[0].split(" (")[0])  # drop commit ids
    return first if len(first) <= limit else first[: limit - 3] + "..."
