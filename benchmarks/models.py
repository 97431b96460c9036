"""The benchmark models of issue #6, each with its example batch and how much of it trains."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], dict[str, torch.Tensor]]  # batch size -> example inputs
    batch: int
    classes: int
    trainable: tuple[str, ...] = field(default=())
    vocab: int = 0


class Encoder(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int, classes: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(1, seq, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embedding(ids) + self.position)[:, 0])


def _seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return factory()

    return build


def _cnn(batchnorm: bool) -> nn.Module:
    norm = (lambda c: nn.BatchNorm2d(c)) if batchnorm else (lambda c: nn.Identity())
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), norm(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), norm(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def _ids(vocab: int, seq: int) -> Callable[[int], dict[str, torch.Tensor]]:
    return lambda b: {"ids": torch.randint(0, vocab, (b, seq), generator=torch.Generator().manual_seed(0))}


def _pixels(*shape: int) -> Callable[[int], dict[str, torch.Tensor]]:
    return lambda b: {"input": torch.randn(b, *shape, generator=torch.Generator().manual_seed(0))}


def cases() -> list[Case]:
    from pathlib import Path

    from artifacts.loading import load_factory

    sample = Path(__file__).resolve().parents[1] / "samples" / "digits" / "model.py"

    mlp = _seeded(
        lambda: nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    )
    small = _seeded(lambda: Encoder(1000, 128, 4, 2, 128, 2))
    bert = _seeded(lambda: Encoder(30522, 256, 4, 4, 128, 2))
    return [
        Case("MLP 784-256-128-10", mlp, _pixels(784), 64, 10),
        Case("CNN", _seeded(lambda: _cnn(False)), _pixels(1, 28, 28), 64, 10),
        Case("CNN + BatchNorm", _seeded(lambda: _cnn(True)), _pixels(1, 28, 28), 64, 10),
        Case("encoder (all trainable)", small, _ids(1000, 128), 16, 2, vocab=1000),
        Case("encoder (last layer + head)", small, _ids(1000, 128), 16, 2, ("encoder.layers.1", "head"), 1000),
        Case("BERT-shaped encoder", bert, _ids(30522, 128), 8, 2, vocab=30522),
        Case("digits sample", lambda: load_factory(f"{sample}:build"), _pixels(64), 32, 10),
    ]
