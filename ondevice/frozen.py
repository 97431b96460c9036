"""The frozen weights: one read-only mapping of ``frozen.bin``, shared by every session of a trainer.

ONNX Runtime maps external data once per session, and RSS counts a page once per mapping: the
training and eval sessions each mapped the file, so on MiniLM (LoRA r16 + head, micro-batches of
4) ``odt train --val``'s RSS went from 180 to 255 MiB when validation began. Here the runtime maps
the file itself (numpy) and hands ORT every tensor as a shared initializer
(``SessionOptions.add_initializer``): all sessions read the same pages, nothing is copied, and the
losses are bit-identical to ORT's own mapping.

Lookup tables are paged in by the row. When the file is in the page cache in large folios (ext4
and others on recent Linux kernels, after the generator wrote it or the loader hashed it), one
touch maps a whole folio: on MiniLM (LoRA r8 + head, one text of 64 tokens a step) 64 rows of the
47 MB word table put 38 MB into the process's RSS. For the tables the manifest names as lookups,
the runtime drops their cached pages and marks its mapping of them random access, so each touched
row faults in alone: the peak went from 178 to 138 MB (``ondevice.measure``). Advice only: any
failure (another OS, a kernel that refuses) leaves the default behaviour.

Streamed weights (``Trainer.load(stream_weights=True)``, ``odt train --stream-weights``): a step reads
every frozen page, and each page it read stays mapped, so a step's peak RSS holds the whole file
(SmolLM2 on an int8 base: 131 of its 378 MiB). While a step runs, a thread unmaps the file's pages every
:data:`STREAM_INTERVAL` seconds; ORT's next read of a page maps it again from the page cache (a minor
fault, no copy). The process then holds only the pages of the last interval (SmolLM2's peak: see
``docs/pretrained.md``). The pages stay in the system's page cache, which a system short of memory
may drop and read again from storage. Linux only (``madvise``); elsewhere it changes nothing. The
thread needs Python's lock: the portable engine's sessions release it while they run, the classic
engine's training API holds it for a whole step, so there the pages leave between steps only
(SmolLM2's classic peak stayed at 401 MiB).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import mmap
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

from .file_guard import FileGuard
from .session import OrtValue

if TYPE_CHECKING:
    from .manifest import Manifest

__all__ = ["FrozenWeights", "HALF", "SCALE_SUFFIX", "BLOCK_VALUES", "STREAM_INTERVAL", "block_name", "dequantize_rows",
           "mapped_ranges", "narrow_matrices", "row_blocks", "stored_arrays", "streamed", "widened"]

_MADV_RANDOM, _MADV_DONTNEED = 1, 4

STREAM_INTERVAL = 0.01
"""Seconds between two unmappings of the frozen file while a step streams its weights. SmolLM2, int8 base,
portable engine, probes of one process each: not streamed 378 MiB; every 50 ms 284 and 290 MiB, 10 ms 258
and 258, 5 ms 255 and 255, at step times within each other's noise (a page faults in once per read either
way). A step shorter than this holds the whole file at its end, as without streaming."""

SCALE_SUFFIX = "::scale"
"""An int8 matrix ``W`` of an int8 base (``odt generate --base int8``) has its per-row scales in ``W::scale``."""

HALF = "float16"
"""``frozen_file``'s key listing the matrices of a float16 base (``odt generate --base float16``)."""


BLOCK_VALUES = 1 << 19
"""An int8 or float16 matrix of more than 4 x this many values (8 MiB in float32) is widened a block of rows of about
this many values (2 MiB) at a time, each block its own tensor (a view of the matrix's rows in ``frozen.bin``,
named by :func:`block_name`). On a SmolLM2-shaped model (a tied 49,152 x 576 embedding) a step's peak fell
by 8 MB from blocks of 2^21 values at the same speed, and by 36 MB from blocks of 2^23. Smaller matrices
stay whole: blocking SmolLM2's 576 x 1,536 projections too added 7,000 nodes to the step graph."""


