"""The hand-written MoE of loop_moe.py with its expert list named `ffns`: the trace finds the
list, the runtime shards only a list named `experts`."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    def __init__(self, d: int = 64, f: int = 128, num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(d, num_experts, bias=False)
        self.ffns = nn.ModuleList(Expert(d, f) for _ in range(num_experts))

    def forward(self, x):
        b, s, d = x.shape
        x = x.view(-1, d)
        weights, chosen = torch.topk(F.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.ffns):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out[rows] += weights[rows, slot, None] * expert(x[rows])
        return out.view(b, s, d)


class Block(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.moe = SparseMoE(d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class LoopMoE(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
