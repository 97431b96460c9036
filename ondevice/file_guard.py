"""A guard on a file the runtime maps (``frozen.bin``): a change under the mapping ends training with a typed
error instead of killing the process.

A mapped file truncated under a running step makes the next read of a lost page a SIGBUS, which no Python code
can catch: ``odt train`` died with exit 135, no message, its buffered output lost. On Linux the guard takes a
read lease on the file (``fcntl(F_SETLEASE)``): a process that opens it to write or truncates it is held by the
kernel (up to ``/proc/sys/fs/lease-break-time``, 45 s by default) and this process is sent SIGIO. The step under
way finishes on intact pages, and :meth:`FileGuard.check`, called around every step, raises; the other process
goes on once this one has exited (or dropped the guard). Where no lease can be taken (another system, a file of
another user, a thread other than the main one, which cannot set the signal handler), ``check`` still compares
the file's size and identity before and after each step, which catches a change between steps.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import weakref
from pathlib import Path

from .errors import ArtifactIntegrityError

__all__ = ["FileGuard"]

_GUARDS: weakref.WeakSet[FileGuard] = weakref.WeakSet()
_INSTALLED = False


class FileGuard:
    """Watch ``path`` (``size`` bytes, mapped by the caller) for writes, truncation and replacement."""

    def __init__(self, path: Path, size: int, *, reader: str = "training", remedy: str = "") -> None:
        self.path, self.size = path, size
        self.reader = reader  # what reads the file, and what to do after a change, for the error
        self.remedy = remedy or ("Training stopped before reading the change; the last checkpoint is intact. Copy "
                                 "the artifacts again, then resume (--resume).")  # fmt: skip
        self.changing = False
        self._fd = os.open(path, os.O_RDONLY)
        self._inode = os.fstat(self._fd).st_ino
        self.leased = _lease(self)

    def check(self) -> None:
        """Raise ArtifactIntegrityError if another process is changing the file, or changed or replaced it."""
        why = None
        if self.changing:
            why = "another process opened it to write or truncate it (it waits until this one exits)"
        else:
            try:
                now = os.stat(self.path)
            except OSError:
                now = None
            if now is None or now.st_ino != self._inode:
                why = "it was removed or replaced"
            elif os.fstat(self._fd).st_size != self.size:
                why = f"its size changed from {self.size:,} to {os.fstat(self._fd).st_size:,} bytes"
        if why is not None:
            raise ArtifactIntegrityError(f"{self.path} changed while {self.reader} read it: {why}. {self.remedy}")

    def __del__(self) -> None:
        try:
            os.close(self._fd)  # drops the lease: a held writer goes on
        except (OSError, AttributeError):
            pass


def _lease(guard: FileGuard) -> bool:
    """Take a read lease on the guard's file (Linux, main thread); False where none can be taken."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return False
    import fcntl

    _install()
    try:
        fcntl.fcntl(guard._fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError:  # another user's file, a file open for writing elsewhere, a file system without leases
        return False
    _GUARDS.add(guard)
    return True


def _install() -> None:
    """Catch SIGIO (its default action ends the process), passing it on to a handler installed before."""
    global _INSTALLED
    if _INSTALLED:
        return
    import fcntl

    previous = signal.getsignal(signal.SIGIO)

    def notified(signum: int, frame: object) -> None:
        for guard in list(_GUARDS):
            try:
                if fcntl.fcntl(guard._fd, fcntl.F_GETLEASE) == fcntl.F_UNLCK:  # a break is pending
                    guard.changing = True
            except OSError:
                guard.changing = True
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGIO, notified)
    _INSTALLED = True
