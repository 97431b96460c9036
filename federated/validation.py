"""Server-side checks of a client's update before it may be aggregated: admission (is it a sound
update of this run's model?) and norm bounds (is it an outlier?), as pure functions over arrays."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from ondevice.manifest import Manifest

from .partial import leading, slice_problem

__all__ = ["update_problem", "partial_update_problem", "update_norm", "norm_bounds", "bound_updates", "Bounded"]


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


def partial_update_problem(
    payload: Mapping[str, np.ndarray],
    manifest: Manifest | None,
    global_weights: Mapping[str, np.ndarray],
    *,
    num_examples: object,
    max_examples: int,
) -> str | None:
    """Why a partial update (mixed tiers, personal tensors) must not be aggregated, or None: it
    trained a known tier (``manifest``, None when its hash names none), sends only tensors that tier
    trains, each a leading slice of the global tensor."""
    if manifest is None:
        return "trained on artifacts of no tier of this run (manifest hash differs)"
    if not isinstance(num_examples, int) or isinstance(num_examples, bool) or not 0 < num_examples <= max_examples:
        return f"example count {num_examples!r} is outside 1..{max_examples}"
    trains = {p.name: p.shape for p in manifest.trainable}
    for name, array in payload.items():
        if trains.get(name) != array.shape:
            return f"tensor {name!r} {array.shape} is not one its tier trains"
        problem = slice_problem(name, array, global_weights)
        if problem:
            return problem
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


@dataclass
class Bounded:
    """A round's updates after the norm bounds: those kept (clipped ones scaled), with the reasons."""

    kept: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    clipped: dict[int, str] = field(default_factory=dict)
    excluded: dict[int, str] = field(default_factory=dict)


def bound_updates(
    updates: Mapping[int, Mapping[str, np.ndarray]],
    global_weights: Mapping[str, np.ndarray],
    *,
    multiple: float,
    absolute: float,
    action: str,
) -> Bounded:
    """Apply :func:`norm_bounds` to node -> weights: an update over its bound is excluded
    (``action="reject"``) or moved back towards the global weights until its norm is the bound
    (``"clip"``); the others pass unchanged."""
    norms = {node: update_norm(weights, global_weights) for node, weights in updates.items()}
    over = norm_bounds(norms, multiple=multiple, absolute=absolute)
    result = Bounded()
    for node, weights in updates.items():
        if node not in over:
            result.kept[node] = dict(weights)
            continue
        reason = f"update norm {norms[node]:.3g} is over its bound {over[node]:.3g}"
        if action == "clip":
            scale = np.float32(over[node] / norms[node])
            starts = {k: global_weights[k][leading(v.shape)] for k, v in weights.items()}
            result.kept[node] = {k: starts[k] + (v - starts[k]) * scale for k, v in weights.items()}
            result.clipped[node] = reason
        else:
            result.excluded[node] = reason
    return result
