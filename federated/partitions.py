"""Seeded, reproducible partitions of a labelled dataset: IID and Dirichlet label skew."""

from __future__ import annotations

import numpy as np

from .errors import PartitionError

__all__ = ["iid", "dirichlet", "partition"]


def iid(size: int, num_partitions: int, seed: int) -> list[np.ndarray]:
    """Shuffle ``range(size)`` and cut it into ``num_partitions`` near-equal index arrays."""
    _check(size, num_partitions)
    order = np.random.default_rng(seed).permutation(size)
    return [np.sort(part) for part in np.array_split(order, num_partitions)]


def dirichlet(labels: np.ndarray, num_partitions: int, alpha: float, seed: int, min_size: int = 2) -> list[np.ndarray]:
    """Label skew: each class is split over partitions with proportions drawn from Dir(alpha).

    Small ``alpha`` gives partitions dominated by few classes. Draws are repeated (seeded) until
    every partition holds at least ``min_size`` examples.
    """
    labels = np.asarray(labels)
    _check(len(labels), num_partitions)
    if not alpha > 0:
        raise PartitionError(f"Dirichlet alpha must be > 0, got {alpha}.")
    if len(labels) < num_partitions * min_size:
        raise PartitionError(
            f"{len(labels)} examples cannot give {num_partitions} partitions of at least {min_size} each."
        )
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        parts: list[list[int]] = [[] for _ in range(num_partitions)]
        for cls in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == cls))
            cuts = (np.cumsum(rng.dirichlet(np.full(num_partitions, alpha))) * len(members)).astype(int)[:-1]
            for part, chunk in zip(parts, np.split(members, cuts)):
                part.extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise PartitionError(
        f"could not draw {num_partitions} partitions of at least {min_size} examples with alpha={alpha}; "
        "raise alpha or use fewer partitions."
    )


def partition(
    labels: np.ndarray, num_partitions: int, *, scheme: str = "iid", alpha: float = 0.5, seed: int = 0
) -> list[np.ndarray]:
    """Index arrays of every partition, by scheme name (``iid`` or ``dirichlet``)."""
    if scheme == "iid":
        return iid(len(labels), num_partitions, seed)
    if scheme == "dirichlet":
        return dirichlet(labels, num_partitions, alpha, seed)
    raise PartitionError(f"partitioning must be 'iid' or 'dirichlet', got {scheme!r}.")


def _check(size: int, num_partitions: int) -> None:
    if num_partitions < 1 or num_partitions > size:
        raise PartitionError(f"cannot cut {size} examples into {num_partitions} partitions.")
