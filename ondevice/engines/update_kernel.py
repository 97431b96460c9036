"""The optimizer update as one native pass over the flat vectors, where this platform has the library.

The update graph (``artifacts/portable_optimizer.py``) is twelve element-wise passes over every trained value,
each at the speed of a numpy pass; ONNX Runtime's training build makes one (``AdamWOptimizer``). This module
loads ``ondevice/kernels/<platform>/libodt_update.so`` (``ondevice/kernels/update.c``, built per platform by the
wheel's build backend) with ctypes and runs AdamW or SGD in one pass, the graph's float32 operations in the
graph's order: the results are the graph's bit for bit (tested). One thread, the caller's, as the update graph
runs. Measured on AMD EPYC (one thread, medians of 21 interleaved runs): 235 k values 0.050 against 0.373 ms
for the graph, 2.3 M 1.09 against 4.90, 22.7 M 10.5 against 45.4 (``docs/engineering-notes.md``).

Before first use the library's AdamW and SGD are run on a short vector and compared with :func:`adamw` and
:func:`sgd` (numpy, the same operations); a library that cannot load, has another ABI or computes other bits
is not used, and the engine runs the update graph. ``ODT_UPDATE_KERNEL=0`` asks for the graph. Where no
library is built (macOS, Windows; browsers and phones never load this), the graph runs too.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["UpdateKernel", "Bound", "load", "status", "adamw", "sgd", "ENV"]

ENV = "ODT_UPDATE_KERNEL"
"""Set to ``0`` to run the update graph even where the kernel loads (benchmarks' A/B, a suspected fault)."""
ABI = 1
LIBRARY = Path(__file__).resolve().parents[1] / "kernels" / f"{sys.platform}-{platform.machine().lower()}" / \
    "libodt_update.so"  # fmt: skip
ISAS = ("baseline", "AVX2", "AVX-512")

_F = ctypes.c_float
_P = ctypes.c_void_p
f32 = np.float32


def adamw(w: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, *, betas: tuple[float, float], eps: float,
          lr_corrected: float, lr_decay: float, clip: float = 1.0) -> None:  # fmt: skip
    """AdamW in place, in numpy: the update graph's operations (the kernel's self-check and tests' reference)."""
    b1, b2 = f32(betas[0]), f32(betas[1])
    gi = g * f32(clip)
    m[...] = m * b1 + gi * (f32(1) - b1)
    v[...] = v * b2 + (gi * (f32(1) - b2)) * gi
    moved = w - (m * f32(lr_corrected)) / (np.sqrt(v) + f32(eps))
    w[...] = moved - moved * f32(lr_decay) if f32(lr_decay) != 0 else moved


def sgd(w: np.ndarray, g: np.ndarray, *, lr: float, clip: float = 1.0) -> None:
    """SGD in place, in numpy: ``w - (g clip) lr``."""
    w[...] = w - (g * f32(clip)) * f32(lr)


class UpdateKernel:
    """The loaded library. Every array is a contiguous float32 vector of one length; ``w``, ``m`` and ``v`` are
    updated in place."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._adamw, self._sgd, self._squares = library.odt_adamw, library.odt_sgd, library.odt_sum_squares
        self._adamw.argtypes = [_P, _P, _P, _P, ctypes.c_size_t, *[_F] * 8]
        self._sgd.argtypes = [_P, _P, ctypes.c_size_t, _F, _F]
        self._squares.argtypes = [_P, ctypes.c_size_t]
        self._squares.restype = ctypes.c_double
        for function in (self._adamw, self._sgd):
            function.restype = None
        self.isa = ISAS[library.odt_isa()]

    def bind_adamw(self, w: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, *, betas: tuple[float, float],
                   eps: float) -> Bound:  # fmt: skip
        """AdamW over these vectors, checked and converted once: ``step(lr_corrected, lr_decay, clip)`` (a step of
        digits' 17 k values spent 4 of its 9 us of update in the checks and conversions)."""
        _check(w, g, m, v)
        b1, b2 = f32(betas[0]), f32(betas[1])
        return Bound(self._adamw, (w, g, m, v), (w.size, b1, f32(1) - b1, b2, f32(1) - b2, f32(eps)))

    def bind_sgd(self, w: np.ndarray, g: np.ndarray) -> Bound:
        """SGD over these vectors: ``step(lr, clip)``."""
        _check(w, g)
        return Bound(self._sgd, (w, g), (w.size,))

    def adamw(self, w: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, *, betas: tuple[float, float],
              eps: float, lr_corrected: float, lr_decay: float, clip: float = 1.0) -> None:  # fmt: skip
        self.bind_adamw(w, g, m, v, betas=betas, eps=eps)(f32(lr_corrected), f32(lr_decay), f32(clip))

    def sgd(self, w: np.ndarray, g: np.ndarray, *, lr: float, clip: float = 1.0) -> None:
        self.bind_sgd(w, g)(f32(lr), f32(clip))

    def clip_coefficient(self, g: np.ndarray, max_norm: float) -> float:
        """``min(max_norm / (||g|| + 1e-6), 1)`` in float32, as the clipping graph computes it (the sum of squares
        in double, where the graph sums float32 in its own order: the last bit may differ)."""
        _check(g)
        norm = np.sqrt(f32(self._squares(g.ctypes.data, g.size)))
        return float(min(f32(max_norm) / (norm + f32(1e-6)), f32(1)))


class Bound:
    """A kernel function with its vectors' addresses and fixed arguments; calling it with the step's rates runs
    it. It holds the vectors, so their memory outlives it."""

    __slots__ = ("_run", "_vectors", "_fixed")

    def __init__(self, run: Callable[..., None], vectors: tuple[np.ndarray, ...], fixed: tuple) -> None:
        self._run, self._vectors = run, vectors
        self._fixed = (*(vector.ctypes.data for vector in vectors), *fixed)

    def __call__(self, *rates: float) -> None:
        self._run(*self._fixed, *rates)


def _check(*arrays: np.ndarray) -> None:
    size = arrays[0].size
    for array in arrays:
        if array.dtype != np.float32 or not array.flags.c_contiguous or array.size != size:
            raise ValueError(f"the update kernel takes contiguous float32 vectors of one length, got "
                             f"{array.dtype} {array.shape} (contiguous: {array.flags.c_contiguous})")  # fmt: skip


def _agrees(kernel: UpdateKernel) -> bool:
    """The library's AdamW (with and without decay, clipped) and SGD give numpy's bits on 67 values (a vector
    loop and its tail), over magnitudes from 1e-6 to 1e3."""
    rng = np.random.default_rng(0)
    draw = lambda: (rng.standard_normal(67) * 10.0 ** rng.uniform(-6, 3, 67)).astype(np.float32)  # noqa: E731
    for decay, clip in ((1e-5, 1.0), (0.0, 0.37)):
        ours = [draw(), draw(), draw(), np.abs(draw())]
        theirs = [a.copy() for a in ours]
        options = dict(betas=(0.9, 0.999), eps=1e-8, lr_corrected=7e-4, lr_decay=decay, clip=clip)
        kernel.adamw(*ours, **options)
        adamw(*theirs, **options)
        kernel.sgd(ours[0], ours[1], lr=0.01, clip=clip)
        sgd(theirs[0], theirs[1], lr=0.01, clip=clip)
        if not all(np.array_equal(a, b) for a, b in zip(ours, theirs)):
            return False
    return True


@functools.cache
def _load(path: Path) -> tuple[UpdateKernel | None, str]:
    if not path.is_file():
        return None, f"no update kernel is built for {path.parent.name} (the update graph runs)"
    try:
        library = ctypes.CDLL(os.fspath(path))
        if library.odt_abi() != ABI:
            return None, f"{path} has ABI {library.odt_abi()}, this runtime wants {ABI} (the update graph runs)"
        kernel = UpdateKernel(library)
    except (OSError, AttributeError) as exc:
        return None, f"{path} does not load ({exc}); the update graph runs"
    if not _agrees(kernel):
        return None, f"{path} computes other bits than the update graph on this machine; the update graph runs"
    return kernel, f"native update kernel ({kernel.isa})"


def load(path: Path = LIBRARY) -> UpdateKernel | None:
    """The kernel, or None where it is absent, does not load, fails its self-check or ``ODT_UPDATE_KERNEL=0``."""
    if os.environ.get(ENV, "1") == "0":
        return None
    return _load(path)[0]


def status(path: Path = LIBRARY) -> str:
    """One line: which update the portable engine runs here, and why."""
    if os.environ.get(ENV, "1") == "0":
        return f"the update graph ({ENV}=0)"
    return _load(path)[1]
