"""Tiny models, plans and an independent single-process reference loop for the runtime tests.

The reference is written from scratch (plain model, full-batch loss, torch's own
clip_grad_norm_ and AdamW), sharing no code with autoplan.runtime, so a parity test fails
when the runtime's data order, loss averaging, clipping or LR schedule drift.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import re
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import batch_models
import hf_models
import image_models
from autoplan.models import build_model
from autoplan.runtime.loop import materialise

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 256, "max_position_embeddings": 256}
TINY_TIED_LLAMA = dict(TINY_LLAMA, tie_word_embeddings=True)  # lm_head.weight is embed_tokens.weight
TINY_MQA_LLAMA = dict(TINY_LLAMA, num_key_value_heads=1)  # one K/V head: replicated under TP
TINY_MIXTRAL = dict(TINY_LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
SEQ_LEN, GLOBAL_BATCH, STEPS, SEED = 32, 8, 5, 1234
IMAGE_KINDS = {"image_vit": "vit", "image_convnext": "convnext", "image_resnet": "resnet",
               "timm_swin": "timm_swin", "timm_vit": "timm_vit"}  # kind -> image_models.BUILDERS
IMAGE_INPUTS = {"kind": "images", "image_size": image_models.IMAGE_SIZE,
                "channels": image_models.CHANNELS, "num_classes": image_models.CLASSES}
OPTIMIZER = {"name": "adamw", "lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1,
             "warmup_steps": 2, "max_steps": 5, "grad_clip": 1.0}


class TinyGPT(nn.Module):
    """A nanoGPT-like user model: no init_weights, learned positions, SDPA, ModuleList blocks."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 4, heads: int = 4,
                 max_len: int = 256, manual_attention: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)  # draws from torch's default generator when > 0
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        block = ManualAttentionBlock if manual_attention else GPTBlock
        self.blocks = nn.ModuleList(block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class ManualAttentionBlock(GPTBlock):
    """Attention written out with softmax (no SDPA): context parallelism must refuse it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(c // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class LoopMoE(nn.Module):
    """A hand-written top-2 MoE: a router and a Python loop over an nn.ModuleList of experts,
    each called once per routing slot on the tokens that chose it (boolean masks)."""

    def __init__(self, dim: int, ffn: int, experts: int, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, ffn), nn.SiLU(), nn.Linear(ffn, dim))
                                     for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = F.softmax(self.gate(x), -1).topk(self.top_k, -1)
        out = torch.zeros_like(x)
        for k in range(self.top_k):
            for e, expert in enumerate(self.experts):
                hit = chosen[..., k] == e
                out[hit] += weights[..., k][hit, None] * expert(x[hit])
        return out


class LoopMoELM(nn.Module):
    """A user LM of pre-norm GPT attention blocks whose MLPs are LoopMoE layers."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 4, heads: int = 4,
                 experts: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LoopMoEBlock(dim, heads, experts) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


class LoopMoEBlock(GPTBlock):
    def __init__(self, dim: int, heads: int, experts: int) -> None:
        super().__init__(dim, heads)
        del self.fc, self.out
        # no bias: the key third's gradient is zero, leaving AdamW's steps on rounding noise
        self.attn = nn.Linear(dim, 3 * dim, bias=False)
        self.mlp = LoopMoE(dim, dim, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class TinyEncoder(nn.Module):
    """A user model around nn.TransformerEncoder (nn.MultiheadAttention inside)."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))


class TinyViT(nn.Module):
    """An image classifier: patches in, class logits out; no token ids to train on."""

    def __init__(self, dim: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, kernel_size=8, stride=8)
        self.blocks = nn.Sequential(nn.TransformerEncoderLayer(dim, 4, 2 * dim, batch_first=True))
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.patch(images).flatten(2).transpose(1, 2)).mean(1))


def builder(kind: str):
    if kind == "llama":
        return lambda: build_model(TINY_LLAMA)
    if kind == "mixtral":
        return lambda: build_model(TINY_MIXTRAL)
    if kind == "tied_llama":
        return lambda: build_model(TINY_TIED_LLAMA)
    if kind == "mqa_llama":
        return lambda: build_model(TINY_MQA_LLAMA)
    if kind == "gpt":
        return lambda: TinyGPT()
    if kind == "dropgpt":
        return lambda: TinyGPT(dropout=0.1)
    if kind == "manualgpt":
        return lambda: TinyGPT(manual_attention=True)
    if kind == "loop_moe":
        return LoopMoELM
    if kind == "written_out_gpt":  # attention as matmuls, viewed by the `n_head` it holds
        models = _capability_models("written_out_heads.py")
        return lambda: models.WrittenOut(models.HeadCounted, vocab=256, layers=4)
    if kind in hf_models.CONFIGS:
        return lambda: hf_models.build(kind)
    if kind in IMAGE_KINDS:
        return image_models.BUILDERS[IMAGE_KINDS[kind]]
    if kind in ("encoder", "vit"):
        return TinyEncoder if kind == "encoder" else TinyViT
    if kind == "tabular":
        return batch_models.TabularRegressor
    raise ValueError(kind)


def _capability_models(name: str):
    """A model file of tests/trace/capability_models, imported as a module."""
    path = Path(__file__).resolve().parents[1] / "trace" / "capability_models" / name
    spec = importlib.util.spec_from_file_location(f"capability_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hooks(kind: str) -> dict:
    """The model file's own `loss` and `batch` (example_batch) a kind trains with, if any."""
    return {"loss": batch_models.loss, "batch": batch_models.example_batch} if kind == "tabular" else {}


def llama_tp_styles(layers: int = 4, moe: bool = False, prefix: str = "") -> dict[str, str]:
    """Megatron pairs of the Llama-style decoder (q/k/v/gate/up column, o/down row) with SP;
    `prefix`: where the decoder sits ("model." in a Hugging Face *ForCausalLM)."""
    styles = {f"{prefix}embed_tokens": "vocab_embedding", f"{prefix}norm": "sequence_parallel",
              "lm_head": "vocab_head"}
    for i in range(layers):
        p = f"{prefix}layers.{i}"
        styles.update({f"{p}.input_layernorm": "sequence_parallel",
                       f"{p}.self_attn": "prepare_input",
                       f"{p}.self_attn.q_proj": "colwise", f"{p}.self_attn.k_proj": "colwise",
                       f"{p}.self_attn.v_proj": "colwise", f"{p}.self_attn.o_proj": "rowwise",
                       f"{p}.post_attention_layernorm": "sequence_parallel",
                       f"{p}.mlp": "moe" if moe else "prepare_input"})
        if not moe:
            styles.update({f"{p}.mlp.gate_proj": "colwise", f"{p}.mlp.up_proj": "colwise",
                           f"{p}.mlp.down_proj": "rowwise"})
    return styles


def plan_dict(kind: str = "llama", **over) -> dict:
    """A plan for the tiny models; stages split the blocks evenly over pp*vpp."""
    if kind in hf_models.CONFIGS:
        return _hf_plan_dict(kind, **over)
    world = over.get("dp", 1) * over.get("tp", 1) * over.get("pp", 1) * over.get("cp", 1)
    block = "blocks" if kind.endswith("gpt") or kind in IMAGE_KINDS or kind == "tabular" else "layers"
    paths = [f"{block}.{i}" for i in range(4)]
    if kind == "encoder":
        paths = ["encoder.layers.0", "encoder.layers.1"]
    stages_n = over.get("pp", 1) * over.get("vpp", 1)
    plan = {"model": {"source": "catalog", "name": f"tiny-{kind}"}, "gpu": "cpu",
            "world_size": world, "gpus_per_node": world, "global_batch": GLOBAL_BATCH,
            "seq_len": SEQ_LEN, "precision": "fp32", "zero_stage": 0, "micro_batch": 1,
            "schedule": "1f1b", "optimizer": dict(OPTIMIZER), "format_version": 1,
            "stages": ([paths[i * len(paths) // stages_n:(i + 1) * len(paths) // stages_n]
                        for i in range(stages_n)]
                       if stages_n > 1 else [])}
    if kind in IMAGE_KINDS:  # a sample is one image: no sequence
        plan.update(seq_len=1, inputs=dict(IMAGE_INPUTS))
    if kind == "tabular":  # the model file's example_batch: no sequence to shard
        plan.update(seq_len=batch_models.FEATURES, inputs={"kind": "batch"}, sequence_parallel=False)
        if over.get("tp", 1) > 1:
            plan.update(tp_styles=dict(batch_models.TP_STYLES), format_version=2)  # per block class
    elif over.get("tp", 1) > 1 and kind != "gpt" and kind not in IMAGE_KINDS:
        plan["tp_styles"] = llama_tp_styles(moe=kind == "mixtral")
    if over.get("cp", 1) > 1:
        plan["cp_modules"] = [f"layers.{i}.self_attn" for i in range(4)]
        plan["cp_buffers"] = {"rope_cos": 0, "rope_sin": 0}
    if over.get("ep", 1) > 1:
        plan["ep_modules"] = [f"layers.{i}.mlp" for i in range(4)]
    plan.update(over)
    return plan


def _hf_plan_dict(kind: str, **over) -> dict:
    """The same plan for a Hugging Face model: its module paths, positions from position_ids."""
    plan = plan_dict("llama", **{k: v for k, v in over.items() if k not in ("tp", "cp", "ep", "pp")})
    paths = hf_models.blocks(kind)
    stages_n = over.get("pp", 1) * over.get("vpp", 1)
    plan["model"]["name"] = f"tiny-{kind}"
    plan["world_size"] = plan["gpus_per_node"] = (over.get("dp", 1) * over.get("tp", 1)
                                                  * over.get("pp", 1) * over.get("cp", 1))
    plan["stages"] = ([paths[i * len(paths) // stages_n:(i + 1) * len(paths) // stages_n]
                       for i in range(stages_n)] if stages_n > 1 else [])
    plan["stages"] = list(plan["stages"])
    if over.get("tp", 1) > 1:
        plan["tp_styles"] = llama_tp_styles(hf_models.LAYERS, moe=kind != "hf_llama", prefix="model.")
    if over.get("cp", 1) > 1:
        plan["cp_modules"] = hf_models.attention_modules(kind)
    if over.get("ep", 1) > 1:
        plan["ep_modules"] = hf_models.moe_modules(kind)
    plan.update(over)
    return plan


@functools.lru_cache(maxsize=None)
def traced_graph(kind: str):
    """The planner's graph of `kind` (token ids given positionally, as `autoplan plan
    hf:config.json` traces): one trace per kind however many plans read it."""
    from autoplan.runtime.model_io import model_call
    from autoplan.trace.tracer import trace_model

    with torch.device("meta"):
        model = builder(kind)()
    inputs = (torch.zeros(1, image_models.CHANNELS, image_models.IMAGE_SIZE, image_models.IMAGE_SIZE,
                          device="meta") if kind in IMAGE_KINDS else
              torch.zeros(1, SEQ_LEN, dtype=torch.long, device="meta"))
    # an encoder-decoder reads the same tokens on both sides, as the runtime calls it (model_io)
    decoder = {"decoder_input_ids": inputs} if "decoder_input_ids" in model_call(model).accepted else None
    return trace_model(model, (inputs,), name=kind, example_kwargs=decoder)


def traced_plan_dict(kind: str, **over) -> dict:
    """`plan_dict` with what a generated job gets from the planner: the TP styles (and EP
    modules) derived from the traced model (traced_graph), not written by hand. No TP pair
    found is an error: a plan without styles would train replicated and match the reference
    without testing TP."""
    plan = plan_dict(kind, **over)
    graph = traced_graph(kind)
    if not graph.tensor_parallel or "tp" in graph.refused:
        raise AssertionError(f"{kind}: no tensor parallelism offered: {graph.tp_unsplit} {graph.refused}")
    plan["tp_styles"] = {scope: dict(styles) for scope, styles in graph.tp_styles.items()}
    if not graph.sequence_shardable:  # as the planner chooses (solve/space.py sequence_parallel)
        plan["sequence_parallel"] = False
    plan["format_version"] = 2  # styles per block class
    if over.get("ep", 1) > 1:
        plan["ep_modules"] = [e["module"] for e in graph.expert_parallel]
    return plan


def _lr(step: int, optimizer: dict) -> float:
    peak, warmup, max_steps = optimizer["lr"], optimizer["warmup_steps"], optimizer["max_steps"]
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return 0.1 * peak + 0.9 * peak * 0.5 * (1 + math.cos(math.pi * progress))


def reference_losses(kind: str, steps: int = STEPS, seed: int = SEED) -> list[float]:
    return reference_run(kind, steps, seed)[0]


def write_token_file(path, num_tokens: int = 20_000, vocab: int = 256) -> None:
    """A learnable uint16 token stream: runs of an affine sequence t -> (5t + 3) mod vocab."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.empty(num_tokens, dtype=torch.int64)
    tokens[0] = 0
    for start in range(0, num_tokens, 64):  # a random restart every 64 tokens
        value = int(torch.randint(0, vocab, (1,), generator=gen))
        for i in range(start, min(start + 64, num_tokens)):
            tokens[i] = value
            value = (5 * value + 3) % vocab
    path.write_bytes(b"".join(int(t).to_bytes(2, "little") for t in tokens.tolist()))


def _file_batch(path, step: int, seed: int) -> torch.Tensor:
    """Rows at offsets drawn from (seed, step), read with plain Python (not the runtime's mmap)."""
    data = path.read_bytes()
    tokens = torch.tensor([int.from_bytes(data[i:i + 2], "little") for i in range(0, len(data), 2)])
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - SEQ_LEN - 1, (GLOBAL_BATCH,), generator=gen)
    return torch.stack([tokens[s:s + SEQ_LEN + 1] for s in starts.tolist()])


def _image_batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of synthetic images: sample `row` of step `step` from its own generator
    (label first, then the image), whatever rank trains on it."""
    shape = (image_models.CHANNELS, image_models.IMAGE_SIZE, image_models.IMAGE_SIZE)
    images, labels = [], []
    for row in range(GLOBAL_BATCH):
        gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_033 + row)
        labels.append(int(torch.randint(0, image_models.CLASSES, (), generator=gen)))
        images.append(torch.randn(shape, generator=gen))
    return torch.stack(images), torch.tensor(labels)


def reference_run(kind: str, steps: int = STEPS, seed: int = SEED,
                  data_path=None) -> tuple[list[float], list[float]]:
    """Single-process fp32 training on the full global batch: (losses, pre-clip grad norms)."""
    reference = reference_training(kind, steps, seed, data_path)
    return reference.losses, reference.grad_norms


class Reference(NamedTuple):
    losses: list[float]
    grad_norms: list[float]  # pre-clip
    state: dict[str, torch.Tensor]  # the model's state_dict after the last step


def float8_reference(model: torch.nn.Module, recipe: str = "tensorwise") -> None:
    """torchao's own single-process float8 training of `model`: every linear inside a block
    ("layers.N" / "blocks.N") with dimensions that are multiples of 16, torchao's `recipe`,
    emulated (CPU)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def in_a_block(module, fqn: str) -> bool:
        return (re.search(r"(^|\.)(layers|blocks)\.\d+\.", fqn) is not None
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model, module_filter_fn=in_a_block, config=config)


def reference_training(kind: str, steps: int = STEPS, seed: int = SEED, data_path=None,
                       optimizer: dict = OPTIMIZER, float8: str | None = None,
                       micro_batch: int | None = None) -> Reference:
    """Single-process fp32 training on the full global batch; with `float8` (a recipe name),
    torchao's float8 linears in the blocks under bf16 autocast (what an fp8 plan runs), the batch accumulated in
    chunks of `micro_batch` sequences (FP8's tensorwise scales are per forward: a plan's
    micro-batches are cast with their own).

    Grad norms are compared too because AdamW and clipping are nearly invariant to a
    gradient scale factor, so a wrong DP/CP/EP averaging would barely move the losses;
    the final weights catch a gradient of the wrong direction (an untied weight)."""
    torch.manual_seed(seed)
    if kind in ("gpt", "encoder", "loop_moe", "tabular", "written_out_gpt") or kind in IMAGE_KINDS:
        model = builder(kind)()
    elif kind in hf_models.CONFIGS:  # as the runtime does: init_weights, else the constructor's value
        with torch.device("meta"):
            model = hf_models.build(kind)
        model = materialise(lambda: hf_models.build(kind), model, seed, torch.device("cpu"))
    else:
        with torch.device("meta"):
            model = builder(kind)()
        model.to_empty(device="cpu")
        model.init_weights()
    vocab = 256
    if float8:
        float8_reference(model, float8)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": optimizer["weight_decay"]},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=optimizer["lr"], betas=tuple(optimizer["betas"]))
    losses, norms = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, optimizer)
        if kind in IMAGE_KINDS or kind == "tabular":
            if kind == "tabular":
                x, y = batch_models.global_batch(step, seed, GLOBAL_BATCH)
                loss = batch_models.loss(model(x), y)
            else:
                images, labels = _image_batch(step, seed)
                loss = F.cross_entropy(model(images), labels)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), optimizer["grad_clip"])))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            continue
        if data_path is not None:
            batch = _file_batch(data_path, step, seed)
        else:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
            batch = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ_LEN + 1), generator=gen)
        for group in opt.param_groups:
            group["lr"] = _lr(step, optimizer)
        chunks = batch.split(micro_batch or len(batch))
        loss = 0.0
        for chunk in chunks:
            inputs = chunk[:, :-1]
            # HF returns a ModelOutput; an encoder-decoder reads the same tokens on both sides
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(float8)):
                logits = model(inputs, decoder_input_ids=inputs) if kind == "hf_t5" else model(inputs)
                logits = getattr(logits, "logits", logits)
                part = F.cross_entropy(logits.reshape(-1, vocab), chunk[:, 1:].reshape(-1)) / len(chunks)
            part.backward()
            loss += part.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), optimizer["grad_clip"])))
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return Reference(losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()})
