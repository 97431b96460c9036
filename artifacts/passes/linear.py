"""Linear layers as Gemm on their own weight, so the step keeps no transposed copy of it."""

from __future__ import annotations

import onnx
from onnx import helper

from ._nodes import int_constant

__all__ = ["linear_to_gemm"]


def linear_to_gemm(model: onnx.ModelProto) -> int:
    """Rewrite ``MatMul(x, Transpose(W))`` of a 2-D weight as ``Reshape(Gemm(Reshape(x), W, transB=1))``.

    PyTorch exports ``nn.Linear`` on an input of rank 3 or more as a Transpose of the weight
    feeding a MatMul. In training the weight is a graph input, so the Transpose runs every step
    and its output, a full copy of the weight, stays alive until the backward's MatMul gradient
    has used it: on MiniLM about 85 MB of transposed weights, whether the layers train or not.
    Gemm reads the weight transposed in place (``transB``) and its gradient uses the weight itself.
    The two Reshapes fold the leading dimensions into rows and back; values are the same GEMM.
    Returns the number of layers rewritten.
    """
    parameters = {i.name for i in model.graph.initializer if len(i.dims) == 2}
    transposes = {
        n.output[0]: n
        for n in model.graph.node
        if n.op_type == "Transpose" and n.input[0] in parameters and _perm(n) in (None, [1, 0])
    }
    uses: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    graph_outputs = {o.name for o in model.graph.output}
    rewritten: list[onnx.NodeProto] = []
    count = 0
    for node in model.graph.node:
        transpose = transposes.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if transpose is None:
            rewritten.append(node)
            continue
        x, weight, base = node.input[0], transpose.input[0], f"{node.output[0]}/odt_gemm"
        inner = int(next(i for i in model.graph.initializer if i.name == weight).dims[1])
        rewritten += [  # x as (rows, in_features), then the rows back into x's leading dimensions
            int_constant(f"{base}/rows", [-1, inner]),
            int_constant(f"{base}/zero", [0]),
            int_constant(f"{base}/minus_one", [-1]),
            helper.make_node("Shape", [x], [f"{base}/x_shape"], name=f"{base}/x_shape"),
            helper.make_node("Slice", [f"{base}/x_shape", f"{base}/zero", f"{base}/minus_one"], [f"{base}/lead"],
                             name=f"{base}/lead"),
            helper.make_node("Concat", [f"{base}/lead", f"{base}/minus_one"], [f"{base}/shape"], axis=0),
            helper.make_node("Reshape", [x, f"{base}/rows"], [f"{base}/x"], name=f"{base}/flatten"),
            helper.make_node("Gemm", [f"{base}/x", weight], [f"{base}/y"], name=base, transB=1),
            helper.make_node("Reshape", [f"{base}/y", f"{base}/shape"], list(node.output), name=f"{base}/unflatten"),
        ]  # fmt: skip
        uses[transpose.output[0]] -= 1
        count += 1
    dead = {out for out, t in transposes.items() if uses.get(out, 0) == 0 and out not in graph_outputs}
    del model.graph.node[:]
    model.graph.node.extend(n for n in rewritten if not (n.op_type == "Transpose" and n.output[0] in dead))
    return count


def _perm(node: onnx.NodeProto) -> list[int] | None:
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
