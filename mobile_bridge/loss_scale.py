"""A bundle's training graph takes the loss gradient's seed as an input, for micro-batches.

ORT's training graph starts its backward pass from a constant: the gradient of the loss, 1. The
Python runtime accumulates micro-batches and divides the summed gradients in place through
numpy views of ORT's buffers; ONNX Runtime Web and the mobile training APIs give no access to
those buffers, and ORT-web refuses to feed a constant. So a bundle's graph reads the seed from a
scalar input instead: a runtime feeds 1 for a whole batch, and ``part / batch`` for each part of a
batch trained as micro-batches (mean losses), and the accumulated gradients are the whole batch's.
Fed 1, the graph computes what it computed before, bit for bit.
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from ondevice.session import LOSS_SCALE

from .errors import BundleError

__all__ = ["expose_loss_scale"]


def expose_loss_scale(model: onnx.ModelProto, loss_output: str, feeds: list[str]) -> None:
    """Turn the seed initializer ``<loss_output>_grad`` of ``model`` into the scalar input
    :data:`~ondevice.session.LOSS_SCALE`, placed after the ``feeds`` inputs (in place)."""
    graph = model.graph
    seed = f"{loss_output}_grad"
    found = [i for i in graph.initializer if i.name == seed]
    if len(found) != 1 or numpy_helper.to_array(found[0]).tolist() != 1.0:
        raise BundleError(f"the training graph has no loss-gradient seed {seed!r} equal to 1; regenerate the artifacts")
    graph.initializer.remove(found[0])
    for node in graph.node:
        node.input[:] = [LOSS_SCALE if name == seed else name for name in node.input]
    names = [i.name for i in graph.input]
    position = max(names.index(name) for name in feeds) + 1
    graph.input.insert(position, helper.make_tensor_value_info(LOSS_SCALE, onnx.TensorProto.FLOAT, []))
