"""Traced graphs on disk (trace/store.py): read back equal, found again without torch, and
never found for bytes or code that changed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.trace import store
from autoplan.trace.load import load_graph

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("AUTOPLAN_CACHE", "1")
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(folder))
    return folder


@pytest.mark.parametrize("spec", ["tiny-gpt", "tiny-moe", str(REPO / "examples" / "nano_gpt.py"),
                                  str(REPO / "tests" / "trace" / "capability_models" / "loop_moe.py")])
def test_a_graph_reads_back_equal(spec):
    graph, _, _ = load_graph(spec, 64)
    back = store.graph_from_json(json.loads(json.dumps(store.graph_to_json(graph))))
    assert back.segments == graph.segments and back.layer_order == graph.layer_order
    assert [back.graph.nodes[n]["op"] for n in back.graph] == [graph.graph.nodes[n]["op"] for n in graph.graph]
    assert list(back.graph.edges) == list(graph.graph.edges)
    assert back.pipeline_side_values == graph.pipeline_side_values
    for name in store._GRAPH_SCALARS:
        assert getattr(back, name) == getattr(graph, name), name


def _load_in_a_new_process(spec: str, cache: Path) -> dict:
    """load_graph in a fresh interpreter: the graph's JSON and whether torch was imported."""
    code = ("import json, sys; from autoplan.trace.load import load_graph; from autoplan.trace import store; "
            f"g, ref, seq = load_graph({spec!r}, 64); "
            "print(json.dumps({'graph': store.graph_to_json(g), 'torch': 'torch' in sys.modules, 'name': ref.name}))")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cache.parent), "AUTOPLAN_CACHE_DIR": str(cache), "AUTOPLAN_CACHE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, check=True)
    return json.loads(out.stdout)


def test_a_second_load_neither_imports_torch_nor_traces(cache):
    first = _load_in_a_new_process("tiny-moe", cache)
    second = _load_in_a_new_process("tiny-moe", cache)
    assert first["torch"] and not second["torch"]
    assert second["graph"] == first["graph"] and second["name"] == "tiny-moe"
    assert len(list((cache / "graphs").glob("*.json"))) == 1


def test_changed_bytes_are_traced_again(cache, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    source = (REPO / "examples" / "nano_gpt.py").read_text()
    model = folder / "model.py"
    model.write_text(source)
    layers = load_graph(str(model), 64)[0].num_layers
    model.write_text(source.replace("MAX_SEQ = 256, 64, 2,", "MAX_SEQ = 256, 64, 3,"))
    assert load_graph(str(model), 64)[0].num_layers == layers + 1  # not the stored graph
    (folder / "helper.py").write_text("X = 1\n")  # a neighbour the model could import: a new key
    load_graph(str(model), 64)
    assert len(list((cache / "graphs").glob("*.json"))) == 3


def test_a_damaged_file_is_a_miss_and_is_replaced(cache):
    graph = load_graph("tiny-gpt", 64)[0]
    (path,) = (cache / "graphs").glob("*.json")
    path.write_text('{"format": 1, "key": "')
    assert store.read(path.stem) is None
    assert load_graph("tiny-gpt", 64)[0].segments == graph.segments
    assert store.read(path.stem) is not None


def test_the_cache_can_be_turned_off(cache, monkeypatch):
    monkeypatch.setenv("AUTOPLAN_CACHE", "0")
    load_graph("tiny-gpt", 64)
    assert not cache.exists()


def test_the_key_holds_the_request_and_the_code():
    parts = [b"config"]
    key = store.graph_key("m", parts, 64, None)
    assert key != store.graph_key("m", parts, 128, None)
    assert key != store.graph_key("m", parts, 64, None, batch_size=2)
    assert key != store.graph_key("other", parts, 64, None)
    assert key != store.graph_key("m", [b"config2"], 64, None)
    store.code_digest.cache_clear()
    try:
        store._PACKAGE = REPO / "examples"  # another source tree: another digest
        assert store.graph_key("m", parts, 64, None) != key
    finally:
        store._PACKAGE = REPO / "autoplan"
        store.code_digest.cache_clear()
