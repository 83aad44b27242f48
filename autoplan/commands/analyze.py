"""`autoplan analyze MODEL`: trace on meta and summarise parameters, FLOPs, activations, structure."""

from __future__ import annotations

import json

import click

from autoplan.commands import options as o


@click.command("analyze")
@o.model_argument
@o.batch_size_option
@o.seq_len_option
@o.image_size_option
@o.json_option
@o.load_timeout_option
def command(model: str, batch_size: int, seq_len: int | None, image_size: int | None,
            as_json: bool) -> None:
    """Trace MODEL on the meta device: parameters, FLOPs, activation memory, structure and
    the parallelism it allows. Nothing is allocated and no weights are loaded."""
    from autoplan.trace.load import load_graph
    from autoplan.trace.summary import render, summarize

    graph, _, _ = load_graph(model, seq_len, image_size, batch_size)
    summary = summarize(graph)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    from rich.console import Console

    render(summary, Console())
