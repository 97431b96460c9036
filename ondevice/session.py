"""Torch-free import of ONNX Runtime (stock or the training build), with quiet sessions.

`import onnxruntime` in the training wheel probes `onnxruntime.training.ortmodule`, which
imports torch whenever torch is installed (about a second and a few hundred MB). A device
runtime must not pay that, so the probe is made to fail fast while onnxruntime loads, and
the C bindings are used directly instead of `onnxruntime.training.api` (whose package
`__init__` imports torch too).
"""

from __future__ import annotations

import base64
import functools
import importlib.abc
import re
import sys
from typing import Mapping

import numpy as np


class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        # onnxruntime.training is the probe's way to torch (and to onnx, another 80 ms).
        if name in ("torch", "onnxruntime.training") or name.startswith(("torch.", "onnxruntime.training.")):
            raise ModuleNotFoundError(f"torch is hidden while the ondevice runtime loads ({name})")
        return None


_DISTRIBUTIONS = ("onnxruntime", "onnxruntime_training", "onnxruntime_training_cpu")


def _check_distributions(package: object) -> None:
    """One ONNX Runtime distribution beside the package it installed, or a typed error that says how to
    repair the environment. A glob of one directory: importlib.metadata took 76 ms of every cold start."""
    from pathlib import Path

    from .errors import EngineError

    site = Path(str(getattr(package, "__file__", ""))).parent.parent
    found = sorted({p.name.split("-")[0] for p in site.glob("onnxruntime*.dist-info")} & set(_DISTRIBUTIONS))
    if len(found) > 1:
        raise EngineError(
            f"two ONNX Runtime distributions are installed ({', '.join(found)}); they share the onnxruntime package "
            "and overwrite each other. Uninstall all of them, then install one: ondevice-training[device] or [classic]."
        )


def _no_onnxruntime() -> Exception:
    from .errors import EngineError

    return EngineError(
        "no ONNX Runtime is installed. Install the device runtime with "
        "pip install 'ondevice-training[device]' (stock onnxruntime, every platform), or "
        "'ondevice-training[classic]' for the training build (Linux x86_64, Python 3.11)."
    )


def _import_onnxruntime():  # type: ignore[no-untyped-def]
    if "onnxruntime" in sys.modules or "torch" in sys.modules:
        try:
            import onnxruntime
        except ModuleNotFoundError:
            raise _no_onnxruntime() from None
        _check_distributions(onnxruntime)
        return onnxruntime
    blocker = _NoTorch()
    sys.meta_path.insert(0, blocker)
    try:
        import onnxruntime
    except ModuleNotFoundError as exc:
        if exc.name != "onnxruntime":
            raise
        raise _no_onnxruntime() from None
    finally:
        sys.meta_path.remove(blocker)
        for name in [n for n in sys.modules if n.startswith("onnxruntime.training")]:
            del sys.modules[name]  # half-imported by the probe; a later real import starts clean
    _check_distributions(onnxruntime)
    return onnxruntime


ort = _import_onnxruntime()
from onnxruntime.capi import _pybind_state as C  # noqa: E402
from onnxruntime.capi.onnxruntime_inference_collection import OrtValue  # noqa: E402

__all__ = ["ort", "C", "OrtValue", "ORT_VERSION", "set_seed", "process_status", "session_options", "check_threads",
           "ort_error_message", "training_graph", "nchwc_block_size", "TRAINING_GRAPH", "LOSS_SCALE",
           "NCHWC"]  # fmt: skip

C.set_default_logger_severity(3)  # errors only: ORT's INFO/WARNING flood is not for users
set_seed = C.set_seed
"""Seed ORT's process-wide generator (Dropout masks) in either build."""

ORT_VERSION: str = ort.__version__


