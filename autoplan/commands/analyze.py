"""`autoplan analyze MODEL`: trace on meta and summarise parameters, FLOPs, activations, structure."""

from __future__ import annotations

import json

import click

from autoplan.commands import options as o
from autoplan.errors import UserError


def analyze_model(spec: str, batch_size: int, seq_len: int | None, image_size: int | None = None):
    """Load MODEL (file, config.json or catalog name) and trace it: (LoadedModel, ModelGraph)."""
    from autoplan.trace.load import input_extent
    from autoplan.models.sources import load_model
    from autoplan.trace.tracer import trace_model

    if seq_len is not None and seq_len <= 0:
        raise UserError(f"--seq-len must be a positive number of tokens, got {seq_len}")
    loaded = load_model(spec, seq_len=seq_len)
    seq = input_extent(loaded, seq_len, image_size)
    if batch_size <= 0:
        raise UserError(f"--batch-size must be positive, got {batch_size}")
    graph = trace_model(loaded.module, loaded.example_inputs(batch_size, seq), name=loaded.ref.name)
    return loaded, graph


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
    from autoplan.trace.summary import render, summarize

    _, graph = analyze_model(model, batch_size, seq_len, image_size)
    summary = summarize(graph)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    from rich.console import Console

    render(summary, Console())
