"""The GPT block exactly as Korthikanti et al. 2022 count its activations (explicit softmax
attention, attention dropout, 4h GeLU MLP, dropout after attention and MLP, two LayerNorms),
shared by the trace and cost tests that pin 34sbh + 5as^2b."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F


class MathAttentionBlock(nn.Module):
    def __init__(self, h: int, a: int) -> None:
        super().__init__()
        self.a = a
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        y = self.ln1(x)
        q, k, v = (p(y).view(b, s, self.a, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        att = F.dropout(F.softmax(q @ k.transpose(-1, -2) * 0.125, dim=-1), 0.1, self.training)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + F.dropout(self.o(y), 0.1, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), 0.1, self.training)


class Stack(nn.Module):
    """`layers` copies of the block in a ModuleList (what trace groups as one block)."""

    def __init__(self, h: int, a: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MathAttentionBlock(h, a) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
