"""Running statistics (BatchNorm mean/var) in federated rounds: they travel beside the weights.

A client sends its statistics with its weights; the server averages them over the clients that
sent them, weighted by their example counts, whatever strategy aggregates the weights (a
server optimizer or a robust aggregator is no model for a variance). Clients that train no
statistics (a browser behind the bridge) simply leave them out.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ondevice.manifest import Manifest

__all__ = ["split_state", "average_buffers"]


def split_state(
    manifest: Manifest, arrays: Mapping[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(trainable weights, running statistics) of a record that may hold both."""
    buffers = {b.name for b in manifest.buffers}
    weights = {k: v for k, v in arrays.items() if k not in buffers}
    return weights, {k: v for k, v in arrays.items() if k in buffers}


def average_buffers(updates: Sequence[tuple[int, Mapping[str, np.ndarray]]]) -> dict[str, np.ndarray]:
    """Example-weighted mean of each statistic over ``(num_examples, buffers)`` pairs.

    A running variance with its running mean beside it is pooled like the variance of the union
    of the clients' data: the mean of the variances plus the variance of the means.
    """
    if not updates:
        return {}
    weights = np.array([count for count, _ in updates], np.float64)
    weights /= weights.sum()
    stacked = {name: np.stack([b[name] for _, b in updates]).astype(np.float64) for name in updates[0][1]}
    out = {name: np.tensordot(weights, values, axes=1) for name, values in stacked.items()}
    for name in stacked:
        mean = name.removesuffix("running_var") + "running_mean"
        if name.endswith("running_var") and mean in stacked:
            spread = np.tensordot(weights, (stacked[mean] - out[mean]) ** 2, axes=1)
            out[name] = out[name] + spread
    return {name: value.astype(np.float32) for name, value in out.items()}
