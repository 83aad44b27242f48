"""A model that is not a language model: `autoplan analyze examples/custom_mlp.py`.

The file defines exactly one nn.Module subclass whose constructor needs no arguments, so
autoplan builds it as the model. Its input is a float tensor, not token ids, so the file
says what to feed it with `example_inputs(batch_size, seq_len)`.
"""

import torch
import torch.nn as nn


class ResidualMLP(nn.Module):
    def __init__(self, features: int = 32, hidden: int = 128, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(features), nn.Linear(features, hidden), nn.GELU(),
                          nn.Linear(hidden, features))
            for _ in range(depth)
        )
        self.out = nn.Linear(features, classes)
        self.features = features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def example_inputs(batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    # one feature vector per position: (batch, seq, features)
    return (torch.randn(batch_size, seq_len, 32),)
