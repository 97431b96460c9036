"""Gradients of element-wise arithmetic and activations."""

from __future__ import annotations

import math
from typing import Sequence

import onnx

from ._emit import MS, Emitter
from ._registry import Grads, attr, rule

# -- element-wise arithmetic -------------------------------------------------------------------


@rule("Add", "Sub")
def _add(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    (g,), (a, b), y = dy, node.input, node.output[0]
    db = None
    if need[1]:
        db = e.sum_to(g if node.op_type == "Add" else e.one("Neg", g), b, y)
    return [e.sum_to(g, a, y) if need[0] else None, db]


@rule("Mul")
def _mul(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    (g,), (a, b), y = dy, node.input, node.output[0]
    return [e.sum_to(e.one("Mul", g, b), a, y) if need[0] else None,
            e.sum_to(e.one("Mul", g, a), b, y) if need[1] else None]  # fmt: skip


@rule("Div")
def _div(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    (g,), (a, b), y = dy, node.input, node.output[0]
    da = e.sum_to(e.one("Div", g, b), a, y) if need[0] else None
    db = e.sum_to(e.one("Neg", e.one("Div", e.one("Mul", g, y), b)), b, y) if need[1] else None  # -dY A / B^2
    return [da, db]


@rule("Pow")
def _pow(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    (g,), (a, b), y = dy, node.input, node.output[0]
    exponent = e.value(b)
    if need[1] or exponent is None or exponent.size != 1:
        raise NotImplementedError("Pow with a trained or tensor exponent")
    p = float(exponent.reshape(()))
    if p == 2.0:
        local = e.one("Mul", a, e.const(2.0))
    else:
        local = e.one("Mul", e.one("Pow", a, e.const(p - 1.0)), e.const(p))
    return [e.sum_to(e.one("Mul", g, local), a, y), None]


@rule("Sum")
def _sum(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [e.sum_to(dy[0], x, node.output[0]) if n else None for x, n in zip(node.input, need)]


@rule("Min", "Max")
def _min_max(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    (g,), y = dy, node.output[0]  # to the input that is the result (the first one, on a tie, as PyTorch's
    # minimum and maximum split a tie in half: ties are kinks, which verification retries)
    if len(node.input) != 2:
        raise NotImplementedError(f"{node.op_type} of {len(node.input)} inputs")
    a, b = node.input
    first = e.one("Equal", a, y)
    half = e.one("Mul", g, e.const(0.5))
    tie = e.one("Equal", a, b)
    ga = e.one("Where", tie, half, e.one("Where", first, g, e.const(0.0)))
    gb = e.one("Where", tie, half, e.one("Where", first, e.const(0.0), g))
    return [e.sum_to(ga, a, y) if need[0] else None, e.sum_to(gb, b, y) if need[1] else None]


@rule("Neg")
def _neg(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [e.one("Neg", dy[0])]


@rule("Identity")
def _identity(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [dy[0]]


@rule("Cast")
def _cast(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    source = e.types.get(node.input[0], onnx.TensorProto.FLOAT)
    return [e.one("Cast", dy[0], to=source)]


# -- activations: ORT's gradient kernels where it has one --------------------------------------


@rule("Relu")
def _relu(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [e.one("ReluGrad", dy[0], node.output[0], domain=MS)]


@rule("Sigmoid")
def _sigmoid(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [e.one("SigmoidGrad", dy[0], node.output[0], domain=MS)]


@rule("Tanh")
def _tanh(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [e.one("TanhGrad", dy[0], node.output[0], domain=MS)]


@rule("Erf")
def _erf(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x = node.input[0]  # d erf(x) = 2 / sqrt(pi) exp(-x^2)
    bell = e.one("Exp", e.one("Neg", e.one("Mul", x, x)))
    return [e.one("Mul", dy[0], e.one("Mul", bell, e.const(2.0 / math.sqrt(math.pi))))]


@rule("Sqrt")
def _sqrt(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [e.one("Div", e.one("Mul", dy[0], e.const(0.5)), node.output[0])]


@rule("Exp")
def _exp(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [e.one("Mul", dy[0], node.output[0])]


@rule("Log")
def _log(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [e.one("Div", dy[0], node.input[0])]


@rule("Reciprocal")
def _reciprocal(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    y = node.output[0]
    return [e.one("Neg", e.one("Mul", dy[0], e.one("Mul", y, y)))]


@rule("Abs")
def _abs(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [e.one("Mul", dy[0], e.one("Sign", node.input[0]))]


@rule("Clip")
def _clip(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x = node.input[0]  # PyTorch's clamp: the gradient passes where min <= x <= max
    inside = None
    if len(node.input) > 1 and node.input[1]:
        inside = e.one("GreaterOrEqual", x, node.input[1])
    if len(node.input) > 2 and node.input[2]:
        below = e.one("LessOrEqual", x, node.input[2])
        inside = below if inside is None else e.one("And", inside, below)
    if inside is None:
        return [dy[0], None, None]
    return [e.one("Where", inside, dy[0], e.const(0.0)), None, None]


@rule("Softmax")
def _softmax(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [e.one("SoftmaxGrad_13", dy[0], node.output[0], domain=MS, axis=attr(node, "axis", -1))]


@rule("LogSoftmax")
def _log_softmax(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [e.one("LogSoftmaxGrad_13", dy[0], node.output[0], domain=MS, axis=attr(node, "axis", -1))]


@rule("Dropout")
def _dropout(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    if len(node.output) < 2 or not node.output[1]:
        raise NotImplementedError("Dropout without its mask output")
    inputs = [dy[0], node.output[1], *node.input[1:3]]
    return [e.one("DropoutGrad", *inputs, domain=MS), None, None]


@rule("Where")
def _where(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    (g,), (c, a, b), y = dy, node.input, node.output[0]
    zero = e.const(0.0)
    return [None,
            e.sum_to(e.one("Where", c, g, zero), a, y) if need[1] else None,
            e.sum_to(e.one("Where", c, zero, g), b, y) if need[2] else None]  # fmt: skip
