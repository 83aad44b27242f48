"""Attention that views its q/k/v with a hard-coded head count (a constant of the file, which
the runtime cannot set to a rank's count as it does an attribute named for heads): legal TP
pairs in the data flow, but a column-sharded q_proj no longer has `HEADS * head_dim`
features per rank."""

import torch
import torch.nn as nn
import torch.nn.functional as F

HEADS = 4


class Attention(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.head_dim = d // HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, HEADS, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, HEADS * self.head_dim))


class MLP(nn.Module):
    def __init__(self, d: int = 64, f: int = 128):
        super().__init__()
        self.up, self.down = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = Attention(d), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class FixedHeads(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))
