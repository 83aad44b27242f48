"""A self-contained nanoGPT-style model file: `autoplan analyze examples/nano_gpt.py`.

A GPT-2-style model (LayerNorm, GELU MLP, learned positions, tied head); not the catalog's
`tiny-gpt`, which is a tiny Llama-type model (RMSNorm, rotary positions, grouped-query
attention, SwiGLU) built from cost_models/models/tiny-gpt.json.

autoplan executes this file once under `torch.device("meta")` and plans for whatever
`build_model()` returns, so even a large configuration allocates no memory while planning.
The first module is an nn.Embedding, so autoplan feeds token ids of shape (batch, seq);
no `example_inputs` is needed. The position table `pos` has MAX_SEQ rows, so MAX_SEQ is
the default --seq-len and the longest autoplan accepts. Change the sizes below to plan a
bigger model.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, LAYERS, HEADS, MAX_SEQ = 256, 64, 2, 4, 256


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.fc_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    return NanoGPT(VOCAB, DIM, LAYERS, HEADS, MAX_SEQ)
