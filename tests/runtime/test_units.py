"""Fast in-process checks of the runtime's pure parts (no process group needed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from autoplan.runtime import lr_at, parse_args
from autoplan.runtime.checkpoint import latest_checkpoint
from autoplan.runtime.data import TokenFile, local_microbatches, zigzag_positions
import hf_models
from autoplan.runtime.pipeline import (StageTie, pipeline_split_problem, split_stages, stage_indices,
                                       stage_ties, untie_on_one_rank)
from runtime_models import builder


def test_import_pulls_no_planner_dependencies():
    code = ("import sys, autoplan.runtime; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('ortools','jinja2','networkx','click','rich') or m.startswith(('autoplan.cost',"
            "'autoplan.solve','autoplan.trace.tracer','autoplan.trace.summary','autoplan.cli'))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_positions_partition_and_balance(cp):
    seq = 32
    parts = [zigzag_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    # causal work of a query at position p is p+1 keys: equal on every rank
    work = {int((p + 1).sum()) for p in parts}
    assert len(work) == 1


def test_lr_warmup_then_cosine_to_ten_percent():
    cfg = {"lr": 1.0, "warmup_steps": 4, "max_steps": 14}
    assert lr_at(0, cfg) == pytest.approx(0.25)
    assert lr_at(3, cfg) == pytest.approx(1.0)
    assert lr_at(9, cfg) == pytest.approx(0.55)  # half-way through the cosine: (1 + 0.1) / 2
    assert lr_at(14, cfg) == pytest.approx(0.1)
    assert lr_at(100, cfg) == pytest.approx(0.1)


@pytest.mark.parametrize("dtype,vocab", [("uint16", 1000), ("uint32", 100_000)])
def test_token_file_rows_are_file_slices(tmp_path, dtype, vocab):
    tokens = torch.arange(5000, dtype=torch.int64) % vocab
    path = tmp_path / "tokens.bin"
    width = 2 if dtype == "uint16" else 4
    path.write_bytes(b"".join(int(t).to_bytes(width, "little") for t in tokens.tolist()))
    source = TokenFile(str(path), vocab, seed=3)
    batch = source.global_batch(7, rows=4, seq_len=16)
    assert batch.shape == (4, 17) and batch.dtype == torch.int64
    for row in batch:
        start = int(row[0])
        assert row.tolist() == tokens[start: start + 17].tolist()
    again = TokenFile(str(path), vocab, seed=3).global_batch(7, rows=4, seq_len=16)
    assert torch.equal(batch, again)


def test_microbatches_cover_the_global_batch_once():
    batch = torch.arange(8 * 9).reshape(8, 9)
    seen = []
    for dp_rank in range(2):
        for inputs, labels in local_microbatches(batch, dp_rank=dp_rank, num_microbatches=2,
                                                 micro_batch=2, positions=None):
            assert torch.equal(inputs[:, 1:], labels[:, :-1])
            seen += inputs[:, 0].tolist()
    assert sorted(seen) == batch[:, 0].tolist()


@pytest.mark.parametrize("kind,prefix", [("llama", "layers"), ("gpt", "blocks")])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_split_stages_chain_equals_full_model(kind, prefix, num_stages):
    torch.manual_seed(0)
    if kind == "gpt":
        model = builder(kind)()
    else:
        model = builder(kind)()
        model.init_weights()
    stages = [[f"{prefix}.{i}" for i in range(4)][s * 4 // num_stages:(s + 1) * 4 // num_stages]
              for s in range(num_stages)]
    _check_chain(model, stages)


def _check_chain(model, stages):
    """The stages run one after another give the full model's logits, exactly; together
    they hold every parameter of the model once, under its own name."""
    tokens = torch.randint(0, 256, (2, 16))
    parts = split_stages(model, stages, torch.arange(16))
    values = (tokens,)
    for part in parts:
        out = part(*values)
        values = out if isinstance(out, tuple) else (out,)
    full = model(tokens)
    assert torch.equal(values[0], getattr(full, "logits", full))
    names = [n for part in parts for n, _ in part.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


@pytest.mark.parametrize("kind", ["hf_llama", "hf_mixtral", "hf_gptj", "hf_deepseek_v3"])
def test_hf_split_stages_chain_equals_full_model(kind):
    torch.manual_seed(0)
    model = builder(kind)()
    blocks = hf_models.blocks(kind)
    assert pipeline_split_problem(model, [blocks[:1], blocks[1:]]) is None
    _check_chain(model, [blocks[:1], blocks[1:]])


def test_pipeline_split_refuses_untraceable_models_with_a_reason():
    model = builder("hf_t5")()  # an encoder-decoder: no family of the shell split
    blocks = hf_models.blocks("hf_t5")
    reason = pipeline_split_problem(model, [blocks[:1], blocks[1:]])
    assert reason is not None and "torch.fx cannot trace" in reason and "'t5'" in reason
    assert "an encoder-decoder" in reason and "Error" not in reason  # the cause, not fx's words
    gpt2 = builder("hf_gpt2")()  # split by the shells; its head, its embedding, a copy per stage
    gpt2_blocks = hf_models.blocks("hf_gpt2")
    assert pipeline_split_problem(gpt2, [gpt2_blocks[:1], gpt2_blocks[1:]]) is None
    llama = builder("hf_llama")()
    llama_blocks = hf_models.blocks("hf_llama")
    assert "once each, in order" in pipeline_split_problem(llama, [llama_blocks[1:], llama_blocks[:1]])


def test_a_tied_head_is_a_tie_between_the_first_and_last_stage():
    with torch.device("meta"):
        model = builder("tied_llama")()
    stages = [["layers.0"], ["layers.1"], ["layers.2"], ["layers.3"]]
    ties = stage_ties(model, split_stages(model, stages, torch.arange(4)))
    assert ties == [StageTie("embed_tokens.weight", ((0, "embed_tokens.weight"), (3, "lm_head.weight")))]
    with torch.device("meta"):
        untied = builder("llama")()
    assert stage_ties(untied, split_stages(untied, stages, torch.arange(4))) == []


@pytest.mark.parametrize("kind", ["tied_llama", "hf_gpt2"])
def test_two_stages_on_one_rank_get_a_copy_each_of_what_they_share(kind):
    # the V placement puts stages 0 and 3 on pipeline rank 0: the last stage's head becomes
    # its own parameter, of the same value; the first stage keeps the model's
    torch.manual_seed(0)
    model = builder(kind)()
    blocks = hf_models.blocks(kind) if kind.startswith("hf_") else [f"layers.{i}" for i in range(4)]
    stages = [[block] for block in blocks]  # 4 stages of the Llama, 2 of the GPT-2
    parts = split_stages(model, stages, torch.arange(8))
    ties = stage_ties(model, parts)
    first, last = 0, len(stages) - 1
    (embed_name, head_name) = [name for _, name in ties[0].users]
    shared = model.get_parameter(embed_name)
    untie_on_one_rank(ties, [parts[first], parts[last]], [first, last])
    head = parts[last].get_parameter(head_name)
    assert head is not shared and torch.equal(head, shared)
    assert parts[first].get_parameter(embed_name) is shared


def test_stage_placement_loop_and_v():
    assert stage_indices(1, 4, 2, "interleaved-1f1b") == [1, 5]
    assert stage_indices(1, 4, 2, "zero-bubble") == [1, 6]


def test_latest_checkpoint_skips_incomplete(tmp_path):
    for name, complete in [("step_000003", True), ("step_000006", True),
                           ("step_000009", False), ("step_000012.tmp", True)]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / ".metadata").write_bytes(b"x")
        if complete:
            (folder / "trainer.json").write_text(json.dumps({"step": 1}))
    assert latest_checkpoint(tmp_path).name == "step_000006"
    assert latest_checkpoint(tmp_path / "missing") is None


def test_parse_args_defaults_and_flags():
    args = parse_args([])
    assert (args.steps, args.seed, args.data, args.resume) == (10, 0, "synthetic", False)
    assert args.checkpoint_path == "./runs/latest/checkpoints"
    args = parse_args(["--steps", "3", "--data", "x.bin", "--data-dtype", "uint32", "--resume",
                       "--run-dir", "r", "--checkpoint-every", "2", "--log-every", "5"])
    assert (args.steps, args.data, args.data_dtype, args.resume, args.checkpoint_path,
            args.checkpoint_every, args.log_every) == (3, "x.bin", "uint32", True,
                                                       "r/checkpoints", 2, 5)
    with pytest.raises(SystemExit):
        parse_args(["--steps", "-1"])


def test_metrics_record_the_device_they_ran_on(tmp_path):
    from autoplan.config import ParallelConfig
    from autoplan.plan import ModelRef, Plan
    from autoplan.runtime.loop import MetricsLog

    plan = Plan(model=ModelRef("catalog", "tiny-gpt"), gpu="h100-sxm-80gb", world_size=1, gpus_per_node=8,
                parallel=ParallelConfig(global_batch=2, seq_len=8))
    MetricsLog(str(tmp_path), plan, num_params=100).write(0, 1.0, 1e-4, 0.5, print_line=False)
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # validate --run compares a CPU run with the CPU cost model whatever GPU the plan was made for
    assert record["device"] == ("cuda" if torch.cuda.is_available() else "cpu")


def test_token_file_checks_size_and_every_id(tmp_path):
    import torch

    from autoplan.errors import UserError
    from autoplan.runtime.data import check_token_file

    path = tmp_path / "tokens.bin"
    tokens = torch.arange(300, dtype=torch.int32) % 200
    tokens.to(torch.int16).numpy().tofile(path)
    assert check_token_file(str(path), 256, seq_len=16, chunk_tokens=64) == 300
    tokens[250] = 256  # in the last chunk
    tokens.to(torch.int16).numpy().tofile(path)
    with pytest.raises(UserError, match="holds token id 256, but the model's vocabulary has 256"):
        check_token_file(str(path), 256, seq_len=16, chunk_tokens=64)
    with pytest.raises(UserError, match="holds 300 uint16 tokens; a training row needs"):
        check_token_file(str(path), 256, seq_len=400)


@pytest.mark.parametrize("content,message", [
    (b"", "holds 0 uint16 tokens"),
    (b"\x01\x00" * 10, "holds 10 uint16 tokens"),
    (b"\x01\x00" * 200 + b"\x01", "not a whole number of uint16 tokens"),
])
def test_a_token_file_too_short_or_ragged_is_refused_naming_its_size(tmp_path, content, message):
    """(launch.sh stops on such a file before any rank starts: tests/codegen/test_faults.py)"""
    from autoplan.errors import UserError
    from autoplan.runtime.data import check_token_file

    path = tmp_path / "tokens.bin"
    path.write_bytes(content)
    with pytest.raises(UserError, match=message):
        check_token_file(str(path), 256, seq_len=16)


class _PositionsDefaultNone(torch.nn.Module):
    """A decoder whose forward numbers the tokens itself when `position_ids` is None, the
    way a pipeline calls it (the first stage gets the token ids alone)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 32)
        self.pos = torch.nn.Embedding(16, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
        self.head = torch.nn.Linear(32, 256)

    def forward(self, ids, position_ids=None, *, scale: float = 1.0):
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1], device=ids.device)
        x = self.embed(ids) + self.pos(position_ids)[None]
        for layer in self.layers:
            x = x + torch.tanh(layer(x)) * scale
        return self.head(x)


