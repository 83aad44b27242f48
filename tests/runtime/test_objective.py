"""The objective: image batches are the same samples whatever the split, and a model file's
own loss replaces the cross-entropy (one process, a 1-rank gloo group)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autoplan.plan import Plan
from autoplan.runtime import TrainArgs, train
from autoplan.runtime.objective import ImageObjective
from runtime_models import SEED, _image_batch, builder, plan_dict

STEADY = {"lr": 1e-3, "warmup_steps": 0, "max_steps": 10**9}


def _rows(plan: Plan, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    micro = ImageObjective(plan, SEED).microbatches(step, dp_rank)
    return torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])


def test_image_rows_do_not_depend_on_the_split():
    whole = Plan.from_dict(plan_dict("image_vit"))  # one rank, 8 micro-batches of 1
    halves = Plan.from_dict(plan_dict("image_vit", dp=2, micro_batch=2))  # 2 ranks, 2 x 2
    images, labels = _rows(whole, 3, 0)
    for rank in (0, 1):
        got_images, got_labels = _rows(halves, 3, rank)
        assert torch.equal(got_images, images[4 * rank: 4 * rank + 4])
        assert torch.equal(got_labels, labels[4 * rank: 4 * rank + 4])
    ref_images, ref_labels = _image_batch(3, SEED)  # the reference loop's own draw
    assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)
    assert not torch.equal(_rows(whole, 4, 0)[0], images)  # another step, other images


@pytest.fixture
def one_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_model_file_loss_replaces_cross_entropy(one_process, tmp_path):
    def smoothed(outputs, labels):
        return F.cross_entropy(outputs, labels, label_smoothing=0.2)

    plan = plan_dict("image_vit", micro_batch=8, optimizer=dict(plan_dict()["optimizer"], **STEADY))
    losses = train(builder("image_vit"), plan, TrainArgs(steps=1, seed=SEED, run_dir=str(tmp_path)),
                   loss=smoothed)
    torch.manual_seed(SEED)  # the runtime's initial weights
    model = builder("image_vit")()
    images, labels = _image_batch(0, SEED)
    with torch.no_grad():
        outputs = model(images)
    want = float(smoothed(outputs, labels))
    assert losses[0] == pytest.approx(want, rel=1e-6)
    assert want != pytest.approx(float(F.cross_entropy(outputs, labels)), rel=1e-3)


def test_model_file_loss_that_is_not_a_scalar_exits_2(one_process, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        train(builder("image_vit"), plan_dict("image_vit"), TrainArgs(steps=1, run_dir=str(tmp_path)),
              loss=lambda outputs, labels: F.cross_entropy(outputs, labels, reduction="none"))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("autoplan: error: loss(outputs, labels) in the model file returned (1,)")
    assert "Traceback" not in err
    assert not torch.distributed.is_initialized()  # the group train() made is gone
