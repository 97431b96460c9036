"""Training engines behind one small protocol; :func:`open_engine` chooses one in one place.

- ``classic``: ONNX Runtime's training build (``onnxruntime-training`` 1.19.2), Module / Optimizer /
  CheckpointState over the artifacts' ``training_model.onnx`` and ``optimizer_model.onnx``.
- ``portable``: any current stock ``onnxruntime`` (1.19 and later), plain sessions over the portable
  graphs the generator writes beside them (``manifest.portable``).

``auto`` takes the classic engine where the training build is installed and the portable one
elsewhere. Both read and write ONNX Runtime's checkpoint format, so a checkpoint crosses engines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Protocol, Sequence

import numpy as np

from ..errors import ConfigError, EngineError
from ..manifest import Manifest
from ..session import OrtValue, training_graph

__all__ = ["Engine", "ENGINES", "open_engine", "installed_engines"]

ENGINES = ("auto", "classic", "portable")


class Engine(Protocol):
    """What the trainer needs from an engine: steps, parameters in and out, state to save.

    A step is ``train_step`` per micro-batch, then ``optimizer_step`` (or not, when it was not finite) and
    ``reset_grad``. ``whole=True`` tells ``train_step`` that its batch is the step's only one and the
    gradients will not be touched before ``optimizer_step``: an engine may then compute the update in the
    same run and apply it in ``optimizer_step``."""

    name: str
    ort_version: str
    update: str
    """how the optimizer update runs: ``"kernel"`` or ``"graph"`` (portable), ``"training build"`` (classic)"""
    with_eval: bool
    lean_memory: bool

    def train_step(self, feeds: Sequence[np.ndarray], scale: float = 1.0, whole: bool = False) -> list[np.ndarray]: ...
    def eval_step(self, feeds: Sequence[np.ndarray]) -> list[np.ndarray]: ...
    def optimizer_step(self) -> None: ...
    def reset_grad(self) -> None: ...
    def set_learning_rate(self, lr: float) -> None: ...
    def get_flat(self, trainable_only: bool = True) -> np.ndarray: ...
    def set_flat(self, flat: np.ndarray, trainable_only: bool = True) -> None: ...
    def get_parameter(self, name: str) -> np.ndarray: ...
    def parameter_view(self, name: str) -> np.ndarray: ...
    def gradient_view(self, name: str) -> np.ndarray | None: ...
    def set_parameter(self, name: str, value: np.ndarray) -> None: ...
    def get_property(self, name: str) -> int | float | str | None: ...
    def write_checkpoint(self, path: Path, properties: Mapping[str, int | float | str]) -> None: ...
    def export_model(self, path: Path, outputs: list[str]) -> None: ...


def installed_engines() -> tuple[str, ...]:
    """The engines this ONNX Runtime can run (the portable one always)."""
    from .classic import available

    return ("classic", "portable") if available() else ("portable",)


def resolve(engine: str, manifest: Manifest) -> str:
    """The engine ``engine`` names for these artifacts here, or a typed error saying why none can run."""
    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}.")
    installed = installed_engines()
    if engine == "auto":
        engine = "classic" if "classic" in installed and "classic" in manifest.engines else "portable"
    if engine == "classic" and "classic" not in manifest.engines:
        raise EngineError(
            "these artifacts carry no classic graphs: they were generated without ONNX Runtime's training build, "
            "which alone writes them. Use engine 'portable' (--engine portable, any ONNX Runtime), or regenerate "
            "them where onnxruntime-training 1.19.2 is installed."
        )
    if engine == "classic" and "classic" not in installed:
        raise EngineError(
            "the classic engine needs ONNX Runtime's training build (onnxruntime-training 1.19.2), and this "
            "environment has stock onnxruntime. Use engine 'portable' (--engine portable), or install "
            "'ondevice-training[classic]' in an environment without stock onnxruntime."
        )
    if engine == "portable" and not manifest.portable_files:
        reason = (manifest.portable or {}).get("unsupported")
        raise EngineError(
            "these artifacts carry no portable graphs"
            + (f": {reason}" if reason else " (generated before the portable engine existed)")
            + ". Regenerate them with `odt generate` (a current generator writes them when every operator lowers), "
            "or train them where onnxruntime-training 1.19.2 installs (--engine classic)."
        )
    return engine


def open_engine(
    directory: Path,
    manifest: Manifest,
    engine: str,
    checkpoint: Path,
    *,
    threads: int | None,
    lean_memory: bool,
    with_eval: bool,
    graph: str | None = None,
    frozen: Mapping[str, OrtValue] | None = None,
) -> Engine:
    """Create the engine ``engine`` (already resolved) over ``directory``, its state from ``checkpoint``;
    ``graph``: the training graph file (None: the variant this ORT runs fastest, else the plain graph);
    ``frozen``: shared initializers for its sessions (:class:`ondevice.frozen.FrozenWeights`)."""
    if engine == "classic":
        from .classic import OrtTraining

        return OrtTraining(directory, checkpoint=checkpoint, threads=threads, with_eval=with_eval,
                           lean_memory=lean_memory, graph=graph or training_graph(manifest.variants),
                           frozen=frozen)  # fmt: skip
    from .portable import PortableEngine

    return PortableEngine(directory, manifest, checkpoint, threads=threads, with_eval=with_eval,
                          lean_memory=lean_memory, graph=graph, frozen=frozen)  # fmt: skip
