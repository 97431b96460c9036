"""The portable step: ORT's training graph lowered to operators every current ONNX Runtime runs.

Stock ``onnxruntime`` (1.20 and later, every platform and Python) has no training kernels. The
lowerings here rewrite each training-only operator the generator emits as the formula ORT 1.19.2's
CPU kernel evaluates, with standard ONNX operators, so that one training graph runs in a plain
``InferenceSession`` (the portable engine, :mod:`ondevice.engines.portable`):

- the gradient accumulators go: the graph returns each parameter's gradient, and the runtime
  binds that output to its accumulation buffer (or adds it in, for micro-batches);
- every other operator is replaced node for node (``LOWERINGS``), values unchanged up to rounding;
- what is left that stock ORT cannot run is reported by :func:`unportable`, never run silently.

The optimizer update is its own graph (:mod:`artifacts.portable_optimizer`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ._nodes import attributes

__all__ = ["LOWERINGS", "lower_accumulators", "lower_operators", "unportable", "gradient_output", "RUNS_ON_STOCK"]

ACCUMULATOR = "InPlaceAccumulatorV2"
BUFFER_SUFFIX = "_grad.accumulation.buffer"
RESET = "lazy_reset_grad"
TRAINING_DOMAINS = ("ai.onnx.training", "ai.onnx.preview.training", "com.microsoft.experimental", "org.pytorch.aten")
RUNS_ON_STOCK = {
    "com.microsoft": {"FusedMatMul", "BiasGelu", "Gelu", "FastGelu", "QuickGelu", "BiasAdd", "SkipLayerNormalization"},
    "com.microsoft.nchwc": set(),  # x86 only: the variant graphs, never the portable one
}
"""Contrib operators with CPU kernels in stock ONNX Runtime (standard-domain operators always qualify)."""


def gradient_output(parameter: str) -> str:
    """The portable training graph's output that carries ``parameter``'s gradient of one step."""
    return f"{parameter}_grad"


def lower_accumulators(model: onnx.ModelProto) -> list[str]:
    """Replace ``InPlaceAccumulatorV2`` by plain gradient outputs; returns the parameters, in order.

    The accumulation buffers and the reset flag leave the inputs, the flags leave the outputs, and
    whatever read the accumulated alias (the finite check) reads the step's gradient instead.
    """
    graph = model.graph
    renames: dict[str, str] = {}
    parameters, keep, extra = [], [], []
    for node in graph.node:
        if node.op_type != ACCUMULATOR:
            keep.append(node)
            continue
        parameter = node.input[0].removesuffix(BUFFER_SUFFIX)
        parameters.append(parameter)
        grad, name = node.input[1], gradient_output(parameter)
        if grad != name:
            extra.append(helper.make_node("Identity", [grad], [name]))
        if len(node.output) > 1 and node.output[1]:
            renames[node.output[1]] = name
    del graph.node[:]
    graph.node.extend(keep + extra)
    _rename_inputs(graph, renames)
    flags = {f"{p}_grad.accumulation.out" for p in parameters}
    outputs = [o for o in graph.output if o.name not in flags]
    del graph.output[:]
    graph.output.extend(outputs)
    for parameter in parameters:
        shape = next(list(i.type.tensor_type.shape.dim) for i in graph.input if i.name == parameter)
        value = helper.make_tensor_value_info(gradient_output(parameter), onnx.TensorProto.FLOAT, None)
        value.type.tensor_type.shape.dim.extend(shape)
        graph.output.append(value)
    dropped = {p + BUFFER_SUFFIX for p in parameters} | {RESET}
    inputs = [i for i in graph.input if i.name not in dropped]
    del graph.input[:]
    graph.input.extend(inputs)
    return parameters


def _rename_inputs(graph: onnx.GraphProto, renames: dict[str, str]) -> None:
    for node in graph.node:
        node.input[:] = [renames.get(i, i) for i in node.input]


# -- node lowerings: each returns the replacement nodes (and adds constants to ``constants``) --------


class _Builder:
    """Names and constants for one lowered node."""

    def __init__(self, node: onnx.NodeProto, constants: dict[str, onnx.TensorProto], opset: int) -> None:
        self.node, self.constants, self.opset = node, constants, opset
        self.prefix = (node.name or node.output[0]) + ".portable"
        self.nodes: list[onnx.NodeProto] = []

    def const(self, value: np.ndarray | float | list[int]) -> str:
        array = np.asarray(value, dtype=np.float32 if isinstance(value, float) else None)
        name = f"odt.portable.{array.dtype}.{'_'.join(map(str, array.shape))}.{array.tobytes().hex()}"
        self.constants.setdefault(name, numpy_helper.from_array(array, name))
        return name

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: object) -> str:
        out = out or f"{self.prefix}.{len(self.nodes)}.{op_type}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def reduce(self, op_type: str, x: str, axes: list[int], keepdims: int, out: str | None = None) -> str:
        """A reduction over ``axes`` in this opset's form (axes became an input in 13 or 18)."""
        if op_type == "ReduceSum" and self.opset >= 13 or self.opset >= 18:
            return self.op(op_type, [x, self.const(np.array(axes, np.int64))], out, keepdims=keepdims)
        return self.op(op_type, [x], out, axes=axes, keepdims=keepdims)


