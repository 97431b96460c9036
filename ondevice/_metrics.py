"""Pure helpers of the trainer: weights to a flat buffer, and example-weighted metrics."""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from .errors import WeightsError
from .manifest import IGNORE_INDEX, Manifest

__all__ = ["flatten_weights", "Meter"]


def flatten_weights(manifest: Manifest, weights: np.ndarray | Mapping[str, np.ndarray]) -> np.ndarray:
    if isinstance(weights, Mapping):
        names = [p.name for p in manifest.trainable]
        if sorted(weights) != sorted(names):
            missing, extra = sorted(set(names) - set(weights)), sorted(set(weights) - set(names))
            raise WeightsError(f"weights must name every trainable parameter; missing {missing}, unexpected {extra}.")
        parts = []
        for p in manifest.trainable:
            array = np.asarray(weights[p.name])
            if tuple(array.shape) != p.shape:
                raise WeightsError(f"weight {p.name!r} needs shape {p.shape}, got {array.shape}.")
            parts.append(array.astype(np.float32, copy=False).ravel())
        return np.concatenate(parts)
    flat = np.asarray(weights)
    if flat.ndim != 1 or flat.size != manifest.trainable_size:
        raise WeightsError(
            f"a flat weight buffer needs {manifest.trainable_size} values (1-D), got shape {flat.shape}."
        )
    if flat.dtype.kind != "f":
        raise WeightsError(f"weights must be floating point, got {flat.dtype}.")
    return flat.astype(np.float32, copy=False)


class Meter:
    """Example-weighted loss and classification accuracy over batches (and top-3 accuracy, the share
    whose label is among the three best scores, for more than 3 classes: next-word models).

    Accuracy is lazy: scores and labels are kept (not copied) and scored together in one
    vectorized pass when they pass ``FLUSH_BYTES`` or when the result is asked for, instead of
    an argmax per step.
    """

    FLUSH_BYTES = 8 * 2**20

    def __init__(self, manifest: Manifest) -> None:
        self.scores = manifest.loss_input if manifest.num_classes else None
        self.top3 = bool(manifest.num_classes and manifest.num_classes > 3)
        self.labels = manifest.targets[0].name if manifest.targets else None
        self.ignore = manifest.loss.options.get("ignore_index")
        self.tokens = manifest.tokenizer.labels if manifest.tokenizer is not None else None
        """A causal LM's token labels: batches weigh by the tokens their loss counts, and the result
        has the perplexity."""
        self.loss_sum = 0.0
        self.count = 0
        self.correct = 0
        self.correct3 = 0
        self.labelled = 0
        self._held: list[tuple[np.ndarray, np.ndarray]] = []
        self._held_bytes = 0

    def add(self, loss: float, size: int, scores: np.ndarray | None = None, labels: np.ndarray | None = None) -> None:
        """One batch of ``size`` examples (for a causal LM: counted tokens, :meth:`weight`): its mean
        loss and, for accuracy, the class scores (the output named ``self.scores``) and the labels."""
        if math.isfinite(loss):
            self.loss_sum += loss * size
            self.count += size
        if self.scores is not None and scores is not None and labels is not None:
            self._held.append((scores, labels))
            self._held_bytes += scores.nbytes
            if self._held_bytes > self.FLUSH_BYTES:
                self._score()

    def weight(self, batch: dict[str, np.ndarray], examples: int) -> int:
        """How much a batch's mean loss weighs: its examples, or for a causal LM the tokens its loss
        counts (every label but the first of a row, which predicts nothing, and the ignored ones)."""
        if self.tokens is None or self.tokens not in batch:
            return examples
        return int(np.count_nonzero(batch[self.tokens][:, 1:] != IGNORE_INDEX))

    def _score(self) -> None:
        if not self._held:
            return
        if len(self._held) == 1 or len({s.shape[1:] for s, _ in self._held}) > 1:
            parts = self._held  # one batch, or ragged lengths
        else:
            parts = [(np.concatenate([s for s, _ in self._held]), np.concatenate([labels for _, labels in self._held]))]
        self._held, self._held_bytes = [], 0
        for scores, labels in parts:
            keep = np.ones(labels.shape, bool) if self.ignore is None else labels != self.ignore
            self.correct += int(np.count_nonzero((scores.argmax(axis=-1) == labels) & keep))
            self.labelled += int(np.count_nonzero(keep))
            if self.top3:
                best = np.argpartition(-scores, 2, axis=-1)[..., :3]
                self.correct3 += int(np.count_nonzero((best == labels[..., None]).any(axis=-1) & keep))

    def result(self) -> dict[str, float]:
        self._score()
        metrics = {"loss": self.loss_sum / self.count if self.count else float("nan")}
        if self.tokens is not None:  # exp of the mean loss per counted token: the model's perplexity
            metrics["perplexity"] = math.exp(min(metrics["loss"], 700.0))
        if self.labelled:
            metrics["accuracy"] = self.correct / self.labelled
            if self.top3:
                metrics["top3_accuracy"] = self.correct3 / self.labelled
        return metrics
