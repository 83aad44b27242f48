"""The importers and run validation as the user reaches them: through estimate/plan/validate."""

from __future__ import annotations

import json


def test_estimate_from_megatron_lists_what_it_read(run_cli, repo):
    code, out, err = run_cli("estimate", "llama2-7b", "--gpu", "h100", "--gpus", "16", "--seq-len", "4096",
                             "--from-megatron", "@" + str(repo / "examples/configs/megatron_llama2_7b.args"),
                             "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["imported"]["source"].startswith("megatron")
    config = data["config"]
    assert config["dp"] * config["tp"] * config["pp"] * config["cp"] == 16
    assert data["imported"]["unsupported"] is not None


def test_estimate_from_import_rejects_mixed_options(run_cli, repo):
    code, _, err = run_cli("estimate", "llama2-7b", "--gpu", "h100", "--gpus", "16", "--tp", "2",
                           "--from-deepspeed", str(repo / "examples/configs/ds_config.json"))
    assert code == 2 and "drop" in err


def test_validate_needs_a_file_or_a_run(run_cli):
    code, _, err = run_cli("validate")
    assert code == 2 and "--run" in err
