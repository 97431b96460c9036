"""What travels in a round: record keys, array converters, the flat weight layout, the train reply.

The ClientApp, the ServerApp's guard and relays for devices behind a bridge all speak it, so a
device's update is indistinguishable from a Python client's.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from ondevice.manifest import Manifest

from .codec import payload_bytes

__all__ = [
    "ARRAYS",
    "METRICS",
    "CONFIG",
    "to_arrays",
    "from_arrays",
    "hash_tag",
    "flatten",
    "unflatten",
    "train_reply",
    "skip_evaluation",
]

ARRAYS, METRICS, CONFIG = "arrays", "metrics", "config"
"""Record keys of a task (ARRAYS + CONFIG) and of a reply (ARRAYS + METRICS)."""


def to_arrays(weights: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(np.ascontiguousarray(value)) for name, value in weights.items()})


def from_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in record.items()}


def hash_tag(manifest_sha256: str) -> int:
    """The manifest hash as an integer that fits a Flower MetricRecord (first 52 bits)."""
    return int(manifest_sha256[:13], 16)


def flatten(manifest: Manifest, weights: Mapping[str, np.ndarray]) -> np.ndarray:
    """Trainable weights as one little-endian float32 buffer at the manifest's offsets."""
    return np.concatenate([np.asarray(weights[p.name], "<f4").ravel() for p in manifest.trainable])


def unflatten(manifest: Manifest, flat: np.ndarray) -> dict[str, np.ndarray]:
    """The inverse of :func:`flatten`."""
    return {p.name: flat[p.offset : p.offset + p.size].reshape(p.shape).astype(np.float32) for p in manifest.trainable}


def train_reply(
    task: Message, payload: Mapping[str, np.ndarray], num_examples: int, manifest_sha256: str, **metrics: float
) -> Message:
    """The one reply shape of a train task: one ArrayRecord and one MetricRecord.

    ``metrics`` add train-loss, train-accuracy, skipped-steps...; Flower aggregates metric records
    key by key, so every client sends the same keys.
    """
    record = MetricRecord(
        {
            "num-examples": int(num_examples),
            **metrics,
            "bytes-up": payload_bytes(payload),
            "manifest-tag": hash_tag(manifest_sha256),
        }
    )
    return Message(RecordDict({ARRAYS: to_arrays(payload), METRICS: record}), reply_to=task)


def skip_evaluation(task: Message) -> Message:
    """A reply with no examples: the server leaves this node out of the round's evaluation."""
    return Message(RecordDict({METRICS: MetricRecord({"num-examples": 0})}), reply_to=task)
