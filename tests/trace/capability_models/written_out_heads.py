"""Attention written out with matmuls (q @ k^T, softmax, @ v: no SDPA), viewing q/k/v as `n`
heads (an attribute not named for heads) of whatever size is left: with q column-sharded
every reshape still works, each rank running all `n` heads at half their size, and nothing
fails. `HeadCounted` holds its count as `n_head`, which the runtime sets to the rank's.
`Folded` (heads folded into the batch for torch.bmm, the softmax on the folded scores) and
`Einsum` are forms whose heads the trace does not read: left whole. `FoldedAsBloom` folds
them for bmm only, each operand one reshape of (batch, heads, seq, size), as BLOOM does: read
per head, and refused at plan time where its count `n` would stay the model's under TP
(`FoldedAsBloomCounted` holds it as `n_head`)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.n = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def count(self) -> int:
        return self.n

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.count(), -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.o((weights @ v).transpose(1, 2).reshape(b, s, -1))


class HeadCounted(Attention):
    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__(d, heads)
        del self.n
        self.n_head = heads

    def count(self) -> int:
        return self.n_head


class Folded(Attention):
    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.n, -1).transpose(1, 2).reshape(b * self.n, s, -1)
                   for p in (self.q, self.k, self.v))
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = (torch.bmm(q, k.transpose(1, 2)) * q.shape[-1] ** -0.5).masked_fill(~causal, float("-inf"))
        out = torch.bmm(scores.softmax(-1), v).view(b, self.n, s, -1)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class FoldedAsBloom(Attention):
    def forward(self, x):
        b, s, _ = x.shape
        n = self.count()
        q, k, v = (p(x).view(b, s, n, -1).transpose(1, 2).reshape(b * n, s, -1)
                   for p in (self.q, self.k, self.v))
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = (torch.bmm(q, k.transpose(1, 2)) * q.shape[-1] ** -0.5).view(b, n, s, s)
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1).view(b * n, s, s)
        out = torch.bmm(weights, v).view(b, n, s, -1)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class FoldedAsBloomCounted(FoldedAsBloom, HeadCounted):
    pass


class Einsum(Attention):
    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.n, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
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


class WrittenOut(nn.Module):
    def __init__(self, attention: type = Attention, vocab: int = 128, d: int = 64, layers: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(64, d)
        self.blocks = nn.ModuleList(Block(attention, d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model():
    return WrittenOut()


def build_head_counted():
    return WrittenOut(HeadCounted)


def build_folded():
    return WrittenOut(Folded)


def build_folded_as_bloom():
    return WrittenOut(FoldedAsBloom)


def build_folded_as_bloom_counted():
    return WrittenOut(FoldedAsBloomCounted)


def build_einsum():
    return WrittenOut(Einsum)
