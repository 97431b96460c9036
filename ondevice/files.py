"""Small file helpers: sha256, atomic writes (temp file + fsync + rename) and output directories the
SDK may replace, for every package."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

__all__ = [
    "sha256_file",
    "atomic_write_bytes",
    "public_mode",
    "fsync_dir",
    "output_refusal",
    "staging_dir",
    "publish_dir",
    "pid_alive",
    "clear_stale_temps",
    "written_by_odt",
    "export_refusal",
    "PRODUCER",
    "EXPORT_RECORD",
]

PRODUCER = "odt"
"""The producer name odt writes into the files it exports (ONNX producer_name, safetensors metadata)."""
EXPORT_RECORD = "odt-export.json"
"""The file an exported folder (PEFT, Hugging Face) lists its files in, as manifest.json does."""


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, secret: bool = False) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    The file gets the usual permissions (0644 under the common umask 022); ``secret`` files
    (private keys) 0600.
    """
    target = Path(path)
    import tempfile  # here, not at the top: a cold start that only trains never writes (~4 ms)

    clear_stale_temps(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o600 if secret else public_mode())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def clear_stale_temps(target: Path, *, locked: bool = False) -> None:
    """Remove the temporary files (``.NAME.PID....tmp``) that killed writers of ``target`` left; a
    writer that holds ``target``'s lock (``locked``) removes every other process's too."""
    import glob

    for stale in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        pid = stale.name[len(target.name) + 2 :].split(".")[0]
        if pid.isdigit() and int(pid) != os.getpid() and (locked or not pid_alive(int(pid))):
            stale.unlink(missing_ok=True)


