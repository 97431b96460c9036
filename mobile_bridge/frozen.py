"""Frozen weights back into the checkpoint, for runtimes that cannot memory-map ``frozen.bin``.

Artifacts keep frozen weights in ``frozen.bin`` as ONNX external data (see ``artifacts.frozen``).
onnxruntime-web and the mobile packages load graphs and checkpoints from bytes, and an ORT-format
graph would hold its initializers itself (twice: training and eval). A bundle therefore carries
them as ORT always did: frozen parameters in the checkpoint, graph inputs in every graph.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ondevice import Manifest, Trainer
from ondevice.session import C

__all__ = ["internalize_frozen"]


def internalize_frozen(source: Path, work: Path, manifest: Manifest, graphs: tuple[str, ...], trainer: Trainer) -> None:
    """Write ``graphs`` and ``checkpoint`` of ``source`` into ``work`` with every frozen weight of
    ``frozen.bin`` back in the checkpoint (``trainer``, over ``source``, reads them)."""
    assert manifest.frozen_file is not None, "artifacts without frozen.bin are copied as they are"
    offsets, shapes = manifest.frozen_file["offsets"], {p.name: p.shape for p in manifest.frozen}
    for graph in graphs:
        model = onnx.load(source / graph, load_external_data=False)
        kept = [i for i in model.graph.initializer if i.name not in offsets]
        used = {name for node in model.graph.node for name in node.input}
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
        model.graph.input.extend(
            helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, shapes[n]) for n in offsets if n in used
        )
        onnx.save(model, work / graph)
    trainable = {p.name for p in manifest.trainable}
    names = [p.name for p in (*manifest.trainable, *manifest.frozen)]

    def proto(name: str) -> bytes:
        return numpy_helper.from_array(np.ascontiguousarray(trainer.parameter(name)), name).SerializeToString()

    trained = [proto(n) for n in names if n in trainable]
    frozen = [proto(n) for n in names if n not in trainable]
    C.save_checkpoint(trained, frozen, str(work / "checkpoint"), False)
