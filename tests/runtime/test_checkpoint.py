"""Checkpoint/resume through the public train() API, and a rank killed mid-training.

The uninterrupted 6-step run (10 for the killed rank) is the single-process reference (runtime_models), so
"identical" means within the 1e-5 relative fp32 tolerance of test_parity (resuming onto
another plan changes the summation order); same-plan resume is checked at 1e-6.

Resuming in a new launch is test_resume_same_and_other_plan's and the killed rank's; the
layout tests save and resume as jobs of one launch per world size for all of them
(ckpt_worker --jobs, the `layouts` fixture), each a train() of its own that builds its model
and loads the checkpoint afresh.
"""

from __future__ import annotations

import json

import pytest

from runtime_models import plan_dict, reference_run, traced_plan_dict

STEPS = 6  # 3 before the checkpoint, 3 resumed


def _rel(a, b):
    return abs(a - b) / abs(b)


def _write(tmp, name, plan):
    path = tmp / name
    path.write_text(json.dumps(plan))
    return path


@pytest.mark.slow
def test_resume_same_and_other_plan(torchrun, tmp_path):
    ref_losses, ref_norms = reference_run("llama", steps=STEPS)
    save_plan = _write(tmp_path, "zero3.json", plan_dict(dp=2, zero_stage=3))
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    first = torchrun("ckpt_worker.py", 2, save_plan, tmp_path / "first.json", "--steps", "3",
                     "--seed", "1234", "--checkpoint-dir", ckpt, "--checkpoint-every", "3",
                     "--run-dir", run, "--resume")
    assert first.returncode == 0, first.stderr[-4000:]
    assert f"no complete checkpoint in {ckpt}: starting from step 0" in first.stdout
    assert (ckpt / "step_000003" / "trainer.json").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(3))
    assert {"step", "loss", "lr", "tokens_per_s", "mfu", "peak_memory_gib", "step_time_s"} <= set(records[0])
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 for r in records)
    # the logged pre-clip norm is the whole model's, as one process computes it (fp32 sums
    # in another order: 1e-5 relative)
    assert max(_rel(r["grad_norm"], n) for r, n in zip(records, ref_norms)) <= 1e-5

    same = torchrun("ckpt_worker.py", 2, save_plan, tmp_path / "same.json", "--steps", "6",
                    "--seed", "1234", "--checkpoint-dir", ckpt, "--resume", "--run-dir", run)
    assert same.returncode == 0, same.stderr[-4000:]
    assert "resumed from" in same.stdout and "(step 3)" in same.stdout
    resumed = json.loads((tmp_path / "same.json").read_text())
    assert len(resumed) == 3
    assert max(_rel(a, b) for a, b in zip(resumed, ref_losses[3:])) <= 1e-6

    # Onto another world size and plan: 4 ranks, dp2 x tp2 (FSDP + TP), same checkpoint.
    other_plan = _write(tmp_path, "dp2tp2.json", plan_dict(dp=2, tp=2, zero_stage=3))
    other = torchrun("ckpt_worker.py", 4, other_plan, tmp_path / "other.json", "--steps", "6",
                     "--seed", "1234", "--checkpoint-dir", ckpt, "--resume",
                     "--run-dir", tmp_path / "run4")
    assert other.returncode == 0, other.stderr[-4000:]
    resharded = json.loads((tmp_path / "other.json").read_text())
    assert max(_rel(a, b) for a, b in zip(resharded, ref_losses[3:])) <= 1e-5
    # a data-parallel checkpoint resuming onto a pipeline, whose fx stages hold the RoPE tables
    # as buffers the checkpoint lacks: test_pipelined_tied_checkpoint_keeps_the_models_names_and_resumes


