"""The test corpus of model code users have: Hugging Face transformers classes built from
config objects (never downloaded), plain-torch vision models written like timm/torchvision
(no wheel of those matches this CPU torch), `nn.TransformerEncoder`, and hand-written files.

Every entry builds in two sizes: `tiny` (hidden <= 128, 2 layers per stack; real CPU tensors
are fine, for multi-rank tests) and `full` (the published architecture; build it under
`torch.device("meta")` only). Each entry states the facts a trace must find:

- `stacks`: ModuleList/Sequential path -> number of blocks in it (full size; the tiny size
  has 2 per stack, and ResNet/Swin tiny only their first two stages: `Entry.stacks_for`).
- `attention` / `moe`: module paths, inside the first block of a stack, of the attention
  and routed-expert modules.
- `inputs`: "tokens" (input_ids), "seq2seq" (input_ids + decoder_input_ids) or "image".

    from tests import corpus
    entry = corpus.ENTRIES["llama"]
    with torch.device("meta"):
        model = entry.build("full")
    inputs = entry.example_inputs(batch=1, seq=2048)  # meta tensors

`corpus.model_file(name, size, directory)` writes a model file for the CLI
(`autoplan analyze|plan FILE`) that builds the entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- plain-torch vision models

class PatchEmbed(nn.Module):
    def __init__(self, patch: int, channels: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, patches, dim)


class VitAttention(nn.Module):
    """timm's Attention: one fused qkv Linear, SDPA, an output projection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VitBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = VitAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), attn_mask=attn_mask)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """timm `vit_base_patch16_224` layout: class token, learned positions, blocks called
    with a keyword argument, final norm, classifier on the class token."""

    def __init__(self, image_size=224, patch=16, dim=768, depth=12, heads=12, classes=1000) -> None:
        super().__init__()
        self.image_size = image_size
        self.patch_embed = PatchEmbed(patch, 3, dim)
        patches = (image_size // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, patches + 1, dim))
        self.blocks = nn.Sequential(*[VitBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixel_values)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x, attn_mask=None)
        return self.head(self.norm(x)[:, 0])


def _window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    b, h, w, c = x.shape
    x = x.view(b, h // window, window, w // window, window, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, c)


def _window_reverse(windows: torch.Tensor, window: int, h: int, w: int) -> torch.Tensor:
    c = windows.shape[-1]
    x = windows.view(-1, h // window, w // window, window, window, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, h, w, c)


class WindowAttention(nn.Module):
    """Swin window attention with a learned relative-position bias."""

    def __init__(self, dim: int, heads: int, window: int) -> None:
        super().__init__()
        self.num_heads, self.window = heads, window
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, heads))
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("relative_position_index", rel[..., 0] * (2 * window - 1) + rel[..., 1],
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        bias = bias.view(n, n, -1).permute(2, 0, 1).unsqueeze(0)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, shift: int) -> None:
        super().__init__()
        self.window, self.shift = window, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, window)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, H, W, C)
        b, h, w, c = x.shape
        y = self.norm1(x)
        if self.shift:
            y = torch.roll(y, shifts=(-self.shift, -self.shift), dims=(1, 2))
        y = _window_reverse(self.attn(_window_partition(y, self.window)), self.window, h, w)
        if self.shift:
            y = torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))
        x = x + y
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        x = x.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).flatten(3)
        return self.reduction(self.norm(x))


class SwinStage(nn.Module):
    def __init__(self, dim: int, depth: int, heads: int, window: int, downsample: bool) -> None:
        super().__init__()
        self.downsample = PatchMerging(dim // 2) if downsample else nn.Identity()
        self.blocks = nn.Sequential(*[SwinBlock(dim, heads, window, 0 if i % 2 == 0 else window // 2)
                                      for i in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class SwinTransformer(nn.Module):
    """timm `swin_tiny_patch4_window7_224` layout (stages of shifted-window blocks)."""

    def __init__(self, image_size=224, patch=4, dim=96, depths=(2, 2, 6, 2), heads=(3, 6, 12, 24),
                 window=7, classes=1000) -> None:
        super().__init__()
        self.image_size = image_size
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.embed_norm = nn.LayerNorm(dim)
        self.layers = nn.Sequential(*[
            SwinStage(dim * 2 ** i, depths[i], heads[i], window, downsample=i > 0)
            for i in range(len(depths))])
        self.norm = nn.LayerNorm(dim * 2 ** (len(depths) - 1))
        self.head = nn.Linear(dim * 2 ** (len(depths) - 1), classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embed_norm(self.patch_embed(pixel_values).permute(0, 2, 3, 1))
        x = self.norm(self.layers(x))
        return self.head(x.mean(dim=(1, 2)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + identity)


class ResNet(nn.Module):
    """torchvision `resnet50` layout."""

    def __init__(self, layers=(3, 4, 6, 3), width=64, classes=1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = width
        self.stages = len(layers)
        for i, count in enumerate(layers):
            planes = width * 2 ** i
            blocks = [Bottleneck(inplanes, planes, stride=1 if i == 0 else 2)]
            inplanes = planes * Bottleneck.expansion
            blocks += [Bottleneck(inplanes, planes) for _ in range(count - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(pixel_values))))
        for i in range(self.stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ConvNeXtBlock(nn.Module):
    """ConvNeXt block: depthwise 7x7 conv, LayerNorm over channels-last, an inverted
    bottleneck (dim -> 4 dim -> dim) of Linears, a learned per-channel layer scale."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C, H, W)
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))  # channels-last for the LayerNorm
        y = self.gamma * self.pwconv2(self.act(self.pwconv1(y)))
        return x + y.permute(0, 3, 1, 2)


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of a channels-first (B, C, H, W) map."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtStage(nn.Module):
    def __init__(self, in_dim: int, dim: int, depth: int) -> None:
        super().__init__()
        self.downsample = nn.Identity() if in_dim == dim else nn.Sequential(
            LayerNorm2d(in_dim, eps=1e-6), nn.Conv2d(in_dim, dim, 2, stride=2))
        self.blocks = nn.Sequential(*[ConvNeXtBlock(dim) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class ConvNeXt(nn.Module):
    """timm `convnext_tiny` layout: a 4x4 patchify stem, four stages (a LayerNorm + 2x2
    strided conv between them, then blocks), global pooling, norm, classifier."""

    def __init__(self, depths=(3, 3, 9, 3), dims=(96, 192, 384, 768), classes=1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0], eps=1e-6))
        self.stages = nn.Sequential(*[ConvNeXtStage(dims[max(i - 1, 0)], dims[i], depths[i])
                                      for i in range(len(dims))])
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(pixel_values))
        return self.head(self.norm(x.mean(dim=(2, 3))))


