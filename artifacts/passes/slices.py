"""Constant-index Gathers as Slice + Squeeze, whose gradient ORT 1.19 runs as a plain copy."""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

__all__ = ["gather_to_slice"]


def gather_to_slice(model: onnx.ModelProto) -> int:
    """Rewrite ``Gather(x, k)`` with a constant scalar index as ``Squeeze(Slice(x, k, k + 1))``.

    The exporter picks q/k/v and ``x[:, 0]`` with such Gathers, and ORT 1.19's CPU GatherGrad
    (a scatter into a zeroed tensor) took half of a transformer encoder's step (measured with
    ORT's profiler); Slice's gradient is a plain copy. Returns the number of rewrites.
    """
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    parameters = {i.name for i in model.graph.initializer}
    rewritten: list[onnx.NodeProto] = []
    count = 0
    for node in model.graph.node:
        index = constants.get(node.input[1]) if node.op_type == "Gather" else None
        if index is None or index.ndim != 0 or node.input[0] in parameters:
            rewritten.append(node)
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        k = int(index)
        base = f"{node.output[0]}/odt_slice"

        def ints(name: str, value: int) -> onnx.NodeProto:
            return helper.make_node(
                "Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64, [1], [value])
            )

        rewritten += [
            ints(f"{base}/start", k),
            ints(f"{base}/end", k + 1 if k != -1 else 2**62),
            ints(f"{base}/axis", axis),
            helper.make_node(
                "Slice", [node.input[0], f"{base}/start", f"{base}/end", f"{base}/axis"], [base], name=base
            ),
            helper.make_node("Squeeze", [base, f"{base}/axis"], list(node.output), name=f"{node.name}/odt_squeeze"),
        ]
        count += 1
    del model.graph.node[:]
    model.graph.node.extend(rewritten)
    return count
