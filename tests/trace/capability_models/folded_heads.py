"""Attention written out in forms whose heads the trace does not read: heads folded into the
batch for torch.bmm ((batch * heads, seq, head_dim)), or an einsum. Viewed by `n` (not named
for heads), a column-sharded q would still run without an error, every rank all `n` heads
at half their size; the attention is left whole and TP not offered."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class FoldedAttention(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.n = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def heads_of(self, x, projection):
        b, s, _ = x.shape
        return projection(x).view(b, s, self.n, -1).transpose(1, 2)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (self.heads_of(x, p).reshape(b * self.n, s, -1) for p in (self.q, self.k, self.v))
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        weights = (torch.bmm(q, k.transpose(1, 2)) * q.shape[-1] ** -0.5).masked_fill(~causal, float("-inf"))
        out = torch.bmm(weights.softmax(-1), v).view(b, self.n, s, -1)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class EinsumAttention(FoldedAttention):
    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (self.heads_of(x, p) for p in (self.q, self.k, self.v))
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
        out = torch.einsum("bhqk,bhkd->bhqd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, attention: type, d: int = 64):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = attention(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Folded(nn.Module):
    def __init__(self, attention: type = FoldedAttention, vocab: int = 128, d: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(attention, d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model():
    return Folded()


def build_einsum():
    return Folded(EinsumAttention)
