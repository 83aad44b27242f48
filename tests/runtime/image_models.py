"""Tiny image classifiers written as a user would write them (no autoplan hooks): a ViT
(patch-embedding Conv2d, pre-norm transformer blocks, mean-pooled class head), a
ConvNeXt-style ConvNet (patchify stem, depthwise 7x7 blocks, pooled head) and a ResNet
(BatchNorm: its statistics couple the samples of a batch)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

IMAGE_SIZE, CHANNELS, CLASSES = 32, 3, 10


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyViT(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 4, heads: int = 4, patch: int = 8,
                 classes: int = CLASSES) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(CHANNELS, dim, kernel_size=patch, stride=patch)
        self.pos_embed = nn.Parameter(torch.randn(1, (IMAGE_SIZE // patch) ** 2, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class TinyConvNeXt(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 4, classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Conv2d(CHANNELS, dim, kernel_size=4, stride=4)
        self.blocks = nn.Sequential(*[ConvNeXtBlock(dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(images))
        return self.head(self.norm(x.mean(dim=(2, 3))))


class BasicBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(dim)
        self.conv2 = nn.Conv2d(dim, dim, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class TinyResNet(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 4, classes: int = CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(CHANNELS, dim, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(dim)
        self.blocks = nn.Sequential(*[BasicBlock(dim) for _ in range(depth)])
        self.fc = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.bn1(self.conv1(images))))
        return self.fc(x.mean(dim=(2, 3)))


def _corpus_model(name: str) -> nn.Module:
    """A tiny corpus model (tests/corpus.py). The timm-style ViT and Swin view their fused
    qkv as (..., 3, heads, head_dim) and merge the heads with `reshape(b, n, c)`, c read from
    the input; Swin adds a per-head relative position bias table."""
    from tests import corpus
    return corpus.ENTRIES[name].build("tiny")


def timm_swin() -> nn.Module:
    return _corpus_model("swin_t")


def timm_vit() -> nn.Module:
    return _corpus_model("vit_b16")


BUILDERS = {"vit": TinyViT, "convnext": TinyConvNeXt, "resnet": TinyResNet, "timm_swin": timm_swin,
            "timm_vit": timm_vit}
