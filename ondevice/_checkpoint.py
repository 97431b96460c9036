"""Checkpoint files and inference export, written atomically (temp file + fsync + rename)."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CheckpointError
from .files import fsync_dir
from .session import C, OrtTraining, ort_error_message

__all__ = ["save_state", "read_property", "export_inference"]


def _temp_beside(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _make_parent(path: Path, what: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create {what} {path.parent}: {exc.strerror}.") from exc


def _commit(tmp: Path, path: Path) -> None:
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save_state(state: C.CheckpointState, path: Path) -> Path:
    """Write ``state`` with its optimizer state to ``path``; on any failure the old file is untouched."""
    _make_parent(path, "checkpoint directory")
    tmp = _temp_beside(path)
    try:
        C.save_checkpoint(state, os.fspath(tmp), True)
        _commit(tmp, path)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        reason = exc.strerror if isinstance(exc, OSError) else ort_error_message(exc)
        raise CheckpointError(
            f"could not write checkpoint {path} ({reason}); the previous checkpoint, if any, is unchanged. "
            "Free disk space or choose a writable --checkpoint."
        ) from exc
    return path


def read_property(path: Path, name: str) -> int | float | str | None:
    """A property of a checkpoint file, or None if it has none; unreadable files raise CheckpointError."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist.")
    try:
        state = C.load_checkpoint(os.fspath(path))
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {path} is truncated or not an ONNX Runtime checkpoint; use an earlier one or retrain."
        ) from exc
    return state.get_property(name) if state.has_property(name) else None


def export_inference(session: OrtTraining, outputs: list[str], path: Path) -> Path:
    """The eval graph with the current weights and the loss removed, as one ONNX file."""
    if not outputs:
        raise CheckpointError("these artifacts have no outputs besides the loss: nothing to export.")
    _make_parent(path, "export directory")
    tmp = _temp_beside(path)
    try:
        session.module.export_model_for_inferencing(os.fspath(tmp), outputs)
        _commit(tmp, path)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not export {path}: {ort_error_message(exc)}") from exc
    return path
