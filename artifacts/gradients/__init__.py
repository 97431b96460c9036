"""The generator's own gradient builder: ONNX forward graph in, ONNX Runtime's training-graph form out,
with no training build installed.

``write_graphs`` appends the loss (:mod:`.loss_graphs`, standard ONNX), differentiates the graph
operator by operator (:mod:`.rules`, one registered rule each) and writes ``training_model.onnx``,
``eval_model.onnx`` and the checkpoint as ONNX Runtime's ``generate_artifacts`` lays them out. The
training graph speaks ORT's gradient vocabulary (``SoftmaxGrad_13``, ``ConvGrad``...), so the
registry's passes and the portable lowering (:mod:`artifacts.passes`) run on it unchanged; only the
portable graphs they produce are published when the training build is absent.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

import onnx
from onnx import numpy_helper

from ondevice.ort_checkpoint import CheckpointData, write_checkpoint

from ..losses import Loss
from .builder import differentiate, eval_graph, without_parameters
from .loss_graphs import attach_loss, loss_graph
from .rules import RULES

__all__ = ["write_graphs", "training_build", "RULES"]


def training_build() -> bool:
    """Whether ONNX Runtime's training build is installed (then ORT's own builder writes the classic graphs)."""
    from ondevice.engines.classic import available

    return available()


def write_graphs(
    forward: onnx.ModelProto,
    trainable: Sequence[str],
    frozen: Sequence[str],
    loss: Loss,
    loss_output: str,
    extra_outputs: Sequence[str],
    work: Path,
    describe: Callable[[str], str] = lambda node: node,
    stored: Sequence[str] | None = None,
) -> None:
    """Write ``training_model.onnx``, ``eval_model.onnx`` and ``checkpoint`` for ``forward`` into ``work``; the
    checkpoint holds the trainable tensors and the frozen ones in ``stored`` (default: all of them)."""
    model, parameters = without_parameters(forward, [*trainable, *frozen])  # the graphs read them as inputs
    attached = loss_graph(loss, model, loss_output)
    attach_loss(model, attached)
    model.graph.input.extend(parameters)  # after the feeds and the target, as ORT orders them
    outputs = [o for o in extra_outputs if o != attached.output]
    onnx.save(differentiate(model, attached, trainable, frozen, outputs, describe), work / "training_model.onnx")
    onnx.save(eval_graph(model, [attached.output, *outputs]), work / "eval_model.onnx")
    del model
    values = {t.name: t for t in forward.graph.initializer}
    kept = set(frozen if stored is None else stored)
    state = CheckpointData(
        trainable={n: numpy_helper.to_array(values[n]) for n in trainable},
        frozen={n: numpy_helper.to_array(values[n]) for n in frozen if n in values and n in kept},
    )
    partial = work / "checkpoint.partial"
    partial.write_bytes(write_checkpoint(state))
    os.replace(partial, work / "checkpoint")
