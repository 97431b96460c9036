"""The benchmark models of issue #6 (and issue #13's pretrained MiniLM), each with its example
batch and how much of it trains."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], dict[str, torch.Tensor]]  # batch size -> example inputs
    batch: int
    classes: int
    trainable: tuple[str, ...] = field(default=())
    vocab: int = 0
    lora: dict[str, Any] | None = None  # generate(lora=Lora(**lora)); PyTorch gets the same adapters
    steps: int = 20  # steps per timed block (fewer for the slow models)
    random_batch: Callable[[np.random.Generator, int], dict[str, np.ndarray]] | None = None  # inputs, no labels

    def torch_model(self) -> nn.Module:
        """The model PyTorch trains: the SDK's starting point, with the same adapters under LoRA."""
        model = self.build()
        if self.lora is None:
            return model
        from artifacts import Lora
        from artifacts.lora import add_adapters

        return add_adapters(model, Lora(**self.lora), seed=0)[0]


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


class _NextWord(nn.Module):
    """Issue 27's size: an LSTM language model (vocab 5k, hidden 256) reading 20 tokens."""

    def __init__(self, vocab: int = 5000) -> None:
        super().__init__()
        self.embed, self.lstm, self.head = (
            nn.Embedding(vocab, 128),
            nn.LSTM(128, 256, batch_first=True),
            nn.Linear(256, vocab),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(ids))[0][:, -1])


class _UNet(nn.Module):
    """A U-Net-style block: a strided Conv down, a ConvTranspose up, a skip connection, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.down = nn.Conv2d(1, 16, 3, padding=1), nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.up, self.fuse = nn.ConvTranspose2d(32, 16, 2, stride=2), nn.Conv2d(32, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.relu(self.stem(x))
        merged = torch.cat([skip, torch.relu(self.up(torch.relu(self.down(skip))))], dim=1)
        return self.head(torch.relu(self.fuse(merged)).mean(dim=(2, 3)))


def _mobilenet() -> nn.Module:
    """A MobileNet-style net (the on-device vision model users fine-tune): depthwise-separable blocks
    with BatchNorm and Hardswish, all trainable, on 64x64 RGB images."""

    def block(inp: int, out: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(inp, inp, 3, stride, 1, groups=inp, bias=False), nn.BatchNorm2d(inp), nn.Hardswish(),
                nn.Conv2d(inp, out, 1, bias=False), nn.BatchNorm2d(out), nn.Hardswish()]  # fmt: skip

    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish(),
        *block(16, 32, 1), *block(32, 64, 2), *block(64, 64, 1), *block(64, 128, 2), *block(128, 128, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    )  # fmt: skip


def _ids(vocab: int, seq: int) -> Callable[[int], dict[str, torch.Tensor]]:
    return lambda b: {"ids": torch.randint(0, vocab, (b, seq), generator=torch.Generator().manual_seed(0))}


def _pixels(*shape: int) -> Callable[[int], dict[str, torch.Tensor]]:
    return lambda b: {"input": torch.randn(b, *shape, generator=torch.Generator().manual_seed(0))}


SEQ, MINILM_BATCH, MINILM_CLASSES = 64, 16, 33
MINILM_LAST_TWO = ("encoder.encoder.layer.4", "encoder.encoder.layer.5", "head")
MINILM_LORA = {"rank": 8, "alpha": 16.0, "targets": ("query", "value")}


def _minilm() -> nn.Module:
    """The pretrained all-MiniLM-L6-v2 with mean pooling and a new head (the intents sample's model)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_intents_model", ROOT / "samples" / "intents" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.IntentClassifier(MINILM_CLASSES)


def _tokens(rng: np.random.Generator, batch: int) -> dict[str, np.ndarray]:
    """Full-length sequences of ordinary word-piece ids with every position attended."""
    return {"ids": rng.integers(1_000, 30_000, (batch, SEQ)), "mask": np.ones((batch, SEQ), np.int64)}


def _minilm_inputs(batch: int) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in _tokens(np.random.default_rng(0), batch).items()}


def cases() -> list[Case]:
    from artifacts.loading import load_factory

    sample = ROOT / "samples" / "digits" / "model.py"

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
        Case("LSTM next-word (seq 20, hidden 256, vocab 5k)", _seeded(_NextWord), _ids(5000, 20), 32, 5000, vocab=5000),
        Case("U-Net-style (ConvTranspose)", _seeded(_UNet), _pixels(1, 28, 28), 32, 10),
        Case("MobileNet-style (depthwise, BatchNorm, Hardswish)", _seeded(_mobilenet), _pixels(3, 64, 64), 32, 10),
        *(
            Case(
                name,
                _minilm,
                _minilm_inputs,
                MINILM_BATCH,
                MINILM_CLASSES,
                trainable,
                lora=lora,
                steps=5,
                random_batch=_tokens,
            )  # fmt: skip
            for name, trainable, lora in (
                ("MiniLM-L6 (full fine-tuning)", (), None),
                ("MiniLM-L6 (last 2 layers + head)", MINILM_LAST_TWO, None),
                ("MiniLM-L6 (LoRA r8 + head)", ("head",), MINILM_LORA),
            )
        ),
    ]
