"""The training objective: what one step's batch is, and the loss on the model's output.

  tokens  (a plan without `inputs`) next-token prediction: a row is seq_len + 1 token ids
          (synthetic or a token file, data.py); inputs its first seq_len, labels the next
          ones; cross-entropy over the vocabulary.
  images  (plan.inputs kind "images") image classification on synthetic data: images
          (batch, channels, side, side) from N(0, 1) and integer labels in [0, num_classes);
          cross-entropy on the model's (batch, num_classes) output.

  batch   (plan.inputs kind "batch") the model file's own `example_batch(batch_size)`
          (models/user_batch.py): its inputs go to forward, its labels to the loss; cross-entropy
          over the output's last dimension unless the file defines its loss.

A model file may define its own `loss(outputs, labels)` (the generated train.py passes it
on): it replaces the cross-entropy of any objective and must return the micro-batch's mean
loss as a scalar tensor; the batch stays the objective's.

Both give a rank its rows of step s's global batch as a function of (seed, s, row) alone, so
a 1-rank run and any DP/PP split train on the same samples (DP rank d, micro-batch m owns
rows [(d * M + m) * b, ... + b)). Token rows are drawn as one global batch and sliced; an
image is drawn from its own generator, so a rank draws only the rows it trains on (a global
batch of 224-pixel images is gigabytes).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.errors import UserError
from autoplan.plan import Plan
from autoplan.runtime.data import local_microbatches, make_source
from autoplan.runtime.model_io import logits_of, vocab_size_of
from autoplan.models.user_batch import BATCH_HOOK, sample_rows

Microbatches = list[tuple[torch.Tensor, torch.Tensor]]


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (vocab-sharded DTensor logits under loss_parallel)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


class TokenObjective:
    kind = "tokens"

    def __init__(self, vocab_size: int, plan: Plan, data: str, seed: int, data_dtype: str | None,
                 positions: torch.Tensor | None) -> None:
        self.plan, self.positions = plan, positions
        self.source = make_source(data, vocab_size, seed, data_dtype, plan.seq_len)

    def microbatches(self, step: int, dp_rank: int) -> Microbatches:
        plan = self.plan
        batch = self.source.global_batch(step, plan.global_batch, plan.seq_len)
        return local_microbatches(batch, dp_rank=dp_rank, num_microbatches=plan.num_microbatches,
                                  micro_batch=plan.micro_batch, positions=self.positions)

    @staticmethod
    def loss(output, labels: torch.Tensor) -> torch.Tensor:
        return token_loss(logits_of(output), labels)


class ImageObjective:
    kind = "images"

    def __init__(self, plan: Plan, seed: int) -> None:
        self.plan, self.seed = plan, seed
        inputs = plan.inputs
        self.shape = (inputs["channels"], inputs["image_size"], inputs["image_size"])
        self.classes = inputs["num_classes"]

    def sample(self, step: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Image and label of row `row` of step `step`'s global batch."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1_000_033 + row)
        label = torch.randint(0, self.classes, (), generator=gen)
        return torch.randn(self.shape, generator=gen), label

    def microbatches(self, step: int, dp_rank: int) -> Microbatches:
        plan, out = self.plan, []
        for m in range(plan.num_microbatches):
            start = (dp_rank * plan.num_microbatches + m) * plan.micro_batch
            images, labels = zip(*(self.sample(step, row) for row in range(start, start + plan.micro_batch)))
            out.append((torch.stack(images), torch.stack(labels)))
        return out

    def loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy in fp32 of the (batch, num_classes) class scores."""
        scores = logits_of(output)
        if scores.dim() != 2 or scores.shape[-1] != self.classes:
            raise UserError(f"the model returned scores of shape {tuple(scores.shape)}, but the plan "
                            f"trains a classifier of {self.classes} classes: (batch, {self.classes}) "
                            "expected. Was the plan made for another model? Plan it again.")
        return F.cross_entropy(scores.float(), labels)


