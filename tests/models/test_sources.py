"""MODEL sources: Python files, HF config.json, catalog names; every bad-input case."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from autoplan.errors import UserError
from autoplan.models.sources import build_from_ref, fingerprint, load_model

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
              "max_position_embeddings": 256}


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def all_meta(model: nn.Module) -> bool:
    return all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


# ---------------------------------------------------------------- good inputs


def test_example_nano_gpt_file_gets_token_ids():
    loaded = load_model(str(EXAMPLES / "nano_gpt.py"))
    assert loaded.ref.source == "file" and loaded.ref.name == "nano_gpt"
    assert type(loaded.module).__name__ == "NanoGPT" and all_meta(loaded.module)
    # V*h (tied) + s*h + L*(12h^2 + 13h) + 2h with V=256, s=256, h=64, L=2
    assert n_params(loaded.module) == 256 * 64 + 256 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64
    (tokens,) = loaded.example_inputs(3, 17)
    assert tokens.shape == (3, 17) and tokens.dtype == torch.int64 and tokens.is_meta
    assert loaded.module(tokens).shape == (3, 17, 256)


def test_example_own_batch_is_traced_with_its_keyword_batch():
    loaded = load_model(str(EXAMPLES / "own_batch.py"))
    assert loaded.user_batch and not loaded.takes_images
    inputs = loaded.example_inputs(2, 16)
    assert set(inputs) == {"input_ids", "attention_mask"}
    assert all(t.is_meta and tuple(t.shape) == (2, 16) for t in inputs.values())


def test_example_custom_mlp_uses_its_example_inputs():
    loaded = load_model(str(EXAMPLES / "custom_mlp.py"))
    assert type(loaded.module).__name__ == "ResidualMLP"
    (x,) = loaded.example_inputs(2, 5)
    assert x.shape == (2, 5, 32) and x.dtype == torch.float32 and x.is_meta
    assert loaded.module(x).shape == (2, 5, 10)


def test_catalog_name_and_fingerprint():
    loaded = load_model("Tiny-GPT")
    assert loaded.ref.source == "catalog" and loaded.ref.name == "tiny-gpt"
    assert loaded.default_seq_len == 128 and loaded.config["model_type"] == "llama"
    assert all_meta(loaded.module)
    assert len(loaded.ref.fingerprint) == 64
    assert loaded.ref.fingerprint == load_model("tiny-gpt").ref.fingerprint
    assert loaded.ref.fingerprint != load_model("tiny-moe").ref.fingerprint


def test_config_json_and_hf_model_directory(tmp_path):
    model_dir = tmp_path / "my-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({**TINY_LLAMA, "_autoplan": {"seq_len": 64}}))
    loaded = load_model(str(model_dir / "config.json"))
    assert loaded.ref.source == "config" and loaded.ref.name == "my-llama"
    assert loaded.default_seq_len == 64 and "_autoplan" not in loaded.config
    # same architecture as the tiny-gpt catalog entry -> same parameter count
    assert n_params(loaded.module) == n_params(load_model("tiny-gpt").module)
    assert load_model(str(model_dir)).ref.fingerprint == loaded.ref.fingerprint


def test_module_level_construction_allocates_nothing(write_file):
    # 50k x 50k fp32 = 10 GB if it were real; on meta it is free
    path = write_file("huge.py", """
        import torch.nn as nn
        model = nn.Sequential(nn.Embedding(50_000, 50_000), nn.Linear(50_000, 50_000))
    """)
    start = time.perf_counter()
    loaded = load_model(path)
    assert time.perf_counter() - start < 5  # generous: a real allocation would take far longer or fail
    assert all_meta(loaded.module) and n_params(loaded.module) == 2 * 50_000**2 + 50_000
    assert loaded.example_inputs(2, 8)[0].dtype == torch.int64


def test_first_leaf_linear_gets_float_features(write_file):
    path = write_file("mlp.py", """
        import torch.nn as nn
        model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 3))
    """)
    (x,) = load_model(path).example_inputs(4, 6)
    assert x.shape == (4, 6, 12) and x.dtype == torch.float32


def test_single_root_class_is_chosen_over_its_parts(write_file):
    path = write_file("parts.py", """
        import torch.nn as nn
        class MLP(nn.Module):
            def __init__(self, dim=8):
                super().__init__()
                self.fc = nn.Linear(dim, dim)
            def forward(self, x):
                return self.fc(x)
        class Block(nn.Module):
            def __init__(self, dim):  # needs an argument: not a candidate
                super().__init__()
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(10, 8)
                self.mlp = MLP()
            def forward(self, x):
                return self.mlp(self.emb(x))
    """)
    assert type(load_model(path).module).__name__ == "Net"


def test_build_model_receives_seq_len_and_wins_over_classes(write_file):
    path = write_file("with_seq.py", """
        import torch.nn as nn
        class Other(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(2, 2)
        def build_model(seq_len=16):
            return nn.Sequential(nn.Embedding(seq_len, 4), nn.Linear(4, 4))
    """)
    assert n_params(load_model(path).module) == 16 * 4 + 20
    assert n_params(load_model(path, seq_len=100).module) == 100 * 4 + 20


def test_build_from_ref_round_trips_each_source(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_LLAMA, "_autoplan": {"seq_len": 32}}))
    for spec in ("tiny-moe", str(config), str(EXAMPLES / "nano_gpt.py")):
        loaded = load_model(spec)
        rebuilt = build_from_ref(loaded.ref)
        assert fingerprint(rebuilt, loaded.config) == loaded.ref.fingerprint
        assert n_params(rebuilt) == n_params(loaded.module)


def test_build_from_ref_detects_a_changed_file(write_file, monkeypatch):
    # A user's shell writes bytecode; an edit of the same size within the same second must still
    # be seen, so the file may never be loaded from a cached .pyc.
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    path = write_file("m.py", "import torch.nn as nn\nmodel = nn.Sequential(nn.Embedding(8, 4))\n")
    ref = load_model(path).ref
    Path(path).write_text("import torch.nn as nn\nmodel = nn.Sequential(nn.Embedding(8, 5))\n")
    assert not (Path(path).parent / "__pycache__").exists()  # nothing cached beside the user's file
    with pytest.raises(UserError, match="the file changed"):
        build_from_ref(ref)
    # a ref without the file's hash (a plan from before autoplan recorded one) builds the edit
    assert n_params(build_from_ref(dataclasses.replace(ref, file_sha256=""), verify=False)) == 40


# ---------------------------------------------------------------- bad inputs


def _error(spec: str, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        load_model(spec, **kwargs)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message  # one paragraph for the CLI
    return message


def test_missing_files(tmp_path):
    assert "does not exist" in _error(str(tmp_path / "nope.py"))
    assert "does not exist" in _error(str(tmp_path / "nope.json"))


def test_unknown_catalog_name_lists_names():
    message = _error("gpt-17")
    assert "gpt-17" in message and "llama3.1-8b" in message and ".py" in message


def test_syntax_error_names_the_line(write_file):
    path = write_file("bad.py", "import torch\n\ndef build_model(:\n    pass\n")
    message = _error(path)
    assert "syntax error" in message and "line 3" in message


def test_error_while_running_the_file_names_the_line(write_file):
    path = write_file("boom.py", "import torch\nx = 1\nraise RuntimeError('kaput')\n")
    message = _error(path)
    assert "kaput" in message and "line 3" in message


def test_no_model_found(write_file):
    path = write_file("empty.py", "import torch.nn as nn\nDIM = 4\n")
    assert "no model found" in _error(path)


def test_several_candidate_classes(write_file):
    path = write_file("two.py", """
        import torch.nn as nn
        class A(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(2, 2)
        class B(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(3, 3)
    """)
    message = _error(path)
    assert "several candidate" in message and "A" in message and "B" in message
    assert "build_model" in message


def test_constructor_needing_arguments(write_file):
    path = write_file("args.py", """
        import torch.nn as nn
        class Net(nn.Module):
            def __init__(self, dim, layers=2):
                super().__init__()
    """)
    message = _error(path)
    assert "Net(dim)" in message and "defaults" in message


def test_constructor_raising(write_file):
    path = write_file("ctor.py", """
        import torch.nn as nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                raise ValueError("bad size")
    """)
    assert "bad size" in _error(path)


def test_build_model_raising_names_function_and_line(write_file):
    path = write_file("raises.py", """
        import torch.nn as nn
        def build_model():
            return nn.Linear(4, -4)
    """)
    message = _error(path)
    assert "build_model()" in message and "line 4" in message


def test_build_model_returning_non_module(write_file):
    path = write_file("notmodule.py", "def build_model():\n    return 42\n")
    assert "not an nn.Module" in _error(path)


def test_module_level_model_not_a_module(write_file):
    path = write_file("model_str.py", "model = 'gpt'\n")
    assert "not an nn.Module" in _error(path)


def test_unknown_first_op_needs_example_inputs(write_file):
    path = write_file("conv.py", "import torch.nn as nn\nmodel = nn.Sequential(nn.Conv1d(3, 8, 3))\n")
    assert "example_inputs" in _error(path)


def test_conv2d_first_takes_an_image_batch_of_the_given_side(write_file):
    path = write_file("cnn.py", "import torch.nn as nn\nmodel = nn.Sequential(nn.Conv2d(5, 8, 3))\n")
    loaded = load_model(path)
    assert loaded.takes_images
    (images,) = loaded.example_inputs(2, 64)
    assert tuple(images.shape) == (2, 5, 64, 64) and images.is_floating_point()


def test_example_inputs_may_return_keyword_inputs(write_file):
    path = write_file("kw.py", """
        import torch, torch.nn as nn
        model = nn.Linear(4, 4)
        def example_inputs(batch_size, seq_len):
            return {"input": torch.zeros(batch_size, seq_len, 4)}
    """)
    inputs = load_model(path).example_inputs(2, 3)
    assert set(inputs) == {"input"} and inputs["input"].is_meta


def test_example_inputs_returning_garbage(write_file):
    path = write_file("garbage.py", """
        import torch.nn as nn
        model = nn.Linear(4, 4)
        def example_inputs(batch_size, seq_len):
            return "tokens"
    """)
    loaded = load_model(path)
    with pytest.raises(UserError, match="tuple of tensors"):
        loaded.example_inputs(2, 3)


@pytest.mark.parametrize("config, phrase", [
    ({**TINY_LLAMA, "model_type": "bert"}, "model_type 'bert'"),
    ({k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, "model_type None"),
    ({**TINY_LLAMA, "num_attention_heads": 5}, "num_attention_heads=5 does not divide"),
    ({**TINY_LLAMA, "hidden_size": -64}, "'hidden_size' must be a positive integer"),
    ({**TINY_LLAMA, "model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3},
     "exceeds"),
    ({"model_type": "gpt2", "n_embd": 64}, "'n_layer'"),
])
def test_invalid_configs(tmp_path, config, phrase):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    message = _error(str(path))
    assert phrase in message and str(path) in message


def test_config_not_json_or_not_object(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama",\n  "hidden_size": }')
    assert "line 2" in _error(str(path))
    path.write_text("[1, 2]")
    assert "JSON object" in _error(str(path))


def test_seq_len_beyond_the_models_positions():
    message = _error("tiny-gpt", seq_len=1024)
    assert "1024" in message and "256" in message
    assert load_model("tiny-gpt", seq_len=256).module is not None


_TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
               "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def _hf_config(tmp_path, **autoplan) -> Path:
    path = tmp_path / "llama" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**_TINY_LLAMA, **({"_autoplan": autoplan} if autoplan else {})}))
    return path


def test_config_builds_the_transformers_class_when_asked(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = _hf_config(tmp_path, model_source="transformers")
    loaded = load_model(str(path))
    assert type(loaded.module) is transformers.LlamaForCausalLM
    assert loaded.ref.source == "transformers" and next(loaded.module.parameters()).is_meta
    again = build_from_ref(loaded.ref)  # what the generated job does
    assert type(again) is transformers.LlamaForCausalLM


def test_hf_prefix_builds_the_transformers_class_and_default_stays_reference(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = _hf_config(tmp_path)
    assert type(load_model(f"hf:{path.parent}").module) is transformers.LlamaForCausalLM
    assert not type(load_model(str(path)).module).__module__.startswith("transformers")


def test_transformers_source_without_transformers_is_one_paragraph(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    with pytest.raises(UserError, match="pip install 'transformers"):
        load_model(str(_hf_config(tmp_path, model_source="transformers")))


def test_unknown_transformers_family_is_one_short_paragraph(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "florbnet", "hidden_size": 64}))
    with pytest.raises(UserError) as info:
        load_model(f"hf:{path}")
    message = str(info.value)
    assert "does not know model_type 'florbnet'" in message
    # transformers' own error lists every family it knows (over 10,000 characters)
    assert len(message) < 400, len(message)


def test_transformers_config_defaults_to_its_positions_and_feeds_encoder_decoders(tmp_path):
    # hf: kept the 2048-token fallback past GPT-2's 1024 positions (traced silently beyond the
    # position table: FLOPs 2.3x), and called T5 with input_ids alone (its forward refused)
    pytest.importorskip("transformers")
    gpt2 = tmp_path / "gpt2" / "config.json"
    gpt2.parent.mkdir()
    gpt2.write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                "vocab_size": 256, "n_positions": 128, "n_embd": 64, "n_layer": 2,
                                "n_head": 4}))
    assert load_model(f"hf:{gpt2}").default_seq_len == 128
    t5 = tmp_path / "t5" / "config.json"
    t5.parent.mkdir()
    t5.write_text(json.dumps({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
                              "vocab_size": 256, "d_model": 64, "d_kv": 16, "d_ff": 128,
                              "num_layers": 2, "num_heads": 4}))
    inputs = load_model(f"hf:{t5}").example_inputs(2, 16)
    assert sorted(inputs) == ["decoder_input_ids", "input_ids"]
    assert inputs["decoder_input_ids"].shape == (2, 16)


def test_a_config_transformers_saved_with_an_infinite_field_builds(tmp_path):
    # save_pretrained writes float("inf") as {"__float__": "Infinity"} (Falcon-H1's Mamba-2
    # time_step_limit of (0, inf)); read back as a dict it failed the config's type check
    transformers = pytest.importorskip("transformers")
    config = transformers.FalconH1Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=256)
    config.architectures = ["FalconH1ForCausalLM"]
    config.save_pretrained(tmp_path)
    assert '"__float__": "Infinity"' in (tmp_path / "config.json").read_text()
    module = load_model(f"hf:{tmp_path}").module
    assert type(module) is transformers.FalconH1ForCausalLM
    assert module.config.time_step_limit[1] == float("inf")
