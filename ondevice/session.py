"""Torch-free access to ONNX Runtime's training C API (Module, Optimizer, CheckpointState).

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
import os
import re
import sys
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np


class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        # onnxruntime.training is the probe's way to torch (and to onnx, another 80 ms).
        if name in ("torch", "onnxruntime.training") or name.startswith(("torch.", "onnxruntime.training.")):
            raise ModuleNotFoundError(f"torch is hidden while the ondevice runtime loads ({name})")
        return None


def _import_onnxruntime():  # type: ignore[no-untyped-def]
    if "onnxruntime" in sys.modules or "torch" in sys.modules:
        import onnxruntime

        return onnxruntime
    blocker = _NoTorch()
    sys.meta_path.insert(0, blocker)
    try:
        import onnxruntime
    finally:
        sys.meta_path.remove(blocker)
        for name in [n for n in sys.modules if n.startswith("onnxruntime.training")]:
            del sys.modules[name]  # half-imported by the probe; a later real import starts clean
    return onnxruntime


ort = _import_onnxruntime()
from onnxruntime.capi import _pybind_state as C  # noqa: E402
from onnxruntime.capi.onnxruntime_inference_collection import OrtValue  # noqa: E402

C.set_default_logger_severity(3)  # errors only: ORT's INFO/WARNING flood is not for users

ORT_VERSION: str = ort.__version__
_CPU = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)


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


def training_graph(variants: Mapping[str, str]) -> str:
    """The training graph file this runtime should load: the NCHWc variant where ORT has the kernels
    (the variant's channel counts are multiples of 16, so any block of 4, 8 or 16 divides them)."""
    return variants[NCHWC] if NCHWC in variants and nchwc_block_size() in (4, 8, 16) else TRAINING_GRAPH


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
    if threads is not None:
        options.intra_op_num_threads = int(threads)
        options.inter_op_num_threads = 1
    return options


class OrtTraining:
    """The three ORT training objects over one artifact directory, with numpy in and out.

    This is the thin layer every trainer uses; it checks nothing (callers validate first).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        checkpoint: str | os.PathLike[str] | None = None,
        threads: int | None = None,
        with_optimizer: bool = True,
        with_eval: bool = True,
        lean_memory: bool = False,
        graph: str = TRAINING_GRAPH,
    ) -> None:
        directory = Path(directory)
        self.graph = graph
        self.lean_memory = lean_memory
        self.with_eval = with_eval
        options = session_options(threads, lean_memory)
        self.state = C.load_checkpoint(os.fspath(checkpoint or directory / "checkpoint"))
        self.module = C.Module(
            os.fspath(directory / graph),
            self.state,
            os.fspath(directory / "eval_model.onnx") if with_eval else None,  # see Trainer.load(evaluation=)
            _CPU,
            options,
        )
        self.optimizer = (
            C.Optimizer(os.fspath(directory / "optimizer_model.onnx"), self.state, _CPU, options)
            if with_optimizer
            else None
        )
        names = self.input_names()
        self._scale_at = names.index(LOSS_SCALE) if LOSS_SCALE in names else None

    def train_step(self, feeds: Sequence[np.ndarray], scale: float = 1.0) -> list[np.ndarray]:
        """One forward and backward pass; gradients add to the accumulated ones. ``scale`` multiplies
        this pass's gradients where the graph has the loss-scale input (a bundle's), else it must be 1."""
        feeds = list(feeds)
        if self._scale_at is not None:
            feeds.insert(self._scale_at, np.array(scale, np.float32))
        elif scale != 1.0:
            raise ValueError(f"this training graph has no {LOSS_SCALE} input to scale its gradients by {scale}")
        fetches = C.OrtValueVector()
        self.module.train_step(feeds, fetches)
        return _numpy(fetches)

    def eval_step(self, feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
        fetches = C.OrtValueVector()
        self.module.eval_step(list(feeds), fetches)
        return _numpy(fetches)

    def optimizer_step(self) -> None:
        assert self.optimizer is not None, "created without an optimizer"
        self.optimizer.optimizer_step()

    def reset_grad(self) -> None:
        self.module.lazy_reset_grad()

    def set_learning_rate(self, lr: float) -> None:
        assert self.optimizer is not None, "created without an optimizer"
        self.optimizer.set_learning_rate(float(lr))

    def get_flat(self, trainable_only: bool = True) -> np.ndarray:
        size = self.module.get_parameters_size(trainable_only)
        buffer = OrtValue.ortvalue_from_shape_and_type([size], np.float32, "cpu", 0)
        self.module.copy_parameters_to_buffer(buffer._ortvalue, trainable_only)
        return buffer.numpy()

    def set_flat(self, flat: np.ndarray, trainable_only: bool = True) -> None:
        value = OrtValue.ortvalue_from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
        self.module.copy_buffer_to_parameters(value._ortvalue, trainable_only)

    def get_parameter(self, name: str) -> np.ndarray:
        return np.array(self.state.get_parameter(name).data.numpy())

    def get_gradient(self, name: str) -> np.ndarray | None:
        view = self.gradient_view(name)
        return None if view is None else view.copy()

    def gradient_view(self, name: str) -> np.ndarray | None:
        """The accumulated gradient of ``name`` as a writable numpy view of ORT's own buffer."""
        grad = self.state.get_parameter(name).grad
        return grad.numpy() if grad.has_value() else None

    def parameter_view(self, name: str) -> np.ndarray:
        """The parameter's current value as a numpy view of ORT's buffer (read it, do not keep it)."""
        return self.state.get_parameter(name).data.numpy()

    def set_parameter(self, name: str, value: np.ndarray) -> None:
        self.state.copy_parameter_from(name, OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value))._ortvalue)

    def input_names(self, training: bool = True) -> list[str]:
        return list(self.module.input_names(training))

    def output_names(self, training: bool = True) -> list[str]:
        return list(self.module.output_names(training))


def _numpy(values: C.OrtValueVector) -> list[np.ndarray]:
    # By index: iterating an OrtValueVector ends in a C++ IndexError, which for the digits step's
    # three outputs costs about ten times reading them by index (benchmarks/runtime.py).
    return [values[i].numpy() for i in range(len(values))]