class BatchObjective:
    """The model file's `example_batch`, a rank's rows drawn sample by sample."""

    kind = "batch"

    def __init__(self, plan: Plan, seed: int, batch) -> None:
        self.plan, self.seed, self.batch = plan, seed, batch

    def microbatches(self, step: int, dp_rank: int) -> list:
        plan, out = self.plan, []
        for m in range(plan.num_microbatches):
            start = (dp_rank * plan.num_microbatches + m) * plan.micro_batch
            inputs, labels = sample_rows(self.batch, plan.seq_len, self.seed, step,
                                         range(start, start + plan.micro_batch))
            one = isinstance(inputs, tuple) and len(inputs) == 1
            if not one and plan.pp > 1:
                raise UserError(f"pp={plan.pp}: the pipeline hands its first stage one positional "
                                f"input, and {BATCH_HOOK} in the model file returns "
                                f"{'keyword inputs' if isinstance(inputs, dict) else len(inputs)}. "
                                "Plan the model again (the planner does not offer PP for it).")
            out.append((inputs[0] if one else inputs, labels))
        return out

    @staticmethod
    def loss(output, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy in fp32 over the output's last dimension (the classes)."""
        scores = logits_of(output)
        if scores.dim() < 2 or scores.shape[:-1].numel() != labels.numel():
            raise UserError(f"the model returned scores of shape {tuple(scores.shape)} for labels of "
                            f"shape {tuple(labels.shape)} from {BATCH_HOOK}, and without a "
                            "loss(outputs, labels) in the model file the loss is cross-entropy "
                            "over the scores' last dimension (one score row per label). Define "
                            "loss(outputs, labels) in the model file.")
        return F.cross_entropy(scores.flatten(0, -2).float(), labels.flatten())


def check_inputs(meta: nn.Module, plan: Plan, data: str, batch=None) -> None:
    """Before any process talks: the model reads what the plan's objective feeds it."""
    kind = plan.inputs.get("kind")
    if kind == "batch":
        _check_batch_plan(plan, data, batch)
        return
    if kind != "images":
        vocab_size_of(meta)
        return
    if data != "synthetic":
        raise UserError(f"--data {data}: the plan trains an image classifier, whose data autoplan's "
                        "runtime draws itself (synthetic images and labels); a token file cannot feed "
                        "it. Use --data synthetic, or train on your images with your own loop using "
                        "the plan's degrees.")
    conv = next((m for m in meta.modules() if isinstance(m, nn.Conv2d)), None)
    channels = plan.inputs["channels"]
    if conv is not None and conv.in_channels != channels:
        raise UserError(f"the plan feeds {channels}-channel images, but the model's first Conv2d takes "
                        f"{conv.in_channels} channels. Was the plan made for another model? Plan it again.")


def _check_batch_plan(plan: Plan, data: str, batch) -> None:
    if batch is None:
        raise UserError(f"the plan trains on the model file's own batches, but the model file "
                        f"defines no {BATCH_HOOK}(batch_size); restore it, or plan the model again.")
    if data != "synthetic":
        raise UserError(f"--data {data}: the plan trains on the model file's {BATCH_HOOK}, which "
                        "makes its own data; a token file cannot feed it. Use --data synthetic.")
    if plan.cp > 1:
        raise UserError(f"cp={plan.cp}: context parallelism shards a token sequence, and which "
                        f"dimension of {BATCH_HOOK}'s inputs is a sequence only the model file "
                        "knows. Plan the model again (the planner does not offer CP for it).")


class UserLoss:
    """The objective's batches with the model file's `loss(outputs, labels)`."""

    def __init__(self, objective, loss) -> None:
        self.objective, self.user_loss = objective, loss
        self.kind = objective.kind

    def microbatches(self, step: int, dp_rank: int) -> Microbatches:
        return self.objective.microbatches(step, dp_rank)

    def loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        value = self.user_loss(output, labels)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            shown = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise UserError(f"loss(outputs, labels) in the model file returned {shown}, not a scalar "
                            "tensor; return the mean loss of the micro-batch (e.g. "
                            "F.cross_entropy(outputs, labels)).")
        return value.float()


def make_objective(meta: nn.Module, plan: Plan, data: str, seed: int, data_dtype: str | None,
                   positions: torch.Tensor | None, loss=None, batch=None):
    kind = plan.inputs.get("kind")
    if kind == "batch":
        objective = BatchObjective(plan, seed, batch)
    elif kind == "images":
        objective = ImageObjective(plan, seed)
    else:
        objective = TokenObjective(vocab_size_of(meta), plan, data, seed, data_dtype, positions)
    return objective if loss is None else UserLoss(objective, loss)
