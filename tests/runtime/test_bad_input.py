"""Bad plans fail with one clear message, before any collective, with exit status 2."""

from __future__ import annotations

import json

import pytest

from autoplan.runtime import TrainArgs, train
from runtime_models import IMAGE_INPUTS, builder, plan_dict

CASES = {
    "world_size": ("llama", plan_dict(dp=2), "plan is for 2 processes but 1 were launched"),
    "missing_module": ("llama", dict(plan_dict(), recompute={"layers.9": "full"}),
                       "recompute: layers.9"),
    "cp_without_sdpa": ("manualgpt", dict(plan_dict("manualgpt"), cp_modules=["blocks.0"]),
                        "does not call F.scaled_dot_product_attention"),
    "image_model": ("vit", plan_dict(), "TinyViT has no nn.Embedding, so it does not read token ids"),
    "image_channels": ("image_vit", dict(plan_dict("image_vit"), inputs=dict(IMAGE_INPUTS, channels=1)),
                       "the model's first Conv2d takes 3 channels"),
    "plan_not_a_plan": ("llama", {"format_version": 1, "world_size": 1}, "plan keys do not match"),
}


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][2]])
def test_bad_plan_exits_2_with_message(case, capsys, monkeypatch, tmp_path):
    """In one process (WORLD_SIZE unset = 1): train() must stop before init_process_group."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    kind, plan, message = CASES[case]
    with pytest.raises(SystemExit) as exc:
        train(builder(kind), plan, TrainArgs(steps=1, run_dir=str(tmp_path)))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("autoplan: error:")
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_token_file_for_an_image_plan_exits_2(capsys, monkeypatch, tmp_path):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    data = tmp_path / "tokens.bin"
    data.write_bytes(bytes(64))
    with pytest.raises(SystemExit) as exc:
        train(builder("image_vit"), plan_dict("image_vit"),
              TrainArgs(steps=1, run_dir=str(tmp_path / "run"), data=str(data)))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("autoplan: error: --data") and "image classifier" in err
    assert "Traceback" not in err and "\n\n" not in err.strip()


def test_ep_on_dense_model_names_the_module():
    """ep=2 needs 2 ranks, so check the model-level error through validate_plan (meta)."""
    import torch

    from autoplan.errors import UserError
    from autoplan.plan import Plan
    from autoplan.runtime import validate_plan

    full = Plan.from_dict(dict(plan_dict(dp=2), ep=2, ep_modules=["layers.0.mlp"]))
    with torch.device("meta"):
        model = builder("llama")()
    with pytest.raises(UserError, match=r"'layers\.0\.mlp' \(SwiGLU\), which expert parallelism "
                                        r"cannot shard: it has no `experts` submodule"):
        validate_plan(model, full)


@pytest.mark.slow
@pytest.mark.parametrize("case,nproc", [("world_size", 4), ("ep_without_moe", 2)])
def test_bad_plan_under_torchrun_every_rank_exits(torchrun, tmp_path, case, nproc):
    kind = "llama"
    if case == "world_size":
        plan, message = plan_dict(dp=2), "plan is for 2 processes but 4 were launched"
    else:
        plan = dict(plan_dict(dp=2), ep=2, ep_modules=["layers.0.mlp"])
        message = "which expert parallelism cannot shard: it has no `experts` submodule"
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc = torchrun("bad_input_worker.py", nproc, tmp_path / "plan.json", kind, timeout=120)
    assert proc.returncode != 0
    assert "TRAINED" not in proc.stdout
    assert proc.stderr.count(message) == 1, proc.stderr[-3000:]  # rank 0 only
    # The ranks exit with status 2 on their own; torchrun stops the others as soon as the
    # first one exits, so its report lists that rank's 2 (and SIGTERM for the slower ones).
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
