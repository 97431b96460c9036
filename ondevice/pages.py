"""Page embedding tables in by the row: a step reads a few rows, RSS should hold only those.

ONNX Runtime memory-maps ``frozen.bin``. When the file is in the page cache in large folios
(ext4 and others on recent Linux kernels, after the generator wrote it or the loader hashed
it), one touch maps a whole folio: on MiniLM (LoRA r8 + head, one text of 64 tokens a step)
64 rows of the 47 MB word table put 38 MB into the process's RSS. For the tables the manifest
names as lookups, the runtime drops their cached pages and marks ORT's mappings random access,
so each touched row faults in alone: the peak went from 178 to 138 MB (``ondevice.measure``,
docs/performance.md).

Advice only: nothing changes what the graph computes, and any failure (another OS, no
``/proc``, a kernel that refuses) leaves the default behaviour.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .manifest import Manifest

__all__ = ["page_by_row", "page_lookups_by_row"]

_MADV_RANDOM = 1


def page_lookups_by_row(directory: Path, manifest: Manifest) -> int:
    """:func:`page_by_row` for the lookup tables ``manifest.frozen_file`` names (none in older manifests)."""
    stored = manifest.frozen_file or {}
    shapes = {p.name: p.shape for p in manifest.frozen}
    starts = {name: 4 * int(stored["offsets"][name]) for name in stored.get("lookups", ())}
    ranges = [(start, start + 4 * math.prod(shapes[name])) for name, start in starts.items()]
    return page_by_row(directory / stored["file"], ranges) if ranges else 0


def page_by_row(path: Path, ranges: Sequence[tuple[int, int]]) -> int:
    """Drop the cached pages of ``path``'s byte ``ranges`` ((start, end)) and mark this process's
    mappings of them random access; returns how many mappings were advised (0 off Linux)."""
    if not ranges or not sys.platform.startswith("linux"):
        return 0
    try:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            try:
                os.fdatasync(descriptor)  # pages just written are dirty: the kernel would keep those
            except OSError:
                pass  # a read-only file system: nothing there is dirty
            for start, end in ranges:
                os.posix_fadvise(descriptor, start, end - start, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)
        return _advise_mappings(os.path.realpath(path), ranges)
    except (OSError, AttributeError):
        return 0


def _advise_mappings(path: str, ranges: Sequence[tuple[int, int]]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[5].rstrip("\n") != path:
                continue
            low, high = (int(x, 16) for x in fields[0].split("-"))
            offset = int(fields[2], 16)
            middle = offset + (high - low) // 2  # ORT maps each tensor from its page: neighbours overlap
            if any(start <= middle < end for start, end in ranges):
                advised += libc.madvise(low, high - low, _MADV_RANDOM) == 0
    return advised