def _out(node: onnx.NodeProto, index: int) -> str | None:
    return node.output[index] if len(node.output) > index and node.output[index] else None


def _dropout_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # ORT's DropoutGrad: dX = dY * mask * (1 / (1 - ratio)) in training mode, else dY (ratio 0.5 by default).
    node = b.node
    dy, mask = node.input[0], node.input[1]
    ratio = node.input[2] if len(node.input) > 2 and node.input[2] else b.const(0.5)
    scale = b.op("Div", [b.const(1.0), b.op("Sub", [b.const(1.0), ratio])])
    dropped = b.op("Mul", [b.op("Mul", [dy, b.op("Cast", [mask], to=onnx.TensorProto.FLOAT)]), scale])
    if len(node.input) > 3 and node.input[3]:
        b.op("Where", [node.input[3], dropped, dy], node.output[0])
    else:
        b.op("Identity", [dropped], node.output[0])


def _softmax_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # dX = Y * (dY - sum(dY * Y, axis)) over the softmax axis (opset-13 semantics).
    dy, y = b.node.input[:2]
    axis = int(attributes(b.node).get("axis", -1))
    total = b.reduce("ReduceSum", b.op("Mul", [dy, y]), [axis], 1)
    b.op("Mul", [y, b.op("Sub", [dy, total])], b.node.output[0])


def _log_softmax_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # dX = dY - exp(Y) * sum(dY, axis)
    dy, y = b.node.input[:2]
    axis = int(attributes(b.node).get("axis", -1))
    total = b.reduce("ReduceSum", dy, [axis], 1)
    b.op("Sub", [dy, b.op("Mul", [b.op("Exp", [y]), total])], b.node.output[0])


def _layer_norm_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # ORT's LayerNormalizationGrad over the trailing axes that scale covers:
    #   x_hat = (X - mean) * inv_std;  dbias = sum_rows dY;  dscale = sum_rows dY * x_hat
    #   a = dY * scale;  dX = inv_std * (a - mean(a) - x_hat * mean(a * x_hat))
    node = b.node
    dy, x, scale, mean, inv_std = node.input[:5]
    normalized = shapes.get(scale)
    if normalized is None:
        raise _Unlowerable(f"the shape of LayerNormalization's scale {scale!r} is unknown")
    axes = list(range(-len(normalized), 0))
    x_hat = b.op("Mul", [b.op("Sub", [x, mean]), inv_std])
    if _out(node, 0):
        a = b.op("Mul", [dy, scale])
        mean_a = b.reduce("ReduceMean", a, axes, 1)
        mean_ax = b.reduce("ReduceMean", b.op("Mul", [a, x_hat]), axes, 1)
        inner = b.op("Sub", [b.op("Sub", [a, mean_a]), b.op("Mul", [x_hat, mean_ax])])
        b.op("Mul", [inner, inv_std], node.output[0])
    rows = b.const(np.array([-1, int(np.prod(normalized))], np.int64))
    target = b.const(np.array(normalized, np.int64))
    for index, value in ((1, b.op("Mul", [dy, x_hat]) if _out(node, 1) else None), (2, dy if _out(node, 2) else None)):
        if value is not None:
            summed = b.reduce("ReduceSum", b.op("Reshape", [value, rows]), [0], 0)
            b.op("Reshape", [summed, target], node.output[index])