# ---------------------------------------------------------------- hand-written token models

class EncoderLM(nn.Module):
    """Token embedding + `nn.TransformerEncoder` + a vocabulary head."""

    def __init__(self, vocab=32000, dim=512, heads=8, ffn=2048, layers=6, max_seq=4096) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, ffn, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        mask = nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1], device=input_ids.device)
        return self.head(self.encoder(x, mask=mask, is_causal=True))


class Expert(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RoutedMoE(nn.Module):
    """Mixtral-style top-2 routing: a loop over an nn.ModuleList of experts, each running
    only on the tokens routed to it (a data-dependent shape)."""

    def __init__(self, dim: int, ffn: int, num_experts: int = 8, top_k: int = 2) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, ffn) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        x = x.reshape(-1, d)
        weights, selected = torch.topk(self.gate(x).softmax(dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token, slot = torch.where(selected == i)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.view(b, t, d)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class MoEBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.norm2 = nn.RMSNorm(dim)
        self.moe = RoutedMoE(dim, ffn, num_experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoELM(nn.Module):
    def __init__(self, vocab=32000, dim=1024, heads=16, ffn=2816, layers=8, num_experts=8, top_k=2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MoEBlock(dim, heads, ffn, num_experts, top_k) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class NeoXAttention(nn.Module):
    """GPT-NeoX attention: fused qkv, rotary on a fraction of each head (`int(d * frac)` on
    a traced shape)."""

    def __init__(self, dim: int, heads: int, rotary_pct: float = 0.25) -> None:
        super().__init__()
        self.heads, self.rotary_pct = heads, rotary_pct
        self.query_key_value = nn.Linear(dim, 3 * dim)
        self.dense = nn.Linear(dim, dim)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        rot = int(x.shape[-1] * self.rotary_pct)
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        t = x.shape[-2]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, device=x.device, dtype=torch.float32) / rot))
        freqs = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos().repeat(1, 2).to(x.dtype), freqs.sin().repeat(1, 2).to(x.dtype)
        half = x_rot.shape[-1] // 2
        rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
        return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.query_key_value(x).view(b, t, self.heads, 3 * (d // self.heads)).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(self._rotate(q), self._rotate(k), v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(b, t, d))


class NeoXBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(dim)
        self.post_attention_layernorm = nn.LayerNorm(dim)
        self.attention = NeoXAttention(dim, heads)
        self.mlp = Mlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # parallel residual
        return x + self.attention(self.input_layernorm(x)) + self.mlp(self.post_attention_layernorm(x))


class NeoXLM(nn.Module):
    def __init__(self, vocab=50304, dim=2048, heads=16, layers=24) -> None:
        super().__init__()
        self.embed_in = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(NeoXBlock(dim, heads) for _ in range(layers))
        self.final_layer_norm = nn.LayerNorm(dim)
        self.embed_out = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_in(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.embed_out(self.final_layer_norm(x))


class Seq2SeqTransformer(nn.Module):
    """A translation model on `nn.Transformer` (encoder-decoder, the "Attention Is All You
    Need" base sizes): one token embedding shared by source and target, learned positions,
    a causal decoder, a vocabulary head. Inputs are seq2seq, as T5's."""

    def __init__(self, vocab=37000, dim=512, heads=8, ffn=2048, layers=6, max_seq=4096) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.transformer = nn.Transformer(dim, heads, layers, layers, ffn, dropout=0.0,
                                          batch_first=True, norm_first=True)
        self.head = nn.Linear(dim, vocab)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        t = decoder_input_ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=decoder_input_ids.device)
        y = self.transformer(self._embed(input_ids), self._embed(decoder_input_ids),
                             tgt_mask=mask, tgt_is_causal=True)
        return self.head(y)


def rotary_table(seq: int, head_dim: int, theta: float) -> torch.Tensor:
    """Llama reference `precompute_freqs_cis`: complex64 rotations, always float32."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    """Llama reference: q and k rotated as complex float32 numbers, then cast back to the
    projections' dtype (`.type_as`), so SDPA sees the compute dtype, not float32."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[None, :, None, :]  # (1, seq, 1, head_dim / 2)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RopeAttention(nn.Module):
    """Llama reference attention (wq/wk/wv/wo, grouped K/V heads) with fp32 rotary."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim, self.repeats = dim // heads, heads // kv_heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim)  # heads as -1: a rank's share under TP
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis)
        k, v = (y.repeat_interleave(self.repeats, dim=2) for y in (k, v))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class RopeFeedForward(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RopeBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.attention = RopeAttention(dim, heads, kv_heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.feed_forward = RopeFeedForward(dim, ffn)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs_cis)
        return x + self.feed_forward(self.ffn_norm(x))


class RopeFp32LM(nn.Module):
    """Meta's Llama reference `model.py` (Llama-2-7B sizes), trainable. What sets it apart
    from the transformers Llama is its rotary embedding: a complex64 table `freqs_cis`
    (`torch.polar`, float32 whatever the compute dtype; a buffer, as torchtitan keeps it, for
    twice the context) that the root slices to the sequence and hands to every block as an
    argument; q and k are rotated as complex float32 numbers and cast back with `.type_as`
    before SDPA. No position ids."""

    def __init__(self, vocab=32000, dim=4096, heads=32, kv_heads=32, ffn=11008, layers=32,
                 theta=10000.0, max_seq=4096) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(RopeBlock(dim, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", rotary_table(2 * max_seq, dim // heads, theta), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(input_ids)
        freqs_cis = self.freqs_cis[: input_ids.shape[1]]
        for layer in self.layers:
            x = layer(x, freqs_cis)
        return self.output(self.norm(x))


# ---------------------------------------------------------------- Hugging Face transformers

def _hf_config(cls_name: str, **fields):
    import transformers

    return getattr(transformers, cls_name)(**fields)


def _hf_model(model_cls: str, config_cls: str, fields: dict, tiny: dict, size: str) -> nn.Module:
    import transformers

    values = {**fields, **(tiny if size == "tiny" else {})}
    attention = values.pop("attn_implementation", "sdpa")  # "eager" where there is no attention
    config = _hf_config(config_cls, **values)
    config._attn_implementation = attention
    return getattr(transformers, model_cls)(config)


# (model class, config class, full-size fields, tiny overrides)
HF_MODELS: dict[str, tuple[str, str, dict, dict]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(  # Llama-3-8B
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(  # Mixtral-8x7B
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False),
        dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, max_position_embeddings=256)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(  # Qwen1.5-MoE-A2.7B
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, decoder_sparse_step=1,
        max_position_embeddings=8192, tie_word_embeddings=False),
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=64, max_position_embeddings=256)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(  # GPT-2 124M
        vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
        dict(vocab_size=256, n_positions=256, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
             eos_token_id=0)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(  # Pythia-1.4B
        vocab_size=50304, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
        num_attention_heads=16, rotary_pct=0.25, max_position_embeddings=2048,
        use_parallel_residual=True, tie_word_embeddings=False),
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=256)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(  # Phi-3-mini-4k
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        tie_word_embeddings=False),
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
             bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(  # Gemma-2B
        vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
        num_attention_heads=8, num_key_value_heads=1, head_dim=256, max_position_embeddings=8192),
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=256)),
    "bert": ("BertForMaskedLM", "BertConfig", dict(  # bert-base-uncased
        vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
        intermediate_size=3072, max_position_embeddings=512),
        dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, max_position_embeddings=256)),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(  # t5-base
        vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_decoder_layers=12,
        num_heads=12),
        dict(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
             num_heads=4)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(  # Qwen/Qwen3-8B config.json
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False),
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(  # allenai/OLMo-2-1124-7B config.json
        vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        pad_token_id=100277, bos_token_id=None, eos_token_id=100257),
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
             pad_token_id=0, eos_token_id=0)),
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(  # ibm-granite/granite-3.0-2b-base
        vocab_size=49155, hidden_size=2048, intermediate_size=8192, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
        rope_theta=10000.0, rms_norm_eps=1e-5, embedding_multiplier=12.0, logits_scaling=8.0,
        residual_multiplier=0.22, attention_multiplier=0.015625, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=0, eos_token_id=0),
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             attention_multiplier=0.25)),
    # deepseek-ai/DeepSeek-V3 config.json (without its YaRN rope scaling, which changes only
    # the rotary frequencies): MLA (low-rank q and kv projections, a decoupled rotary part),
    # the first 3 layers dense, then 256 routed experts (8 per token, chosen within 4 of 8
    # groups) plus a shared expert
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3,
        norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6,
        tie_word_embeddings=False),
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
             n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
             first_k_dense_replace=1, max_position_embeddings=256)),
    "mamba": ("MambaForCausalLM", "MambaConfig", dict(  # state-spaces/mamba-130m-hf (tied head)
        vocab_size=50280, hidden_size=768, num_hidden_layers=24, state_size=16, expand=2,
        conv_kernel=4, time_step_rank=48, tie_word_embeddings=True, use_cache=False,
        attn_implementation="eager"),
        dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, state_size=8, time_step_rank=8)),
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(  # EleutherAI/gpt-j-6b
        vocab_size=50400, n_embd=4096, n_layer=28, n_head=16, rotary_dim=64, n_positions=2048,
        tie_word_embeddings=False),
        dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=256,
             bos_token_id=0, eos_token_id=0)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(  # mistralai/Mistral-7B-v0.1
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=4096, tie_word_embeddings=False),
        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)),
}


# ---------------------------------------------------------------- entries

@dataclass(frozen=True)
class Entry:
    name: str
    build_fn: Callable[[str], nn.Module] = field(repr=False)
    inputs: str  # "tokens" | "seq2seq" | "image"
    stacks: dict[str, int]  # full size: stack path -> blocks in it
    attention: tuple[str, ...] = ()
    moe: tuple[str, ...] = ()
    hf: bool = False
    data_dependent: bool = False  # routing whose shapes depend on values (cannot run on meta)
    image_size: int = 0  # full size; tiny uses `tiny_image_size`
    tiny_image_size: int = 0
    vocab: dict[str, int] = field(default_factory=lambda: {"full": 0, "tiny": 0})
    # whether the suite traces and plans the full size (tests/trace/test_corpus.py); off where
    # that costs more than 5 s of CPU and the tiny size exercises the same code
    full_tests: bool = True

    def build(self, size: str = "tiny") -> nn.Module:
        """The model at `size` ("tiny" or "full"); call under torch.device("meta") for full."""
        assert size in ("tiny", "full"), size
        torch.manual_seed(0)
        return self.build_fn(size)

    def stacks_for(self, size: str) -> dict[str, int]:
        return dict(self.stacks) if size == "full" else tiny_stacks(self)

    def example_inputs(self, size: str, batch: int = 2, seq: int = 16,
                       device: str = "meta") -> dict[str, torch.Tensor]:
        """Keyword inputs of the forward: `input_ids` (plus `decoder_input_ids` for seq2seq)
        or `pixel_values` (an image batch of the entry's size)."""
        if self.inputs == "image":
            side = self.image_size if size == "full" else self.tiny_image_size
            return {"pixel_values": torch.randn(batch, 3, side, side, device=device)}
        if device == "meta":
            ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
        else:
            ids = torch.randint(0, self.vocab[size], (batch, seq), device=device)
        if self.inputs == "seq2seq":
            return {"input_ids": ids, "decoder_input_ids": ids.clone()}
        return {"input_ids": ids}


def _hf_entry(name: str, **facts) -> Entry:
    model_cls, config_cls, fields, tiny = HF_MODELS[name]
    vocab = {"full": fields.get("vocab_size"), "tiny": tiny.get("vocab_size")}
    return Entry(name=name, build_fn=lambda size: _hf_model(model_cls, config_cls, fields, tiny, size),
                 hf=True, vocab=vocab, **facts)


def _torch_entry(name: str, full: Callable[[], nn.Module], tiny: Callable[[], nn.Module],
                 **facts) -> Entry:
    return Entry(name=name, build_fn=lambda size: full() if size == "full" else tiny(), **facts)


_VOCAB = {"full": 32000, "tiny": 256}

ENTRIES: dict[str, Entry] = {e.name: e for e in [
    _hf_entry("llama", inputs="tokens", stacks={"model.layers": 32},
              attention=("model.layers.0.self_attn",)),
    _hf_entry("mixtral", inputs="tokens", stacks={"model.layers": 32},
              attention=("model.layers.0.self_attn",), moe=("model.layers.0.mlp",)),
    _hf_entry("qwen2_moe", inputs="tokens", stacks={"model.layers": 24},
              attention=("model.layers.0.self_attn",), moe=("model.layers.0.mlp",)),
    _hf_entry("gpt2", inputs="tokens", stacks={"transformer.h": 12},
              attention=("transformer.h.0.attn",)),
    _hf_entry("gpt_neox", inputs="tokens", stacks={"gpt_neox.layers": 24},
              attention=("gpt_neox.layers.0.attention",)),
    _hf_entry("phi3", inputs="tokens", stacks={"model.layers": 32},
              attention=("model.layers.0.self_attn",)),
    _hf_entry("gemma", inputs="tokens", stacks={"model.layers": 18},
              attention=("model.layers.0.self_attn",)),
    _hf_entry("bert", inputs="tokens", stacks={"bert.encoder.layer": 12},
              attention=("bert.encoder.layer.0.attention.self",)),
    _hf_entry("t5", inputs="seq2seq", stacks={"encoder.block": 12, "decoder.block": 12},
              attention=("encoder.block.0.layer.0.SelfAttention", "decoder.block.0.layer.0.SelfAttention",
                         "decoder.block.0.layer.1.EncDecAttention")),
    # full_tests=False: the full-size trace + 64-GPU plan cost more than 5 s (CPU seconds,
    # then wall seconds with --durations on the shared machine): qwen3 6.4, mamba 30 (its
    # selective scan a Python loop over the tokens), deepseek_v3 6.0; olmo2 2.8/12, granite
    # 3.7/13, mistral 2.3/12.5, gptj 2.7/32, convnext 3.0/36. Their tiny sizes (exact
    # parameters and FLOPs) run the same code; nn_transformer (1.6/7) and rope_fp32 (2.5/11)
    # keep theirs
    _hf_entry("qwen3", inputs="tokens", stacks={"model.layers": 36},
              attention=("model.layers.0.self_attn",), full_tests=False),
    _hf_entry("olmo2", inputs="tokens", stacks={"model.layers": 32},
              attention=("model.layers.0.self_attn",), full_tests=False),
    _hf_entry("granite", inputs="tokens", stacks={"model.layers": 40},
              attention=("model.layers.0.self_attn",), full_tests=False),
    # the first block is dense at both sizes (first_k_dense_replace): the routed experts
    # named are the tiny model's second block (the full size's is dense; full_tests is off)
    _hf_entry("deepseek_v3", inputs="tokens", stacks={"model.layers": 61},
              attention=("model.layers.0.self_attn",), moe=("model.layers.1.mlp",), full_tests=False),
    _hf_entry("mamba", inputs="tokens", stacks={"backbone.layers": 24}, full_tests=False),
    _hf_entry("gptj", inputs="tokens", stacks={"transformer.h": 28},
              attention=("transformer.h.0.attn",), full_tests=False),
    _hf_entry("mistral", inputs="tokens", stacks={"model.layers": 32},
              attention=("model.layers.0.self_attn",), full_tests=False),
    _torch_entry("vit_b16", lambda: VisionTransformer(),
                 lambda: VisionTransformer(image_size=32, patch=8, dim=64, depth=2, heads=4, classes=10),
                 inputs="image", image_size=224, tiny_image_size=32, stacks={"blocks": 12},
                 attention=("blocks.0.attn",)),
    _torch_entry("swin_t", lambda: SwinTransformer(),
                 lambda: SwinTransformer(image_size=32, patch=2, dim=16, depths=(2, 2), heads=(2, 4),
                                         window=4, classes=10),
                 inputs="image", image_size=224, tiny_image_size=32,
                 stacks={"layers.0.blocks": 2, "layers.1.blocks": 2, "layers.2.blocks": 6,
                         "layers.3.blocks": 2},
                 attention=("layers.0.blocks.0.attn",)),
    _torch_entry("resnet50", lambda: ResNet(), lambda: ResNet(layers=(2, 2), width=8, classes=10),
                 inputs="image", image_size=224, tiny_image_size=32,
                 stacks={"layer1": 3, "layer2": 4, "layer3": 6, "layer4": 3}),
    _torch_entry("transformer_encoder", lambda: EncoderLM(),
                 lambda: EncoderLM(vocab=256, dim=64, heads=4, ffn=128, layers=2, max_seq=256),
                 inputs="tokens", stacks={"encoder.layers": 6}, vocab=_VOCAB,
                 attention=("encoder.layers.0.self_attn",)),
    _torch_entry("moe_loop", lambda: MoELM(),
                 lambda: MoELM(vocab=256, dim=64, heads=4, ffn=96, layers=2, num_experts=4, top_k=2),
                 inputs="tokens", stacks={"layers": 8}, vocab=_VOCAB, data_dependent=True,
                 attention=("layers.0.attn",), moe=("layers.0.moe",)),
    _torch_entry("neox_frac", lambda: NeoXLM(),
                 lambda: NeoXLM(vocab=256, dim=64, heads=4, layers=2),
                 inputs="tokens", stacks={"layers": 24}, vocab={"full": 50304, "tiny": 256},
                 attention=("layers.0.attention",)),
    _torch_entry("convnext", lambda: ConvNeXt(),
                 lambda: ConvNeXt(depths=(2, 2), dims=(16, 32), classes=10),
                 inputs="image", image_size=224, tiny_image_size=32,
                 stacks={"stages.0.blocks": 3, "stages.1.blocks": 3, "stages.2.blocks": 9,
                         "stages.3.blocks": 3}, full_tests=False),
    _torch_entry("nn_transformer", lambda: Seq2SeqTransformer(),
                 lambda: Seq2SeqTransformer(vocab=256, dim=64, heads=4, ffn=128, layers=2, max_seq=256),
                 inputs="seq2seq", stacks={"transformer.encoder.layers": 6, "transformer.decoder.layers": 6},
                 vocab={"full": 37000, "tiny": 256},
                 attention=("transformer.encoder.layers.0.self_attn", "transformer.decoder.layers.0.self_attn",
                            "transformer.decoder.layers.0.multihead_attn")),
    _torch_entry("rope_fp32", lambda: RopeFp32LM(),
                 lambda: RopeFp32LM(vocab=256, dim=64, heads=4, kv_heads=2, ffn=128, layers=2, max_seq=256),
                 inputs="tokens", stacks={"layers": 32}, vocab=_VOCAB, attention=("layers.0.attention",)),
]}

def tiny_stacks(entry: Entry) -> dict[str, int]:
    """Stacks of the tiny size: 2 blocks each, in the stages the tiny model has."""
    if entry.name == "resnet50":
        return {"layer1": 2, "layer2": 2}
    if entry.name == "swin_t":
        return {"layers.0.blocks": 2, "layers.1.blocks": 2}
    if entry.name == "convnext":
        return {"stages.0.blocks": 2, "stages.1.blocks": 2}
    return {path: 2 for path in entry.stacks}


def model_file(name: str, size: str, directory: Path) -> Path:
    """Write `<directory>/<name>_<size>.py`, a model file the CLI can load: it builds the
    corpus entry and, where the forward takes more than token ids, defines example_inputs."""
    entry = ENTRIES[name]
    path = Path(directory) / f"{name}_{size}.py"
    lines = [
        "import sys",
        f"sys.path.insert(0, {str(REPO)!r})",
        "from tests import corpus",
        f"ENTRY = corpus.ENTRIES[{name!r}]",
        "",
        "def build_model():",
        f"    return ENTRY.build({size!r})",
    ]
    if entry.inputs == "seq2seq":
        lines += ["", "def example_inputs(batch_size, seq_len):",
                  f"    return ENTRY.example_inputs({size!r}, batch_size, seq_len)"]
    # image models take --image-size; token models take --seq-len
    path.write_text("\n".join(lines) + "\n")
    return path


def grouped_gemm_flops(a_shape, b_shape, *_, out_shape=None, **__) -> int:
    """FLOPs of a grouped GEMM (HF experts' `torch._grouped_mm` and its CPU fallback op):
    every row of `a` meets one group's (K, N) matrix, 2 FLOPs per multiply-add, so
    2 * rows * K * N = 2 * numel(out) * K. FlopCounterMode has no formula for these ops."""
    return 2 * math.prod(out_shape) * a_shape[-1]


def grouped_gemm_mapping() -> dict:
    mapping = {torch.ops.aten._grouped_mm: grouped_gemm_flops}
    transformers_ops = getattr(torch.ops, "transformers", None)
    if transformers_ops is not None and hasattr(transformers_ops, "grouped_mm_fallback"):
        mapping[transformers_ops.grouped_mm_fallback] = grouped_gemm_flops
    return mapping


def reference_flops(model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """Forward FLOPs of the whole model by FlopCounterMode, independent of autoplan's tracer.

    Meta models run under FakeTensorMode over meta tensors (HF code checks for fake tensors
    to skip value-dependent mask shortcuts; SDPA on meta decomposes into counted matmuls);
    a model with real weights runs for real (data-dependent routing needs real values) with
    the math attention kernel.
    Meta models run in bf16, as the tracer does (HF's grouped-GEMM experts need it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=grouped_gemm_mapping())
    if next(model.parameters()).is_meta:
        model = model.to(torch.bfloat16)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = {k: mode.from_tensor(v.to(torch.bfloat16) if v.is_floating_point() else v)
                    for k, v in inputs.items()}
            with counter:
                model(**fake)
    else:  # the math SDPA kernel, whose matmuls FlopCounterMode counts (CPU flash has no formula)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # with grad on: under no_grad a view of a weight (Mamba's conv weight handed to a
        # kernels-hub module) requires grad without a grad_fn, and the counter's module
        # tracker cannot hook it ("Expected gradient function to be set")
        with counter, sdpa_kernel(SDPBackend.MATH):
            model(**inputs)
    return counter.get_total_flops()


def parameter_count(model: nn.Module) -> int:
    """Unique parameters (tied weights once)."""
    return sum(p.numel() for p in model.parameters())

