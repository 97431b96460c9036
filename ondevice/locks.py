"""Advisory locks between odt processes, so that two of them never use one thing at cross purposes:
a checkpoint being written, artifacts a trainer holds while ``odt generate --force`` would replace
them, a federated run's output directory.

Locks are ``flock`` locks on a small file: readers share one, a writer holds it alone. The kernel
drops a lock when its process ends, however it ends (``kill -9`` included), so a lock never
outlives its holder. A refused process is told who holds the lock: the pid the holder wrote into
the file, or on Linux the pids ``/proc/locks`` lists for it.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

from .errors import InUseError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks here; a second process is not refused
    fcntl = None  # type: ignore[assignment]

__all__ = ["exclusive", "shared", "holders", "ARTIFACTS_LOCK"]

ARTIFACTS_LOCK = ".odt-lock"
"""The lock file inside an artifact directory: trainers hold it shared, ``odt generate --force`` alone."""


def _open(lock: Path) -> IO[str]:
    return open(lock, "a+")  # noqa: SIM115 - the caller closes it, which releases the lock


@contextmanager
def exclusive(lock: Path, what: str, advice: str, *, own_holds: bool = False) -> Iterator[None]:
    """Hold ``lock`` alone while the block runs, with this process named in it. Raises
    :class:`InUseError` ("``what`` is in use by ...; ``advice``") when another process holds it,
    shared or alone, and when the lock file cannot be made. With ``own_holds``, holds of this
    process's own do not stop it (a trainer it still has on artifacts it regenerates, as benchmarks
    do; Linux, where the kernel says whose locks they are)."""
    try:
        handle = _open(lock)
    except OSError as exc:
        raise InUseError(f"cannot lock {what} ({lock}: {exc.strerror}); {advice}.") from None
    try:
        if fcntl is not None:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not own_holds or _lock_pids(lock) != {os.getpid()}:
                    raise InUseError(f"{what} is in use by {holders(lock, handle)}; {advice}.") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {os.uname().nodename} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        handle.flush()
        yield
    finally:
        handle.close()


def shared(lock: Path, what: str, advice: str) -> IO[str] | None:
    """A shared hold on ``lock`` (any number of readers at once) until the returned handle is
    closed; None where the lock file cannot be made (a read-only directory: no one replaces it).
    Raises :class:`InUseError` while a writer holds it alone."""
    try:
        handle = _open(lock)
    except OSError:
        return None
    if fcntl is not None:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = holders(lock, handle)
            handle.close()
            raise InUseError(f"{what} is in use by {holder}; {advice}.") from None
    return handle


def holders(lock: Path, handle: IO[str] | None = None) -> str:
    """Who holds ``lock``: the pids the kernel lists for it (Linux), else what its writer wrote."""
    pids = _lock_pids(lock) - {os.getpid()}
    if pids:
        return ("pid " if len(pids) == 1 else "pids ") + ", ".join(str(p) for p in sorted(pids))
    try:
        if handle is not None:
            handle.seek(0)
            return handle.read(200).strip() or "another process"
    except OSError:
        pass
    return "another process"


def _lock_pids(lock: Path) -> set[int]:
    """The pids ``/proc/locks`` lists as holding an flock on ``lock`` (empty elsewhere)."""
    try:
        info = lock.stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return set()
    device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    pids = set()
    for line in table.splitlines():
        fields = line.split()
        if "FLOCK" in fields and device in fields:
            try:
                pids.add(int(fields[fields.index(device) - 1]))
            except (ValueError, IndexError):
                continue
    return pids
