"""Checkpoint files: checksummed, written atomically, the last two kept, one writer at a time.

ONNX Runtime's checkpoint (a flatbuffer) carries no checksum: most single-bit flips load
without complaint. A checkpoint file here is a small header followed by ORT's bytes:

    b"ODTCKPT1" | uint32 header length | header JSON | ORT checkpoint bytes

The header holds the sha256 and size of ORT's bytes and the sha256 of the manifest of the
artifacts it belongs to (plus epoch/step for messages). Loading checks all of it before ORT
sees a byte. Saving writes a temporary file beside the target, fsyncs and renames; the
checkpoint it replaces, if sound, is kept as ``NAME.previous`` (a hard link renamed into place), so
``NAME`` always names a whole checkpoint, even under kill -9. Temporary files of killed saves
are removed by the next save, and an advisory lock (``.NAME.lock``, holding the writer's pid
and host) keeps a second writer out.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator

from .errors import CheckpointCorruptError, CheckpointError, InUseError, OndeviceError
from .files import PRODUCER, clear_stale_temps, fsync_dir, public_mode
from .locks import exclusive
from .model_file import MAPPED, plain_initializer, write_initializer
from .session import ort_error_message

if TYPE_CHECKING:
    from .engines import Engine

log = logging.getLogger(__name__)

__all__ = ["save_state", "unpacked", "read_header", "previous_of", "writer_lock", "export_inference"]

MAGIC = b"ODTCKPT1"
_LENGTH = struct.Struct("<I")


def previous_of(path: Path) -> Path:
    """Where the checkpoint ``path`` replaced is kept."""
    return path.with_name(path.name + ".previous")


def _temp_beside(path: Path, kind: str = "") -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}{kind}.tmp")


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


def _sha256(handle: IO[bytes], size: int) -> str:
    digest = hashlib.sha256()
    left = size
    while left > 0:
        chunk = handle.read(min(1 << 20, left))
        if not chunk:
            break
        digest.update(chunk)
        left -= len(chunk)
    return digest.hexdigest()


def save_state(write: Callable[[Path], None], path: Path, header: dict[str, Any]) -> Path:
    """Write the ORT checkpoint bytes ``write(raw_path)`` produces (an engine's state, optimizer state
    included) to ``path`` with the odt header; on any failure the old file is untouched.

    ``header`` must hold ``manifest_sha256``; epoch and step are welcome (they name the file in errors).
    """
    _make_parent(path, "checkpoint directory")
    clear_stale_temps(path, locked=True)  # under the writer lock no one else is saving
    raw, tmp = _temp_beside(path, ".ort"), _temp_beside(path)
    try:
        write(raw)
        size = raw.stat().st_size
        with open(raw, "rb") as source:
            digest = _sha256(source, size)
        meta = json.dumps({**header, "sha256": digest, "size": size, "saved": time.time()}).encode()
        with open(tmp, "wb") as out, open(raw, "rb") as source:
            os.fchmod(out.fileno(), public_mode())
            out.write(MAGIC + _LENGTH.pack(len(meta)) + meta)
            shutil.copyfileobj(source, out, 1 << 20)
        if path.exists():
            _keep_as_previous(path, str(header["manifest_sha256"]))
        _commit(tmp, path)
    except Exception as exc:
        raise CheckpointError(
            f"could not write checkpoint {path} ({_write_failure(exc)}); the previous checkpoint, if any, is "
            "unchanged. Free disk space or choose a writable --checkpoint."
        ) from exc
    finally:
        raw.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return path


def _write_failure(exc: Exception) -> str:
    """Why a write failed, in the system's words: ORT reports a failed write with its temporary file's
    name and an errno, which reads as if ONNX Runtime were at fault."""
    errno = exc.errno if isinstance(exc, OSError) else None
    if errno is None:
        found = re.search(r"errno:(\d+)", str(exc))
        errno = int(found.group(1)) if found else None
    if errno == 27:
        return "the file-size limit of this process was reached (ulimit -f)"
    if errno == 28:
        return "the disk is full"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return os.strerror(errno) if errno else ort_error_message(exc)


def _keep_as_previous(path: Path, manifest_sha: str) -> None:
    """The checkpoint about to be replaced is also kept as NAME.previous if it is sound.

    A hard link (a copy where links are not possible) renamed over NAME.previous: ``path`` itself
    never moves, so a reader always finds a whole checkpoint under its name.
    """
    previous = previous_of(path)
    if previous.is_symlink() or (previous.exists() and not previous.is_file()):
        log.warning("%s is not a file odt wrote (a directory?): the checkpoint before this save is not kept", previous)
        return
    try:
        read_header(path, manifest_sha, verify=True)
    except CheckpointError:
        return
    keep = _temp_beside(path, ".previous")
    keep.unlink(missing_ok=True)
    try:
        try:
            os.link(path, keep)
        except OSError:
            shutil.copyfile(path, keep)
        os.replace(keep, previous)
    finally:
        keep.unlink(missing_ok=True)  # a rename between two links of one file does nothing and leaves both


def read_header(path: Path, manifest_sha: str | None = None, *, verify: bool = True) -> dict[str, Any]:
    """The header of a checkpoint file; with ``verify`` the payload's size and sha256 are checked too.

    Raises CheckpointCorruptError for a file that is not a whole, unaltered checkpoint and
    CheckpointError for one that belongs to other artifacts.
    """
    if not path.is_file():
        what = "is not a file (a directory?)" if path.exists() else "does not exist"
        raise CheckpointError(f"checkpoint {path} {what}.")
    with open(path, "rb") as handle:
        header = _header(handle, path, manifest_sha)
        if verify and _sha256(handle, int(header["size"])) != header["sha256"]:
            raise CheckpointCorruptError(f"checkpoint {path} was altered (sha256 differs){_hint(path)}")
    return header


def _header(handle: IO[bytes], path: Path, manifest_sha: str | None) -> dict[str, Any]:
    """Read and check the header from an open checkpoint; the handle is left at the payload."""
    head = handle.read(len(MAGIC) + _LENGTH.size)
    if len(head) < len(MAGIC) + _LENGTH.size or head[: len(MAGIC)] != MAGIC:
        raise CheckpointCorruptError(f"checkpoint {path} is not an odt checkpoint (no header){_hint(path)}")
    (length,) = _LENGTH.unpack(head[len(MAGIC) :])
    try:
        header = json.loads(handle.read(min(length, 1 << 16)))
        int(header["size"]), str(header["sha256"])
    except (ValueError, KeyError, TypeError, RecursionError):
        raise CheckpointCorruptError(f"checkpoint {path} has a damaged header{_hint(path)}") from None
    if manifest_sha is not None and header.get("manifest_sha256") != manifest_sha:
        found = str(header.get("manifest_sha256"))[:12]
        raise CheckpointError(
            f"checkpoint {path} was saved from other artifacts (manifest sha256 {found}..., these are "
            f"{manifest_sha[:12]}...). Use the artifact directory it was trained from."
        )
    header["payload_offset"] = len(MAGIC) + _LENGTH.size + length
    if os.fstat(handle.fileno()).st_size != header["payload_offset"] + int(header["size"]):
        raise CheckpointCorruptError(f"checkpoint {path} is truncated or padded{_hint(path)}")
    handle.seek(header["payload_offset"])
    return header


def _hint(path: Path) -> str:
    previous = previous_of(path)
    if previous.is_file():
        return f"; the checkpoint before it is kept as {previous} (odt falls back to it when reading)."
    return "; retrain, or restore it from a copy."


@contextmanager
def unpacked(path: Path, manifest_sha: str) -> Iterator[tuple[Path, dict[str, Any]]]:
    """ORT's checkpoint bytes of a verified checkpoint file, in a temporary file for ORT to load.

    The payload is hashed while it is copied (one read); the sha256 is checked before ORT opens it.
    """
    if not path.is_file():
        what = "is not a file (a directory?)" if path.exists() else "does not exist"
        raise CheckpointError(f"checkpoint {path} {what}.")
    with tempfile.TemporaryDirectory(prefix="odt-ckpt-") as tmp:
        raw = Path(tmp) / "checkpoint"
        digest = hashlib.sha256()
        # One handle for header and payload: a save renaming a new file over ``path`` cannot mix the two.
        with open(path, "rb") as source, open(raw, "wb") as out:
            header = _header(source, path, manifest_sha)  # also checks the size
            for chunk in iter(lambda: source.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != header["sha256"]:
            raise CheckpointCorruptError(f"checkpoint {path} was altered (sha256 differs){_hint(path)}")
        yield raw, header


@contextmanager
def writer_lock(path: Path) -> Iterator[None]:
    """Hold ``.NAME.lock`` beside the checkpoint while writing; a second writer gets a clear error."""
    _make_parent(path, "checkpoint directory")
    try:
        with exclusive(path.with_name(f".{path.name}.lock"), f"checkpoint {path}",
                       "wait for that run to end or choose another --checkpoint (two writers would overwrite "
                       "each other's progress)"):  # fmt: skip
            yield
    except InUseError as exc:
        raise CheckpointError(str(exc)) from None


def export_inference(
    session: Engine,
    outputs: list[str],
    path: Path,
    adapters: tuple = (),
    metadata: dict[str, str] | None = None,
    external: Path | None = None,
) -> Path:
    """The eval graph with the current weights and the loss removed, as one ONNX file.

    LoRA ``adapters`` are folded into their base weights (a plain model); ``metadata`` goes into
    the model's ``metadata_props`` (the manifest and tokenizer, so the file describes itself);
    frozen weights the graph reads from ``external`` (the artifact directory's ``frozen.bin``)
    are written into the file one at a time, read from the file as they are written: the model never
    stands in memory whole (MiniLM's export under a 200 MB plan peaked at 468-613 MiB holding it twice).
    """
    if not outputs:
        raise CheckpointError("these artifacts have no outputs besides the loss: nothing to export.")

    def build(tmp: Path):  # type: ignore[no-untyped-def]
        import onnx

        from .lora import fold_adapters

        session.export_model(tmp, outputs)
        model = onnx.load(tmp, load_external_data=False)
        model = fold_adapters(model, adapters, None if external is None else os.fspath(external))
        stored = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        for tensor in stored:
            model.graph.initializer.remove(tensor)
        return model, _filled(stored, external)

    return write_model(path, build, metadata)


def _filled(stored: list[Any], base: Path | None) -> Iterator[tuple[Any, tuple[Path, int, int]]]:
    """Each initializer kept as external data, without its bytes, and where they are: ``(file, offset, length)``
    (:func:`write_model` copies them from there into the file)."""
    import onnx

    for tensor in stored:
        info = {entry.key: entry.value for entry in tensor.external_data}
        if base is None or "location" not in info:
            raise CheckpointError(f"the eval graph reads {tensor.name!r} from a file the manifest does not name.")
        source = (base / info["location"], int(info.get("offset", 0)), int(info["length"]))
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
        yield tensor, source


def write_model(path: Path, build: Callable[[Path], Any], metadata: dict[str, str] | None = None) -> Path:
    """Write the ONNX model ``build(temporary path)`` returns, with ``metadata``, atomically at ``path``.

    ``build`` may return ``(model, initializers)``: the initializers (an iterable of TensorProtos, or of
    ``(TensorProto without its data, (file, offset, length))``) are then written after the model one at a
    time, each as a message of its own that protobuf merges into the graph on reading, so a large model never
    stands in memory whole (SmolLM2's 513 MiB); data from a file is copied from it a block at a time. Every
    large initializer's bytes start aligned, so a session can map them (:mod:`ondevice.model_file`).
    """
    _make_parent(path, "export directory")
    clear_stale_temps(path)
    tmp = _temp_beside(path)
    try:

        built = build(tmp)
        model, initializers = built if isinstance(built, tuple) else (built, ())
        for key, value in (metadata or {}).items():
            entry = model.metadata_props.add()
            entry.key, entry.value = key, value
        model.producer_name = PRODUCER  # a later export may replace this file (ondevice.files.written_by_odt)
        large = [t for t in model.graph.initializer if len(t.raw_data) >= MAPPED]  # aligned too, for mapping
        for tensor in large:
            model.graph.initializer.remove(tensor)
        with open(tmp, "wb") as handle:
            handle.write(model.SerializeToString())
            for item in itertools.chain(large, initializers):
                tensor, source = item if isinstance(item, tuple) else (item, None)
                if source is None:
                    if not tensor.HasField("raw_data"):  # typed values: a plain message
                        handle.write(plain_initializer(tensor.SerializeToString()))
                        continue
                    source = tensor.raw_data
                    tensor.ClearField("raw_data")
                write_initializer(handle, tensor.SerializeToString(), source)
        os.chmod(tmp, public_mode())
        _commit(tmp, path)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OndeviceError):
            raise
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else ort_error_message(exc)
        raise CheckpointError(f"could not export {path}: {reason}. Choose a writable --out.") from exc
    return path
