"""A decoder whose blocks mix tokens outside attention as well: a running mean of the
residual stream over the tokens so far (a cumulative sum, no parameters), the shape of a
state-space or linear-attention mixer. Under CP or SP a rank would run it over its own share
of the tokens only, and nothing would fail."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.head_dim = dim // heads

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[:, None]
        x = x + torch.cumsum(x, dim=1) / counts  # the mean of the tokens so far
        return x + self.down(F.gelu(self.up(self.n2(x))))


class TokenMixer(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
