"""A next-word model: word embeddings, an LSTM over the context, a Linear over the vocabulary."""

from __future__ import annotations

import torch
from torch import nn


class NextWord(nn.Module):
    """``ids (batch, context) -> scores (batch, vocabulary)`` for the word after the context (left-padded)."""

    def __init__(self, vocabulary: int, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, dim, padding_idx=0)
        self.lstm = nn.LSTM(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocabulary)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        states, _ = self.lstm(self.embed(ids))
        return self.head(states[:, -1])
