"""One graph for a whole training step: the portable training graph and the optimizer update, fused.

A runtime that calls ONNX Runtime through a JavaScript or mobile binding pays a fixed cost per run
(tensors copied into and out of the runtime's memory): measured in onnxruntime-web 1.30 on the
digits bundle, the optimizer's run took 0.46-0.67 ms of a 1.0-1.55 ms step (one-off runs), for an
update of a few microseconds. The fused graph does a step in one run: parameters, moments, the rates and a batch in;
the loss, the outputs and the updated vectors out. The gradients stay inside. (Micro-batches still
need the two graphs: their gradients add up before one update.)
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ondevice.engines.contract import OPTIMIZER_STATE, gradient_output
from ondevice.manifest import Manifest

__all__ = ["fuse_step"]

FLAT = "odt.step.flat_shape"


def fuse_step(training: onnx.ModelProto, optimizer: onnx.ModelProto, manifest: Manifest) -> onnx.ModelProto:
    """The training graph followed by the update: each trainable parameter and its gradient flattened and
    concatenated in the manifest's order into the optimizer's ``odt.parameters`` and ``odt.gradients``."""
    fused = onnx.ModelProto()
    fused.CopyFrom(training)
    graph, update = fused.graph, optimizer.graph
    names = [p.name for p in manifest.trainable]
    gradients = {gradient_output(n) for n in names}
    kept = [o for o in graph.output if o.name not in gradients]
    del graph.output[:]
    graph.output.extend([*kept, *update.output])
    graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), FLAT))
    for flat, sources in ((OPTIMIZER_STATE[0], names), (OPTIMIZER_STATE[1], [gradient_output(n) for n in names])):
        pieces = []
        for source in sources:
            pieces.append(f"{flat}/{source}")
            graph.node.append(helper.make_node("Reshape", [source, FLAT], [pieces[-1]]))
        graph.node.append(helper.make_node("Concat", pieces, [flat], axis=0))
    fed = {i.name for i in graph.input}
    graph.input.extend(i for i in update.input if i.name not in fed and i.name not in OPTIMIZER_STATE[:2])
    graph.initializer.extend(update.initializer)
    graph.node.extend(update.node)
    graph.name = "odt_step"
    return fused
