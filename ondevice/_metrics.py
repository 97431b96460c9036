"""Pure helpers of the trainer: weights to a flat buffer, and example-weighted metrics."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .errors import WeightsError
from .manifest import Manifest

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
    """Example-weighted loss and classification accuracy over batches."""

    def __init__(self, manifest: Manifest) -> None:
        self.scores = manifest.loss_input if manifest.num_classes else None
        self.labels = manifest.targets[0].name if manifest.targets else None
        self.ignore = manifest.loss.options.get("ignore_index")
        self.loss_sum = 0.0
        self.count = 0
        self.correct = 0
        self.labelled = 0

    def add(self, result: Any, batch: Mapping[str, np.ndarray]) -> None:
        size = len(next(iter(batch.values())))
        if math.isfinite(result.loss):
            self.loss_sum += result.loss * size
            self.count += size
        if self.scores is not None and self.labels is not None:
            labels = batch[self.labels]
            hits = result.outputs[self.scores].argmax(axis=-1) == labels
            if self.ignore is None:
                self.correct += int(np.count_nonzero(hits))
                self.labelled += labels.size
            else:
                keep = labels != self.ignore
                self.correct += int(np.count_nonzero(hits & keep))
                self.labelled += int(np.count_nonzero(keep))

    def result(self) -> dict[str, float]:
        metrics = {"loss": self.loss_sum / self.count if self.count else float("nan")}
        if self.labelled:
            metrics["accuracy"] = self.correct / self.labelled
        return metrics
