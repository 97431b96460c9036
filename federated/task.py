"""What a node trains on: its artifacts (checked against the server's hash) and its data."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ondevice import Trainer
from ondevice.data import load_npz
from ondevice.files import sha256_file
from ondevice.manifest import MANIFEST_NAME

from .config import Settings
from .errors import ArtifactMismatchError, FederatedError
from .partitions import partition

__all__ = ["Settings", "node_trainer", "node_data", "manifest_sha256"]


def manifest_sha256(artifacts: str | Path) -> str:
    return sha256_file(Path(artifacts) / MANIFEST_NAME)


def node_trainer(artifacts: str, expected_sha256: str) -> Trainer:
    """A fresh trainer over the node's artifacts (every file hash checked once), refused when
    they are not the server's."""
    trainer = Trainer.load(artifacts)
    if trainer.manifest_sha256 != expected_sha256:
        raise ArtifactMismatchError(
            f"this node's artifacts ({artifacts}, manifest sha256 {trainer.manifest_sha256[:12]}...) differ from "
            f"the server's ({expected_sha256[:12]}...). Copy the server's artifact directory to the node."
        )
    return trainer


def node_data(
    settings: Settings, node_config: Mapping[str, Any]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train, validation) arrays of this node: its own ``data`` .npz from node config, or its
    partition of the shared ``train.npz``; 20 % of it (seeded) is held out for evaluation."""
    if "data" in node_config:
        data = load_npz(str(node_config["data"]))
    else:
        try:
            pid, count = int(node_config["partition-id"]), int(node_config["num-partitions"])
        except KeyError as exc:
            raise FederatedError(
                "node config needs partition-id and num-partitions, or data=PATH.npz for the node's own data."
            ) from exc
        full = load_npz(str(Path(settings.data) / "train.npz"))
        labels = full.get("labels")
        if labels is None:
            raise FederatedError("partitioning needs a 'labels' array in train.npz.")
        parts = partition(
            labels, count, scheme=settings.partitioning, alpha=settings.dirichlet_alpha, seed=settings.seed
        )
        data = {k: v[parts[pid]] for k, v in full.items()}
    size = len(next(iter(data.values())))
    order = np.random.default_rng(settings.seed).permutation(size)
    cut = max(1, size // 5) if size > 1 else 0
    val, train = order[:cut], order[cut:]
    return {k: v[train] for k, v in data.items()}, {k: v[val] for k, v in data.items()}