def row_blocks(shape: tuple[int, ...], limit: int | None = None) -> list[tuple[int, int]]:
    """The (start, stop) row blocks of an int8 or float16 matrix of ``shape``: one block unless it has more than
    4 x ``limit`` values (default :data:`BLOCK_VALUES`; artifacts record theirs as ``frozen_file.block_values``)."""
    limit = BLOCK_VALUES if limit is None else limit
    rows, columns = shape
    step = rows if rows * columns <= 4 * limit else max(1, limit // max(columns, 1))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def block_name(name: str, start: int) -> str:
    return f"{name}::rows{start}"


def dequantize_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``float(q) * scale`` per row: what ONNX's DequantizeLinear (axis 0) computes in the step graph."""
    return q.astype(np.float32) * scale.astype(np.float32)[:, None]


def narrow_matrices(manifest: Manifest) -> set[str]:
    """The frozen matrices stored narrower than float32 (an int8 or a float16 base), widened in the graphs."""
    stored = manifest.frozen_file or {}
    return {*stored.get("int8", {}), *stored.get(HALF, ())}


def stored_arrays(data: np.ndarray, manifest: Manifest) -> dict[str, np.ndarray]:
    """Every tensor of ``frozen.bin`` (``data``: its bytes as uint8) by graph name, as views: float32
    tensors; for an int8 base each matrix as int8 plus its scales (``name + SCALE_SUFFIX``), for a float16
    base each matrix as float16; and for a large int8 or float16 matrix its row blocks (:func:`row_blocks`).
    Offsets count 4-byte words; an int8 or float16 matrix is padded to whole words (int8 scales follow)."""
    stored = manifest.frozen_file or {}
    shapes = {p.name: p.shape for p in manifest.frozen}
    int8, half = stored.get("int8", {}), set(stored.get(HALF, ()))
    arrays: dict[str, np.ndarray] = {}
    for name, offset in stored.get("offsets", {}).items():
        shape, start = shapes[name], 4 * int(offset)
        count = math.prod(shape)
        if name in int8 or name in half:
            dtype = np.dtype(np.int8 if name in int8 else "<f2")
            arrays[name] = data[start : start + dtype.itemsize * count].view(dtype).reshape(shape)
            blocks = row_blocks(shape, stored.get("block_values"))
            arrays.update({block_name(name, a): arrays[name][a:b] for a, b in blocks} if len(blocks) > 1 else {})
            if name in int8:
                scales = 4 * int(int8[name])
                arrays[name + SCALE_SUFFIX] = data[scales : scales + 4 * shape[0]].view(np.float32)
        else:
            arrays[name] = data[start : start + 4 * count].view(np.float32).reshape(shape)
    return arrays


def widened(arrays: dict[str, np.ndarray], name: str) -> np.ndarray:
    """Stored tensor ``name`` of ``arrays`` (:func:`stored_arrays`) as the float32
    values the graphs compute with: an int8 matrix dequantized, a float16 one widened, float32 copied."""
    value = arrays[name]
    if value.dtype == np.int8:
        return dequantize_rows(value, arrays[name + SCALE_SUFFIX])
    return np.array(value, np.float32)


class FrozenWeights:
    """One read-only mapping of an artifact directory's ``frozen.bin`` and an OrtValue per tensor.

    ``values`` go to every session's options (``add_initializer``); they keep the mapping alive, and
    the sessions must not outlive them. :meth:`release_rows` unmaps the lookup tables' rows that
    earlier steps read: clean file pages, read again from the page cache when a later step needs
    them. Without it, every row an epoch touched stayed in RSS (MiniLM on Spanish commands: 31 MiB
    of the word table after 64 examples).
    """

    def __init__(self, directory: Path, manifest: Manifest, stream: bool = False) -> None:
        self.values: dict[str, OrtValue] = {}
        self.arrays: dict[str, np.ndarray] = {}
        self.mapping: np.ndarray | None = None  # the whole file's bytes; ``arrays`` are views of it
        self.stream = stream
        self._tables: list[tuple[int, int]] = []
        self._whole: list[tuple[int, int]] = []
        self._guard: FileGuard | None = None
        stored = manifest.frozen_file
        if not stored or not manifest.frozen:
            return
        path = directory / stored["file"]
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        self._guard = FileGuard(path, mapped.size)  # a change under the mapping: a typed error, not SIGBUS
        self._whole = [(mapped.ctypes.data, mapped.size)]
        arrays = stored_arrays(mapped, manifest)
        tables = [(int(stored["offsets"][n]) * 4, arrays[n].nbytes) for n in stored.get("lookups", ())]
        _drop_cached(path, [(start, start + size) for start, size in tables])
        base, page = mapped.ctypes.data, mmap.PAGESIZE  # the mapping starts at file offset 0, on a page
        self._tables = [(base + start - start % page, size + start % page) for start, size in tables]
        if _madvise(self._tables, _MADV_RANDOM) < len(self._tables):
            self._tables = []  # not Linux, or the kernel refused: leave the pages to the system
        self.mapping, self.arrays = mapped, arrays  # the same views as numpy arrays, for runs that feed them
        self.values = {name: OrtValue.ortvalue_from_numpy(array) for name, array in arrays.items()}

    @property
    def streams(self) -> bool:
        """Whether runs stream the file (asked for, and there is a file to stream)."""
        return bool(self.stream and self._whole)

    def release_rows(self) -> None:
        """Unmap the lookup tables' pages from this process (Linux; elsewhere the system decides)."""
        if self._tables:
            _madvise(self._tables, _MADV_DONTNEED)

    def release(self) -> None:
        """Unmap every page of the file from this process (Linux): the next read maps it again."""
        if self._whole:
            _madvise(self._whole, _MADV_DONTNEED)

    @contextlib.contextmanager
    def reading(self, stream: bool | None = None) -> Iterator[None]:
        """Around one run of a session: with ``stream`` on (by default the weights' own choice), a thread
        unmaps the whole file every :data:`STREAM_INTERVAL` seconds while the run reads it (:func:`streamed`).
        Afterwards what the run read leaves RSS: the whole file when streamed, else the lookup tables' rows."""
        if self._guard is not None:
            self._guard.check()
        if (self.stream if stream is None else stream) and self._whole:
            with streamed(self._whole):
                yield
        else:
            try:
                yield
            finally:
                self.release_rows()
        if self._guard is not None:
            self._guard.check()  # the step read intact pages; its result is not used when the file changed


@contextlib.contextmanager
def streamed(ranges: list[tuple[int, int]]) -> Iterator[None]:
    """While the block runs, a thread unmaps the mapped ``ranges`` (address, length) every
    :data:`STREAM_INTERVAL` seconds, and once more at its end: a run that reads every page of a mapped file
    holds only the pages of the last interval (Linux; elsewhere nothing happens). Joined before the block
    ends, so the thread never outlives the mapping."""
    done = threading.Event()

    def unmap() -> None:
        while not done.wait(STREAM_INTERVAL):
            _madvise(ranges, _MADV_DONTNEED)

    thread = threading.Thread(target=unmap, name="odt-stream-weights", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        _madvise(ranges, _MADV_DONTNEED)


def mapped_ranges(arrays: Iterable[np.ndarray]) -> list[tuple[int, int]]:
    """The whole pages (address, length) that ``arrays`` (views of a mapped file) lie on, for :func:`streamed`."""
    page = mmap.PAGESIZE
    ranges = []
    for array in arrays:
        start = array.ctypes.data - array.ctypes.data % page
        ranges.append((start, array.ctypes.data + array.nbytes - start))
    return ranges


def _drop_cached(path: Path, ranges: list[tuple[int, int]]) -> None:
    """Drop the page cache's pages of ``ranges`` (whole large folios) so rows fault in one by one."""
    if not ranges or not hasattr(os, "posix_fadvise"):
        return
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        try:
            os.fdatasync(descriptor)  # pages just written are dirty: the kernel would keep those
        except OSError:
            pass  # a read-only file system: nothing there is dirty
        for start, end in ranges:
            os.posix_fadvise(descriptor, start, end - start, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(descriptor)


@functools.cache
def _libc_madvise():  # type: ignore[no-untyped-def]
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def _madvise(ranges: list[tuple[int, int]], advice: int) -> int:
    """``madvise`` each (address, length); how many the kernel took (0 off Linux)."""
    madvise = _libc_madvise()
    return 0 if madvise is None else sum(madvise(address, length, advice) == 0 for address, length in ranges)
