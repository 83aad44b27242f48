"""Faults during training of the generated tiny job (2 gloo ranks, launch.sh as a user runs it):
a rank killed with SIGKILL, a corrupted checkpoint, a second job in the same run directory,
and bad token files. The killed and the corrupted runs must end with the losses of the
uninterrupted run: same plan, same seed, so the restarted steps replay bit for bit
(tolerance 1e-6 relative, the same-plan resume tolerance of tests/runtime/test_checkpoint.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from codegen_helpers import run_script

pytestmark = pytest.mark.slow

STEPS, EVERY = 12, 3


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in metrics(run_dir)]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-6 * abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def clean_run(two_rank_job, tmp_path_factory) -> Path:
    """The uninterrupted reference: 12 steps, checkpoints after steps 3, 6, 9 and 12."""
    run = tmp_path_factory.mktemp("clean") / "run"
    result = run_script(two_rank_job / "launch.sh", "--steps", STEPS, "--checkpoint-every", EVERY,
                        "--run-dir", run, cwd=run.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["step"] for row in metrics(run)] == list(range(STEPS))
    return run


def _descendants(root: int) -> list[tuple[int, dict[str, str]]]:
    """(pid, environment) of every process below `root` (torchrun starts each worker in a
    session of its own, so the process tree, not the session, finds them)."""
    parents, envs = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            raw = (entry / "environ").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        envs[int(entry.name)] = dict(item.split("=", 1) for item in
                                     raw.decode(errors="replace").split("\0") if "=" in item)
    below, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return [(pid, envs[pid]) for pid in sorted(below) if pid in envs]


def _kill_rank_once_running(proc: subprocess.Popen, run: Path, rank: str, after_rows: int,
                            timeout: float) -> None:
    """SIGKILL local rank `rank` of the first attempt once metrics.jsonl has `after_rows` rows."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        path = run / "metrics.jsonl"
        if path.is_file() and len(path.read_text().splitlines()) >= after_rows:
            for pid, env in _descendants(proc.pid):
                if env.get("LOCAL_RANK") == rank and env.get("TORCHELASTIC_RESTART_COUNT") == "0":
                    os.kill(pid, signal.SIGKILL)
                    return
        time.sleep(0.05)
    pytest.fail("the job ended or stalled before the rank could be killed")


