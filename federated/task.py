"""What a node trains on: its artifacts (checked against the server's hash) and its data."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ondevice import Trainer
from ondevice.data import load_npz
from ondevice.datafiles import load_data
from ondevice.files import sha256_file
from ondevice.manifest import MANIFEST_NAME

from .config import Settings
from .errors import ArtifactMismatchError, FederatedError
from .partitions import partition

__all__ = [
    "Settings", "node_trainer", "node_data", "client_files", "manifest_sha256", "node_artifacts", "local_epochs",
]  # fmt: skip


def local_epochs(epochs: int, steps: int, examples: int, batch_size: int) -> int:
    """Epochs a client trains in a round: ``epochs``, or more until it has taken at least ``steps``
    optimizer steps (a client with 12 examples takes one step per epoch; one epoch of it barely
    moves the model, and averaging such updates converges slowly: ``benchmarks/federation.py``)."""
    per_epoch = -(-examples // min(batch_size, examples))
    return max(epochs, -(-steps // per_epoch))


def manifest_sha256(artifacts: str | Path) -> str:
    return sha256_file(Path(artifacts) / MANIFEST_NAME)


def file_signature(path: str | Path) -> tuple[tuple[str, int, int, int], ...]:
    """(name, inode, size, mtime) of a file or of every file in a directory: what a cache keys on,
    so that a file replaced on disk is read (and its hash checked) again."""
    path = Path(path)
    if not path.exists():
        return ()  # the reader says what is missing
    entries = sorted(os.scandir(path), key=lambda e: e.name) if path.is_dir() else [path]
    stats = [(Path(e).name, os.stat(e)) for e in entries]
    return tuple((name, st.st_ino, st.st_size, st.st_mtime_ns) for name, st in stats)


def node_trainer(
    artifacts: str, expected_sha256: str, tiers: str = "", *, for_evaluation: bool = False, engine: str = "auto"
) -> Trainer:
    """A trainer over the node's artifacts (every file hash checked when loaded), refused when
    they are not the server's (or, in a mixed-tier run, not one of the comma-separated ``tiers``).
    ``engine`` is the node's (its node config's ``engine``: auto, classic or portable): nodes of one
    run may train on different engines.

    Training gets a fresh trainer per task (a round starts from fresh optimizer moments, and ORT
    cannot reset them), loaded without the eval graph it never runs; evaluation, which never
    touches the optimizer, reuses one per process and artifact directory while its files are
    unchanged on disk, reset to its loaded state.
    """
    if for_evaluation:
        trainer, initial = _evaluation_trainer(artifacts, file_signature(artifacts), engine)
        trainer.set_weights(initial[0])
        if initial[1]:
            trainer.set_buffers(initial[1])
    else:
        trainer = Trainer.load(artifacts, evaluation=False, engine=engine)
    if trainer.manifest_sha256 != expected_sha256 and trainer.manifest_sha256 not in tiers.split(","):
        raise ArtifactMismatchError(
            f"this node's artifacts ({artifacts}, manifest sha256 {trainer.manifest_sha256[:12]}...) differ from "
            f"the server's ({expected_sha256[:12]}...). Copy the server's artifact directory to the node."
        )
    return trainer


@functools.lru_cache(maxsize=4)
def _evaluation_trainer(artifacts: str, signature: tuple, engine: str) -> tuple[Trainer, tuple[dict, dict]]:
    trainer = Trainer.load(artifacts, engine=engine)
    return trainer, (trainer.get_weights(), trainer.get_buffers())


def data_files(data: str | Path) -> list[Path]:
    """The per-client data files of partitioning ``files`` in ``DATA/clients/``, in name order."""
    return sorted(p for p in (Path(data) / "clients").glob("*") if p.suffix in (".npz", ".jsonl"))


def client_files(settings: Settings, nodes: int) -> list[Path]:
    """The per-client data files of partitioning ``files``: one per node, in name order."""
    files = data_files(settings.data)
    if len(files) != nodes:
        raise FederatedError(
            f"partitioning 'files' needs one file per node in {Path(settings.data) / 'clients'}: "
            f"found {len(files)} for {nodes} nodes."
        )
    return files


def node_artifacts(settings: Settings, node_config: Mapping[str, Any]) -> str:
    """The node's artifact directory: its node config's ``artifacts``, else (mixed tiers in a
    simulation) tier ``partition-id mod tiers`` of ``artifacts`` + ``tiers``, else ``artifacts``."""
    if "artifacts" in node_config:
        return str(node_config["artifacts"])
    tiers = [settings.artifacts, *(t for t in settings.tiers.split(",") if t.strip())]
    return tiers[int(node_config.get("partition-id", 0)) % len(tiers)].strip()


def node_data(
    settings: Settings, node_config: Mapping[str, Any], artifacts: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train, validation) arrays of this node: its own ``data`` file from node config, the
    ``partition-id``-th file of ``DATA/clients/`` (partitioning ``files``), or its partition of the
    shared ``train.npz``; 20 % of it (seeded) is held out for evaluation. ``.jsonl`` text is
    tokenized with the tokenizer of the node's ``artifacts``."""
    if "data" in node_config:
        data = _load(str(node_config["data"]), artifacts)
    elif settings.partitioning == "files":
        data = _load(
            str(client_files(settings, int(node_config.get("num-partitions", 0)))[int(node_config["partition-id"])]),
            artifacts,
        )
    else:
        try:
            pid, count = int(node_config["partition-id"]), int(node_config["num-partitions"])
        except KeyError as exc:
            raise FederatedError(
                "node config needs partition-id and num-partitions, or data=PATH.npz for the node's own data."
            ) from exc
        train = str(Path(settings.data) / "train.npz")
        full, parts = _partitions(
            train, file_signature(train), count, settings.partitioning, settings.dirichlet_alpha, settings.seed
        )
        data = {k: v[parts[pid]] for k, v in full.items()}
    size = len(next(iter(data.values())))
    order = np.random.default_rng(settings.seed).permutation(size)
    cut = max(1, size // 5) if size > 1 else 0
    val, train = order[:cut], order[cut:]
    return {k: v[train] for k, v in data.items()}, {k: v[val] for k, v in data.items()}


# A simulation runs many nodes' tasks in one process, round after round: what each task reads is
# read once per process while the file is unchanged (the key holds its inode, size and mtime).


def _load(path: str, artifacts: str) -> dict[str, np.ndarray]:
    return _cached_data(path, file_signature(path), artifacts, file_signature(artifacts))


@functools.lru_cache(maxsize=16)
def _cached_data(path: str, signature: tuple, artifacts: str, artifacts_signature: tuple) -> dict[str, np.ndarray]:
    return _read_only(load_data(path, artifacts))


@functools.lru_cache(maxsize=4)
def _partitions(
    train: str, signature: tuple, count: int, scheme: str, alpha: float, seed: int
) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    full = _read_only(load_npz(train))
    labels = full.get("labels")
    if labels is None:
        raise FederatedError("partitioning needs a 'labels' array in train.npz.")
    return full, partition(labels, count, scheme=scheme, alpha=alpha, seed=seed)


def _read_only(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    for array in arrays.values():
        array.setflags(write=False)  # shared between tasks: nobody may change them in place
    return arrays
