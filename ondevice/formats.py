"""Trained weights in the formats PyTorch and Hugging Face load: safetensors by the model's own
``state_dict`` names, and PEFT LoRA adapter folders. numpy and ``safetensors`` only (no torch).

The manifest's parameter names are the PyTorch model's ``state_dict`` keys (the exporter keeps
them), so the file loads with ``model.load_state_dict(safetensors.torch.load_file(path))`` into
the model the artifacts were generated from. A ``state_dict`` entry the graph never reads (e.g. an
unused pooler) is not in the artifacts: load those files with ``strict=False``, or use
``artifacts.load_into``, which says what it left alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping, Protocol

import numpy as np

from .errors import CheckpointError
from .files import EXPORT_RECORD, PRODUCER, atomic_write_bytes, public_mode, publish_dir, staging_dir
from .lora import fold_weight
from .manifest import Adapter, Manifest

__all__ = [
    "fold_weight", "model_weights", "peft_weights", "save_safetensors", "save_peft", "save_hf", "save_tensors",
    "FORMATS",
]  # fmt: skip



class Trained(Protocol):
    """What the writers read (a :class:`~ondevice.Trainer` has it): the manifest, the artifact directory and
    each tensor by name. A protocol, so this module does not import the trainer that imports it."""

    manifest: Manifest
    directory: Path

    def parameter(self, name: str) -> np.ndarray: ...


FORMATS = ("onnx", "safetensors", "peft", "hf")
PEFT_PREFIX = "base_model.model."


def model_weights(trainer: Trained, *, fold: bool = True) -> dict[str, np.ndarray]:
    """Every parameter and buffer the artifacts hold, by ``state_dict`` name (BatchNorm statistics
    included); LoRA adapters folded into their base weights and left out, unless ``fold=False``."""
    return dict(LazyWeights(trainer, fold=fold))


class LazyWeights(Mapping[str, np.ndarray]):
    """:func:`model_weights` read one tensor at a time, when asked: writing a model from it holds one
    weight beside the file, not every weight twice (SmolLM2: 513 MiB)."""

    def __init__(self, trainer: Trained, *, fold: bool = True, unfolded: Collection[str] = ()) -> None:
        manifest = trainer.manifest
        self._trainer = trainer  # `unfolded`: weights whose adapters stay apart even when the rest fold
        self._folded = {a.weight: a for a in manifest.adapters if a.weight not in unfolded} if fold else {}
        hidden = {name for a in self._folded.values() for name in (a.a, a.b)}
        self._names = [p.name for p in (*manifest.trainable, *manifest.frozen) if p.name not in hidden]

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._folded:
            a, get = self._folded[name], self._trainer.parameter
            return fold_weight(get(name), get(a.a), get(a.b), a.scale)
        if name not in self._names:
            raise KeyError(name)
        return self._trainer.parameter(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def peft_weights(manifest: Manifest, weights: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(adapter_model tensors, adapter_config) in PEFT's LoRA layout for unfolded ``weights``.

    Layers trained besides the adapters (a classifier head) go in ``modules_to_save``.
    """
    if not manifest.adapters:
        raise CheckpointError("these artifacts have no LoRA adapters: export --format safetensors instead.")
    ranks = {weights[a.a].shape[0] for a in manifest.adapters}
    scales = {a.scale for a in manifest.adapters}
    if len(ranks) != 1 or len(scales) != 1:
        raise CheckpointError(f"PEFT needs one rank and alpha for all adapters; found ranks {sorted(ranks)}.")
    rank, scale = ranks.pop(), scales.pop()
    tensors: dict[str, np.ndarray] = {}
    targets = []
    for adapter in manifest.adapters:
        module = _module(adapter)
        targets.append(module)
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = weights[adapter.a]
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = weights[adapter.b]
    adapted = {n for a in manifest.adapters for n in (a.a, a.b)}
    saved = sorted({p.name.rsplit(".", 1)[0] for p in manifest.trainable if p.name not in adapted and "." in p.name})
    for name, value in weights.items():
        if name.rsplit(".", 1)[0] in saved:
            tensors[PEFT_PREFIX + name] = value
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": scale * rank,
        "target_modules": targets,
        "modules_to_save": saved or None,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "task_type": None,
        "base_model_name_or_path": None,
    }
    return tensors, config


