"""Server-side checks of a client's update before it may be aggregated."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ondevice.manifest import Manifest

from .partial import leading

__all__ = ["update_problem", "update_norm", "norm_bounds"]


def update_problem(
    weights: Mapping[str, np.ndarray],
    manifest: Manifest,
    *,
    num_examples: object,
    max_examples: int,
    tag: object,
    expected_tag: int,
) -> str | None:
    """Why an update must not be aggregated, or None when it is sound.

    An update holds every trainable tensor and, optionally, all of the model's running statistics.
    """
    if tag != expected_tag:
        return "trained on other artifacts (manifest hash differs)"
    if not isinstance(num_examples, int) or isinstance(num_examples, bool):
        return f"example count must be an integer, got {num_examples!r}"
    if num_examples <= 0 or num_examples > max_examples:
        return f"example count {num_examples} is outside 1..{max_examples}"
    expected = {p.name: p.shape for p in manifest.trainable}
    statistics = {b.name for b in manifest.buffers}
    buffers = {p.name: p.shape for p in manifest.frozen if p.name in statistics}
    sent = set(weights) & set(buffers)
    if set(weights) - sent != set(expected):
        return f"update names {len(weights) - len(sent)} tensors, the model has {len(expected)} (names differ)"
    if sent and sent != set(buffers):
        return f"update holds {len(sent)} of the model's {len(buffers)} running statistics (all or none)"
    for name, shape in {**expected, **{k: buffers[k] for k in sent}}.items():
        array = np.asarray(weights[name])
        if array.shape != shape:
            return f"tensor {name!r} has shape {array.shape}, expected {shape}"
        if not np.isfinite(array).all():
            return f"tensor {name!r} holds NaN/Inf"
        if name.endswith("running_var") and (array < 0).any():
            return f"running variance {name!r} holds negative values"
    return None


def update_norm(weights: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> float:
    """L2 norm of ``weights - reference`` over every tensor of ``weights`` (float64, no overflow).

    A tensor smaller than its reference (a lower LoRA rank) is compared with the leading slice.
    """
    total = 0.0
    for name, value in weights.items():
        value = np.asarray(value, np.float64)
        start = np.asarray(reference[name])[leading(value.shape)]
        delta = value - np.asarray(start, np.float64)
        total += float(np.dot(delta.ravel(), delta.ravel()))
    return float(np.sqrt(total))


def norm_bounds(norms: Mapping[int, float], *, multiple: float, absolute: float) -> dict[int, float]:
    """The updates over their bound, node -> bound.

    The bound is ``multiple`` times the round's low median non-zero update norm (robust while
    fewer than half the updates are outliers; 0 turns it off), capped at ``absolute`` (0: no cap).
    """
    if not norms:
        return {}
    bound = float("inf")
    moved = sorted(n for n in norms.values() if n > 0)
    if multiple > 0 and moved:
        bound = multiple * moved[(len(moved) - 1) // 2]
    if absolute > 0:
        bound = min(bound, absolute)
    return {node: bound for node, norm in norms.items() if norm > bound}
