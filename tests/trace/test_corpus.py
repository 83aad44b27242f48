"""Tracing the models users have (tests/corpus.py): parameters exact, FLOPs within 1% of
FlopCounterMode over the whole model, the block stacks, attention and MoE modules, and a
plan on 64 H100s for every full-size model (built on meta).

The 1% tolerance is the project's bar for FLOPs against FlopCounterMode; the traces here
are exact (the reference counts the same torch calls), so any drift shows up. Full-size
models are traced once per session (`full_graph`).
"""

from __future__ import annotations

import pytest
import torch

from autoplan.errors import UserError
from autoplan.trace.tracer import trace_model
import corpus

pytest.importorskip("transformers")

NAMES = sorted(corpus.ENTRIES)
# full-size traces and 64-GPU plans cost up to minutes each: only entries that ask for them
FULL_NAMES = [n for n in NAMES if corpus.ENTRIES[n].full_tests]
# text models whose attention is not an SDPA call ring attention can replace
_FULL: dict[str, tuple] = {}


def _trace(entry: corpus.Entry, size: str):
    # the trace's numbers and facts; what the runtime applies (the capability probe) is
    # tested in test_capability.py and measured by benchmarks/corpus_matrix.py
    if size == "full":
        with torch.device("meta"):
            model = entry.build("full")
        inputs = entry.example_inputs("full", batch=1, seq=256)
    else:
        model = entry.build("tiny")
        inputs = entry.example_inputs("tiny", batch=2, seq=16, device="cpu")
    reference = None if size == "full" and entry.data_dependent else corpus.reference_flops(model, inputs)
    meta_inputs = {k: v.to("meta") for k, v in inputs.items()}
    graph = trace_model(model, (), example_kwargs=meta_inputs, name=entry.name, probe_runtime=False)
    return model, graph, reference


@pytest.fixture(scope="session")
def full_graph():
    """(model, graph, reference FLOPs) of a full-size corpus model, traced once per session."""
    def get(name: str):
        if name not in _FULL:
            _FULL[name] = _trace(corpus.ENTRIES[name], "full")
        return _FULL[name]

    return get


def _stack_counts(graph) -> dict[str, int]:
    """Blocks per stack path (a stack's groups, e.g. T5's first block and the rest, summed)."""
    counts: dict[str, int] = {}
    for block in graph.blocks:
        stack = block.paths[0].rsplit(".", 1)[0]
        counts[stack] = counts.get(stack, 0) + block.count
    return counts


def _attention_modules(graph) -> set[str]:
    """Modules that run an attention core: SDPA/MultiheadAttention, or a matmul giving a
    (..., s, s) score matrix (T5 computes its scores by hand)."""
    found = set()
    for _, data in graph.graph.nodes(data=True):
        op = data["op"]
        square = op.kind == "matmul" and len(op.output_shape) >= 2 and \
            op.output_shape[-1] == op.output_shape[-2] > 1
        if op.kind == "attention" or square:
            found.add(op.module)
    return found


def _check_facts(entry: corpus.Entry, model, graph, reference, size: str) -> None:
    assert graph.parameters == corpus.parameter_count(model)
    if reference is not None:
        assert graph.forward_flops() == pytest.approx(reference, rel=0.01)
    assert _stack_counts(graph) == entry.stacks_for(size)
    attention = _attention_modules(graph)
    for path in entry.attention:
        assert path in attention, (path, sorted(attention)[:6])
    moe = {e["module"] for e in graph.expert_parallel}
    assert set(entry.moe) <= moe and (bool(moe) == bool(entry.moe))
    if entry.inputs == "image":
        side = entry.image_size if size == "full" else entry.tiny_image_size
        assert (graph.image_size, graph.seq_len) == (side, 1)
        # a sample is one image: no token sequence for ring attention to split (Swin's
        # attention is within windows, ViT's over one image's patches)
        assert graph.context_parallel == []
    elif entry.attention:  # nn.MultiheadAttention's too: its SDPA call runs ring attention
        assert graph.context_parallel, "attention over the token sequence is context-parallel"


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_traces_exactly(name):
    entry = corpus.ENTRIES[name]
    model, graph, reference = _trace(entry, "tiny")
    _check_facts(entry, model, graph, reference, "tiny")


@pytest.mark.parametrize("name", [n for n in NAMES if corpus.ENTRIES[n].inputs == "tokens"
                                  and not corpus.ENTRIES[n].hf])
