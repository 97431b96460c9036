"""Scoring an exported model: the artifacts' loss in numpy, batch by batch as the eval graph does.

``batch_loss`` computes what ONNX Runtime's loss blocks compute for one batch (mean reduction);
:func:`evaluate_exported` averages it over batches weighted by their examples, like
``Trainer.evaluate``, so both report the same figures (tested).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ._metrics import Meter
from .data import batches, check_data
from .errors import ConfigError
from .manifest import Manifest
from .predict import Predictor

__all__ = ["batch_loss", "evaluate_exported"]


def batch_loss(kind: str, options: Mapping[str, Any], output: np.ndarray, target: np.ndarray) -> float:
    """One batch's mean loss of ``kind`` (``cross_entropy``, ``mse``, ``l1``, ``bce_with_logits``)."""
    if options.get("reduction", "mean") != "mean":
        raise ConfigError(f"scoring an exported model computes mean losses; this {kind} loss sums. Evaluate the "
                          "artifacts instead (odt evaluate ARTIFACT_DIR --checkpoint CKPT_DIR).")  # fmt: skip
    x = output.astype(np.float64)
    if kind == "cross_entropy":
        scores = x.reshape(-1, x.shape[-1])
        labels = target.reshape(-1)
        shifted = scores - scores.max(axis=1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        ignore = options.get("ignore_index")
        keep = np.ones(labels.shape, bool) if ignore is None else labels != ignore
        safe = np.where(keep, labels, 0)
        weight = np.ones(scores.shape[1]) if options.get("weight") is None else np.asarray(options["weight"], float)
        w = weight[safe] * keep
        nll = -log_p[np.arange(len(safe)), safe]
        return float((w * nll).sum() / w.sum()) if w.sum() else float("nan")
    y = target.astype(np.float64)
    if kind == "mse":
        return float(np.mean((x - y) ** 2))
    if kind == "l1":
        return float(np.mean(np.abs(x - y)))
    if kind == "bce_with_logits":
        pos = 1.0 if options.get("pos_weight") is None else np.asarray(options["pos_weight"], float)
        weight = 1.0 if options.get("weight") is None else np.asarray(options["weight"], float)
        log_sig, log_one_minus = -np.logaddexp(0, -x), -np.logaddexp(0, x)
        return float(np.mean(-weight * (pos * y * log_sig + (1 - y) * log_one_minus)))
    raise ConfigError(f"an exported model with a {kind!r} loss cannot be scored here: evaluate the artifacts instead.")


def evaluate_exported(
    predictor: Predictor, data: Mapping[str, np.ndarray], *, batch_size: int | None = None
) -> dict[str, float]:
    """Mean loss (and accuracy for classification) of an exported model over labelled ``data``
    (``batch_size`` rows at a time; default: the manifest's ``eval_batch_size``)."""
    manifest: Manifest = predictor.manifest
    batch_size = manifest.eval_batch_size if batch_size is None else batch_size
    if not manifest.targets or manifest.loss_input is None:
        raise ConfigError("these artifacts compute their own loss inside the model: evaluate the artifacts instead.")
    checked = check_data(manifest, data)
    size = len(next(iter(checked.values())))
    target = manifest.targets[0].name
    meter = Meter(manifest)
    for batch in batches(checked, min(batch_size, size), shuffle=False, seed=0, epoch=0):
        scores = predictor.predict(batch)[manifest.loss_input]
        loss = batch_loss(manifest.loss.kind, manifest.loss.options, scores, batch[target])
        meter.add(loss, len(batch[target]), scores, batch[target])
    return meter.result()
