"""Each ONNX operator's gradient, one rule per operator, registered in :data:`RULES`.

A rule gets the forward node, the gradient of each of its outputs (None where nothing downstream
needs one) and which inputs need a gradient; it appends the backward's nodes through the
:class:`~artifacts.gradients._emit.Emitter` and returns a gradient name (or None) per input.

Where ONNX Runtime's training build has a gradient kernel, the rule writes that kernel's node
(``ReluGrad``, ``SoftmaxGrad_13``, ``LayerNormalizationGrad``, ``ConvGrad``...) with the inputs ORT's
own gradient builder gives it: the project's lowering table (:mod:`artifacts.passes.portable`) is then
the one definition of each kernel in standard ONNX, tested against ORT's kernels, and the training
graph reads exactly as ORT's builder would have written it. Everything else is standard ONNX here.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np
import onnx

from ._emit import MS, Emitter

__all__ = ["RULES", "Rule", "NOT_DIFFERENTIABLE"]

Grads = list[Optional[str]]
Rule = Callable[[Emitter, onnx.NodeProto, Grads, Sequence[bool]], Grads]
RULES: dict[str, Rule] = {}

NOT_DIFFERENTIABLE = frozenset({
    "Shape", "Size", "Constant", "ConstantOfShape", "Range", "Equal", "Greater", "GreaterOrEqual", "Less",
    "LessOrEqual", "And", "Or", "Not", "Xor", "IsNaN", "IsInf", "NonZero", "ArgMax", "ArgMin", "Mod", "Floor",
    "Ceil", "Round", "Sign", "OneHot", "TopK", "EyeLike", "RandomNormal", "RandomUniform", "RandomNormalLike",
    "RandomUniformLike", "Bernoulli", "CumSum_int",
})  # fmt: skip
"""Operators whose outputs carry no gradient (integer, boolean or piecewise-constant results)."""


def rule(*op_types: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for op_type in op_types:
            RULES[op_type] = fn
        return fn

    return register


def _attr(node: onnx.NodeProto, name: str, default):  # type: ignore[no-untyped-def]
    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default


def _copy_attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


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


@rule("Tile")
def _tile(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x, repeats = node.input
    known, rank = e.value(repeats), e.rank(x)
    if known is None and rank is None:
        raise NotImplementedError("Tile with repeats computed in the graph over an input of unknown rank")
    rank = len(known.reshape(-1)) if known is not None else rank
    # dY as [r0, d0, r1, d1, ...] (the repeats as given, or read from the graph's tensor), summed over the repeats
    dims = e.shape(x)

    def entry(tensor: str, axis: int) -> str:
        return e.one("Slice", tensor, e.const([axis], np.int64), e.const([axis + 1], np.int64))

    parts = []
    for axis in range(rank):
        count = e.const([int(known.reshape(-1)[axis])], np.int64) if known is not None else entry(repeats, axis)
        parts += [count, entry(dims, axis)]
    split = e.one("Reshape", dy[0], e.one("Concat", *parts, axis=0))
    summed = e.one("ReduceSum", split, e.const(list(range(0, 2 * rank, 2)), np.int64), keepdims=0)
    return [summed, None]


@rule("Pad")
def _pad(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    mode = _attr(node, "mode", b"constant")
    pads = e.value(node.input[1]) if len(node.input) > 1 else None
    if mode not in (b"constant", "constant") or pads is None or (len(node.input) > 3 and node.input[3]):
        raise NotImplementedError("Pad other than constant padding by constant amounts on every axis")
    pads = [int(p) for p in pads.reshape(-1)]
    rank = len(pads) // 2
    if any(p < 0 for p in pads):
        raise NotImplementedError("Pad with negative amounts")
    starts, ends = pads[:rank], [-p if p else np.iinfo(np.int64).max for p in pads[rank:]]
    cut = e.one("Slice", dy[0], e.const(starts, np.int64), e.const(ends, np.int64),
                e.const(list(range(rank)), np.int64))  # fmt: skip
    return [cut, *([None] * (len(node.input) - 1))]


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
    return [e.one("SoftmaxGrad_13", dy[0], node.output[0], domain=MS, axis=_attr(node, "axis", -1))]


@rule("LogSoftmax")
def _log_softmax(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [e.one("LogSoftmaxGrad_13", dy[0], node.output[0], domain=MS, axis=_attr(node, "axis", -1))]


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


# -- products --------------------------------------------------------------------------------------


@rule("Gemm")
def _gemm(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    (g,), y = dy, node.output[0]
    a, b = node.input[:2]
    alpha, beta = _attr(node, "alpha", 1.0), _attr(node, "beta", 1.0)
    ta, tb = _attr(node, "transA", 0), _attr(node, "transB", 0)
    scale = {"alpha": alpha} if alpha != 1.0 else {}
    da = db = dc = None
    if need[0]:  # dA = dY op(B)^T, or its transpose
        da = (e.one("Gemm", b, g, transA=tb, transB=1, **scale) if ta
              else e.one("Gemm", g, b, transA=0, transB=1 - tb, **scale))  # fmt: skip
    if need[1]:  # dB = op(A)^T dY, or its transpose
        db = (e.one("Gemm", g, a, transA=1, transB=ta, **scale) if tb
              else e.one("Gemm", a, g, transA=1 - ta, transB=0, **scale))  # fmt: skip
    if len(node.input) > 2 and need[2]:
        dc = e.sum_to(g, node.input[2], y)
        if beta != 1.0:
            dc = e.one("Mul", dc, e.const(beta))
    return [da, db, dc]


def _swap_last(e: Emitter, x: str, rank: int) -> str:
    perm = list(range(rank))
    perm[-2:] = perm[-1], perm[-2]
    return e.one("Transpose", x, perm=perm)


@rule("MatMul")
def _matmul(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    (g,), (a, b), y = dy, node.input, node.output[0]
    ra, rb = e.rank(a), e.rank(b)
    if ra is None or rb is None or ra < 2 or rb < 2:
        raise NotImplementedError("MatMul of vectors or of unknown rank")
    da = db = None
    if need[0]:
        if ra == rb == 2:
            da = e.one("Gemm", g, b, transB=1)
        else:
            da = e.sum_to(e.one("MatMul", g, _swap_last(e, b, rb)), a, y)
    if need[1]:
        if rb == 2 and ra >= 2:  # a weight: every row of every batch is one row of A, one product
            k, n = e.shapes[b]
            rows = e.one("Reshape", a, e.const([-1, k], np.int64)) if ra > 2 else a
            grows = e.one("Reshape", g, e.const([-1, n], np.int64)) if ra > 2 else g
            db = e.one("Gemm", rows, grows, transA=1)
        else:
            db = e.sum_to(e.one("MatMul", _swap_last(e, a, ra), g), b, y)
    return [da, db]


# -- shapes and data movement ----------------------------------------------------------------------


@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand")
def _reshape(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x = node.input[0]
    if node.op_type == "Expand":
        return [e.sum_to(dy[0], x, node.output[0]), None]
    return [e.one("Reshape", dy[0], e.shape(x)), *([None] * (len(node.input) - 1))]


@rule("Transpose")
def _transpose(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    perm = _attr(node, "perm", None)
    if perm is None:
        rank = e.rank(node.input[0])
        if rank is None:
            raise NotImplementedError("Transpose without perm of unknown rank")
        perm = list(range(rank))[::-1]
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return [e.one("Transpose", dy[0], perm=inverse)]


@rule("Slice")
def _slice(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x = node.input[0]
    inputs = [dy[0], e.shape(x), *node.input[1:]]
    return [e.one("SliceGrad", *inputs, domain=MS), *([None] * (len(node.input) - 1))]


@rule("Gather")
def _gather(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    data, indices = node.input
    axis, rank, picks = _attr(node, "axis", 0), e.rank(data), e.rank(indices)
    if data in e.parameters or rank is None or picks is None or picks > 1:  # a lookup table: ORT's GatherGrad,
        # which the lookup-grad and padding-rows passes rewrite
        return [e.one("GatherGrad", e.shape(data), indices, dy[0], domain=MS, axis=axis), None]
    # positions picked from an activation along ``axis``: dY added back there, in zeros of its shape
    axis = axis + rank if axis < 0 else axis
    g = dy[0] if picks == 1 else e.one("Unsqueeze", dy[0], e.const([axis], np.int64))
    shape = [1] * rank
    shape[axis] = -1
    where = e.one("Reshape", e.one("Cast", indices, to=onnx.TensorProto.INT64), e.const(shape, np.int64))
    wrapped = e.one("Where", e.one("Less", where, e.const(0, np.int64)),
                    e.one("Add", where, e.one("Gather", e.shape(data), e.const(axis, np.int64))), where)  # fmt: skip
    spread = e.one("Expand", wrapped, e.shape(g))
    return [e.one("ScatterElements", e.zeros_like(data), spread, g, axis=axis, reduction="add"), None]


@rule("GatherElements")
def _gather_elements(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    data, indices = node.input
    scattered = e.one("ScatterElements", e.zeros_like(data), indices, dy[0], axis=_attr(node, "axis", 0),
                      reduction="add")  # fmt: skip
    return [scattered, None]


def _lengths(e: Emitter, inputs: Sequence[str], axis: int) -> str:
    """Each input's length along ``axis`` (>= 0), concatenated: the split of the gradient."""
    return e.one("Concat", *(e.one("Shape", x, start=axis, end=axis + 1) for x in inputs), axis=0)


