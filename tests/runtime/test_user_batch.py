"""A model file's own batch (`example_batch`): rows that do not depend on the split, the
training RNG left alone, bad returns named in one sentence, and several positional inputs
fed to forward as they are (one process, a 1-rank gloo group)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import batch_models
from autoplan.errors import UserError
from autoplan.models.user_batch import checked_batch, sample_rows
from autoplan.plan import Plan
from autoplan.runtime import TrainArgs, train
from autoplan.runtime.objective import BatchObjective
from batch_models import Masked, masked_batch, masked_keyword_batch
from runtime_models import SEED, plan_dict

STEADY = {"lr": 1e-2, "warmup_steps": 0, "max_steps": 10**9, "schedule": "constant"}


def _rows(plan: Plan, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    micro = BatchObjective(plan, SEED, batch_models.example_batch).microbatches(step, dp_rank)
    return torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])


def test_rows_do_not_depend_on_the_split():
    whole = Plan.from_dict(plan_dict("tabular"))  # one rank, 8 micro-batches of 1
    halves = Plan.from_dict(plan_dict("tabular", dp=2, micro_batch=2))  # 2 ranks, 2 x 2
    x, y = _rows(whole, 3, 0)
    for rank in (0, 1):
        got_x, got_y = _rows(halves, 3, rank)
        assert torch.equal(got_x, x[4 * rank: 4 * rank + 4]) and torch.equal(got_y, y[4 * rank: 4 * rank + 4])
    want_x, want_y = batch_models.global_batch(3, SEED, 8)  # what the runtime promises
    assert torch.equal(x, want_x) and torch.equal(y, want_y)
    assert not torch.equal(_rows(whole, 4, 0)[0], x)  # another step, other samples


def test_drawing_rows_leaves_the_training_rng_alone():
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    sample_rows(batch_models.example_batch, 12, SEED, 0, range(4))
    assert torch.equal(torch.random.get_rng_state(), before)  # dropout masks stay the seed's


@pytest.mark.parametrize("value,words", [
    (torch.zeros(2, 3), "returned Tensor; return (inputs, labels)"),
    ((torch.zeros(2, 3), [1, 2]), "returned (Tensor, list)"),
    ((torch.zeros(3, 3), torch.zeros(2)), "shape (3, 3), whose first dimension is not the batch of 2"),
    (((torch.zeros(2, 3), torch.zeros(())), torch.zeros(2)), "shape (), whose first dimension"),
])
def test_a_bad_batch_is_named_in_one_sentence(value, words):
    with pytest.raises(UserError) as exc:
        checked_batch(value, 2, "example_batch(2) in m.py")
    assert words in str(exc.value) and str(exc.value).startswith("example_batch(2) in m.py")


def test_default_loss_refuses_scores_that_do_not_match_the_labels():
    with pytest.raises(UserError, match="one score row per label"):
        BatchObjective.loss(torch.zeros(4), torch.zeros(4, dtype=torch.long))
    loss = BatchObjective.loss(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long))
    assert float(loss) == pytest.approx(float(torch.log(torch.tensor(5.0))))


@pytest.fixture
def one_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_keyword_inputs_are_drawn_row_by_row_as_a_dict():
    whole = sample_rows(masked_keyword_batch, 6, SEED, 2, range(4))
    halves = [sample_rows(masked_keyword_batch, 6, SEED, 2, range(r, r + 2)) for r in (0, 2)]
    assert set(whole[0]) == {"x", "keep"}
    for key in ("x", "keep"):
        assert torch.equal(torch.cat([h[0][key] for h in halves]), whole[0][key])
    positional = sample_rows(masked_batch, 6, SEED, 2, range(4))  # the same draws, by position
    assert torch.equal(positional[0][0], whole[0]["x"]) and torch.equal(positional[1], whole[1])


@pytest.mark.parametrize("batch", [masked_batch, masked_keyword_batch], ids=["positional", "keyword"])
def test_several_inputs_reach_forward_and_the_default_loss_is_cross_entropy(one_process, tmp_path, batch):
    plan = plan_dict("tabular", micro_batch=4, optimizer=dict(plan_dict()["optimizer"], **STEADY))
    plan["seq_len"] = 6
    losses = train(Masked, plan, TrainArgs(steps=2, seed=SEED, run_dir=str(tmp_path)), batch=batch)
    torch.manual_seed(SEED)  # the runtime's initial weights
    model = Masked()
    rows = [sample_rows(masked_batch, 6, SEED, 0, range(r, r + 1)) for r in range(8)]
    x, keep = (torch.cat([row[0][i] for row in rows]) for i in range(2))
    labels = torch.cat([row[1] for row in rows])
    with torch.no_grad():  # two micro-batches of 4, their mean
        want = sum(F.cross_entropy(model(x[i:i + 4], keep[i:i + 4]), labels[i:i + 4]) for i in (0, 4)) / 2
    assert losses[0] == pytest.approx(float(want), rel=1e-6)
    assert losses[1] != pytest.approx(losses[0], rel=1e-3)  # it trains


def test_a_batch_plan_without_the_files_batch_or_with_a_token_file_is_refused():
    from autoplan.runtime.objective import check_inputs

    plan = Plan.from_dict(plan_dict("tabular"))
    with torch.device("meta"):
        meta = batch_models.TabularRegressor()
    with pytest.raises(UserError, match="defines no example_batch"):
        check_inputs(meta, plan, "synthetic", None)
    with pytest.raises(UserError, match="Use --data synthetic"):
        check_inputs(meta, plan, "tokens.bin", batch_models.example_batch)
    check_inputs(meta, plan, "synthetic", batch_models.example_batch)  # what the job runs
