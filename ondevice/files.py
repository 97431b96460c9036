"""Small file helpers: sha256 and atomic writes (temp file + fsync + rename), for every package."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["sha256_file", "atomic_write_bytes", "public_mode", "fsync_dir"]


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

    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
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
