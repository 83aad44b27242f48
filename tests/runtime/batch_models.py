"""A model that brings its own batch and loss, as a model file may (`example_batch`, `loss`):
a residual MLP regressor of 12 features with a mean-squared-error loss, so nothing about it
is a token or an image."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

FEATURES = 12


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TabularRegressor(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1)


def example_batch(batch_size: int):
    """Features from N(0, 1) and a target the model can learn (half the sum of three)."""
    x = torch.randn(batch_size, FEATURES)
    return x, 0.5 * x[:, :3].sum(-1)


def loss(outputs, labels):
    return F.mse_loss(outputs, labels)


class Masked(nn.Module):
    """Two positional inputs: features and a mask of the ones to keep; three classes out."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.head = nn.Linear(6, 3)

    def forward(self, x, keep):
        for block in self.blocks:
            x = torch.tanh(block(x * keep))
        return self.head(x)


def masked_batch(batch_size: int):
    x = torch.randn(batch_size, 6)
    return (x, (x > -1).float()), torch.randint(0, 3, (batch_size,))


def masked_keyword_batch(batch_size: int):
    """The same inputs by keyword, as a Hugging Face batch hands input_ids and attention_mask."""
    (x, keep), labels = masked_batch(batch_size)
    return {"keep": keep, "x": x}, labels


TP_STYLES = {"blocks.*": {"up": "colwise", "down": "rowwise"}}


def global_batch(step: int, seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the runtime promises a step trains on: row r drawn by example_batch(1) under
    torch.manual_seed((seed * 1_000_003 + step) * 1_000_033 + r), whatever rank trains it."""
    xs, ys = [], []
    state = torch.random.get_rng_state()
    for row in range(rows):
        torch.manual_seed((seed * 1_000_003 + step) * 1_000_033 + row)
        x, y = example_batch(1)
        xs.append(x)
        ys.append(y)
    torch.random.set_rng_state(state)
    return torch.cat(xs), torch.cat(ys)