class _EncoderDecoder(_PositionsDefaultNone):
    def forward(self, ids, decoder_input_ids):
        return super().forward(ids) + self.embed(decoder_input_ids).sum()


def test_inputs_with_defaults_split_as_the_pipeline_calls_the_model():
    torch.manual_seed(0)
    model = _PositionsDefaultNone()
    stages = [["layers.0", "layers.1"], ["layers.2", "layers.3"]]
    assert pipeline_split_problem(model, stages) is None
    _check_chain(model, stages)


def test_a_forward_needing_inputs_besides_the_tokens_is_refused_naming_them():
    reason = pipeline_split_problem(_EncoderDecoder(), [["layers.0", "layers.1"], ["layers.2", "layers.3"]])
    assert reason is not None and "decoder_input_ids besides the token ids" in reason


def test_dropout_layers_counts_what_draws_a_mask():
    from autoplan.runtime.rng import dropout_layers

    transformers = pytest.importorskip("transformers")
    config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64)
    with torch.device("meta"):
        quiet = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attention_dropout=0.0))
        attention = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attention_dropout=0.1))
        bert = transformers.BertModel(transformers.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=64))
    assert dropout_layers(quiet) == 0
    assert dropout_layers(attention) == 2  # a float attention_dropout per layer's attention
    # BERT's 0.1 defaults: the embeddings' dropout, and per layer attention probs, attention
    # output and MLP output
    assert dropout_layers(bert) == 1 + 3 * 2
    assert dropout_layers(torch.nn.Sequential(torch.nn.Dropout(0.0), torch.nn.Dropout(0.5))) == 1


