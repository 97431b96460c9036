"""2x2 max pooling without ORT's indices: the gradient routed by the forward's choices.

For its gradient, ORT's training graph runs ``MaxPool`` with its second output, the index of each
window's maximum, and ``MaxPoolGrad`` scatters ``dY`` to those indices. Both are slow on the CPU:
on the benchmark CNN's first pooling (64 x 32 x 28x28) ``MaxPool`` took 3.8 ms with the indices
and 0.2 ms without, and ``MaxPoolGrad`` 2.6 to 3.5 ms (PyTorch's pooling backward: 0.74 ms for
both of its poolings). For a 2x2 window with stride 2 (no padding, even sides) the windows do not
overlap, so the gradient is a choice among the window's four elements ``a b / c d``: the pass
keeps the fast ``MaxPool`` for the forward, splits its input into the four phases there
(``Split`` of a reshaped view) and records, as three bool tensors (smaller than the indices),

    top row if max(a, b) >= max(c, d), then the left element if a >= b (c >= d below)

which is the first maximum in row-major order: the element PyTorch's and ORT's indices pick,
ties included. The backward turns the choices into ``dY``'s four destinations and concatenates
those into the input's shape, so the routed values are the same bit for bit. Verification
against PyTorch covers it, and a test compares it with ``MaxPoolGrad`` on windows full of ties.

Cost: memory. The backward's float masks, the four destinations and their concatenation are
alive together where ``MaxPoolGrad`` wrote one tensor, and ORT's arena grows one more doubling:
the CNN + BatchNorm benchmark's peak RSS went from 101 to 137 MiB (0.83x its step time), the
CNN's from 94 to 112 MiB. Dropping the pass is one registry line. Tried and slower: the four
phases as strided ``Slice``s (1.22x the step, the same peak), and the backward as ``Where`` over
``dY`` expanded to the windows (ORT's ``Expand`` and ``Where`` took 5.0 and 5.6 ms there).
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ._nodes import attributes

__all__ = ["rewrite_max_pool_grad"]

WINDOW = {"kernel_shape": [2, 2], "strides": [2, 2]}
DEFAULTS = {"pads": [0, 0, 0, 0], "dilations": [1, 1], "ceil_mode": 0, "storage_order": 0}


def _plain_window(node: onnx.NodeProto) -> bool:
    a = attributes(node)
    auto_pad = a.pop("auto_pad", b"NOTSET")
    return (
        auto_pad in (b"NOTSET", "NOTSET")
        and all(a.get(k) == v for k, v in WINDOW.items())
        and all(a.get(k, v) == v for k, v in DEFAULTS.items())
    )


MASKS = ("top", "left_top", "left_bottom")
"""The forward's choices in each window ``a b / c d``: the top row, the left of the top row, the left
of the bottom row (ties go to the first element)."""


def _node(p: str, op: str, inputs: list[str], outputs: list[str], **kw: object) -> onnx.NodeProto:
    """A node whose inputs and outputs are all named under the prefix ``p``."""
    return helper.make_node(op, [f"{p}/{i}" for i in inputs], [f"{p}/{o}" for o in outputs], **kw)


def _masks(x: str, prefix: str, height: int, width: int) -> tuple[list[onnx.NodeProto], list]:
    """Forward nodes computing the bool tensors ``{prefix}.{name}`` of :data:`MASKS` from ``x``."""
    p = f"{prefix}/odt"
    windows = numpy_helper.from_array(np.array([0, 0, height // 2, 2, width // 2, 2], np.int64), f"{p}/windows")
    node = functools.partial(_node, p)
    nodes = [
        helper.make_node("Reshape", [x, f"{p}/windows"], [f"{p}/x6"]),
        node("Split", ["x6"], ["top_row", "bottom_row"], axis=3),
        node("Split", ["top_row"], ["a", "b"], axis=5),
        node("Split", ["bottom_row"], ["c", "d"], axis=5),
        helper.make_node("GreaterOrEqual", [f"{p}/a", f"{p}/b"], [f"{prefix}.left_top"]),
        helper.make_node("GreaterOrEqual", [f"{p}/c", f"{p}/d"], [f"{prefix}.left_bottom"]),
        node("Max", ["a", "b"], ["max_top"]),
        node("Max", ["c", "d"], ["max_bottom"]),
        helper.make_node("GreaterOrEqual", [f"{p}/max_top", f"{p}/max_bottom"], [f"{prefix}.top"]),
    ]
    return nodes, [windows]


def _backward(prefix: str, grad: str, out: str, height: int, width: int) -> tuple[list[onnx.NodeProto], list]:
    """Nodes computing the pooling's input gradient ``out``: ``dY`` sent to the element the masks
    ``{prefix}.*`` chose in each window."""
    p = f"{out}/odt_pool"
    constants = [
        numpy_helper.from_array(np.array([0, 0, height // 2, 1, width // 2, 1], np.int64), f"{p}/dy_shape"),
        numpy_helper.from_array(np.array([0, 0, height, width], np.int64), f"{p}/x_shape"),
    ]
    node = functools.partial(_node, p)
    nodes = [
        *(helper.make_node("Cast", [f"{prefix}.{m}"], [f"{p}/{m}"], to=onnx.TensorProto.FLOAT) for m in MASKS),
        helper.make_node("Reshape", [grad, f"{p}/dy_shape"], [f"{p}/dy6"]),
        node("Mul", ["dy6", "top"], ["dtop"]),
        node("Sub", ["dy6", "dtop"], ["dbottom"]),
        node("Mul", ["dtop", "left_top"], ["da"]),
        node("Sub", ["dtop", "da"], ["db"]),
        node("Mul", ["dbottom", "left_bottom"], ["dc"]),
        node("Sub", ["dbottom", "dc"], ["dd"]),
        node("Concat", ["da", "db"], ["dtop_row"], axis=5),
        node("Concat", ["dc", "dd"], ["dbottom_row"], axis=5),
        node("Concat", ["dtop_row", "dbottom_row"], ["dx6"], axis=3),
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
    pools: dict[str, tuple[int, int]] = {}  # indices -> the pooled input's (height, width)
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
            pools[indices] = (sides[0], sides[1])
    if not pools:
        return 0
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type == "MaxPool" and len(node.output) == 2 and node.output[1] in pools:
            indices = node.output[1]
            del node.output[1]  # ORT's fast pooling kernel runs without the indices
            made, constants = _masks(node.input[0], f"{indices}.odt", *pools[indices])
            nodes += [node, *made]
            graph.initializer.extend(constants)
        elif node.op_type == "MaxPoolGrad" and len(node.input) == 2 and node.input[1] in pools:
            made, constants = _backward(f"{node.input[1]}.odt", node.input[0], node.output[0], *pools[node.input[1]])
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