@rule("Concat")
def _concat(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    axis = _attr(node, "axis", 0)
    rank = e.rank(node.output[0])
    if axis < 0:
        if rank is None:
            raise NotImplementedError("Concat on a negative axis of unknown rank")
        axis += rank
    parts = [e.name(f"{x}_grad.part") for x in node.input]
    e.op("Split", [dy[0], _lengths(e, node.input, axis)], parts, axis=axis)
    return [p if n else None for p, n in zip(parts, need)]


@rule("Split")
def _split(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    parts = [g if g is not None else e.zeros_like(y) for g, y in zip(dy, node.output)]
    return [e.one("Concat", *parts, axis=_attr(node, "axis", 0)), *([None] * (len(node.input) - 1))]


def _reduce_axes(e: Emitter, node: onnx.NodeProto) -> list[int] | None:
    """The reduced axes, normalized, or None for all of them."""
    axes = _attr(node, "axes", None)
    if axes is None and len(node.input) > 1 and node.input[1]:
        value = e.value(node.input[1])
        if value is None:
            raise NotImplementedError(f"{node.op_type} over axes computed in the graph")
        axes = [int(v) for v in value.reshape(-1)]
    if not axes:
        return None
    rank = e.rank(node.input[0])
    if rank is None and any(a < 0 for a in axes):
        raise NotImplementedError(f"{node.op_type} over negative axes of unknown rank")
    return sorted(a + rank if a < 0 else a for a in axes)  # type: ignore[operator]


@rule("ReduceSum", "ReduceMean")
def _reduce(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x, g = node.input[0], dy[0]
    axes = _reduce_axes(e, node)
    if axes is None and len(node.input) > 1 and node.input[1] and _attr(node, "noop_with_empty_axes", 0):
        return [g, None]
    if not _attr(node, "keepdims", 1):
        if axes is None:
            rank = e.rank(x)
            if rank is None:
                raise NotImplementedError(f"{node.op_type} of unknown rank")
            axes = list(range(rank))
        g = e.one("Unsqueeze", g, e.const(axes, np.int64))
    spread = e.one("Expand", g, e.shape(x))
    if node.op_type == "ReduceMean":
        count = e.one("Div", e.one("Cast", e.one("Size", x), to=onnx.TensorProto.FLOAT),
                      e.one("Cast", e.one("Size", node.output[0]), to=onnx.TensorProto.FLOAT))  # fmt: skip
        spread = e.one("Div", spread, count)
    return [spread, *([None] * (len(node.input) - 1))]


@rule("GlobalAveragePool")
def _global_average_pool(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x, y = node.input[0], node.output[0]
    count = e.one("Div", e.one("Cast", e.one("Size", x), to=onnx.TensorProto.FLOAT),
                  e.one("Cast", e.one("Size", y), to=onnx.TensorProto.FLOAT))  # fmt: skip
    return [e.one("Div", e.one("Expand", dy[0], e.shape(x)), count)]


# -- layers with ORT gradient kernels ----------------------------------------------------------------


@rule("LayerNormalization")
def _layer_norm(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    if len(node.output) < 3 or not node.output[1] or not node.output[2]:
        raise NotImplementedError("LayerNormalization without its Mean and InvStdDev outputs")
    x, scale = node.input[:2]
    outputs = [e.name(f"{x}_grad.ln"), e.name(f"{scale}_grad.ln"), e.name(f"{scale}_bias_grad.ln")]
    e.op("LayerNormalizationGrad", [dy[0], x, scale, node.output[1], node.output[2]], outputs, domain=MS,
         axis=_attr(node, "axis", -1), epsilon=_attr(node, "epsilon", 1e-5))  # fmt: skip
    return [outputs[0], outputs[1], outputs[2] if len(node.input) > 2 else None]


@rule("Conv")
def _conv(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x, w = node.input[:2]
    has_bias = len(node.input) > 2 and bool(node.input[2])
    wanted = [need[0], need[1], has_bias and need[2]]
    outputs = [e.name(f"{name}_grad.conv") if want else "" for name, want in zip((x, w, "bias"), wanted)]
    e.op("ConvGrad", [dy[0], x, w], outputs, domain=MS, **_copy_attrs(node))
    return [o or None for o in outputs][: len(node.input)]


@rule("MaxPool")
def _max_pool(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    from ..passes.maxpoolgrad import _plain_window

    if len(node.output) < 2 or not node.output[1]:  # the gradient routes by the pooling's indices
        while len(node.output) < 2:
            node.output.append("")
        node.output[1] = e.name(f"{node.output[0]}.indices")
    x, indices = node.input[0], node.output[1]
    sides = (e.shapes.get(x) or [])[2:]
    if len(sides) == 2 and all(isinstance(s, int) and s and s % 2 == 0 for s in sides) and _plain_window(node):
        return [e.one("MaxPoolGrad", dy[0], indices, domain=MS)]  # ORT's form: the max-pool-grad pass rewrites it
    # any other window: dY added at the flat positions the indices name (ONNX's MaxPool indices count
    # through batch and channels), in zeros of the input's size
    flat = e.const([-1], np.int64)
    zeros = e.one("ConstantOfShape", e.one("Reshape", e.one("Size", x), flat),
                  value=onnx.numpy_helper.from_array(np.zeros(1, np.float32)))  # fmt: skip
    added = e.one("ScatterElements", zeros, e.one("Reshape", indices, flat), e.one("Reshape", dy[0], flat), axis=0,
                  reduction="add")  # fmt: skip
    return [e.one("Reshape", added, e.shape(x))]


@rule("BatchNormInternal")
def _batchnorm(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x, scale = node.input[:2]
    outputs = [e.name(f"{n}_grad.bn") for n in (x, scale, node.input[2])]
    e.op("BatchNormalizationGrad", [dy[0], x, scale, node.output[3], node.output[4]], outputs, domain=MS,
         epsilon=_attr(node, "epsilon", 1e-5))  # fmt: skip
    return [*outputs, None, None]


# -- the losses' own operators -----------------------------------------------------------------------


@rule("SoftmaxCrossEntropyLoss")
def _softmax_cross_entropy(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    if len(node.output) < 2 or not node.output[1]:  # the gradient reads the log-probabilities: ask the node for them
        while len(node.output) < 2:
            node.output.append("")
        node.output[1] = e.name(f"{node.output[0]}.log_prob")
    inputs = [dy[0], node.output[1], *node.input[1:]]
    return [e.one("SoftmaxCrossEntropyLossGrad", *inputs, domain=MS, **_copy_attrs(node)), None, None]


@rule("Softplus")
def _softplus(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [e.one("Mul", dy[0], e.one("Sigmoid", node.input[0]))]
