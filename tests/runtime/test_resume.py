"""Resume faults: a resumed run repeats the uninterrupted run's losses bit for bit, a
checkpoint that cannot be verified is never loaded, a changed --data file is refused.

Every case ends either with the uninterrupted run's losses, or with one paragraph, a
non-zero exit, and the checkpoints that remain still verifying.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from autoplan.errors import UserError
from autoplan.runtime.checkpoint import verified_checkpoint
from runtime_models import OPTIMIZER, plan_dict, reference_run, write_token_file

STEPS = 50
RESUME_AT = [7, 20, 33]  # in warm-up's wake, mid-decay, late decay


@pytest.mark.slow
def test_resume_is_bit_exact_at_several_steps(torchrun, tmp_path):
    # A model with dropout: its masks come from torch's default generator, the stream a
    # resumed process would otherwise restart from the seed. ZeRO-1 on 2 ranks: AdamW state
    # (step counts included) is saved as per-rank shards. CPU, same plan: exact equality.
    plan = plan_dict("dropgpt", dp=2, zero_stage=1)
    plan["optimizer"] = {**OPTIMIZER, "warmup_steps": 5, "max_steps": STEPS}
    configs = [{"name": "dropout-zero1", "kind": "dropgpt", "plan": plan, "steps": STEPS,
                "resume_at": RESUME_AT}]
    (tmp_path / "configs.json").write_text(json.dumps(configs))
    start = time.perf_counter()
    proc = torchrun("resume_worker.py", 2, tmp_path / "configs.json", tmp_path / "out.json",
                    tmp_path / "work", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"4 runs of {STEPS} steps, resumed at {RESUME_AT}: {time.perf_counter() - start:.0f} s")
    result = json.loads((tmp_path / "out.json").read_text())["dropout-zero1"]
    assert len(result["reference"]) == STEPS
    for stop, losses in result["resumed"].items():
        assert losses == result["reference"], f"resumed at step {stop}"


def _ckpt(tmp_path, *flags, data=None):
    return ("ckpt_worker.py", 2, tmp_path / "plan.json", tmp_path / "out.json",
            "--seed", "1234", "--data", data, "--checkpoint-dir", tmp_path / "ckpt",
            "--run-dir", tmp_path / "run", *flags)


def _launch(torchrun, *args):
    return torchrun(*args, timeout=420)


@pytest.mark.slow
def test_resume_faults(torchrun, tmp_path):
    data = tmp_path / "tokens.bin"
    write_token_file(data)
    (tmp_path / "plan.json").write_text(json.dumps(plan_dict(dp=2, zero_stage=3)))
    ref, _ = reference_run("llama", steps=6, data_path=data)
    ckpt = tmp_path / "ckpt"
    first = _launch(torchrun, *_ckpt(tmp_path, "--steps", "4", "--checkpoint-every", "2", data=data))
    assert first.returncode == 0, first.stderr[-4000:]

    # The newest checkpoint without its manifest: skipped, said, the older one is loaded.
    # The uninterrupted run is the 1-process reference: 2-rank DP sums in another order, so
    # 1e-6 relative (the same-plan bound of test_checkpoint.py), not equality. Two ranks,
    # not four: four torchrun launches of four ranks outran a 240 s limit on 2 shared cores.
    (ckpt / "step_000004" / "manifest.json").unlink()
    fell_back = _launch(torchrun, *_ckpt(tmp_path, "--steps", "6", "--resume", data=data))
    assert fell_back.returncode == 0, fell_back.stderr[-4000:]
    assert "step_000004/manifest.json: missing, so its files cannot be verified" in fell_back.stdout
    assert "falling back to" in fell_back.stdout and "(step 2)" in fell_back.stdout
    resumed = json.loads((tmp_path / "out.json").read_text())
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, ref[2:6])) <= 1e-6

    # The data file truncated between runs: refused, exit 2, the checkpoints untouched.
    data.write_bytes(data.read_bytes()[:-2000])
    changed = _launch(torchrun, *_ckpt(tmp_path, "--steps", "8", "--resume", data=data))
    assert changed.returncode != 0
    assert "the data changed since the checkpoint was saved" in changed.stderr
    # (torchrun itself prints its ChildFailedError traceback for the non-zero exit; launch.sh
    # runs the same check in one process, --check-only, before torchrun)
    assert "autoplan: error: --data" in changed.stderr and "--allow-data-change" in changed.stderr
    assert verified_checkpoint(ckpt) == ckpt / "step_000002"  # still loadable

    # No checkpoint verifies (every manifest gone): refused, exit 2, nothing loaded.
    for folder in ckpt.glob("step_*"):
        (folder / "manifest.json").unlink(missing_ok=True)
    refused = _launch(torchrun, *_ckpt(tmp_path, "--steps", "8", "--resume", "--allow-data-change",
                              data=data))
    assert refused.returncode != 0
    assert "no checkpoint in" in refused.stderr and "cannot be verified" in refused.stderr
    assert "autoplan: error: no checkpoint in" in refused.stderr



def _fake_checkpoint(folder, step):
    """A complete checkpoint folder with a manifest of its files (no process group needed)."""
    from autoplan.runtime.checkpoint import MANIFEST, _file_entries

    path = folder / f"step_{step:06d}"
    path.mkdir(parents=True)
    for name, text in ((".metadata", "meta"), ("__0_0.distcp", f"w{step}"),
                       ("trainer.json", json.dumps({"step": step}))):
        (path / name).write_text(text)
    names = sorted(p.name for p in path.iterdir())
    (path / MANIFEST).write_text(json.dumps({"step": step, "files": _file_entries(path, names)}))
    return path


def test_unlisted_file_is_not_verified_and_falls_back(tmp_path):
    older, newer = _fake_checkpoint(tmp_path, 2), _fake_checkpoint(tmp_path, 4)
    (newer / "__1_0.distcp").write_text("a shard the manifest does not list")
    said = []
    assert verified_checkpoint(tmp_path, said.append) == older
    assert "__1_0.distcp: not listed in the manifest" in said[0]
    assert "falling back to" in said[1]


def test_no_verifiable_checkpoint_is_refused(tmp_path):
    only = _fake_checkpoint(tmp_path, 2)
    (only / "manifest.json").unlink()
    with pytest.raises(UserError, match="cannot be verified"):
        verified_checkpoint(tmp_path, lambda _text: None)


def test_data_fingerprint_refuses_changes(tmp_path):
    from autoplan.runtime.data import check_same_data, data_fingerprint

    data = tmp_path / "tokens.bin"
    data.write_bytes(bytes(range(256)) * 4096)  # 1 MiB: every byte is sampled
    saved = data_fingerprint(str(data))
    assert check_same_data(saved, str(data), allow_change=False) is None
    moved = tmp_path / "copy.bin"
    shutil.copy(data, moved)  # another path and mtime, the same tokens: accepted
    assert check_same_data(saved, str(moved), allow_change=False) is None
    data.write_bytes(bytes(reversed(range(256))) * 4096)  # replaced, same size
    with pytest.raises(UserError, match="sampled blocks of its contents differ"):
        check_same_data(saved, str(data), allow_change=False)
    assert "--allow-data-change" in check_same_data(saved, str(data), allow_change=True)
    with pytest.raises(UserError, match="the checkpoint trained on"):
        check_same_data(saved, "synthetic", allow_change=False)
