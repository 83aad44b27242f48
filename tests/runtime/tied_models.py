"""Tiny models whose parameters are shared (tied), their plans, and an independent
single-process reference loop, for the tied-parameter tests (test_tied_params.py).

The optimizer runs at a constant LR that moves the loss (1e-2, no warmup, a cosine over a
million steps: flat to 1e-9 over the run), so an untied copy drifts visibly within a few steps.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import hf_models
from autoplan.models import build_model
from runtime_models import GLOBAL_BATCH, SEED, SEQ_LEN, TINY_LLAMA, GPTBlock, llama_tp_styles

STEPS = 8
OPTIMIZER = {"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1,
             "warmup_steps": 0, "max_steps": 10**6, "grad_clip": 1.0}
VOCAB = 256


class TiedBiasGPT(nn.Module):
    """A hand-written GPT whose head shares the embedding's weight but has its own bias,
    and whose two blocks share one LayerNorm module (a shared norm)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(256, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=True)
        self.head.weight = self.tok.weight
        self.blocks[1].ln_2 = self.blocks[0].ln_2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


TIED_LLAMA = dict(TINY_LLAMA, tie_word_embeddings=True)


def build(kind: str) -> nn.Module:
    if kind == "llama":
        return build_model(TIED_LLAMA)
    if kind == "hf_llama":
        return hf_models.build("hf_llama", tie_word_embeddings=True)
    if kind == "gpt":
        return TiedBiasGPT()
    if kind == "gpt_by_rank":  # initialised differently on every rank (a wrong user model)
        model = TiedBiasGPT()
        with torch.no_grad():
            model.tok.weight.add_(int(os.environ.get("RANK", "0")))
        return model
    raise ValueError(kind)


def materialised(kind: str, seed: int = SEED) -> nn.Module:
    """The model as the runtime initialises it (init_weights after to_empty, else the
    constructor under the seed)."""
    torch.manual_seed(seed)
    if kind == "gpt":
        return build(kind)
    with torch.device("meta"):
        model = build(kind)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    return model


def plan_dict(kind: str, **over) -> dict:
    world = over.get("dp", 1) * over.get("tp", 1) * over.get("pp", 1)
    blocks = {"llama": [f"layers.{i}" for i in range(4)], "gpt": ["blocks.0", "blocks.1"],
              "gpt_by_rank": ["blocks.0", "blocks.1"],
              "hf_llama": hf_models.blocks("hf_llama")}[kind]
    pp = over.get("pp", 1)
    plan = {"model": {"source": "catalog", "name": f"tied-{kind}"}, "gpu": "cpu",
            "world_size": world, "gpus_per_node": world, "global_batch": GLOBAL_BATCH,
            "seq_len": SEQ_LEN, "precision": "fp32", "zero_stage": 0, "micro_batch": 1,
            "schedule": "1f1b", "optimizer": dict(OPTIMIZER), "format_version": 1,
            "stages": [blocks[i * len(blocks) // pp:(i + 1) * len(blocks) // pp] for i in range(pp)]}
    if over.get("tp", 1) > 1:
        plan["tp_styles"] = {"llama": llama_tp_styles(),
                             "hf_llama": llama_tp_styles(hf_models.LAYERS, prefix="model."),
                             "gpt": {"tok": "vocab_embedding", "head": "vocab_head"}}[kind]
        plan["sequence_parallel"] = kind != "gpt"  # its learned positions are added in forward
    plan.update(over)
    return plan


def _lr(step: int) -> float:
    peak, warmup, max_steps = OPTIMIZER["lr"], OPTIMIZER["warmup_steps"], OPTIMIZER["max_steps"]
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return 0.1 * peak + 0.9 * peak * 0.5 * (1 + math.cos(math.pi * progress))


def reference_run(kind: str, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process fp32 training on the full global batch: (losses, every parameter by
    name after the last step, tied names included)."""
    model = materialised(kind)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": OPTIMIZER["weight_decay"]},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=OPTIMIZER["lr"], betas=tuple(OPTIMIZER["betas"]))
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(SEED * 1_000_003 + step)
        batch = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=gen)
        for group in opt.param_groups:
            group["lr"] = _lr(step)
        logits = model(batch[:, :-1])
        logits = getattr(logits, "logits", logits)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIMIZER["grad_clip"])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    return losses, params
