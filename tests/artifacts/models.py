"""Small models for the generator tests (also loadable as --model tests/artifacts/models.py:NAME)."""

import torch
from torch import nn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 3, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        self.dropout = nn.Dropout(0.25)
        self.classifier = nn.Linear(32, 5)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(self.features(image).flatten(1)))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    model = CNN()
    with torch.no_grad():  # non-trivial running statistics, as after pre-training
        for bn in (model.features[1], model.features[5]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    return model


class Encoder(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, layers: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(1, 16, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.1, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embedding(ids) + self.position[:, : ids.shape[1]])
        return self.head(self.norm(hidden).mean(dim=1))


def encoder() -> nn.Module:
    torch.manual_seed(0)
    return Encoder()


class TwoHeads(nn.Module):
    """Returns (aux, logits): the loss must read the second output when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.aux = nn.Linear(16, 2)
        self.logits = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.aux(h), self.logits(h)


def two_heads() -> nn.Module:
    torch.manual_seed(0)
    return TwoHeads()


class SelfLoss(nn.Module):
    """forward(x, target) returns (loss, prediction)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 12), nn.Sigmoid(), nn.Linear(12, 2))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prediction = self.net(x)
        return ((prediction - target) ** 2).mean() + 0.1 * prediction.abs().mean(), prediction


def self_loss() -> nn.Module:
    torch.manual_seed(0)
    return SelfLoss()


def hardswish_head() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Hardswish(), nn.Linear(8, 3))


class _Scan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(self.proj(x), dim=1)


def cumsum_head() -> nn.Module:
    """A CumSum (no gradient in ORT 1.19, no exact rewrite) nested two modules deep."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), _Scan(), nn.Linear(8, 3))


def not_a_module() -> str:
    return "not a model"


def no_bias() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4, bias=False))


class SqrtGate(nn.Module):
    """A digits-shaped classifier scaled by sqrt(gate), gate = 0: the loss is finite (log 10),
    the gate's gradient is not; only a check of the gradients catches the step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(64, 10)
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.fc(input) * torch.sqrt(self.gate)


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = nn.functional.adaptive_avg_pool2d(x, 1)
        return x * nn.functional.hardsigmoid(self.expand(nn.functional.relu(self.reduce(scale))))


def _norm(channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels, eps=1e-3, momentum=0.01)  # MobileNetV3's BatchNorm settings


class _InvertedResidual(nn.Module):
    def __init__(self, inp: int, expanded: int, out: int, kernel: int, stride: int, se: bool, act: type) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        if expanded != inp:
            layers += [nn.Conv2d(inp, expanded, 1, bias=False), _norm(expanded), act()]
        layers += [nn.Conv2d(expanded, expanded, kernel, stride, kernel // 2, groups=expanded, bias=False),
                   _norm(expanded), act()]  # fmt: skip
        if se:
            layers.append(_SqueezeExcite(expanded, max(8, expanded // 4)))
        layers += [nn.Conv2d(expanded, out, 1, bias=False), _norm(out)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and inp == out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.residual else self.block(x)


def mobilenet_v3() -> nn.Module:
    """MobileNetV3-small's shape at a third of the width: squeeze-and-excitation, Hardswish, BatchNorm eps 1e-3."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1, bias=False), _norm(16), nn.Hardswish(),
        _InvertedResidual(16, 16, 16, 3, 2, True, nn.ReLU),
        _InvertedResidual(16, 48, 24, 3, 2, False, nn.ReLU),
        _InvertedResidual(24, 64, 24, 3, 1, False, nn.ReLU),
        _InvertedResidual(24, 64, 32, 5, 2, True, nn.Hardswish),
        _InvertedResidual(32, 96, 32, 5, 1, True, nn.Hardswish),
        nn.Conv2d(32, 96, 1, bias=False), _norm(96), nn.Hardswish(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(96, 128), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(128, 10),
    )  # fmt: skip
