"""The digits sample model: an MLP over scikit-learn's 8x8 digit images (64 pixels, 10 classes)."""

import torch
from torch import nn


def build() -> nn.Module:
    """A small MLP with dropout; seeded so every run starts from the same weights."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
