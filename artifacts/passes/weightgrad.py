"""A weight used at every step of an unrolled recurrence: its gradient as one Gemm, not one per step.

ORT's gradient builder gives each use of a weight its own partial gradient and sums them: for the
recurrent weight of an LSTM unrolled over 20 steps, 20 Gemms ``dY_tᵀ · X_t`` whose inner
dimension is only the batch (32), then a Sum of 20 weight-sized tensors, all alive at once; its
bias gets 20 ReduceSums and a Sum. Measured on the next-word LSTM (ORT's profiler, 2 threads):
those Gemms and the Sum took 5.1 ms of the step, against about 1 ms for one Gemm of the same
products. The sum of the products is one product of the stacked rows::

    Σ_t dY_tᵀ · X_t  =  [dY_1; ...; dY_n]ᵀ · [X_1; ...; X_n]
    Σ_t ReduceSum_0(dY_t)  =  ReduceSum_0([dY_1; ...; dY_n])

so the pass concatenates the per-step operands along the rows and runs one Gemm (one ReduceSum):
the same products, added in another order. It rewrites only a Sum whose every input is such a
Gemm (transposed first operand, no bias, alpha 1) or such a ReduceSum (over the leading axis, the
same axes for all), used by that Sum alone. Verification against PyTorch covers it.
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from ._nodes import attributes

__all__ = ["batch_weight_gradients"]

MIN_PARTS = 3
"""Fewer partial gradients than this are left alone (a weight used twice: nothing to win)."""


def _is_weight_gemm(node: onnx.NodeProto) -> bool:
    a = attributes(node)
    return (node.op_type == "Gemm" and len(node.input) == 2 and a.get("transA") == 1 and not a.get("transB", 0)
            and a.get("alpha", 1.0) == 1.0)  # fmt: skip


def batch_weight_gradients(training: onnx.ModelProto) -> int:
    """Rewrite every qualifying Sum of ORT's training graph in place; returns how many."""
    graph = training.graph
    producer = {o: node for node in graph.node for o in node.output}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    for output in graph.output:
        uses[output.name] = uses.get(output.name, 0) + 1
    constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)

    replaced: dict[int, list[onnx.NodeProto]] = {}  # index of a Sum -> the nodes that take its place
    dropped: set[int] = set()  # ids of the per-step nodes no longer needed
    for index, node in enumerate(graph.node):
        if node.op_type != "Sum" or len(node.input) < MIN_PARTS:
            continue
        parts = [producer.get(name) for name in node.input]
        if any(p is None or uses.get(p.output[0], 0) != 1 for p in parts):
            continue
        out = node.output[0]
        if all(_is_weight_gemm(p) for p in parts):  # type: ignore[union-attr]
            stacked = [f"{out}/odt_rows_{side}" for side in "ab"]
            operands = [[p.input[k] for p in parts] for k in (0, 1)]  # type: ignore[union-attr]
            new = [helper.make_node("Concat", operands[k], [stacked[k]], axis=0, name=f"{out}/odt_concat_{k}")
                   for k in (0, 1)]  # fmt: skip
            new.append(helper.make_node("Gemm", stacked, [out], transA=1, name=f"{out}/odt_gemm"))
        elif all(p.op_type == "ReduceSum" and len(p.input) == 2 for p in parts):  # type: ignore[union-attr]
            axes = [constants.get(p.input[1]) for p in parts]  # type: ignore[union-attr]
            keep = {attributes(p).get("keepdims", 1) for p in parts}  # type: ignore[arg-type]
            values = {None if a is None else tuple(a.ravel().tolist()) for a in axes}
            if len(values) != 1 or None in values or keep != {0} or 0 not in next(iter(values)):  # type: ignore[operator]
                continue
            rows = f"{out}/odt_rows"
            new = [
                helper.make_node("Concat", [p.input[0] for p in parts], [rows], axis=0, name=f"{out}/odt_concat"),  # type: ignore[union-attr]
                helper.make_node("ReduceSum", [rows, parts[0].input[1]], [out], keepdims=0, name=f"{out}/odt_reduce"),  # type: ignore[union-attr]
            ]
        else:
            continue
        replaced[index] = new
        dropped.update(id(p) for p in parts)
    if not replaced:
        return 0
    nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        if id(node) in dropped:
            continue
        nodes.extend(replaced.get(index, [node]))
    del graph.node[:]
    graph.node.extend(nodes)
    return len(replaced)