def test_killed_rank_restarts_and_ends_with_the_uninterrupted_losses(two_rank_job, clean_run, tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    for name in ("RDZV_ENDPOINT", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NPROC_PER_NODE"):
        env.pop(name, None)
    proc = subprocess.Popen(["bash", str(two_rank_job / "launch.sh"), "--steps", str(STEPS),
                             "--checkpoint-every", str(EVERY), "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path, start_new_session=True)
    try:
        _kill_rank_once_running(proc, run, rank="1", after_rows=EVERY + 2, timeout=240)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # torchrun stops its workers on SIGTERM
            os.killpg(proc.pid, signal.SIGTERM)
            proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert "restart 1 after a failure" in out, out[-2000:]
    assert "resumed from" in out and "step_000000" not in out, out[-2000:]
    assert [row["step"] for row in metrics(run)] == list(range(STEPS))  # replayed steps once
    assert close(losses(run), losses(clean_run)), (losses(run), losses(clean_run))


def _flip_bytes(path: Path) -> None:
    """The same size, different bytes (a silent disk or copy error)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 8] = bytes(b ^ 0xFF for b in data[middle: middle + 8])
    path.write_bytes(bytes(data))


def test_corrupted_latest_checkpoint_falls_back_to_the_previous(two_rank_job, clean_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(clean_run / "checkpoints", run / "checkpoints")
    _flip_bytes(run / "checkpoints" / "step_000012" / "__1_0.distcp")
    # steps 9..11 again from checkpoint 9, then nothing more: the losses of the clean run
    result = run_script(two_rank_job / "launch.sh", "--steps", STEPS, "--run-dir", run, "--resume",
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step_000012 is damaged" in result.stdout and "__1_0.distcp" in result.stdout
    assert "resumed from" in result.stdout and "(step 9)" in result.stdout, result.stdout[-2000:]
    assert [row["step"] for row in metrics(run)] == [9, 10, 11]
    assert close(losses(run), losses(clean_run)[9:])

    for folder in (run / "checkpoints").glob("step_*"):
        _flip_bytes(folder / "__0_0.distcp")
    start = time.monotonic()
    refused = run_script(two_rank_job / "launch.sh", "--steps", STEPS, "--run-dir", run, "--resume",
                         cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "every one is damaged" in refused.stderr and "step_000003/__0_0.distcp" in refused.stderr
    assert "Traceback" not in refused.stderr and "ChildFailedError" not in refused.stderr
    assert time.monotonic() - start < 60


def test_second_job_in_the_same_run_directory_is_refused(two_rank_job, tmp_path):
    from autoplan.runtime.rundir import DirectoryLock

    run = tmp_path / "run"
    held = DirectoryLock(run).acquire("first-job")  # what the first job's rank 0 holds
    try:
        result = run_script(two_rank_job / "launch.sh", "--steps", 2, "--run-dir", run, cwd=tmp_path)
    finally:
        held.release()
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "is in use by job pid" in result.stderr and "Traceback" not in result.stderr
    assert not (run / "metrics.jsonl").exists()


def test_checkpoint_dir_inside_a_running_jobs_run_dir_is_refused(two_rank_job, clean_run, tmp_path):
    from autoplan.runtime.rundir import DirectoryLock

    first = tmp_path / "first"
    shutil.copytree(clean_run, first)
    before = {p: p.read_bytes() for p in (first / "checkpoints").rglob("*") if p.is_file()}
    held = [DirectoryLock(first).acquire("first-job")]  # what the first job's rank 0 holds
    try:
        result = run_script(two_rank_job / "launch.sh", "--steps", EVERY, "--checkpoint-every", EVERY,
                            "--run-dir", tmp_path / "second", "--checkpoint-dir",
                            first / "checkpoints", cwd=tmp_path)
    finally:
        for lock in held:
            lock.release()
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "run id first-job" in result.stderr and "Traceback" not in result.stderr
    after = {p: p.read_bytes() for p in (first / "checkpoints").rglob("*") if p.is_file()}
    assert after == before


_HOLD_UNTIL_RELEASED = '''
import autoplan.runtime.loop as _loop

_init_distributed = _loop.init_distributed


def _held_init_distributed(*args, **kwargs):
    """Rank 0 of the launch that took the run directory's lock (taken just before this) waits
    here until the test has seen the other launch end: the two overlap however loaded the
    machine is."""
    import json as _json, time as _time
    lock = os.path.join(os.environ["HOLD_RUN_DIR"], ".autoplan.lock")
    deadline = _time.monotonic() + 240
    while not os.path.exists(os.environ["HOLD_RELEASE_FILE"]) and _time.monotonic() < deadline:
        try:
            holder = _json.load(open(lock)).get("run_id")
        except (OSError, ValueError):
            holder = None
        if not holder or holder != os.environ.get("TORCHELASTIC_RUN_ID"):
            break
        _time.sleep(0.1)
    return _init_distributed(*args, **kwargs)


_loop.init_distributed = _held_init_distributed
'''


def test_two_launches_at_once_one_runs_and_one_is_refused(two_rank_job, tmp_path):
    """Two launches of one job into one run directory. Started together, both may pass
    launch.sh's check before either rank 0 holds the lock; the refused rank 0 then makes
    torchrun restart that launch's workers, which must still be refused. The winner holds
    the directory until the loser has ended (a loaded machine would otherwise run them one
    after the other, and both would train)."""
    job = _patched_job(two_rank_job, tmp_path, _HOLD_UNTIL_RELEASED)
    run, release = tmp_path / "run", tmp_path / "release"
    env = dict(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
               OMP_NUM_THREADS="1", MAX_RESTARTS="1", HOLD_RELEASE_FILE=str(release),
               HOLD_RUN_DIR=str(run))
    for name in ("RDZV_ENDPOINT", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NPROC_PER_NODE"):
        env[name] = ""
    logs = [tmp_path / f"launch{i}.log" for i in range(2)]
    procs = [subprocess.Popen(["bash", str(job / "launch.sh"), "--steps", "4",
                               "--checkpoint-every", "2", "--run-dir", str(run)],
                              stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, **env}, cwd=tmp_path, start_new_session=True)
             for log in logs]  # files, not pipes: an unread pipe would stall the loser
    try:
        deadline = time.monotonic() + 240
        while all(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        first_done = [proc.poll() is not None for proc in procs]
        release.touch()
        for proc in procs:
            proc.wait(timeout=300)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    text = "\n".join(log.read_text() for log in logs)
    assert first_done.count(True) == 1, (first_done, text[-3000:])
    loser, winner = (procs[0], procs[1]) if first_done[0] else (procs[1], procs[0])
    assert winner.returncode == 0 and loser.returncode != 0, text[-6000:]
    assert "is in use by job pid" in text and "resumed from" not in text, text[-3000:]
    assert [row["step"] for row in metrics(run)] == [0, 1, 2, 3]


def _token_file(path: Path, values: list[int], dtype=torch.int16) -> Path:
    path.write_bytes(torch.tensor(values, dtype=dtype).numpy().tobytes())
    return path


# a file that is not there, and one whose ids only the scan of the whole file finds; what the
# other bad files are named (empty, too short, ragged) is test_units.py's, in one process
@pytest.mark.parametrize("case,message", [
    ("missing", "is not a file"),
    ("id_too_large", "holds token id 30000"),
])
def test_bad_token_file_stops_before_the_ranks_start(two_rank_job, tmp_path, case, message):
    data = tmp_path / "tokens.bin"
    if case == "id_too_large":
        _token_file(data, [1, 2, 3] * 100 + [30000] + [4] * 100)
    start = time.monotonic()
    result = run_script(two_rank_job / "launch.sh", "--steps", 2, "--data", data, "--run-dir",
                        tmp_path / "run", cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    assert result.stderr.count("autoplan: error:") == 1
    assert time.monotonic() - start < 60


# -- faults that stop the run on purpose: NaN/inf, preemption, a full disk ----------------------

def _patched_job(source: Path, tmp_path: Path, code: str) -> Path:
    """A copy of the job whose train.py runs `code` before main() (a fault only the test makes)."""
    job = tmp_path / "job"
    shutil.copytree(source, job)
    train = job / "train.py"
    text = train.read_text()
    train.write_text(text.replace("\ndef main()", f"\n{code}\n\ndef main()", 1))
    return job


def _exit_record(run: Path) -> dict:
    return json.loads((run / "exit.json").read_text())


def _verified(folder: Path) -> bool:
    from autoplan.runtime.checkpoint import manifest_problems

    return folder.is_dir() and manifest_problems(folder) == []


_NAN_ON_RANK_1 = '''
_build_model = build_model


def build_model():
    """Rank 1's 5th forward (step 4 of a fresh run: one micro-batch a step) returns NaN."""
    model = _build_model()
    if os.environ.get("RANK") == "1":
        calls = [0]

        def poison(_module, _inputs, output):
            calls[0] += 1
            return output * float("nan") if calls[0] == 5 else output

        model.register_forward_hook(poison)
    return model
'''


def test_nan_loss_on_one_rank_stops_before_the_step_is_applied_or_saved(two_rank_job, clean_run, tmp_path):
    job, run = _patched_job(two_rank_job, tmp_path, _NAN_ON_RANK_1), tmp_path / "run"
    # MAX_RESTARTS=1: the restarted workers must find exit.json and stop, not replay the steps
    result = run_script(job / "launch.sh", "--steps", STEPS, "--checkpoint-every", EVERY,
                        "--run-dir", run, cwd=tmp_path, env={"MAX_RESTARTS": "1"})
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-3000:]
    assert "autoplan: error: step 4: the loss is not finite (NaN or inf) on rank 1" in result.stderr
    assert result.stderr.count("autoplan: error:") == 1
    assert "not restarting" in result.stderr
    assert _exit_record(run)["step"] == 4
    assert [row["step"] for row in metrics(run)] == [0, 1, 2, 3]
    assert close(losses(run), losses(clean_run)[:4])
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) \
        == ["step_000003"]
    assert _verified(run / "checkpoints" / "step_000003")

    # from checkpoint 3 the poisoned forward is step 7: skipped, logged, and the run ends
    skipped = run_script(job / "launch.sh", "--steps", 9, "--run-dir", run, "--resume",
                         "--skip-bad-steps", 1, cwd=tmp_path)
    assert skipped.returncode == 0, skipped.stdout[-2000:] + skipped.stderr[-3000:]
    assert "step 7: the loss is not finite (NaN or inf) on rank 1: step skipped" in skipped.stdout
    rows = metrics(run)
    assert [row["step"] for row in rows] == list(range(9))
    assert rows[7]["loss"] is None and all(row["loss"] is not None for row in rows[:7] + rows[8:])
    assert close(losses(run)[:7], losses(clean_run)[:7])
    assert not (run / "exit.json").exists()


def _signal_once_running(proc: subprocess.Popen, run: Path, after_rows: int, send) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        path = run / "metrics.jsonl"
        if path.is_file() and len(path.read_text().splitlines()) >= after_rows:
            send()
            return
        time.sleep(0.05)
    pytest.fail("the job ended or stalled before the signal could be sent")


def _start(job: Path, tmp_path: Path, *args) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    for name in ("RDZV_ENDPOINT", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NPROC_PER_NODE"):
        env.pop(name, None)
    return subprocess.Popen(["bash", str(job / "launch.sh"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path, start_new_session=True)


@pytest.mark.parametrize("signum,to_group", [(signal.SIGTERM, True), (signal.SIGUSR1, False)],
                         ids=["SIGTERM-to-the-process-group", "SIGUSR1-to-launch.sh"])
def test_preempted_job_saves_exits_requeue_and_resumes_to_the_same_losses(
        two_rank_job, clean_run, tmp_path, signum, to_group):
    run = tmp_path / "run"
    proc = _start(two_rank_job, tmp_path, "--steps", STEPS, "--run-dir", run)  # no --checkpoint-every
    try:
        _signal_once_running(proc, run, 3, lambda: os.killpg(proc.pid, signum) if to_group
                             else os.kill(proc.pid, signum))
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
    assert proc.returncode == 143, out[-2000:] + err[-3000:]
    stopped = _exit_record(run)["step"]
    assert f"{signum.name} received: saved the checkpoint" in err, err[-3000:]
    assert 3 <= stopped < STEPS
    assert [row["step"] for row in metrics(run)] == list(range(stopped))
    assert _verified(run / "checkpoints" / f"step_{stopped:06d}")
    if to_group:  # the second half once: the resumed run ends with the uninterrupted losses
        resumed = run_script(two_rank_job / "launch.sh", "--steps", STEPS, "--run-dir", run, "--resume",
                             cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"(step {stopped})" in resumed.stdout
        assert [row["step"] for row in metrics(run)] == list(range(STEPS))
        assert close(losses(run), losses(clean_run))
_FULL_DISK_ON_RANK_1 = '''
import errno as _errno

import torch.distributed.checkpoint.filesystem as _dcp_filesystem

_write_data = _dcp_filesystem._FileSystemWriter.write_data


def _full_disk(self, plan, planner):
    """Rank 1 finds the disk full while writing the checkpoint of step 6."""
    if os.environ.get("RANK") == "1" and "step_000006" in str(self.path):
        raise OSError(_errno.ENOSPC, "No space left on device")
    return _write_data(self, plan, planner)


_dcp_filesystem._FileSystemWriter.write_data = _full_disk
'''


@pytest.fixture
def small_filesystem(tmp_path, clean_run):
    """A tmpfs that holds one checkpoint of the tiny job and a half (root only); None elsewhere."""
    size = sum(p.stat().st_size for p in (clean_run / "checkpoints" / "step_000003").iterdir())
    mount = tmp_path / "small"
    mount.mkdir()
    made = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2}", "tmpfs", str(mount)],
        capture_output=True).returncode == 0
    yield mount if made else None
    if made:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_during_a_checkpoint_stops_with_one_paragraph(two_rank_job, small_filesystem, tmp_path):
    if small_filesystem is not None and not os.environ.get("AUTOPLAN_TEST_INJECT_ENOSPC"):
        job, checkpoints = two_rank_job, small_filesystem / "checkpoints"  # a real full filesystem
    else:  # no tmpfs without root: rank 1's write fails with ENOSPC instead
        job, checkpoints = _patched_job(two_rank_job, tmp_path, _FULL_DISK_ON_RANK_1), tmp_path / "ckpt"
    run = tmp_path / "run"
    result = run_script(job / "launch.sh", "--steps", 8, "--checkpoint-every", EVERY, "--run-dir", run,
                        "--checkpoint-dir", checkpoints, cwd=tmp_path, env={"MAX_RESTARTS": "1"})
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-3000:]
    message = result.stderr[result.stderr.index("autoplan: error:"):].split("\n")[0]
    assert f"the checkpoint of step 6 could not be written to {checkpoints}" in message
    assert "the disk (or the quota) is full" in message and "It needs about" in message
    assert "bytes) and the filesystem has" in message
    assert result.stderr.count("autoplan: error:") == 1
    assert "Traceback" not in result.stdout
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step_")) == ["step_000003"]
    assert _verified(checkpoints / "step_000003")
    assert _exit_record(run)["status"] == 4