@pytest.mark.slow
def test_killed_rank_resumes_from_last_complete_checkpoint(torchrun, tmp_path):
    ref_losses, _ = reference_run("llama", steps=10)
    plan = _write(tmp_path, "pp2.json", plan_dict(pp=2, schedule="1f1b"))
    ckpt = tmp_path / "ckpt"
    proc = torchrun("ckpt_worker.py", 2, plan, tmp_path / "out.json", "--steps", "10",
                    "--seed", "1234", "--checkpoint-dir", ckpt, "--checkpoint-every", "3",
                    "--resume", "--run-dir", tmp_path / "run",
                    torchrun_args=("--max-restarts=1",),
                    env={"AUTOPLAN_TEST_CRASH_STEP": "7"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Steps 0-6 ran, checkpoint 6 is the last complete one; the half-written step 8/9
    # folders left by the dying rank must be skipped.
    assert "(step 6)" in proc.stdout, proc.stdout[-2000:]
    losses = json.loads((tmp_path / "out.json").read_text())
    assert len(losses) == 4  # steps 6..9 after the restart
    assert _rel(losses[-1], ref_losses[-1]) <= 1e-6


def _save_job(plan, results, ckpt, run) -> list:
    """3 steps under `plan`, a checkpoint at step 3 in `ckpt` (a job of ckpt_worker --jobs)."""
    return [str(plan), str(results), ["--steps", "3", "--seed", "1234", "--checkpoint-dir", str(ckpt),
                                      "--checkpoint-every", "3", "--run-dir", str(run)]]


def _resume_job(plan, results, ckpt, run) -> list:
    """Steps 3..5 under `plan`, resumed from the checkpoint in `ckpt`."""
    return [str(plan), str(results), ["--steps", "6", "--seed", "1234", "--checkpoint-dir", str(ckpt),
                                      "--resume", "--run-dir", str(run)]]


def _run_jobs(torchrun, tmp_path, world: int, jobs: list) -> None:
    """One launch of `world` ranks training `jobs` one after the other (ckpt_worker --jobs)."""
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps(jobs))
    proc = torchrun("ckpt_worker.py", world, "--jobs", path, timeout=240 + 60 * len(jobs))
    assert proc.returncode == 0, proc.stderr[-4000:]


def _assert_resumed(kind: str, *results) -> None:
    """Each resumed run's losses are the reference's steps 3..5 within 1e-5 (as in
    test_parity: fp32 summation order only)."""
    ref_losses, _ = reference_run(kind, steps=STEPS)
    for path in results:
        losses = json.loads(path.read_text())
        assert len(losses) == 3 and max(_rel(a, b) for a, b in zip(losses, ref_losses[3:])) <= 1e-5, path.name


def _save_then_resume(tmp_path, plan, others: list[tuple[str, object]]) -> list:
    """Jobs: 3 steps under `plan` with a checkpoint at step 3, then steps 3..5 resumed under
    each of `others` (their losses in tmp_path/<name>.json)."""
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    return [_save_job(plan, tmp_path / "first.json", ckpt, run)] + [
        _resume_job(resumed, tmp_path / f"{name}.json", ckpt, run) for name, resumed in others]


# The layout tests' jobs, by test: {world size: jobs} from the test's own folder. They run in
# one launch per world size (the `layouts` fixture), world 2 first: a world-4 job may resume
# what a world-2 job saved.

def _zero1_to_fsdp(tmp) -> dict:
    return {2: _save_then_resume(tmp, _write(tmp, "zero1.json", plan_dict(dp=2, zero_stage=1)),
                                 [("fsdp", _write(tmp, "zero2.json", plan_dict(dp=2, zero_stage=2)))])}


def _zero1_tp_to_zero1(tmp) -> dict:
    return {4: _save_then_resume(tmp, _write(tmp, "tp_zero1.json", plan_dict(dp=2, tp=2, zero_stage=1)),
                                 [("dp4", _write(tmp, "dp4_zero1.json", plan_dict(dp=4, zero_stage=1)))])}


def _fsdp_experts(tmp) -> dict:
    return {4: _save_then_resume(
        tmp, _write(tmp, "ep2_zero2.json", plan_dict("mixtral", dp=4, ep=2, zero_stage=2)),
        [("zero1", _write(tmp, "ep2_zero1.json", plan_dict("mixtral", dp=4, ep=2, zero_stage=1))),
         ("ep4", _write(tmp, "ep4_zero3.json", plan_dict("mixtral", dp=4, ep=4, zero_stage=3)))])}


def _fused_projection(tmp) -> dict:
    tp2 = _write(tmp, "tp2.json", traced_plan_dict("hf_phi3", tp=2))
    dp2 = _write(tmp, "dp2.json", plan_dict("hf_phi3", dp=2))
    tp2_zero3 = _write(tmp, "tp2_zero3.json", traced_plan_dict("hf_phi3", dp=2, tp=2, zero_stage=3))
    from_tp2, from_dp2, run = tmp / "from_tp2", tmp / "from_dp2", tmp / "run"
    return {2: [_save_job(tp2, tmp / "tp2.losses.json", from_tp2, run),
                _resume_job(dp2, tmp / "dp2.resumed.json", from_tp2, run),
                _save_job(dp2, tmp / "dp2.losses.json", from_dp2, run)],
            4: [_resume_job(tp2_zero3, tmp / "tp2_zero3.resumed.json", from_dp2, tmp / "run4")]}


def _gpt2_conv1d(tmp) -> dict:
    return {2: _save_then_resume(tmp, _write(tmp, "tp2.json", traced_plan_dict("hf_gpt2", tp=2)),
                                 [("dp2", _write(tmp, "dp2.json", plan_dict("hf_gpt2", dp=2)))])}


def _replicated_kv(tmp) -> dict:
    dp2_tp2 = _write(tmp, "dp2_tp2_zero3.json", traced_plan_dict("hf_llama", dp=2, tp=2, zero_stage=3))
    return {4: _save_then_resume(tmp, _write(tmp, "tp4.json", traced_plan_dict("hf_llama", tp=4)),
                                 [("dp2_tp2_zero3", dp2_tp2)])}


TIED_PAIRS = [("pp", "zero3"), ("zero3", "pp"), ("v", "pp")]  # (saved by, resumed by)


def _pipelined_tied(tmp) -> dict:
    plans = {"pp": _write(tmp, "tied_pp2.json", plan_dict("tied_llama", pp=2, schedule="1f1b")),
             "zero3": _write(tmp, "tied_zero3.json", plan_dict("tied_llama", dp=2, zero_stage=3)),
             # the V placement: both copies on pipeline rank 0, one key; each copy loads it back
             "v": _write(tmp, "tied_v.json", plan_dict("tied_llama", pp=2, vpp=2, schedule="zero-bubble"))}
    return {2: [job for saved, resumed in TIED_PAIRS for job in (
        _save_job(plans[saved], tmp / f"{saved}.losses.json", tmp / saved, tmp / "run"),
        _resume_job(plans[resumed], tmp / f"{resumed}_from_{saved}.json", tmp / saved, tmp / "run"))]}


LAYOUT_JOBS = {"zero1_to_fsdp": _zero1_to_fsdp, "zero1_tp_to_zero1": _zero1_tp_to_zero1,
               "fsdp_experts": _fsdp_experts, "fused_projection": _fused_projection,
               "gpt2_conv1d": _gpt2_conv1d, "replicated_kv": _replicated_kv,
               "pipelined_tied": _pipelined_tied}


@pytest.fixture(scope="module")
def layouts(torchrun, tmp_path_factory):
    """Every layout test's jobs, one launch per world size (a launch costs 6-20 CPU s before
    its first step); returns the folder holding each test's folder."""
    root = tmp_path_factory.mktemp("layouts")
    by_world: dict[int, list] = {2: [], 4: []}
    for name, jobs_of in LAYOUT_JOBS.items():
        (root / name).mkdir()
        for world, jobs in jobs_of(root / name).items():
            by_world[world] += jobs
    for world, jobs in by_world.items():
        (root / f"world{world}").mkdir()
        _run_jobs(torchrun, root / f"world{world}", world, jobs)
    return root


@pytest.mark.slow
def test_zero1_checkpoint_resumes_as_fsdp(layouts):
    """ZeRO-1 keeps each optimizer state on one rank; the checkpoint must still hold all.
    (Resuming under the plan that saved is test_resume_same_and_other_plan's.)"""
    _assert_resumed("llama", layouts / "zero1_to_fsdp" / "fsdp.json")


@pytest.mark.slow
def test_zero1_tp_checkpoint_resumes_as_zero1_without_tp(layouts):
    """ZeRO-1 under TP saves its states as DTensors shaped like the parameters, so they
    load into a plan without TP."""
    _assert_resumed("llama", layouts / "zero1_tp_to_zero1" / "dp4.json")


@pytest.mark.slow
def test_fsdp_expert_checkpoint_resumes_outside_fsdp_and_at_another_ep(layouts):
    """At ZeRO-2 the experts are FSDP units on their replicas' mesh, their weights and Adam
    states DTensors sharded by FSDP within each ep shard; the checkpoint loads into
    ZeRO-1 (experts outside DDP, states sharded by ZeroRedundancyOptimizer) and into ep4
    ZeRO-3 (a different expert split and no expert replicas)."""
    tmp = layouts / "fsdp_experts"
    _assert_resumed("mixtral", tmp / "zero1.json", tmp / "ep4.json")


@pytest.mark.slow
def test_fused_projection_checkpoint_is_in_the_models_own_layout(layouts):
    """Phi-3 at tp=2 holds qkv_proj and gate_up_proj rows rank-major ([q, k, v heads of rank
    0 | of rank 1], runtime/fused_projection.py); its checkpoint holds them, and their Adam
    states, in the model's own order: it resumes without TP (dp=2) on the reference's losses,
    and a checkpoint saved without TP resumes at tp=2 (ZeRO-3 on top)."""
    tmp = layouts / "fused_projection"
    _assert_resumed("hf_phi3", tmp / "dp2.resumed.json", tmp / "tp2_zero3.resumed.json")


@pytest.mark.slow
def test_gpt2_conv1d_checkpoint_is_in_the_models_own_layout(layouts):
    """GPT-2 at tp=2 holds c_attn's weight columns rank-major (its Conv1D weight is (in, out));
    the checkpoint holds them, and their Adam states, in the model's own (in, out) layout and
    resumes without TP (dp=2) on the reference's losses, its head still tied."""
    from torch.distributed.checkpoint import FileSystemReader

    tmp = layouts / "gpt2_conv1d"
    _assert_resumed("hf_gpt2", tmp / "dp2.json")
    saved = FileSystemReader(str(tmp / "ckpt" / "step_000003")).read_metadata().state_dict_metadata
    c_attn = "transformer.h.0.attn.c_attn.weight"
    assert tuple(saved[f"model.{c_attn}"].size) == (64, 192)
    assert tuple(saved[f"optim.state.{c_attn}.exp_avg"].size) == (64, 192)


@pytest.mark.slow
def test_replicated_kv_checkpoint_is_in_the_models_layout_and_resumes_at_another_tp(layouts):
    """hf_llama's 2 K/V heads over tp=4 ranks: each rank computes one from k and v weights
    held whole (runtime/kv_replication.py); the checkpoint holds them, and their Adam states,
    as the model's own tensors, and resumes at dp2 x tp2 with ZeRO-3 (the K/V heads sharded,
    one a rank) on the reference's losses."""
    from torch.distributed.checkpoint import FileSystemReader

    tmp = layouts / "replicated_kv"
    _assert_resumed("hf_llama", tmp / "dp2_tp2_zero3.json")
    saved = FileSystemReader(str(tmp / "ckpt" / "step_000003")).read_metadata().state_dict_metadata
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    assert tuple(saved[f"model.{k_proj}"].size) == (32, 64)  # 2 heads of 16, the model's shape
    assert tuple(saved[f"optim.state.{k_proj}.exp_avg"].size) == (32, 64)


def _saved_keys(folder) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


@pytest.mark.slow
def test_pipelined_tied_checkpoint_keeps_the_models_names_and_resumes(layouts):
    """A head tied to the embedding is a copy on each of 2 pipeline stages; the checkpoint
    holds the weights under the model's names (both, as the unsplit model's state dict) and
    the optimizer state once, under the model's own name (embed_tokens.weight), as the
    unsplit model's optimizer keeps it. So it resumes without a pipeline (FSDP), and a
    checkpoint of either loads into the other (the RoPE tables of the fx stages, buffers the
    unsplit checkpoint lacks, built afresh); so does one of the V placement, whose pipeline
    rank 0 holds both copies."""
    tmp = layouts / "pipelined_tied"
    _assert_resumed("tied_llama", *(tmp / f"{resumed}_from_{saved}.json" for saved, resumed in TIED_PAIRS))
    keys = _saved_keys(tmp / "pp" / "step_000003")
    assert {"model.embed_tokens.weight", "model.lm_head.weight"} <= keys
    assert {"optim.state.embed_tokens.weight.exp_avg", "optim.state.embed_tokens.weight.exp_avg_sq",
            "optim.param_groups.embed_tokens.weight.lr"} <= keys
    assert not [k for k in keys if k.startswith(("optim.state.lm_head", "optim.param_groups.lm_head"))]
    assert _saved_keys(tmp / "zero3" / "step_000003") == keys
    assert _saved_keys(tmp / "v" / "step_000003") == keys


def _fake_checkpoint(root, step: int, payload: bytes):
    """A complete checkpoint folder with a manifest, as save_checkpoint leaves it."""
    from autoplan.runtime.checkpoint import MANIFEST, sha256_file

    folder = root / f"step_{step:06d}"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"meta")
    (folder / "__0_0.distcp").write_bytes(payload)
    (folder / "trainer.json").write_text(json.dumps({"step": step}))
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in folder.iterdir()}
    (folder / MANIFEST).write_text(json.dumps({"step": step, "files": files}))
    return folder