def test_positional_token_ids_find_the_same_blocks(name):
    # a model file's inputs reach the tracer positionally (the symbolic fx path), where fx
    # keeps torch.nn modules whole: nn.TransformerEncoder's layers went uncosted and
    # `autoplan plan` stopped with a StopIteration
    entry = corpus.ENTRIES[name]
    with torch.device("meta"):
        model = entry.build("tiny")
    ids = entry.example_inputs("tiny", batch=2, seq=16)["input_ids"]
    positional = trace_model(model, (ids,), name=name, probe_runtime=False)
    keyword = trace_model(model, (), example_kwargs={"input_ids": ids}, name=name, probe_runtime=False)
    assert _stack_counts(positional) == entry.stacks_for("tiny")
    assert {b.name for b in positional.blocks} == {b.name for b in keyword.blocks}
    assert positional.forward_flops() == pytest.approx(keyword.forward_flops(), rel=0.01)


@pytest.mark.parametrize("name", FULL_NAMES)
def test_full_model_traces_exactly(name, full_graph):
    entry = corpus.ENTRIES[name]
    model, graph, reference = full_graph(name)
    _check_facts(entry, model, graph, reference, "full")


def test_routing_loop_is_run_with_balanced_routing_and_named():
    # The top-2 routing loop cannot run on meta as written (torch.where on a mask); it runs
    # with T*k/E tokens per expert, and the FLOPs equal a real run's (dropless top-k routing
    # sends T*k tokens whatever the router picks). T*k/E = 2*16*2/4 = 16 exactly.
    entry = corpus.ENTRIES["moe_loop"]
    model, graph, reference = _trace(entry, "tiny")
    assert graph.forward_flops() == reference
    assert graph.fallback_modules == ["layers.0.moe", "layers.1.moe"]


@pytest.mark.parametrize("name", FULL_NAMES)
def test_full_model_plans_on_64_h100(name, full_graph):
    from autoplan.hardware import resolve_cluster
    from autoplan.plan import ModelRef
    from autoplan.solve.api import plan_job

    _, graph, _ = full_graph(name)
    cluster = resolve_cluster("h100", None, 64, None)
    # the search returns once optimal; the limit binds only on a loaded machine
    job = plan_job(graph, ModelRef("file", name, f"{name}.py", graph.fingerprint), cluster,
                   global_batch=256, seq_len=graph.seq_len, time_limit_s=600.0)
    assert job.plan is not None, name


def test_value_branch_outside_routing_is_a_user_error_naming_the_module():
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) if x.mean() > 0 else x

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = Gate()

        def forward(self, x, scale=2.0):
            return self.gate(x) * scale

    with torch.device("meta"):
        model = Net()
    with pytest.raises(UserError, match=r"forward of gate fails .*outside a routing"):
        trace_model(model, (torch.empty(2, 8, device="meta"),), example_kwargs={"scale": 3.0})


POSITIONAL = ["mixtral", "qwen2_moe"] + sorted(n for n, e in corpus.ENTRIES.items()
                                               if not e.hf and e.inputs == "tokens")


@pytest.mark.parametrize("name", POSITIONAL)
def test_model_given_positional_ids_traces_exactly(name):
    # the command line passes token ids positionally: a model torch.fx can trace is traced
    # symbolically there (keyword inputs always run the forward), and the facts must not
    # depend on the path. nn.TransformerEncoder was one opaque fx leaf, without blocks; the
    # transformers MoE CausalLM root states the expert count for its aux loss but is no MoE
    # layer (folded as one, Mixtral-8x7B's forward FLOPs came out 6.8x too low)
    entry = corpus.ENTRIES[name]
    model = entry.build("tiny")
    inputs = entry.example_inputs("tiny", batch=2, seq=16, device="cpu")
    reference = corpus.reference_flops(model, inputs)
    graph = trace_model(model, (inputs["input_ids"].to("meta"),), name=name, probe_runtime=False)
    _check_facts(entry, model, graph, reference, "tiny")


def test_full_mixtral_config_plans_with_tp_fixed(run_cli, tmp_path):
    # the command-line path: a config.json built with its transformers class traces with
    # positional token ids; --fix tp=2 exited 2 ("no column/row linear pairs") before
    import json

    model_cls, _, fields, _ = corpus.HF_MODELS["mixtral"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="mixtral", architectures=[model_cls], **fields)))
    code, stdout, stderr = run_cli("plan", f"hf:{path}", "--gpu", "h100", "--gpus", "64",
                                   "--global-batch", "256", "--fix", "tp=2", "--time-limit", "20",
                                   "--json")
    assert code == 0, stdout + stderr
    assert json.loads(stdout)["plan"]["tp"] == 2
