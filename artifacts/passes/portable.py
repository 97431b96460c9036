"""The portable step: ORT's training graph lowered to operators every current ONNX Runtime runs.

Stock ``onnxruntime`` (1.20 and later, every platform and Python) has no training kernels. The
lowerings here rewrite each training-only operator the generator emits as the formula ORT 1.19.2's
CPU kernel evaluates, with standard ONNX operators, so that one training graph runs in a plain
``InferenceSession`` (the portable engine, :mod:`ondevice.engines.portable`):

- the gradient accumulators go: the graph returns each parameter's gradient, and the runtime
  binds that output to its accumulation buffer (or adds it in, for micro-batches);
- every other operator is replaced node for node (``LOWERINGS``), values unchanged up to rounding;
- what is left that stock ORT cannot run is reported by :func:`unportable`, never run silently.

The normalizations' lowerings are in :mod:`.portable_norms`, the convolution gradient's in
:mod:`.portable_conv`; what every lowering builds with (the graph's facts, the node builder) in
:mod:`._lowering`.

The optimizer update is its own graph (:mod:`artifacts.portable_optimizer`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ondevice.engines.contract import gradient_output

from ._lowering import Builder, GraphFacts, Unlowerable, output
from ._nodes import attributes
from .portable_conv import conv_grad
from .portable_norms import batchnorm_grad, batchnorm_internal, layer_norm_grad, simplified_layer_norm_grad

__all__ = ["FUNCTIONS", "LOWERINGS", "lower_accumulators", "lower_operators", "unportable", "RUNS_ON_STOCK"]

ACCUMULATOR = "InPlaceAccumulatorV2"
BUFFER_SUFFIX = "_grad.accumulation.buffer"
RESET = "lazy_reset_grad"
TRAINING_DOMAINS = ("ai.onnx.training", "ai.onnx.preview.training", "com.microsoft.experimental", "org.pytorch.aten")
RUNS_ON_STOCK = {
    "com.microsoft": {"FusedMatMul", "BiasGelu", "Gelu", "FastGelu", "QuickGelu", "BiasAdd", "SkipLayerNormalization"},
    "com.microsoft.nchwc": set(),  # x86 only: the variant graphs, never the portable one
}
"""Contrib operators with CPU kernels in stock ONNX Runtime (standard-domain operators always qualify)."""


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


def _dropout_grad(b: Builder, shapes: dict[str, list[int]]) -> None:
    # ORT's DropoutGrad: dX = dY * mask * (1 / (1 - ratio)) in training mode, else dY (ratio 0.5 by default).
    # A constant mode needs no Where (nodes fewer on small models'
    # steps, where each costs: the exported model's mode and ratio are constants).
    node = b.node
    dy, mask = node.input[0], node.input[1]
    ratio = node.input[2] if len(node.input) > 2 and node.input[2] else b.const(0.5)
    mode = node.input[3] if len(node.input) > 3 and node.input[3] else None
    training = None if mode is None else b.known(mode)
    if training is not None and not training.all():
        b.op("Identity", [dy], node.output[0])
        return
    fixed, one = b.known(ratio), np.float32(1.0)
    # Where, not a product with the mask as floats: a Cast of the mask reads no gradient, so ORT's priority order
    # would run it in the forward and keep a float copy of every mask (four times its bytes) until the backward
    masked = b.op("Where", [mask, dy, b.const(0.0)])
    if fixed is not None:  # a division by 1 - ratio: what ORT makes of the formula below (DivMulFusion). The
        # divisor is computed from the ratio (the same float32 as a constant): verification's dropout-free twin
        # zeroes the ratio input, which then reaches the gradient as it does the forward
        dropped = b.op("Div", [masked, b.op("Sub", [b.const(one), ratio])])
    else:
        dropped = b.op("Mul", [masked, b.op("Div", [b.const(1.0), b.op("Sub", [b.const(1.0), ratio])])])
    if mode is not None and training is None:
        b.op("Where", [mode, dropped, dy], node.output[0])
    else:
        b.op("Identity", [dropped], node.output[0])


def _softmax_grad(b: Builder, shapes: dict[str, list[int]]) -> None:
    # dX = Y * (dY - sum(dY * Y, axis)) over the softmax axis (opset-13 semantics).
    dy, y = b.node.input[:2]
    axis = int(attributes(b.node).get("axis", -1))
    total = b.reduce("ReduceSum", b.op("Mul", [dy, y]), [axis], 1)
    b.op("Mul", [y, b.op("Sub", [dy, total])], b.node.output[0])


def _log_softmax_grad(b: Builder, shapes: dict[str, list[int]]) -> None:
    # dX = dY - exp(Y) * sum(dY, axis)
    dy, y = b.node.input[:2]
    axis = int(attributes(b.node).get("axis", -1))
    total = b.reduce("ReduceSum", dy, [axis], 1)
    b.op("Sub", [dy, b.op("Mul", [b.op("Exp", [y]), total])], b.node.output[0])


def _quick_gelu_grad(b: Builder, shapes: dict[str, list[int]]) -> None:
    # QuickGelu(X) = X * sigmoid(alpha X) (SiLU when alpha is 1): with v = alpha X and s = sigmoid(v),
    # dX = dY * s * (1 + v * (1 - s)), the kernel's formula
    dy, x = b.node.input[:2]
    v = b.op("Mul", [x, b.const(float(attributes(b.node).get("alpha", 1.702)))])
    s = b.op("Sigmoid", [v])
    slope = b.op("Add", [b.const(1.0), b.op("Mul", [v, b.op("Sub", [b.const(1.0), s])])])
    b.op("Mul", [b.op("Mul", [dy, s]), slope], b.node.output[0])


def _label_weights(b: Builder, label: str, weight: str | None, given: dict) -> tuple[str, str]:
    """A cross-entropy's labels safe to gather with (ignored ones as class 0) and each label's weight: its class
    weight (1 without weights), 0 at ignore_index."""
    if "ignore_index" in given:
        valid = b.op("Not", [b.op("Equal", [label, b.const(np.array(int(given["ignore_index"]), np.int64))])])
        label = b.op("Where", [valid, label, b.const(np.array(0, np.int64))])  # any class: its row counts 0
        w = b.op("Cast", [valid], to=onnx.TensorProto.FLOAT)
    else:
        w = b.op("Cast", [b.op("Equal", [label, label])], to=onnx.TensorProto.FLOAT)  # ones of the label's shape
    if weight is not None:
        w = b.op("Mul", [w, b.op("Gather", [weight, label])])
    return label, w


def _softmax_cross_entropy_grad(b: Builder, shapes: dict[str, list[int]]) -> None:
    # ORT's SoftmaxCrossEntropyLossGrad: dX = (exp(log_prob) - onehot(label)) * w * dY / W, where w is
    # the label's class weight (1 without weights) and 0 at ignore_index, and W the sum of w ("mean"),
    # or 1 ("sum"); with "none" dY holds one value per row. The class axis is 1, as ONNX's loss has it.
    node = b.node
    dy, log_prob, label = node.input[:3]
    weight = node.input[3] if len(node.input) > 3 and node.input[3] else None
    a = attributes(node)
    reduction = a.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else str(reduction)
    rank = b.ranks.get(log_prob)
    if rank is None:
        raise Unlowerable(f"the rank of the cross-entropy scores {log_prob!r} is unknown")
    label, w = _label_weights(b, label, weight, a)
    if reduction == "mean":
        per_row = b.op("Div", [b.op("Mul", [w, dy]), b.reduce("ReduceSum", w, list(range(rank - 1)), 0)])
    elif reduction in ("sum", "none"):
        per_row = b.op("Mul", [w, dy])
    else:
        raise Unlowerable(f"reduction {reduction!r}")
    axis = b.const(np.array([1], np.int64))
    unsqueezed = b.op("Unsqueeze", [per_row, axis])
    # Two class-sized tensors (exp, then the scaled rows), not four (and no one-hot): the label's entry is
    # gathered, computed as the kernel computes it, (p - 1) * scale, and scattered back.
    probabilities, index = b.op("Exp", [log_prob]), b.op("Unsqueeze", [label, axis])
    picked = b.op("GatherElements", [probabilities, index], axis=1)
    at_label = b.op("Mul", [b.op("Sub", [picked, b.const(np.array(1.0, np.float32))]), unsqueezed])
    scaled = b.op("Mul", [probabilities, unsqueezed])
    b.op("ScatterElements", [scaled, index, at_label], node.output[0], axis=1)


def _softmax_cross_entropy(b: Builder, shapes: dict[str, list[int]]) -> None:
    # ONNX's SoftmaxCrossEntropyLoss (what the cross-entropy rewrite leaves: class weights or an ignore_index,
    # a causal LM's token loss): log_prob = LogSoftmax(scores, 1); loss = -sum(w * log_prob[label]) / sum(w)
    # ("mean"), the sum ("sum") or each row's ("none"), w the label's class weight (1 without weights), 0 at
    # ignore_index. Stock ORT has no kernel for it and runs the ONNX function it is defined by, inlined when
    # it loads an ONNX file; an ORT-format graph converted where the training build's kernel exists keeps the
    # node, and stock ORT (ORT Mobile, onnxruntime-web) then refuses the graph.
    node = b.node
    scores, label = node.input[:2]
    weight = node.input[2] if len(node.input) > 2 and node.input[2] else None
    a = attributes(node)
    reduction = a.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else str(reduction)
    rank = b.ranks.get(scores)
    if rank is None or b.opset < 13 or reduction not in ("mean", "sum", "none"):
        raise Unlowerable(f"cross-entropy over {scores!r} (rank {rank}, opset {b.opset}, reduction {reduction!r})")
    log_prob = b.op("LogSoftmax", [scores], output(node, 1), axis=1)
    label, w = _label_weights(b, label, weight, a)
    axis = b.const(np.array([1], np.int64))
    picked = b.op("Squeeze", [b.op("GatherElements", [log_prob, b.op("Unsqueeze", [label, axis])], axis=1), axis])
    losses = b.op("Neg", [b.op("Mul", [picked, w])])
    if reduction == "none":
        b.op("Identity", [losses], node.output[0])
        return
    total = b.reduce("ReduceSum", losses, list(range(rank - 1)), 0)
    if reduction == "sum":
        b.op("Identity", [total], node.output[0])
    else:
        b.op("Div", [total, b.reduce("ReduceSum", w, list(range(rank - 1)), 0)], node.output[0])


def _fast_gelu_grad(b: Builder, shapes: dict[str, list[int]]) -> None:
    # FastGelu(X) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3) (GPT-2's tanh GELU):
    # dX = dY (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)), t = tanh(u), the kernel's formula
    node = b.node
    dy, x = node.input[:2]
    # (each product with x starts from a constant, so all of it can wait for dY: Builder.wait_for)
    root = b.const(float(np.sqrt(2 / np.pi)))
    cubic = b.op("Mul", [b.op("Mul", [x, b.const(0.044715)]), x])  # 0.044715 x^2
    t = b.op("Tanh", [b.op("Mul", [root, b.op("Mul", [x, b.op("Add", [b.const(1.0), cubic])])])])
    left = b.op("Mul", [b.const(0.5), b.op("Add", [b.const(1.0), t])])
    slope = b.op("Mul", [root, b.op("Add", [b.const(1.0), b.op("Mul", [b.const(3.0), cubic])])])
    right = b.op("Mul", [b.op("Mul", [b.const(0.5), x]), b.op("Mul", [b.op("Sub", [b.const(1.0), b.op("Mul", [t, t])]),
                                                                       slope])])  # fmt: skip
    b.op("Mul", [dy, b.op("Add", [left, right])], node.output[0])


def _gather_grad(b: Builder, shapes: dict[str, list[int]]) -> None:
    # GatherGrad(shape, indices, dY; axis 0): zeros of ``shape`` with each row of dY added into the row its
    # index names (negative indices count from the end). ScatterElements with reduction "add" sums repeated
    # indices in order (ScatterND's CPU kernel loses repeated updates across threads; see gathergrad.py).
    node = b.node
    shape, indices, dy = node.input[:3]
    rank = (b.dims.get(shape) or [None])[0]
    if int(attributes(node).get("axis", 0)) != 0 or not isinstance(rank, int) or rank < 1 or b.opset < 16:
        raise Unlowerable("GatherGrad on an axis other than 0, of an unknown rank, or below opset 16")
    zeros = b.op("ConstantOfShape", [shape], value=numpy_helper.from_array(np.array([0.0], np.float32)))
    rows = b.op("Slice", [shape, b.const(np.array([0], np.int64)), b.const(np.array([1], np.int64))])
    flat = b.op("Reshape", [indices, b.const(np.array([-1], np.int64))])
    flat = b.op("Where", [b.op("Less", [flat, b.const(np.array(0, np.int64))]), b.op("Add", [flat, rows]), flat])
    rest = b.op("Slice", [shape, b.const(np.array([1], np.int64)), b.const(np.array([rank], np.int64))])
    updates = b.op("Reshape", [dy, b.op("Concat", [b.const(np.array([-1], np.int64)), rest], axis=0)])
    column = b.op("Reshape", [flat, b.const(np.array([-1] + [1] * (rank - 1), np.int64))])
    spread = b.op("Expand", [column, b.op("Shape", [updates])])
    b.op("ScatterElements", [zeros, spread, updates], node.output[0], axis=0, reduction="add")


def _concat_training(b: Builder, shapes: dict[str, list[int]]) -> None:
    # Concat, and (when read) each input's length along the axis as an int64 vector.
    node = b.node
    axis = int(attributes(b.node)["axis"])
    b.op("Concat", list(node.input), node.output[0], axis=axis)
    if output(node, 1):
        end = axis + 1 if axis != -1 else 2**62  # a slice ending at -1 + 1 = 0 would be empty
        at, after = b.const(np.array([axis], np.int64)), b.const(np.array([end], np.int64))
        lengths = [b.op("Slice", [b.op("Shape", [i]), at, after]) for i in node.input]
        b.op("Concat", lengths, node.output[1], axis=0)


def _split_training(b: Builder, shapes: dict[str, list[int]]) -> None:
    # SplitTraining(input, split) is Split with the lengths as an input (opset 13+).
    node = b.node
    axis = int(attributes(node).get("axis", 0))
    b.nodes.append(helper.make_node("Split", list(node.input[:2]), list(node.output), axis=axis))


def _sigmoid_grad(b: Builder, shapes: dict[str, list[int]]) -> None:
    dy, y = b.node.input[:2]  # dX = dY * Y * (1 - Y)
    b.op("Mul", [b.op("Mul", [dy, y]), b.op("Sub", [b.const(1.0), y])], b.node.output[0])


def _tanh_grad(b: Builder, shapes: dict[str, list[int]]) -> None:
    dy, y = b.node.input[:2]  # dX = dY * (1 - Y^2), as (1 - Y)(1 + Y): each factor starts from a constant (wait_for)
    b.op("Mul", [dy, b.op("Mul", [b.op("Sub", [b.const(1.0), y]), b.op("Add", [b.const(1.0), y])])], b.node.output[0])


def _scale(b: Builder, shapes: dict[str, list[int]]) -> None:
    x, factor = b.node.input[:2]  # Y = X * scale, or X / scale with scale_down
    cast = b.op("Cast", [factor], to=onnx.TensorProto.FLOAT)
    b.op("Div" if attributes(b.node).get("scale_down", 0) else "Mul", [x, cast], b.node.output[0])


def _reduce_all_l2(b: Builder, shapes: dict[str, list[int]]) -> None:
    # sqrt of the sum of every input's squares (the finite check's norm)
    squares = [b.op("ReduceSumSquare", [i], keepdims=0) for i in b.node.input]
    b.op("Sqrt", [b.op("Sum", squares)], b.node.output[0])


def _slice_grad(b: Builder, shapes: dict[str, list[int]]) -> None:
    # The gradient of a unit-step Slice is dY padded with zeros back to the input's shape:
    # pads at each sliced axis are the clamped start and (dim - clamped end).
    node = b.node
    dy, shape, starts, ends = node.input[:4]
    axes = node.input[4] if len(node.input) > 4 and node.input[4] else None
    steps = node.input[5] if len(node.input) > 5 and node.input[5] else None
    if steps is not None and not np.all(b.constant_value(steps) == 1):
        raise Unlowerable("SliceGrad with steps other than 1")
    rank = b.op("Size", [shape])
    if axes is None:
        axes = b.op("Range", [b.const(np.array(0, np.int64)), b.op("Size", [starts]), b.const(np.array(1, np.int64))])
    axes = b.op("Where", [b.op("Less", [axes, b.const(np.array(0, np.int64))]), b.op("Add", [axes, rank]), axes])
    dims = b.op("Gather", [shape, axes])
    zero = b.const(np.array(0, np.int64))

    def clamp(index: str) -> str:
        wrapped = b.op("Where", [b.op("Less", [index, zero]), b.op("Add", [index, dims]), index])
        return b.op("Max", [b.op("Min", [wrapped, dims]), zero])

    begin, end = clamp(starts), clamp(ends)
    twice = b.op("Reshape", [b.op("Mul", [rank, b.const(np.array(2, np.int64))]), b.const(np.array([1], np.int64))])
    pads = b.op("ConstantOfShape", [twice], value=numpy_helper.from_array(np.array([0], np.int64)))
    where = b.op("Concat", [axes, b.op("Add", [axes, rank])], axis=0)
    amounts = b.op("Concat", [begin, b.op("Sub", [dims, end])], axis=0)
    b.op("Pad", [dy, b.op("ScatterElements", [pads, where, amounts])], node.output[0])


LOWERINGS: dict[str, Callable[[Builder, dict[str, list[int]]], None]] = {
    "DropoutGrad": _dropout_grad,
    "SoftmaxGrad_13": _softmax_grad,
    "LogSoftmaxGrad_13": _log_softmax_grad,
    "LayerNormalizationGrad": layer_norm_grad,
    "SimplifiedLayerNormalizationGrad": simplified_layer_norm_grad,
    "QuickGeluGrad": _quick_gelu_grad,
    "SoftmaxCrossEntropyLossGrad": _softmax_cross_entropy_grad,
    "SoftmaxCrossEntropyLoss": _softmax_cross_entropy,
    "FastGeluGrad": _fast_gelu_grad,
    "GatherGrad": _gather_grad,
    "ConcatTraining": _concat_training,
    "SplitTraining": _split_training,
    "SigmoidGrad": _sigmoid_grad,
    "TanhGrad": _tanh_grad,
    "Scale": _scale,
    "ReduceAllL2": _reduce_all_l2,
    "SliceGrad": _slice_grad,
    "BatchNormInternal": batchnorm_internal,
    "BatchNormalizationGrad": batchnorm_grad,
    "ConvGrad": conv_grad,
}
"""ORT training operator (com.microsoft), or an ONNX function operator stock ORT has no kernel for (in
:data:`FUNCTIONS`) -> the standard operators that compute it."""
FUNCTIONS = {"SoftmaxCrossEntropyLoss"}
"""Standard-domain operators that stock ORT runs only by inlining their ONNX function, which it does for ONNX
files but not for ORT-format graphs."""


def lower_operators(model: onnx.ModelProto, opset: int, only: tuple[str, ...] | None = None) -> list[str]:
    """Replace every operator in ``LOWERINGS`` (or those in ``only``) in place; returns the types replaced."""
    graph = model.graph
    shapes = _static_shapes(graph)
    facts = GraphFacts(model)
    constants: dict[str, onnx.TensorProto] = {}
    nodes, done = [], []
    for node in graph.node:
        known = node.domain == "com.microsoft" or node.domain in ("", "ai.onnx") and node.op_type in FUNCTIONS
        chosen = known and (only is None or node.op_type in only)
        lowering = LOWERINGS.get(node.op_type) if chosen else None
        if lowering is None:
            nodes.append(node)
            continue
        builder = Builder(node, constants, opset, facts)
        try:
            lowering(builder, shapes)
        except Unlowerable:
            nodes.append(node)
            continue
        if node.op_type.removesuffix("_13").endswith("Grad"):
            builder.wait_for(node.input[0])
        nodes.extend(builder.nodes)
        done.append(node.op_type)
    del graph.node[:]
    graph.node.extend(nodes)
    present = {i.name for i in graph.initializer}  # another lowering pass may have added the same constants
    graph.initializer.extend(value for name, value in constants.items() if name not in present)
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