def ort_error_message(exc: BaseException) -> str:
    """The human part of an ORT error, without the C++ source path and function signature."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    for marker in ("] : ", "was false. "):
        if marker in text:
            text = text.rsplit(marker, 1)[1]
    text = re.sub(r"^\d+ : [A-Z_]+ : ", "", text)  # status code and name
    # "/onnxruntime_src/.../model.cc:165 onnxruntime::Model::Model(...) " -> ""
    text = re.sub(r"\s*/onnxruntime_src\S*:\d+\s+(?:[\w:~<>,&* ]+\([^()]*\)\s*)?", " ", text)
    text = re.sub(r"^[\w/.-]+\.(?:cc|cpp|h):\d+\s+(?:[\w:~]+\s+)?", "", text)  # "checkpoint.cc:231 ToFile "
    return re.sub(r"^/\S+:\d+ ", "", text).strip()[:400]


TRAINING_GRAPH = "training_model.onnx"
LOSS_SCALE = "odt_loss_scale"
"""A bundle's training graph input that scales the loss gradient (``mobile_bridge/loss_scale.py``):
runtimes that cannot reach the gradient buffers feed ``part / batch`` to accumulate micro-batches."""
NCHWC = "nchwc"
"""The variant training graph whose depthwise convolutions run on ORT's x86 NCHWc kernels
(``artifacts/passes/nchwc.py``); the manifest's ``variants`` names its file."""
_NCHWC_PROBE = base64.b64decode(
    "CAgSA29kdDpgCikKAXgSAXkiDFJlb3JkZXJJbnB1dDoTY29tLm1pY3Jvc29mdC5uY2h3YxILbmNod2NfcHJvYmVaGwoBeBIWChQIARIQCgIIAQoC"
    "CAQKAggBCgIIAWIJCgF5EgQKAggBQgQKABARQhcKE2NvbS5taWNyb3NvZnQubmNod2MQAQ=="
)
"""One ``ReorderInput`` (com.microsoft.nchwc) of a [1, 4, 1, 1] input, serialized by onnx 1.17 (rebuilt
and compared in tests/artifacts/test_nchwc.py): its output has the block size as channels."""


@functools.cache
def nchwc_block_size() -> int:
    """The channel block of this ORT's NCHWc kernels (8 with AVX2, 16 with AVX-512), or 0 where the
    build has none (ORT 1.19 has them on x86 only)."""
    try:
        probe = ort.InferenceSession(_NCHWC_PROBE, session_options(1), providers=["CPUExecutionProvider"])
        (blocked,) = probe.run(None, {"x": np.ones((1, 4, 1, 1), np.float32)})
        return int(blocked.shape[1])
    except Exception:
        return 0


def training_graph(variants: Mapping[str, str], default: str = TRAINING_GRAPH) -> str:
    """The training graph file this runtime should load: the NCHWc variant where ORT has the kernels
    (the variant's channel counts are multiples of 16, so any block of 4, 8 or 16 divides them), else
    ``default``."""
    return variants[NCHWC] if NCHWC in variants and nchwc_block_size() in (4, 8, 16) else default


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_RETURN_ABOVE = 128 * 1024


def process_status(field: str) -> int | None:
    """A size in bytes from Linux's ``/proc/self/status`` (``VmRSS``, ``VmHWM``), None elsewhere."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@functools.cache
def return_freed_memory() -> bool:
    """Make glibc give freed blocks of 128 KiB and more back to the system at once (Linux only).

    Without ORT's arena, activations are malloc'd and freed every step, in sizes that change with
    each batch's text length. glibc raises its mmap threshold after the first large free, so later
    activations come from the heap, whose top stays mapped: on MiniLM LoRA (micro-batches of 4,
    Spanish commands) ``odt train``'s peak grew from 151 MiB after the first steps to 213 MiB over an
    epoch. With fixed thresholds it stayed at 188 MiB; the epoch took 44.7 s against 46.7 s
    (one run each). Process-wide and only ever lowering what stays resident, so it is set once,
    by the first lean session. Returns whether it was applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt  # glibc; musl has no mallopt and already returns large blocks
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _RETURN_ABOVE) and mallopt(_M_TRIM_THRESHOLD, _RETURN_ABOVE))


def check_threads(threads: object) -> int:
    """``threads`` as an intra-op thread count, or a ConfigError: 1 to 4 per core of this machine
    (``--threads 5000`` made ORT start thousands of threads and hang; ``-1`` was taken)."""
    import os

    from .errors import ConfigError

    most = 4 * (os.cpu_count() or 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= most:
        raise ConfigError(f"threads must be a whole number from 1 to {most} (4 per core here), got {threads!r}. "
                          "Leave it out to let ONNX Runtime choose.")  # fmt: skip
    return threads


def session_options(threads: int | None = None, lean_memory: bool = False) -> C.SessionOptions:
    """Session options with ORT logging at errors only and an optional intra-op thread count.

    ``lean_memory`` turns ORT's CPU memory arena off: freed activations go back to the system
    instead of a pool that grows in doubling chunks. Measured on MiniLM (seq 64, batch 16, 2
    threads): peak RSS 932 -> 751-766 MB with every weight training (step ~15 % slower), 540 ->
    369-407 MB with LoRA (step time unchanged within noise).
    """
    options = C.SessionOptions()
    options.log_severity_level = 3
    options.enable_cpu_mem_arena = not lean_memory
    if lean_memory:
        return_freed_memory()
    if threads is not None:
        options.intra_op_num_threads = check_threads(threads)
        options.inter_op_num_threads = 1
    return options
