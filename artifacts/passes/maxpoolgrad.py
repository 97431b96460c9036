"""2x2 max pooling without ORT's indices: the gradient routed from the pooling's input.

For its gradient, ORT's training graph runs ``MaxPool`` with its second output, the index of each
window's maximum, and ``MaxPoolGrad`` scatters ``dY`` to those indices. Both are slow on the CPU:
on the benchmark CNN's first pooling (64 x 32 x 28x28) ``MaxPool`` took 3.8 ms with the indices
and 0.2 ms without, and ``MaxPoolGrad`` 2.6 to 3.5 ms (PyTorch's pooling backward: 0.74 ms for
both of its poolings). For a 2x2 window with stride 2 (no padding, even sides) the windows do not
overlap, so the gradient is a choice among the window's four elements ``a b / c d``: the pass
keeps the fast ``MaxPool`` for the forward and, in the backward, splits the input into the four
phases (``Split`` of a reshaped view) and sends ``dY`` to

    top row if max(a, b) >= max(c, d), then the left element if a >= b (c >= d below)

which is the first maximum in row-major order: the element PyTorch's and ORT's indices pick,
ties included, so the routed values are the same bit for bit. The backward then holds the
pooling's input instead of the indices. Verification against PyTorch covers it, and a test
compares it with ``MaxPoolGrad`` on windows full of ties.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["rewrite_max_pool_grad"]

WINDOW = {"kernel_shape": [2, 2], "strides": [2, 2]}
DEFAULTS = {"pads": [0, 0, 0, 0], "dilations": [1, 1], "ceil_mode": 0, "storage_order": 0}


def _attributes(node: onnx.NodeProto) -> dict[str, object]:
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in values.items()}


def _plain_window(node: onnx.NodeProto) -> bool:
    a = _attributes(node)
    auto_pad = a.pop("auto_pad", b"NOTSET")
    return (
        auto_pad in (b"NOTSET", "NOTSET")
        and all(a.get(k) == v for k, v in WINDOW.items())
        and all(a.get(k, v) == v for k, v in DEFAULTS.items())
    )


def _backward(x: str, grad: str, out: str, height: int, width: int) -> tuple[list[onnx.NodeProto], list]:
    """Nodes computing the pooling's input gradient ``out`` from its input ``x`` and ``grad`` (dY)."""
    p = f"{out}/odt_pool"
    shapes = {
        f"{p}/windows": [0, 0, height // 2, 2, width // 2, 2],
        f"{p}/dy_shape": [0, 0, height // 2, 1, width // 2, 1],
        f"{p}/x_shape": [0, 0, height, width],
    }
    constants = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in shapes.items()]

    def node(op: str, inputs: list[str], outputs: list[str], **kw: object) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [f"{p}/{o}" for o in outputs], **kw)

    def mask_of(a: str, b: str, name: str) -> list[onnx.NodeProto]:  # 1.0 where a wins (ties go to a)
        return [node("GreaterOrEqual", [a, b], [f"{name}_bool"]),
                node("Cast", [f"{p}/{name}_bool"], [name], to=TensorProto.FLOAT)]  # fmt: skip

    nodes = [
        helper.make_node("Reshape", [x, f"{p}/windows"], [f"{p}/x6"]),
        node("Split", [f"{p}/x6"], ["top_row", "bottom_row"], axis=3),
        node("Split", [f"{p}/top_row"], ["a", "b"], axis=5),
        node("Split", [f"{p}/bottom_row"], ["c", "d"], axis=5),
        *mask_of(f"{p}/a", f"{p}/b", "left_top"),
        *mask_of(f"{p}/c", f"{p}/d", "left_bottom"),
        node("Max", [f"{p}/a", f"{p}/b"], ["max_top"]),
        node("Max", [f"{p}/c", f"{p}/d"], ["max_bottom"]),
        *mask_of(f"{p}/max_top", f"{p}/max_bottom", "top"),
        helper.make_node("Reshape", [grad, f"{p}/dy_shape"], [f"{p}/dy6"]),
        node("Mul", [f"{p}/dy6", f"{p}/top"], ["dtop"]),
        node("Sub", [f"{p}/dy6", f"{p}/dtop"], ["dbottom"]),
        node("Mul", [f"{p}/dtop", f"{p}/left_top"], ["da"]),
        node("Sub", [f"{p}/dtop", f"{p}/da"], ["db"]),
        node("Mul", [f"{p}/dbottom", f"{p}/left_bottom"], ["dc"]),
        node("Sub", [f"{p}/dbottom", f"{p}/dc"], ["dd"]),
        node("Concat", [f"{p}/da", f"{p}/db"], ["dtop_row"], axis=5),
        node("Concat", [f"{p}/dc", f"{p}/dd"], ["dbottom_row"], axis=5),
        node("Concat", [f"{p}/dtop_row", f"{p}/dbottom_row"], ["dx6"], axis=3),
        helper.make_node("Reshape", [f"{p}/dx6", f"{p}/x_shape"], [out]),
    ]
    return nodes, constants


def rewrite_max_pool_grad(training: onnx.ModelProto) -> int:
    """Rewrite every qualifying ``MaxPool`` + ``MaxPoolGrad`` pair of ORT's training graph in place;
    returns how many poolings. Qualifying: 2x2 windows, stride 2, no padding or dilation, floor
    mode, an input of rank 4 whose height and width are static and even, and indices read by
    ``MaxPoolGrad`` alone."""
    graph = training.graph
    shapes = {v.name: v.type.tensor_type.shape.dim for v in [*graph.input, *graph.value_info]}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    pools: dict[str, tuple[onnx.NodeProto, int, int]] = {}  # indices -> (pooling, height, width)
    for node in graph.node:
        if node.op_type != "MaxPool" or node.domain not in ("", "ai.onnx") or len(node.output) != 2:
            continue
        dims = shapes.get(node.input[0])
        sides = [d.dim_value if d.HasField("dim_value") else 0 for d in dims[2:]] if dims and len(dims) == 4 else []
        indices = node.output[1]
        grads = readers.get(indices, [])
        if (
            len(sides) == 2 and all(s and s % 2 == 0 for s in sides) and _plain_window(node) and indices not in outputs
            and grads and all(g.op_type == "MaxPoolGrad" and list(g.input[1:]) == [indices] for g in grads)
        ):  # fmt: skip
            pools[indices] = (node, sides[0], sides[1])
    if not pools:
        return 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type == "MaxPool" and len(node.output) == 2 and node.output[1] in pools:
            del node.output[1]  # the indices: ORT's fast pooling kernel runs without them
            nodes.append(node)
        elif node.op_type == "MaxPoolGrad" and len(node.input) == 2 and node.input[1] in pools:
            pool, height, width = pools[node.input[1]]
            made, constants = _backward(pool.input[0], node.input[0], node.output[0], height, width)
            nodes += made
            graph.initializer.extend(constants)
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [v for v in graph.value_info if v.name not in pools]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return len(pools)
