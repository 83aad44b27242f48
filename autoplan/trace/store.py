"""Traced graphs kept on disk, so a second command on the same model neither imports torch
nor traces nor probes the runtime again.

A graph is stored as JSON (never pickle: reading the cache runs no code) under a key that
holds everything the trace depends on:

- the model's bytes: the catalog entry, the config.json, or the model file together with
  every other `.py` file in its folder (a model file may import its neighbours);
- how it was asked for: the MODEL spec as given (the plan records it), sequence length,
  image size and batch;
- the code that traces it: autoplan's own source, and the installed torch and transformers
  (their version files, which carry the release and the commit).

Any change to one of these is a new key; an unreadable or foreign file is a miss. The cache
lives in `$AUTOPLAN_CACHE_DIR`, else `$XDG_CACHE_HOME/autoplan`, else `~/.cache/autoplan`;
`AUTOPLAN_CACHE=0` turns it off. Failing to write it never fails a command: it is only
time saved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import networkx as nx

from autoplan.plan import ModelRef
from autoplan.trace.graph import BlockInfo, ModelGraph, OpInfo, SideValue

FORMAT = 1
MAX_NEIGHBOUR_FILES = 200  # a model file in a folder with more .py files is not cached
_PACKAGE = Path(__file__).resolve().parent.parent


def cache_dir() -> Path | None:
    """Where graphs are kept, or None when the cache is off."""
    if os.environ.get("AUTOPLAN_CACHE", "1").strip().lower() in ("0", "off", "no", "false"):
        return None
    if os.environ.get("AUTOPLAN_CACHE_DIR"):
        return Path(os.environ["AUTOPLAN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autoplan"


def graph_key(spec: str, model_bytes: list[bytes], seq_len: int | None, image_size: int | None,
              batch_size: int = 1) -> str:
    """sha256 of what a trace of `spec` depends on (the module docstring's list)."""
    digest = hashlib.sha256()
    for part in (f"format {FORMAT}", spec, repr((seq_len, image_size, batch_size)), code_digest()):
        digest.update(part.encode() + b"\0")
    for data in model_bytes:
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


@lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 of autoplan's Python source and torch's and transformers' version files."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes())
    for package, version_file in (("torch", "version.py"), ("transformers", "__init__.py")):
        spec = importlib.util.find_spec(package)
        origin = Path(spec.origin).parent / version_file if spec and spec.origin else None
        digest.update(origin.read_bytes() if origin and origin.is_file() else b"absent")
    return digest.hexdigest()


def model_file_bytes(path: Path) -> list[bytes] | None:
    """The bytes a model file's trace may read: it and its folder's other .py files (by name
    order, names included); None when the folder holds too many to hash."""
    neighbours = sorted(p for p in path.parent.glob("*.py") if p.is_file() and p.resolve() != path.resolve())
    if len(neighbours) > MAX_NEIGHBOUR_FILES:
        return None
    parts = [path.read_bytes()]
    for p in neighbours:
        parts += [p.name.encode(), p.read_bytes()]
    return parts


def read(key: str) -> tuple[ModelGraph, ModelRef] | None:
    """The graph and model stored under `key`, or None (absent, unreadable, other format)."""
    directory = cache_dir()
    if directory is None:
        return None
    try:
        data = json.loads((directory / "graphs" / f"{key}.json").read_text())
        if data.get("format") != FORMAT or data.get("key") != key:
            return None
        return graph_from_json(data["graph"]), ModelRef(**data["model"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write(key: str, graph: ModelGraph, ref: ModelRef) -> None:
    """Store the graph under `key` (atomically: a reader sees the old file or the new one)."""
    directory = cache_dir()
    if directory is None:
        return
    folder = directory / "graphs"
    tmp = folder / f".{key}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        data = {"format": FORMAT, "key": key, "model": dataclasses.asdict(ref), "graph": graph_to_json(graph)}
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, folder / f"{key}.json")
    except OSError:
        tmp.unlink(missing_ok=True)


_GRAPH_SCALARS = ("batch_size", "seq_len", "dtype_bytes", "parameters", "embedding_parameters", "vocab",
                  "tensor_parallel", "context_parallel", "cp_buffers", "expert_parallel", "fallback_modules", "sequence_loops",
                  "tp_unsplit", "tp_styles", "refused", "sp_problem", "cp_problem", "capability_probe_s", "fingerprint", "model_name",
                  "image_size", "image_channels", "num_classes", "user_batch_inputs",
                  "user_batch_keywords", "attention_window")


def graph_to_json(graph: ModelGraph) -> dict[str, Any]:
    """A ModelGraph as JSON-ready values (graph_from_json reads it back equal)."""
    return {
        "ops": [dataclasses.asdict(graph.graph.nodes[n]["op"]) for n in graph.graph.nodes],
        "edges": [list(edge) for edge in graph.graph.edges],
        "segments": [dataclasses.asdict(s) for s in graph.segments],
        "layer_order": [list(item) for item in graph.layer_order],
        "pipeline_side_values": [[dataclasses.asdict(v) for v in cut] for cut in graph.pipeline_side_values],
        **{name: getattr(graph, name) for name in _GRAPH_SCALARS},
    }


def graph_from_json(data: dict[str, Any]) -> ModelGraph:
    g = nx.DiGraph()
    for fields in data["ops"]:
        op = OpInfo(**_tuples(fields))
        g.add_node(op.name, op=op)
    g.add_edges_from(tuple(edge) for edge in data["edges"])
    return ModelGraph(
        graph=g, segments=[BlockInfo(**_tuples(s)) for s in data["segments"]],
        layer_order=[tuple(item) for item in data["layer_order"]],
        pipeline_side_values=[tuple(SideValue(**v) for v in cut) for cut in data["pipeline_side_values"]],
        **{name: data[name] for name in _GRAPH_SCALARS},
    )


def _tuples(fields: dict[str, Any]) -> dict[str, Any]:
    """A frozen dataclass's fields from JSON: its sequences are tuples (of tuples)."""
    return {k: _tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


def _tuple(value):
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value
