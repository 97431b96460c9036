"""Broadcast inputs of ``Where`` expanded first, so that their gradients sum over the broadcast axes.

ORT 1.19's gradient of ``Where(condition, X, Y)`` passes ``dOutput`` masked by the condition
straight to ``X`` and ``Y``, at the output's shape: an input that was broadcast gets a gradient of
the wrong shape. T5 masks its relative position bias ``[1, heads, q, k]`` with a ``[batch, 1, q,
k]`` mask this way, and the step failed inside ORT ("Dimension of input 0 must be 1 instead of 4").
Here such an input goes through ``Expand`` to the broadcast shape first: the forward values are
the same, and ORT's gradient of ``Expand`` is the sum over the expanded axes that was missing.

The broadcast shape is the elementwise maximum of the three inputs' shapes, each padded with
leading ones to the output's rank (computed in the graph: the shapes may be dynamic).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["expand_where_inputs"]


def _dims(value: onnx.ValueInfoProto) -> list[int | str | None]:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in value.type.tensor_type.shape.dim]


def _broadcast(dims: list[int | str | None] | None, out: list[int | str | None]) -> bool:
    """Whether an input of ``dims`` is broadcast to ``out`` (unknown shapes count as broadcast)."""
    if dims is None or len(dims) != len(out):
        return True
    return any(d != o and (d == 1 or d is None or o is None) for d, o in zip(dims, out))


def expand_where_inputs(model: onnx.ModelProto) -> list[str]:
    """Expand the broadcast float inputs of every ``Where`` that is not a constant; returns the nodes changed."""
    graph = model.graph
    shapes = {v.name: _dims(v) for v in (*graph.input, *graph.value_info, *graph.output)
              if v.type.tensor_type.HasField("shape")}  # fmt: skip
    real = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    floats = {v.name for v in (*graph.input, *graph.value_info, *graph.output) if v.type.tensor_type.elem_type in real}
    floats |= {i.name for i in graph.initializer if i.data_type in real}  # a weight may be masked directly
    shapes |= {i.name: list(i.dims) for i in graph.initializer}
    constants = {o for n in graph.node if n.op_type == "Constant" for o in n.output}  # no gradient to give
    nodes, changed, added = [], [], []
    for node in graph.node:
        out = shapes.get(node.output[0]) if node.op_type == "Where" else None
        if out is None:
            nodes.append(node)
            continue
        targets = [i for i in (1, 2) if node.input[i] in floats and node.input[i] not in constants
                   and _broadcast(shapes.get(node.input[i]), out)]  # fmt: skip
        if not targets:
            nodes.append(node)
            continue
        ranks = [len(shapes[name]) if name in shapes else None for name in node.input]
        if None in ranks:  # left as it is: verification against PyTorch tells whether it trains right
            nodes.append(node)
            continue
        prefix = f"{node.name or node.output[0]}.expanded"
        padded = []
        for index, (name, rank) in enumerate(zip(node.input, ranks)):
            shape = f"{prefix}.shape{index}"
            nodes.append(helper.make_node("Shape", [name], [shape]))
            if rank < len(out):
                ones = numpy_helper.from_array(np.ones(len(out) - rank, np.int64), f"{prefix}.ones{index}")
                added.append(ones)
                nodes.append(helper.make_node("Concat", [ones.name, shape], [f"{shape}.padded"], axis=0))
                shape = f"{shape}.padded"
            padded.append(shape)
        target = f"{prefix}.target"
        nodes.append(helper.make_node("Max", padded, [target]))
        inputs = list(node.input)
        for i in targets:
            inputs[i] = f"{prefix}.input{i}"
            nodes.append(helper.make_node("Expand", [node.input[i], target], [inputs[i]]))
        rewritten = onnx.NodeProto()
        rewritten.CopyFrom(node)
        del rewritten.input[:]
        rewritten.input.extend(inputs)
        nodes.append(rewritten)
        changed.append(node.name)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(added)
    return changed