def _concat_training(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # Concat, and (when read) each input's length along the axis as an int64 vector.
    node = b.node
    axis = int(attributes(b.node)["axis"])
    b.op("Concat", list(node.input), node.output[0], axis=axis)
    if _out(node, 1):
        end = axis + 1 if axis != -1 else 2**62  # a slice ending at -1 + 1 = 0 would be empty
        at, after = b.const(np.array([axis], np.int64)), b.const(np.array([end], np.int64))
        lengths = [b.op("Slice", [b.op("Shape", [i]), at, after]) for i in node.input]
        b.op("Concat", lengths, node.output[1], axis=0)


def _split_training(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # SplitTraining(input, split) is Split with the lengths as an input (opset 13+).
    node = b.node
    axis = int(attributes(node).get("axis", 0))
    b.nodes.append(helper.make_node("Split", list(node.input[:2]), list(node.output), axis=axis))


def _sigmoid_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
    dy, y = b.node.input[:2]  # dX = dY * Y * (1 - Y)
    b.op("Mul", [b.op("Mul", [dy, y]), b.op("Sub", [b.const(1.0), y])], b.node.output[0])


def _tanh_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
    dy, y = b.node.input[:2]  # dX = dY * (1 - Y^2)
    b.op("Mul", [dy, b.op("Sub", [b.const(1.0), b.op("Mul", [y, y])])], b.node.output[0])


def _scale(b: _Builder, shapes: dict[str, list[int]]) -> None:
    x, factor = b.node.input[:2]  # Y = X * scale, or X / scale with scale_down
    cast = b.op("Cast", [factor], to=onnx.TensorProto.FLOAT)
    b.op("Div" if attributes(b.node).get("scale_down", 0) else "Mul", [x, cast], b.node.output[0])


def _reduce_all_l2(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # sqrt of the sum of every input's squares (the finite check's norm)
    squares = [b.op("ReduceSumSquare", [i], keepdims=0) for i in b.node.input]
    b.op("Sqrt", [b.op("Sum", squares)], b.node.output[0])


class _Unlowerable(ValueError):
    pass


LOWERINGS: dict[str, Callable[[_Builder, dict[str, list[int]]], None]] = {
    "DropoutGrad": _dropout_grad,
    "SoftmaxGrad_13": _softmax_grad,
    "LogSoftmaxGrad_13": _log_softmax_grad,
    "LayerNormalizationGrad": _layer_norm_grad,
    "ConcatTraining": _concat_training,
    "SplitTraining": _split_training,
    "SigmoidGrad": _sigmoid_grad,
    "TanhGrad": _tanh_grad,
    "Scale": _scale,
    "ReduceAllL2": _reduce_all_l2,
}
"""ORT training operator (com.microsoft) -> the standard operators that compute it."""


def lower_operators(model: onnx.ModelProto, opset: int, only: tuple[str, ...] | None = None) -> list[str]:
    """Replace every operator in ``LOWERINGS`` (or those in ``only``) in place; returns the types replaced."""
    graph = model.graph
    shapes = _static_shapes(graph)
    constants: dict[str, onnx.TensorProto] = {}
    nodes, done = [], []
    for node in graph.node:
        chosen = node.domain == "com.microsoft" and (only is None or node.op_type in only)
        lowering = LOWERINGS.get(node.op_type) if chosen else None
        if lowering is None:
            nodes.append(node)
            continue
        builder = _Builder(node, constants, opset)
        try:
            lowering(builder, shapes)
        except _Unlowerable:
            nodes.append(node)
            continue
        nodes.extend(builder.nodes)
        done.append(node.op_type)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(constants.values())
    _prune_opsets(model)
    return done


def _static_shapes(graph: onnx.GraphProto) -> dict[str, list[int]]:
    shapes = {i.name: list(i.dims) for i in graph.initializer}
    for value in (*graph.input, *graph.value_info):
        dims = value.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes.setdefault(value.name, [d.dim_value for d in dims])
    return shapes


def _prune_opsets(model: onnx.ModelProto) -> None:
    used = {n.domain for n in model.graph.node}
    keep = [o for o in model.opset_import if o.domain in ("", "ai.onnx") or o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(keep)


def unportable(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes stock ONNX Runtime has no CPU kernel for (empty when the graph is portable)."""
    return [
        n for n in model.graph.node
        if n.domain not in ("", "ai.onnx") and n.op_type not in RUNS_ON_STOCK.get(n.domain, set())
    ]  # fmt: skip