def public_mode(*, directory: bool = False) -> int:
    """What ``open()``/``mkdir()`` would give under the process umask (mkstemp/mkdtemp give 0600/0700)."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (another user's process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def output_refusal(out: str | os.PathLike[str], *, force: bool, marker: str, extra: tuple[str, ...] = ()) -> str | None:
    """Why the SDK must not write the directory ``out``, or None when it may.

    ``out`` may be new, or (with ``force``) an empty directory or one the SDK wrote: it holds
    ``marker`` (a manifest.json or bundle.json) and nothing but the files that marker lists,
    ``marker`` itself and ``extra``. An empty path, the working directory and its parents are
    always refused: an unset shell variable must not replace the directory a user stands in.
    """
    if not os.fspath(out).strip():
        return "--out is empty (an unset shell variable?); name the directory to write"
    target = Path(out).absolute()
    here = Path.cwd().resolve()
    real = target.resolve()
    if real == here or real in here.parents:
        return f"--out {os.fspath(out)!r} is the working directory or one of its parents; name a new directory"
    if not target.exists() and not target.is_symlink():
        return None
    if not force:
        return f"{target} already exists; pass --force to replace it (only a directory odt wrote is replaced)"
    if target.is_symlink() or not target.is_dir():
        return f"{target} is not a directory odt wrote; --force replaces only those. Choose another --out"
    names = {entry.name for entry in target.iterdir()}
    if not names:
        return None
    if marker not in names:
        return (
            f"{target} holds files odt did not write (no {marker}); --force replaces only a directory odt made. "
            "Choose another --out, or move those files away yourself"
        )
    foreign = sorted(names - _written_by_sdk(target / marker) - {marker, *extra})
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        return (
            f"{target} holds files odt did not write ({shown}); --force would delete them. "
            "Move them away or choose another --out"
        )
    return None


def _written_by_sdk(marker: Path) -> set[str]:
    """The files a manifest.json or bundle.json lists (empty when it is not one of ours)."""
    try:
        data = json.loads(marker.read_bytes()[: 1 << 24])
    except (OSError, ValueError, RecursionError):
        return set()
    files = data.get("files") if isinstance(data, dict) else None
    return {str(name) for name in files} if isinstance(files, dict) else set()


def staging_dir(target: Path) -> Path:
    """A new hidden directory beside ``target`` to build it in; those of killed runs are removed first."""
    import tempfile

    for stale in target.parent.glob(f".{target.name}.*.partial"):
        pid = stale.name[len(target.name) + 2 :].split(".")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".partial", dir=target.parent))


def publish_dir(work: Path, target: Path) -> None:
    """Move the finished ``work`` directory to ``target``; an existing one (checked by the caller) is replaced whole."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.{os.getpid()}.old.partial")
        os.rename(target, old)
    os.chmod(work, public_mode(directory=True))  # mkdtemp made it 0700
    os.rename(work, target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def written_by_odt(path: Path) -> bool:
    """Whether the file at ``path`` is an ONNX model, a .safetensors file or an .npz that odt wrote
    (its producer, or the zip comment, is :data:`PRODUCER`). Reads only the file's first bytes (an
    .npz: its central directory)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(1 << 16)
    except OSError:
        return False
    if head[:4] == b"PK\x03\x04":  # an .npz (a zip): odt predict names itself in the archive comment
        import zipfile

        try:
            with zipfile.ZipFile(path) as archive:
                return archive.comment == PRODUCER.encode()
        except (OSError, zipfile.BadZipFile):
            return False
    if len(head) >= 8 and head[8:9] == b"{":  # safetensors: u64 header length, then a JSON header
        size = int.from_bytes(head[:8], "little")
        try:
            if 8 + size > len(head):  # a header longer than the first read (many tensors)
                with open(path, "rb") as handle:
                    handle.seek(8)
                    head = b"\0" * 8 + handle.read(min(size, 1 << 24))
            header = json.loads(head[8 : 8 + size])
            return isinstance(header, dict) and header.get("__metadata__", {}).get("producer") == PRODUCER
        except (OSError, ValueError, RecursionError, AttributeError):
            return False
    return _onnx_producer(head) == PRODUCER


def _onnx_producer(head: bytes) -> str | None:
    """ModelProto.producer_name (field 2) from the start of a serialized ONNX model: protobuf writes
    fields in number order, so it follows ir_version (field 1)."""
    pos = 0
    while pos < len(head):
        key, pos = _varint(head, pos)
        field, wire = key >> 3, key & 7
        if field > 2 or wire not in (0, 2):
            return None
        value, pos = _varint(head, pos)
        if wire == 2:
            if field == 2:
                return head[pos : pos + value].decode("utf-8", "replace")
            pos += value
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(data):
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            break
    return value, pos


def export_refusal(out: str | os.PathLike[str], source: str | os.PathLike[str], *, folder: bool,
                   force: bool) -> str | None:  # fmt: skip
    """Why a command that writes ``out`` (``odt export``, ``odt predict --out``) must not write it, or
    None when it may: a new path, or with ``force`` a file (``folder`` False) or folder odt wrote.
    Never ``source`` (the artifacts or model the command reads) or anything in it, a symbolic link,
    a device or other special file, or the working directory."""
    if not os.fspath(out).strip():
        return "--out is empty (an unset shell variable?); name the file or folder to write"
    target = Path(out).absolute()
    real, read = target.resolve(), Path(source).resolve()
    if real == read or read in real.parents:
        return (f"--out {os.fspath(out)!r} is {source} or inside it, which this command reads: writing there "
                "would overwrite it. Choose a path outside it")  # fmt: skip
    if folder:
        return output_refusal(out, force=force, marker=EXPORT_RECORD)
    if target.is_symlink():
        return f"{target} is a symbolic link; odt never writes through one. Choose another --out"
    if not target.exists():
        return None
    if not target.is_file():
        return f"{target} is not a regular file (a directory, a device or a pipe); choose another --out"
    if not force:
        return f"{target} already exists; pass --force to replace it (only a file odt wrote is replaced)"
    if not written_by_odt(target):
        return f"{target} was not written by odt, so --force does not replace it. Move it away or choose another --out"
    return None