class _PartlyInitialised(torch.nn.Module):
    """init_weights covers the linear but not the learned scalar and buffer (as transformers'
    _init_weights leaves xIELU's), which to_empty fills with whatever memory held."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.alpha = torch.nn.Parameter(torch.full((1,), 0.8))
        self.register_buffer("beta", torch.tensor(0.5))

    def init_weights(self):
        torch.nn.init.normal_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)


def test_materialise_gives_what_init_weights_leaves_unset_the_constructors_value():
    from autoplan.runtime.loop import materialise

    builds = []

    def build():
        builds.append(1)
        return _PartlyInitialised()

    def fresh():
        with torch.device("meta"):
            meta = _PartlyInitialised()
        return materialise(build, meta, seed=3, device=torch.device("cpu"))

    first, second = fresh(), fresh()
    assert float(first.alpha) == pytest.approx(0.8) and float(first.beta) == 0.5
    assert len(builds) == 2  # one device build per materialise, for the unset tensors
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    torch.manual_seed(3)  # the covered tensors are init_weights' own draws under the seed
    expected = torch.nn.init.normal_(torch.empty(4, 4))
    assert torch.equal(first.linear.weight, expected)


def test_materialise_builds_no_second_model_when_init_weights_covers_everything():
    from autoplan.runtime.loop import materialise

    with torch.device("meta"):
        meta = hf_models.build("hf_llama")
    model = materialise(lambda: pytest.fail("built a second model"), meta, seed=0, device=torch.device("cpu"))
    assert all(torch.isfinite(p).all() for p in model.parameters())
