"""Partial updates: clients that train different parts of one model, and parts that stay personal.

Mixed tiers (a browser training the head, a phone LoRA rank 4, a desktop rank 16) send only the
tensors they train. A smaller LoRA rank trains the leading rows of A and the leading columns of
B of the global adapters (heterogeneous-rank truncation), so every tensor a client sends is a
leading slice of a global tensor. The server averages each element over the clients that
trained it, weighted by their examples, and leaves every other element as it was.

Flower's strategies average whole ArrayRecords with identical keys, which these updates are not:
this module is the aggregation they lack.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Iterable, Mapping, Sequence

import numpy as np

from ondevice.manifest import Manifest

__all__ = ["leading", "fit_to", "union_of", "aggregate_partial", "personal_names", "slice_problem", "tier_problem"]


def leading(shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def fit_to(manifest: Manifest, global_weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The global values of the tensors ``manifest`` trains, cut to its shapes (absent ones left out)."""
    return {
        p.name: np.ascontiguousarray(global_weights[p.name][leading(p.shape)])
        for p in manifest.trainable
        if p.name in global_weights
    }


def union_of(states: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One global state holding every tensor of ``states``; a name with several shapes keeps the largest.

    Raises ValueError when two shapes of one name are not nested (one a leading slice of the other).
    """
    union: dict[str, np.ndarray] = {}
    for state in states:
        for name, value in state.items():
            have = union.get(name)
            if have is None or have.shape == value.shape:
                union.setdefault(name, np.asarray(value, np.float32))
                continue
            small, large = sorted((have, value), key=lambda a: a.size)
            if small.ndim != large.ndim or any(s > g for s, g in zip(small.shape, large.shape)):
                raise ValueError(f"tensor {name!r} has shapes {have.shape} and {value.shape}, neither inside the other")
            union[name] = np.asarray(large, np.float32)
    return union


def slice_problem(name: str, array: np.ndarray, global_weights: Mapping[str, np.ndarray]) -> str | None:
    """Why ``array`` cannot update ``global_weights[name]``, or None."""
    if name not in global_weights:
        return f"tensor {name!r} is not part of the global model"
    target = global_weights[name].shape
    if array.ndim != len(target) or any(s > t for s, t in zip(array.shape, target)):
        return f"tensor {name!r} has shape {array.shape}, not a leading slice of {target}"
    if not np.isfinite(array).all():
        return f"tensor {name!r} holds NaN/Inf"
    return None


def aggregate_partial(
    global_weights: Mapping[str, np.ndarray], updates: Sequence[tuple[int, Mapping[str, np.ndarray]]]
) -> dict[str, np.ndarray]:
    """Example-weighted mean of every element over the updates that hold it; the rest unchanged."""
    result = {}
    for name, value in global_weights.items():
        total = np.zeros(value.shape, np.float64)
        weight = np.zeros(value.shape, np.float64)
        for count, update in updates:
            if name in update:
                part = leading(np.shape(update[name]))
                total[part] += count * np.asarray(update[name], np.float64)
                weight[part] += count
        trained = weight > 0
        merged = np.asarray(value, np.float64).copy()
        merged[trained] = total[trained] / weight[trained]
        result[name] = merged.astype(np.float32)
    return result


def personal_names(manifest: Manifest, patterns: str) -> list[str]:
    """Trainable tensors matching the comma-separated globs of ``patterns`` (``head.*``, ``head``)."""
    globs = [p.strip() for p in patterns.split(",") if p.strip()]
    return [
        p.name
        for p in manifest.trainable
        if any(fnmatchcase(p.name, g) or p.name.startswith(g.rstrip(".*") + ".") for g in globs)
    ]


def tier_problem(base: Manifest, tier: Manifest) -> str | None:
    """Why ``tier`` cannot join ``base``'s rounds (another base model), or None.

    Tiers share the model: the same inputs, and tensors of one name nested in shape (a tier may
    train a leading slice, e.g. a smaller LoRA rank), with at least one tensor in common.
    """
    if [(t.name, t.dtype) for t in tier.inputs] != [(t.name, t.dtype) for t in base.inputs]:
        return f"its inputs {[t.name for t in tier.inputs]} differ from the base's {[t.name for t in base.inputs]}"
    shapes = {p.name: p.shape for p in (*base.trainable, *base.frozen)}
    common = [p for p in (*tier.trainable, *tier.frozen) if p.name in shapes]
    if not common:
        return "it shares no tensor with the base model"
    for p in common:
        small, large = sorted((p.shape, shapes[p.name]), key=lambda s: int(np.prod(s)))
        if len(small) != len(large) or any(a > b for a, b in zip(small, large)):
            return f"tensor {p.name!r} is {p.shape} there and {shapes[p.name]} in the base, neither inside the other"
    return None
