"""Exact rewrites of operators ORT 1.19 cannot differentiate into operators it can.

Each rewrite replaces one node by a few that compute the same function with gradients ORT has
(Clip, Exp, Log, Tanh, Where, Mul, ReduceMean, MaxPool...). The result is verified against
PyTorch like every export. Only nodes on the trained path are rewritten: elsewhere the fused
kernels stay.
"""

from __future__ import annotations

from typing import Callable

import onnx
from onnx import helper

from ._nodes import inferred_graph

__all__ = ["REWRITABLE", "rewrite_activations"]

_F = onnx.TensorProto.FLOAT


class _Builder:
    """Makes the nodes of one rewrite, with names derived from the original node."""

    def __init__(self, node: onnx.NodeProto, opset: int) -> None:
        self.base = f"{node.name or node.output[0]}/odt"
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.count = 0

    def const(self, value: float | list[int], dtype: int = _F) -> str:
        name = self._name("c")
        values = value if isinstance(value, list) else [value]
        dims = [len(values)] if isinstance(value, list) else []
        self.nodes.append(helper.make_node("Constant", [], [name], value=helper.make_tensor(name, dtype, dims, values)))
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: object) -> str:
        name = out or self._name(op_type.lower())
        self.nodes.append(
            helper.make_node(op_type, list(inputs), [name], name=f"{self.base}/{op_type}{self.count}", **attrs)
        )
        return name

    def reduce_mean(self, x: str, axes: list[int]) -> str:
        if self.opset >= 18:
            return self.op("ReduceMean", x, self.const(axes, onnx.TensorProto.INT64), keepdims=1)
        return self.op("ReduceMean", x, axes=axes, keepdims=1)

    def _name(self, kind: str) -> str:
        self.count += 1
        return f"{self.base}/{kind}{self.count}"


def _attr(node: onnx.NodeProto, name: str, default: float) -> float:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _softplus(b: _Builder, x: str, out: str | None = None) -> str:
    # log(1 + exp(x)) = relu(x) + log(1 + exp(-|x|)): no overflow, and no inf * 0 in the gradient.
    tail = b.op("Log", b.op("Add", b.const(1.0), b.op("Exp", b.op("Neg", b.op("Abs", x)))))
    return b.op("Add", b.op("Relu", x), tail, out=out)


def _hard_sigmoid(b: _Builder, x: str, alpha: float, beta: float, out: str | None = None) -> str:
    scaled = b.op("Add", b.op("Mul", x, b.const(alpha)), b.const(beta))
    return b.op("Clip", scaled, b.const(0.0), b.const(1.0), out=out)


def _elu(b: _Builder, x: str, alpha: float, scale: float, out: str | None = None, celu: bool = False) -> str:
    below = b.op("Min", x, b.const(0.0))
    if celu:  # CELU: alpha * (exp(x / alpha) - 1) below 0
        below = b.op("Div", below, b.const(alpha))
    negative = b.op("Mul", b.const(alpha), b.op("Sub", b.op("Exp", below), b.const(1.0)))
    value = b.op("Where", b.op("Greater", x, b.const(0.0)), x, negative)
    return b.op("Mul", value, b.const(scale), out=out) if scale != 1.0 else b.op("Identity", value, out=out)


def _instance_norm(b: _Builder, node: onnx.NodeProto, rank: int) -> None:
    x, scale, bias = node.input
    axes = list(range(2, rank))
    centered = b.op("Sub", x, b.reduce_mean(x, axes))
    variance = b.reduce_mean(b.op("Mul", centered, centered), axes)
    std = b.op("Sqrt", b.op("Add", variance, b.const(_attr(node, "epsilon", 1e-5))))
    channel = b.const([1, -1] + [1] * (rank - 2), onnx.TensorProto.INT64)
    normed = b.op("Mul", b.op("Div", centered, std), b.op("Reshape", scale, channel))
    b.op("Add", normed, b.op("Reshape", bias, channel), out=node.output[0])


def _rewrite(node: onnx.NodeProto, b: _Builder, shapes: dict[str, list[int | str]]) -> bool:
    x, y = node.input[0], node.output[0]
    kind = node.op_type
    if kind == "HardSigmoid":
        _hard_sigmoid(b, x, _attr(node, "alpha", 0.2), _attr(node, "beta", 0.5), out=y)
    elif kind == "HardSwish":
        b.op("Mul", x, _hard_sigmoid(b, x, 1.0 / 6.0, 0.5), out=y)
    elif kind == "Softplus":
        _softplus(b, x, out=y)
    elif kind == "Mish":
        b.op("Mul", x, b.op("Tanh", _softplus(b, x)), out=y)
    elif kind == "Elu":
        _elu(b, x, _attr(node, "alpha", 1.0), 1.0, out=y)
    elif kind == "Celu":
        _elu(b, x, _attr(node, "alpha", 1.0), 1.0, out=y, celu=True)
    elif kind == "Selu":
        _elu(
            b,
            x,
            _attr(node, "alpha", 1.67326319217681884765625),
            _attr(node, "gamma", 1.05070102214813232421875),
            out=y,
        )
    elif kind == "PRelu":
        positive = b.op("Relu", x)
        b.op("Add", positive, b.op("Mul", node.input[1], b.op("Sub", x, positive)), out=y)
    elif kind == "GlobalMaxPool":
        spatial = shapes.get(x, [])[2:]
        if not spatial or not all(isinstance(d, int) and d > 0 for d in spatial):
            return False  # MaxPool needs a fixed kernel: the spatial size must be known
        b.op("MaxPool", x, out=y, kernel_shape=spatial)
    elif kind == "InstanceNormalization":
        rank = len(shapes.get(x, []))
        if rank < 3:
            return False
        _instance_norm(b, node, rank)
    else:
        return False
    return True


REWRITABLE = (
    "HardSigmoid",
    "HardSwish",
    "Softplus",
    "Mish",
    "Celu",
    "Elu",
    "Selu",
    "PRelu",
    "GlobalMaxPool",
    "InstanceNormalization",
)
"""Operators without an ORT gradient that :func:`rewrite_activations` replaces exactly."""


def rewrite_activations(model: onnx.ModelProto, live: Callable[[onnx.NodeProto], bool]) -> list[str]:
    """Rewrite every node in :data:`REWRITABLE` for which ``live(node)`` holds; returns their op types."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    shapes = _shapes(model)
    done: list[str] = []
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        builder = _Builder(node, opset)
        if node.op_type in REWRITABLE and live(node) and _rewrite(node, builder, shapes):
            nodes.extend(builder.nodes)
            done.append(node.op_type)
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return done


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | str]]:
    inferred = inferred_graph(model)
    return {
        v.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]
        for v in (*inferred.value_info, *inferred.input)
    }
