"""The classic engine: ONNX Runtime's training build (Module, Optimizer, CheckpointState).

Needs ``onnxruntime-training`` 1.19.2 (the last release; Linux x86_64 on Python 3.10-3.11, and
``onnxruntime-training-cpu`` for macOS, Windows and 3.12). Where it is installed, ``engine="auto"``
takes it; :mod:`ondevice.engines.portable` runs the same artifacts on stock ONNX Runtime.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ..session import LOSS_SCALE, ORT_VERSION, TRAINING_GRAPH, C, OrtValue, session_options

__all__ = ["OrtTraining", "available"]

_CPU = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0) if hasattr(C, "OrtDevice") else None


def available() -> bool:
    """Whether this ONNX Runtime is the training build (has the Module API)."""
    return hasattr(C, "Module") and hasattr(C, "load_checkpoint")


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
        frozen: Mapping[str, OrtValue] | None = None,
    ) -> None:
        """``frozen``: shared initializers for the graphs' frozen weights (:mod:`ondevice.frozen`; by
        default each session maps ``frozen.bin`` on its own)."""
        directory = Path(directory)
        self.graph = graph
        self.lean_memory = lean_memory
        self.with_eval = with_eval
        options = session_options(threads, lean_memory)
        self._frozen = dict(frozen or {})  # the sessions read these buffers: they live as long as this engine
        for name, value in self._frozen.items():
            options.add_initializer(name, value)
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

    def train_step(self, feeds: Sequence[np.ndarray], scale: float = 1.0, whole: bool = False) -> list[np.ndarray]:
        """One forward and backward pass; gradients add to the accumulated ones. ``scale`` multiplies
        this pass's gradients where the graph has the loss-scale input (a bundle's), else it must be 1.
        ``whole`` (this batch is a whole optimizer step) changes nothing here: the update is its own run."""
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

    # -- the engine protocol's state methods -------------------------------------------------------
    name = "classic"
    ort_version = ORT_VERSION
    update = "training build"

    def get_property(self, name: str) -> int | float | str | None:
        return self.state.get_property(name) if self.state.has_property(name) else None

    def write_checkpoint(self, path: Path, properties: Mapping[str, int | float | str]) -> None:
        """ORT's checkpoint bytes, optimizer state included, with ``properties`` added, to ``path``."""
        for key, value in properties.items():
            self.state.add_property(key, value)
        C.save_checkpoint(self.state, os.fspath(path), True)

    def export_model(self, path: Path, outputs: list[str]) -> None:
        self.module.export_model_for_inferencing(os.fspath(path), outputs)


def _numpy(values: C.OrtValueVector) -> list[np.ndarray]:
    # By index: iterating an OrtValueVector ends in a C++ IndexError, which for the digits step's
    # three outputs costs about ten times reading them by index (benchmarks/runtime.py).
    return [values[i].numpy() for i in range(len(values))]
