"""`autoplan analyze` end to end through the CLI: JSON keys, sources, bad input exit codes."""

from __future__ import annotations

import json


from autoplan.models.sources import load_model

KEYS = {"parameters", "forward_flops", "train_flops", "activation_bytes", "blocks",
        "tensor_parallel", "context_parallel", "expert_parallel", "fallback_modules"}


def test_json_keys_and_values_for_catalog_model(run_cli):
    code, out, _ = run_cli("analyze", "tiny-gpt", "--seq-len", "64", "--batch-size", "2", "--json")
    assert code == 0
    data = json.loads(out)
    assert KEYS <= set(data)
    module = load_model("tiny-gpt").module
    assert data["parameters"] == sum(p.numel() for p in module.parameters())
    assert data["train_flops"] == 3 * data["forward_flops"]
    assert data["blocks"][0]["count"] == module.config["num_hidden_layers"]
    assert data["seq_len"] == 64 and data["batch_size"] == 2


def test_moe_model_lists_fallback_modules(run_cli):
    code, out, _ = run_cli("analyze", "tiny-moe", "--seq-len", "32", "--json")
    data = json.loads(out)
    assert code == 0
    assert data["fallback_modules"] and all(m.endswith(".mlp") for m in data["fallback_modules"])
    assert data["expert_parallel"][0]["experts"] >= 2


def test_python_file_source(run_cli, repo):
    code, out, _ = run_cli("analyze", str(repo / "examples" / "nano_gpt.py"), "--seq-len", "32", "--json")
    assert code == 0, out
    assert json.loads(out)["parameters"] > 0


def test_rich_output_mentions_structure(run_cli):
    code, out, _ = run_cli("analyze", "tiny-gpt", "--seq-len", "32")
    assert code == 0
    assert "Tensor parallel" in out and "parameters" in out


def test_bad_inputs_exit_2_without_traceback(run_cli, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def build_model(:\n")
    bad_config = tmp_path / "config.json"
    bad_config.write_text(json.dumps({"model_type": "llama", "hidden_size": 100,
                                      "num_hidden_layers": 2, "num_attention_heads": 3,
                                      "intermediate_size": 64, "vocab_size": 10}))
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model_type": "bert"}))
    meta_fails = tmp_path / "meta_fails.py"
    meta_fails.write_text(
        "import torch, torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.l = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n        return self.l(x) if x.sum().item() > 0 else x\n"
        "def example_inputs(batch_size, seq_len):\n    return (torch.zeros(batch_size, 4),)\n")
    for args in (["no/such/model.py"], [str(broken)], [str(bad_config)], [str(unknown)],
                 ["not-a-catalog-model"], [str(meta_fails)], ["tiny-gpt", "--seq-len", "0"]):
        code, out, err = run_cli("analyze", *args)
        assert code == 2, (args, out, err)
        assert "Traceback" not in err and err.startswith("error:"), (args, err)


def test_moe_layer_left_whole_by_tensor_parallelism_is_said(run_cli):
    code, out, _ = run_cli("analyze", "tiny-moe", "--seq-len", "32", "--json")
    assert code == 0
    data = json.loads(out)
    assert [p["row"] for p in data["tensor_parallel"]] == ["self_attn.o_proj"]
    assert [(m["block"], m["module"]) for m in data["tp_whole_moe"]] == [("layers", "mlp")]
    assert "replicated over the TP ranks" in data["tp_whole_moe"][0]["reason"]
    code, text, _ = run_cli("analyze", "tiny-moe", "--seq-len", "32")
    assert "not sharded: layers.mlp: a MoE layer" in " ".join(text.split())
    code, out, _ = run_cli("analyze", "tiny-gpt", "--seq-len", "32", "--json")
    assert json.loads(out)["tp_whole_moe"] == []  # no MoE layer