def test_manifest_catches_a_byte_flip_and_a_truncation(tmp_path):
    from autoplan.runtime.checkpoint import manifest_problems

    folder = _fake_checkpoint(tmp_path, 3, bytes(range(256)) * 4)
    assert manifest_problems(folder) == []
    data = bytearray((folder / "__0_0.distcp").read_bytes())
    data[100] ^= 0x01  # one bit, same size
    (folder / "__0_0.distcp").write_bytes(bytes(data))
    assert manifest_problems(folder) == [f"{folder / '__0_0.distcp'}: sha256 differs from the manifest (corrupted)"]
    (folder / "__0_0.distcp").write_bytes(bytes(data[:10]))
    assert manifest_problems(folder) == [f"{folder / '__0_0.distcp'}: 10 bytes, the manifest says 1024"]


def test_verified_checkpoint_falls_back_then_refuses_naming_files(tmp_path):
    from autoplan.errors import UserError
    from autoplan.runtime.checkpoint import verified_checkpoint

    older = _fake_checkpoint(tmp_path, 3, b"a" * 64)
    newer = _fake_checkpoint(tmp_path, 6, b"b" * 64)
    (newer / "__0_0.distcp").write_bytes(b"c" * 64)
    said = []
    assert verified_checkpoint(tmp_path, said.append) == older
    assert "step_000006 is damaged" in said[0] and "falling back to" in said[1]
    (older / ".metadata").unlink()  # no longer complete: not a candidate
    (older / ".metadata").write_bytes(b"META")  # complete again, but not what the manifest says
    with pytest.raises(UserError, match=r"every one is damaged: .*step_000006/__0_0.distcp.*step_000003/.metadata"):
        verified_checkpoint(tmp_path, said.append)
    assert verified_checkpoint(tmp_path / "none", said.append) is None


def test_a_failed_write_is_named_in_one_line():
    """DCP wraps each rank's failure in a CheckpointException whose text is every rank's
    traceback; the job's error names the failure underneath, on one line."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from autoplan.runtime.checkpoint import failure_text

    stack = traceback.extract_stack()
    torch_save = RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter\nfailed writing file")
    wrapped = CheckpointException("CheckpointException ranks:dict_keys([0, 1])",
                                  {0: (torch_save, stack), 1: (torch_save, stack)})
    assert "\n" in str(wrapped)
    assert failure_text(wrapped) == ("RuntimeError: [enforce fail at inline_container.cc:664] . "
                                     "PytorchStreamWriter failed writing file")
    full = OSError(28, "No space left on device")
    assert failure_text(CheckpointException("x", {1: (full, stack)})) == "OSError: [Errno 28] No space left on device"
    long = failure_text(RuntimeError("no space\n" * 100))
    assert "\n" not in long and len(long) == 300