def _module(adapter: Adapter) -> str:
    if not adapter.weight.endswith(".weight"):
        raise CheckpointError(f"LoRA weight {adapter.weight!r} is not a module's `.weight`: PEFT cannot name it.")
    return adapter.weight[: -len(".weight")]


def save_safetensors(trainer: Trained, path: str | os.PathLike[str], *, fold: bool = True) -> Path:
    """Write :func:`model_weights` as one ``.safetensors`` file, atomically.

    Examples
    --------
    >>> save_safetensors(Trainer.load("out/mlp", checkpoint="ckpt/latest.ckpt"), "mlp.safetensors")  # doctest: +SKIP
    """
    return _write(Path(path), model_weights(trainer, fold=fold))


def save_peft(trainer: Trained, directory: str | os.PathLike[str]) -> Path:
    """Write a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) that
    ``PeftModel.from_pretrained(base_model, directory)`` loads. The folder is built beside
    ``directory`` and renamed into place whole (an existing one is replaced: check it first)."""
    tensors, config = peft_weights(trainer.manifest, model_weights(trainer, fold=False))
    return _write_folder(Path(directory), {
        "adapter_model.safetensors": _safetensors(tensors),
        "adapter_config.json": json.dumps(config, indent=2).encode(),
    })  # fmt: skip


def save_hf(trainer: Trained, directory: str | os.PathLike[str]) -> Path:
    """Write a Hugging Face folder (``config.json``, ``model.safetensors``, the tokenizer if the
    artifacts carry one) that ``AutoModel...from_pretrained(directory)`` loads with the trained
    weights; built beside ``directory`` and renamed into place whole, like :func:`save_peft`."""
    manifest = trainer.manifest
    if manifest.hf_config is None:
        raise CheckpointError(
            "these artifacts were not generated from a transformers model (the manifest has no hf_config): "
            "export --format safetensors and load it with artifacts.load_into."
        )
    prefix = str(manifest.hf_config["prefix"])
    weights = {name[len(prefix) :]: value for name, value in model_weights(trainer).items() if name.startswith(prefix)}
    files = {"model.safetensors": _safetensors(weights),
             "config.json": json.dumps(manifest.hf_config["config"], indent=2).encode()}  # fmt: skip
    if manifest.tokenizer is not None:
        files["tokenizer.json"] = (Path(trainer.directory) / manifest.tokenizer.file).read_bytes()
    return _write_folder(Path(directory), files)


def save_tensors(path: str | os.PathLike[str], tensors: dict[str, np.ndarray]) -> Path:
    """Named arrays as one ``.safetensors`` file, written atomically (e.g. a client's personal tensors)."""
    return _write(Path(path), tensors)


def _safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    """Tensors in the .safetensors format; "pt" is what from_pretrained expects, "producer" tells a
    later export that odt wrote the file (:func:`ondevice.files.written_by_odt`)."""
    from safetensors.numpy import save

    contiguous = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    return save(contiguous, metadata={"format": "pt", "producer": PRODUCER})


def _write(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    """Tensors as a .safetensors file, written atomically."""
    data = _safetensors(tensors)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
    except OSError as exc:
        raise CheckpointError(f"cannot write {path}: {exc.strerror}. Choose a writable --out.") from None
    return path


def _write_folder(target: Path, files: dict[str, bytes]) -> Path:
    """``files`` (name -> bytes) and a record of them (:data:`EXPORT_RECORD`) as the folder ``target``:
    written in a staging folder beside it, then renamed into place whole, so that a full disk or a
    kill never leaves half a folder (a killed export's staging folder goes at the next export)."""
    import hashlib
    import shutil

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        work = staging_dir(target)
    except OSError as exc:
        raise CheckpointError(f"cannot write {target}: {exc.strerror}. Choose a writable --out.") from None
    try:
        record = {"written_by": "odt export", "files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}}
        for name, data in {**files, EXPORT_RECORD: json.dumps(record, indent=2).encode()}.items():
            with open(work / name, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(work / name, public_mode())
        publish_dir(work, target)
    except OSError as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise CheckpointError(f"cannot write {target}: {exc.strerror}; nothing was written. Choose a writable "
                              "--out or free some space.") from None  # fmt: skip
    return target
