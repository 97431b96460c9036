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

from collections import Counter
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ondevice.engines.contract import gradient_output

from ._nodes import attributes, inferred_graph, zero_after

__all__ = ["FUNCTIONS", "LOWERINGS", "lower_accumulators", "lower_operators", "unportable", "RUNS_ON_STOCK"]

ACCUMULATOR = "InPlaceAccumulatorV2"
_WAIT = "odt.portable.wait"
_WAIT_CONSTANTS = {
    f"{_WAIT}/flat": np.array([-1], np.int64),
    f"{_WAIT}/start": np.array([0], np.int64),
    f"{_WAIT}/stop": np.array([1], np.int64),
    f"{_WAIT}/nothing": np.array([0.0], np.float32),
}
"""What :func:`zero_after` reads (``wait_constants``' values) as initializers, shared by every lowered gradient."""
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


class _GraphFacts:
    """What lowerings read about the whole graph: ranks (from ONNX shape inference), the values some
    node reads, and constant initializers."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self._initializers = {i.name: i for i in graph.initializer if i.data_location != 1}
        self._values: dict[str, np.ndarray] = {}  # each initializer's value, read once when a lowering asks
        self.used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        self.inputs = {i.name for i in graph.input}
        self.batchnorm_scales = Counter(n.input[1] for n in graph.node if n.op_type == "BatchNormInternal")
        """how many training-mode BatchNorms read each scale (more than one: a module applied twice)"""
        try:
            inferred = inferred_graph(model)
        except Exception:  # noqa: BLE001 - ranks are a help; a lowering that needs one declines without
            inferred = graph
        values = [v for v in (*inferred.input, *inferred.value_info, *inferred.output)
                  if v.type.tensor_type.HasField("shape")]  # fmt: skip
        self.ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in values}
        self.dims = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
                     for v in values}  # fmt: skip

    def is_constant(self, name: str) -> bool:
        """Whether ``name`` is an initializer (its value is not read)."""
        return name in self._initializers

    def constant(self, name: str) -> np.ndarray | None:
        """The value of the initializer ``name`` (None when there is none)."""
        if name not in self._values and name in self._initializers:
            self._values[name] = numpy_helper.to_array(self._initializers[name])
        return self._values.get(name)


class _Builder:
    """Names and constants for one lowered node."""

    def __init__(self, node: onnx.NodeProto, constants: dict[str, onnx.TensorProto], opset: int,
                 graph: _GraphFacts) -> None:  # fmt: skip
        self.node, self.constants, self.opset = node, constants, opset
        self.ranks, self.dims, self.used, self._graph = graph.ranks, graph.dims, graph.used, graph
        self.inputs, self.batchnorm_scales = graph.inputs, graph.batchnorm_scales
        self.per_row: set[str] = set()
        """inputs a lowering knows hold one value per row (a norm's statistics), whatever shape inference knew"""
        self.prefix = (node.name or node.output[0]) + ".portable"
        self.nodes: list[onnx.NodeProto] = []

    def const(self, value: np.ndarray | float | list[int]) -> str:
        array = np.asarray(value, dtype=np.float32 if isinstance(value, float) else None)
        name = f"odt.portable.{array.dtype}.{'_'.join(map(str, array.shape))}.{array.tobytes().hex()}"
        self.constants.setdefault(name, numpy_helper.from_array(array, name))
        return name

    def constant_value(self, name: str) -> np.ndarray:
        if name in self.constants:
            return numpy_helper.to_array(self.constants[name])
        value = self._graph.constant(name)
        if value is None:
            raise _Unlowerable(f"{name!r} is not a constant")
        return value

    def known(self, name: str) -> np.ndarray | None:
        """``name``'s value when it is a constant, else None."""
        try:
            return self.constant_value(name)
        except _Unlowerable:
            return None

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: object) -> str:
        out = out or f"{self.prefix}.{len(self.nodes)}.{op_type}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def wait_for(self, gradient: str) -> None:
        """Make the lowering's forward-only arithmetic (what it computes from saved activations alone, like
        SiLU's sigmoid) wait for ``gradient``: ORT's priority order would run it in the forward, as soon as
        the activation exists, and keep its results (new tensors of the activation's size) until the
        backward. Each such node that reads a float constant reads that constant plus ``0 * gradient[0]``
        instead (SmolLM2's step: 377 -> 367 MiB, measured). Others stay as they are."""
        made = {n.output[0] for n in self.nodes}
        later = {gradient}
        for node in self.nodes:
            if later.intersection(node.input):
                later.update(node.output)
        early = []  # (node, input position of a float constant) of nodes that read activations alone
        for node in self.nodes:
            reads = [i for i in node.input if i]
            if later.intersection(reads) or made.intersection(reads) or all(self._constant(i) for i in reads):
                continue  # waits already, waits through what it reads, or is constant (DropoutGrad's 1 - ratio
                # waited for dY: 4 nodes, and a Slice the profile gave 139 us of a 360 us digits step)
            slots = [k for k, i in enumerate(node.input) if self._waitable(i)]
            early += [(node, slots[0])] if slots else []
        if not early:
            return
        at = f"{self.prefix}.wait"
        waits: list[onnx.NodeProto] = []
        for name, array in _WAIT_CONSTANTS.items():
            self.constants.setdefault(name, numpy_helper.from_array(array, name))
        zero = zero_after(gradient, at, _WAIT, waits)  # [1]; as a scalar, the sums keep each constant's shape
        scalar = self.const(np.array([], np.int64))
        waits.append(helper.make_node("Reshape", [zero, scalar], [f"{at}.zero"], name=f"{at}.zero"))
        for index, (node, slot) in enumerate(early):
            waited = f"{at}.{index}"
            waits.append(helper.make_node("Add", [node.input[slot], f"{at}.zero"], [waited], name=waited))
            node.input[slot] = waited
        self.nodes[:0] = waits

    def _constant(self, name: str) -> bool:
        return name in self.constants or self._graph.is_constant(name)

    def _waitable(self, name: str) -> bool:
        """A float constant, or one of :attr:`per_row`: cheap to add a zero to."""
        if name in self.constants:
            return self.constants[name].data_type == onnx.TensorProto.FLOAT
        return name in self.per_row

    def reduce(self, op_type: str, x: str, axes: list[int], keepdims: int, out: str | None = None) -> str:
        """A reduction over ``axes`` in this opset's form (axes became an input in 13 or 18)."""
        if op_type == "ReduceSum" and self.opset >= 13 or self.opset >= 18:
            return self.op(op_type, [x, self.const(np.array(axes, np.int64))], out, keepdims=keepdims)
        return self.op(op_type, [x], out, axes=axes, keepdims=keepdims)


def _out(node: onnx.NodeProto, index: int) -> str | None:
    return node.output[index] if len(node.output) > index and node.output[index] else None


def _dropout_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
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
    b.per_row.update((mean, inv_std))
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


def _simplified_layer_norm_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # ORT's SimplifiedLayerNormalizationGrad (RMSNorm, as Llama, Qwen, Mistral and SmolLM normalize):
    #   x_hat = X * inv_std;  a = dY * scale;  dX = inv_std * (a - x_hat * mean(a * x_hat))
    #   dscale = sum_rows dY * x_hat
    node = b.node
    dy, x, scale, inv_std = node.input[:4]
    b.per_row.add(inv_std)
    normalized = shapes.get(scale)
    if normalized is None:
        raise _Unlowerable(f"the shape of SimplifiedLayerNormalization's scale {scale!r} is unknown")
    axes = list(range(-len(normalized), 0))
    x_hat = b.op("Mul", [x, inv_std])
    if _out(node, 0):
        a = b.op("Mul", [dy, scale])
        mean_ax = b.reduce("ReduceMean", b.op("Mul", [a, x_hat]), axes, 1)
        b.op("Mul", [b.op("Sub", [a, b.op("Mul", [x_hat, mean_ax])]), inv_std], node.output[0])
    if _out(node, 1):
        rows = b.const(np.array([-1, int(np.prod(normalized))], np.int64))
        summed = b.reduce("ReduceSum", b.op("Reshape", [b.op("Mul", [dy, x_hat]), rows]), [0], 0)
        b.op("Reshape", [summed, b.const(np.array(normalized, np.int64))], node.output[1])


def _quick_gelu_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # QuickGelu(X) = X * sigmoid(alpha X) (SiLU when alpha is 1): with v = alpha X and s = sigmoid(v),
    # dX = dY * s * (1 + v * (1 - s)), the kernel's formula
    dy, x = b.node.input[:2]
    v = b.op("Mul", [x, b.const(float(attributes(b.node).get("alpha", 1.702)))])
    s = b.op("Sigmoid", [v])
    slope = b.op("Add", [b.const(1.0), b.op("Mul", [v, b.op("Sub", [b.const(1.0), s])])])
    b.op("Mul", [b.op("Mul", [dy, s]), slope], b.node.output[0])


def _label_weights(b: _Builder, label: str, weight: str | None, given: dict) -> tuple[str, str]:
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


def _softmax_cross_entropy_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
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
        raise _Unlowerable(f"the rank of the cross-entropy scores {log_prob!r} is unknown")
    label, w = _label_weights(b, label, weight, a)
    if reduction == "mean":
        per_row = b.op("Div", [b.op("Mul", [w, dy]), b.reduce("ReduceSum", w, list(range(rank - 1)), 0)])
    elif reduction in ("sum", "none"):
        per_row = b.op("Mul", [w, dy])
    else:
        raise _Unlowerable(f"reduction {reduction!r}")
    axis = b.const(np.array([1], np.int64))
    unsqueezed = b.op("Unsqueeze", [per_row, axis])
    # Two class-sized tensors (exp, then the scaled rows), not four (and no one-hot): the label's entry is
    # gathered, computed as the kernel computes it, (p - 1) * scale, and scattered back.
    probabilities, index = b.op("Exp", [log_prob]), b.op("Unsqueeze", [label, axis])
    picked = b.op("GatherElements", [probabilities, index], axis=1)
    at_label = b.op("Mul", [b.op("Sub", [picked, b.const(np.array(1.0, np.float32))]), unsqueezed])
    scaled = b.op("Mul", [probabilities, unsqueezed])
    b.op("ScatterElements", [scaled, index, at_label], node.output[0], axis=1)


def _softmax_cross_entropy(b: _Builder, shapes: dict[str, list[int]]) -> None:
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
        raise _Unlowerable(f"cross-entropy over {scores!r} (rank {rank}, opset {b.opset}, reduction {reduction!r})")
    log_prob = b.op("LogSoftmax", [scores], _out(node, 1), axis=1)
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


def _fast_gelu_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
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


def _gather_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # GatherGrad(shape, indices, dY; axis 0): zeros of ``shape`` with each row of dY added into the row its
    # index names (negative indices count from the end). ScatterElements with reduction "add" sums repeated
    # indices in order (ScatterND's CPU kernel loses repeated updates across threads; see gathergrad.py).
    node = b.node
    shape, indices, dy = node.input[:3]
    rank = (b.dims.get(shape) or [None])[0]
    if int(attributes(node).get("axis", 0)) != 0 or not isinstance(rank, int) or rank < 1 or b.opset < 16:
        raise _Unlowerable("GatherGrad on an axis other than 0, of an unknown rank, or below opset 16")
    zeros = b.op("ConstantOfShape", [shape], value=numpy_helper.from_array(np.array([0.0], np.float32)))
    rows = b.op("Slice", [shape, b.const(np.array([0], np.int64)), b.const(np.array([1], np.int64))])
    flat = b.op("Reshape", [indices, b.const(np.array([-1], np.int64))])
    flat = b.op("Where", [b.op("Less", [flat, b.const(np.array(0, np.int64))]), b.op("Add", [flat, rows]), flat])
    rest = b.op("Slice", [shape, b.const(np.array([1], np.int64)), b.const(np.array([rank], np.int64))])
    updates = b.op("Reshape", [dy, b.op("Concat", [b.const(np.array([-1], np.int64)), rest], axis=0)])
    column = b.op("Reshape", [flat, b.const(np.array([-1] + [1] * (rank - 1), np.int64))])
    spread = b.op("Expand", [column, b.op("Shape", [updates])])
    b.op("ScatterElements", [zeros, spread, updates], node.output[0], axis=0, reduction="add")


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
    dy, y = b.node.input[:2]  # dX = dY * (1 - Y^2), as (1 - Y)(1 + Y): each factor starts from a constant (wait_for)
    b.op("Mul", [dy, b.op("Mul", [b.op("Sub", [b.const(1.0), y]), b.op("Add", [b.const(1.0), y])])], b.node.output[0])


def _scale(b: _Builder, shapes: dict[str, list[int]]) -> None:
    x, factor = b.node.input[:2]  # Y = X * scale, or X / scale with scale_down
    cast = b.op("Cast", [factor], to=onnx.TensorProto.FLOAT)
    b.op("Div" if attributes(b.node).get("scale_down", 0) else "Mul", [x, cast], b.node.output[0])


def _reduce_all_l2(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # sqrt of the sum of every input's squares (the finite check's norm)
    squares = [b.op("ReduceSumSquare", [i], keepdims=0) for i in b.node.input]
    b.op("Sqrt", [b.op("Sum", squares)], b.node.output[0])


def _slice_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # The gradient of a unit-step Slice is dY padded with zeros back to the input's shape:
    # pads at each sliced axis are the clamped start and (dim - clamped end).
    node = b.node
    dy, shape, starts, ends = node.input[:4]
    axes = node.input[4] if len(node.input) > 4 and node.input[4] else None
    steps = node.input[5] if len(node.input) > 5 and node.input[5] else None
    if steps is not None and not np.all(b.constant_value(steps) == 1):
        raise _Unlowerable("SliceGrad with steps other than 1")
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


def _channel_shape(b: _Builder, rank: int) -> str:
    """[C] -> [C, 1, ...] for broadcasting over a rank-``rank`` NC... tensor."""
    return b.const(np.array([-1] + [1] * (rank - 2), np.int64))


def _batchnorm_internal(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # Training-mode BatchNorm: batch mean and biased variance over every axis but 1,
    # inv_std = 1 / sqrt(var + eps), Y = (X - mean) inv_std scale + B; saved_mean and saved_inv_std as [C].
    node = b.node
    x, scale, bias = node.input[:3]
    if _out(node, 1) in b.used or _out(node, 2) in b.used:
        raise _Unlowerable("BatchNormInternal's running statistics are read")
    rank = b.ranks.get(x)
    if rank is None:
        raise _Unlowerable(f"the rank of BatchNorm's input {x!r} is unknown")
    eps = float(attributes(node).get("epsilon", 1e-5))
    if b.opset >= 14 and {scale, bias} <= b.inputs and scale != bias and b.batchnorm_scales[scale] == 1:
        _batchnorm_in_training_mode(b, eps)
        return
    axes = [0, *range(2, rank)]
    mean = b.reduce("ReduceMean", x, axes, 1)
    centered = b.op("Sub", [x, mean])
    variance = b.reduce("ReduceMean", b.op("Mul", [centered, centered]), axes, 1)
    inv_std = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [variance, b.const(eps)])])])
    channel = _channel_shape(b, rank)
    normalized = b.op("Mul", [centered, inv_std])
    scaled = b.op("Mul", [normalized, b.op("Reshape", [scale, channel])])
    b.op("Add", [scaled, b.op("Reshape", [bias, channel])], node.output[0])
    flat = b.const(np.array([-1], np.int64))
    if _out(node, 3):
        b.op("Reshape", [mean, flat], node.output[3])
    if _out(node, 4):
        b.op("Reshape", [inv_std, flat], node.output[4])


def _batchnorm_in_training_mode(b: _Builder, eps: float) -> None:
    """ONNX's own BatchNormalization in training mode (opset 14; in every stock ORT but the minimal,
    ORT-format-only builds). With momentum 0 its "running" statistics are the batch's mean and biased variance,
    the values the lowering above computes, bit for bit (onnxruntime 1.32); Y is the same formula rounded in
    ORT's order (within 1.5e-6). One kernel in place of seven passes over X: 0.06-0.23 ms against 0.25-0.36
    on MobileNet-style's activations (batch 32, 2 threads, one-off).

    The "previous" statistics it reads are zeros made in the graph from this node's own scale and bias: ORT
    writes the new statistics over the tensors it reads (in place), so two BatchNorms reading one constant
    overwrote each other's saved statistics (a one-off with two such nodes: the first node's mean off by 2.7),
    and a constant would carry a non-finite value from one step into every later one. So it is used where the
    scale and bias are graph inputs (trained: never folded into constants) that no other BatchNorm reads (ORT
    merges equal nodes, and two nodes' zeros would become one tensor again); frozen or shared ones keep the
    lowering above."""
    node = b.node
    x, scale, bias = node.input[:3]
    mean, variance = f"{b.prefix}.mean", f"{b.prefix}.variance"
    zero = b.const(0.0)
    previous = [b.op("Mul", [scale, zero]), b.op("Mul", [bias, zero])]  # each node's own, fresh every step
    b.nodes.append(helper.make_node("BatchNormalization", [x, scale, bias, *previous],
                                    [node.output[0], mean, variance], name=f"{b.prefix}.BatchNormalization",
                                    epsilon=eps, momentum=0.0, training_mode=1))  # fmt: skip
    if _out(node, 3):
        b.op("Identity", [mean], node.output[3])
    if _out(node, 4):
        b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [variance, b.const(eps)])])], node.output[4])


def _batchnorm_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # x_hat = (X - mean) inv_std; dbias = sum dY; dscale = sum dY x_hat (over every axis but 1);
    # dX = scale inv_std (dY - mean(dY) - x_hat mean(dY x_hat))
    node = b.node
    dy, x, scale, mean, inv_std = node.input[:5]
    rank = b.ranks.get(x)
    if rank is None:
        raise _Unlowerable(f"the rank of BatchNorm's input {x!r} is unknown")
    axes = [0, *range(2, rank)]
    channel = _channel_shape(b, rank)
    inv = b.op("Reshape", [inv_std, channel])
    x_hat = b.op("Mul", [b.op("Sub", [x, b.op("Reshape", [mean, channel])]), inv])
    product = b.op("Mul", [dy, x_hat])
    # one pass each over dY and dY x_hat: the means dX needs are the sums that dbias and dscale are, divided
    # by the values per channel (MobileNet's eleven BatchNorms: two passes fewer each)
    sum_dy = b.reduce("ReduceSum", dy, axes, 1) if _out(node, 0) or _out(node, 2) else ""
    sum_product = b.reduce("ReduceSum", product, axes, 1) if _out(node, 0) or _out(node, 1) else ""
    if _out(node, 0):
        # values per channel: a constant where the input's sizes are known, else counted (the batch axis is
        # usually symbolic); the channels are known wherever the scale's shape is
        sizes, channels = b.dims.get(x) or [], (shapes.get(scale) or [None])[0]
        if len(sizes) == rank and all(isinstance(d, int) and d > 0 for d in sizes):
            count = b.const(float(np.prod(sizes) // sizes[1]))
        else:
            per = b.const(float(channels)) if isinstance(channels, int) else \
                b.op("Cast", [b.op("Size", [scale])], to=onnx.TensorProto.FLOAT)  # fmt: skip
            count = b.op("Div", [b.op("Cast", [b.op("Size", [dy])], to=onnx.TensorProto.FLOAT), per])
        inner = b.op("Sub", [b.op("Sub", [dy, b.op("Div", [sum_dy, count])]),
                             b.op("Mul", [x_hat, b.op("Div", [sum_product, count])])])  # fmt: skip
        b.op("Mul", [inner, b.op("Mul", [b.op("Reshape", [scale, channel]), inv])], node.output[0])
    flat = b.const(np.array([-1], np.int64))
    if _out(node, 1):
        b.op("Reshape", [sum_product, flat], node.output[1])
    if _out(node, 2):
        b.op("Reshape", [sum_dy, flat], node.output[2])


def _conv_grad(b: _Builder, shapes: dict[str, list[int]]) -> None:
    # dX as a transposed convolution; dW of a one-group convolution with static sizes as products of dY with
    # the input's windows (channels last for 16 channels or more, else im2col), otherwise (and for a depthwise
    # one) as a convolution of the input with dY, batch as channels; dB sums dY.
    node = b.node
    dy, x, w = node.input[:3]
    a = attributes(node)
    w_shape = shapes.get(w)
    if w_shape is None or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise _Unlowerable("ConvGrad with an unknown kernel shape or auto_pad")
    spatial = len(w_shape) - 2
    group = int(a.get("group", 1))
    depthwise = group > 1 and group == w_shape[0] and w_shape[1] == 1
    if group != 1 and not depthwise:
        raise _Unlowerable("a grouped convolution that is not depthwise")
    strides = list(a.get("strides") or [1] * spatial)
    dilations = list(a.get("dilations") or [1] * spatial)
    pads = list(a.get("pads") or [0] * 2 * spatial)
    if _out(node, 0):
        _conv_input_grad(b, w_shape, strides, dilations, pads, group)
    if depthwise:  # a strided one keeps the convolution: its windows copied slowly (0.42-0.68x), and from the
        # input's phases it took 1.15-1.5x as long in the MobileNet-style step (the convolution runs on NCHWc there)
        by_products = _depthwise_weight_grad_by_windows if set(strides) == {1} else None
    else:
        by_windows = w_shape[1] >= WINDOWS_FROM_CHANNELS and int(np.prod(w_shape[2:])) > 1
        by_products = _weight_grad_by_windows if by_windows else _weight_grad_by_columns
    if _out(node, 1) and not (by_products and by_products(b, w_shape, strides, dilations, pads)):
        _weight_grad_by_convolution(b, w_shape, strides, dilations, pads, group, depthwise)
    if _out(node, 2):
        b.reduce("ReduceSum", dy, [0, *range(2, spatial + 2)], 0, node.output[2])


WINDOWS_FROM_CHANNELS = 16
"""Input channels from which a one-group convolution's weight gradient takes channels-last windows, one
product per kernel offset (``_weight_grad_by_windows``): a window's rows are then runs of C values, and
each product sums over batch and positions at once. Measured against im2col (onnxruntime 1.32, 2 threads,
interleaved, one-off): 3x3 layers 32 -> 64 at 14x14 1.28x, 32 -> 16 at 28x28 2.26x, 16 -> 32 stride 2
1.93x faster; with 1 or 3 input channels 0.59-0.71x (im2col kept there)."""


def _windows(b: _Builder, w_shape: list[int], strides: list[int], dilations: list[int], pads: list[int],
             channels_last: bool = False) -> list[str] | None:
    """The convolution input's shifted, strided window at each kernel offset (row-major), shaped like dY's
    spatial extent: [N, C, *out], or [N, *out, C] with ``channels_last``. None (nothing emitted) where
    neither dY's spatial sizes nor the input's are static."""
    dy, x = b.node.input[:2]
    kernel = w_shape[2:]
    spatial = len(kernel)
    out_size = (b.dims.get(dy) or [None])[2:]
    if len(out_size) != spatial or any(s is None for s in out_size):
        out_size = _output_size(b, w_shape, strides, dilations, pads)
    if len(out_size) != spatial or any(s is None for s in out_size):
        return None
    if not channels_last and _phased(b, strides):
        return _phase_windows(b, kernel, strides[0], dilations, pads, out_size)
    first = 1 if channels_last else 2  # the first spatial axis
    padded = b.op("Transpose", [x], perm=[0, *range(2, spatial + 2), 1]) if channels_last else x
    if any(pads):
        around = [0] * (first - 1) + pads[:spatial] + [0] * (2 - first)
        ahead = [0] * (first - 1) + pads[spatial:] + [0] * (2 - first)
        padded = b.op("Pad", [padded, b.const(np.array([0, *around, 0, *ahead], np.int64))])
    axes = b.const(np.arange(first, first + spatial, dtype=np.int64))
    steps = b.const(np.array(strides, np.int64))
    windows = []
    for offset in np.ndindex(*kernel):
        begin = [offset[i] * dilations[i] for i in range(spatial)]
        stop = [begin[i] + (out_size[i] - 1) * strides[i] + 1 for i in range(spatial)]
        windows.append(b.op("Slice", [padded, b.const(np.array(begin, np.int64)), b.const(np.array(stop, np.int64)),
                                      axes, steps]))  # fmt: skip
    return windows


def _phased(b: _Builder, strides: list[int]) -> bool:
    """Whether a strided convolution's windows come from its input's phases (:func:`_phase_windows`): 2-D,
    one stride > 1 for both axes, the input's spatial sizes static."""
    size = (b.dims.get(b.node.input[1]) or [None])[2:]
    return len(strides) == 2 == len(size) and strides[0] == strides[1] > 1 and b.opset >= 13 \
        and all(isinstance(s, int) for s in size)


def _phase_windows(b: _Builder, kernel: list[int], stride: int, dilations: list[int], pads: list[int],
                   out_size: list[int]) -> list[str]:  # fmt: skip
    """The strided windows of a 2-D convolution's input ([N, C, *out] each) as stride-1 windows of its phases:
    the padded input (and zeros up to a multiple of ``stride``) in ``stride`` x ``stride`` blocks, one phase per
    position in a block (``SpaceToDepth``). A strided Slice copies element by element; a phase's window is
    runs of whole rows. MobileNet-style's first layer (3 -> 16 channels at stride 2 over 64x64, batch 32, im2col):
    its gradient's nodes took 631 against 1055 us a step in ORT's profile (onnxruntime 1.32, 2 threads, one-off).
    For a depthwise layer these windows lost to the convolution with the batch as channels in the step (see
    :func:`_conv_grad`), though alone they won (32 channels of 32x32: 2.0 against 5.9 ms)."""
    x = b.node.input[1]
    size = b.dims[x][2:]
    ahead = [pads[2 + i] + (-(size[i] + pads[i] + pads[2 + i]) % stride) for i in range(2)]
    padded = b.op("Pad", [x, b.const(np.array([0, 0, *pads[:2], 0, 0, *ahead], np.int64))])
    blocks = [(size[i] + pads[i] + ahead[i]) // stride for i in range(2)]
    phases = b.op("Reshape", [b.op("SpaceToDepth", [padded], blocksize=stride),
                              b.const(np.array([0, stride * stride, -1, *blocks], np.int64))])  # fmt: skip
    axes, one = b.const(np.array([1, 3, 4], np.int64)), b.const(np.array([1], np.int64))
    windows = []
    for offset in np.ndindex(*kernel):
        reach = [offset[i] * dilations[i] for i in range(2)]  # = stride * shift + position in the block
        phase = (reach[0] % stride) * stride + reach[1] % stride
        shift = [reach[i] // stride for i in range(2)]
        begin = b.const(np.array([phase, *shift], np.int64))
        end = b.const(np.array([phase + 1, shift[0] + out_size[0], shift[1] + out_size[1]], np.int64))
        windows.append(b.op("Squeeze", [b.op("Slice", [phases, begin, end, axes]), one]))
    return windows


def _output_size(b: _Builder, w_shape: list[int], strides: list[int], dilations: list[int],
                 pads: list[int]) -> list[int | None]:  # fmt: skip
    """dY's spatial sizes from the convolution input's, where dY's are unknown (a gradient builder that writes
    no shapes for the tensors it makes: artifacts.gradients). Without them every weight gradient fell back to the
    convolution with the batch as channels: on the MobileNet-style model 2.2-2.3 ms a layer where its windows
    took a fraction of that."""
    size = (b.dims.get(b.node.input[1]) or [None])[2:]
    spatial = len(w_shape) - 2
    if len(size) != spatial or any(s is None for s in size):
        return [None]
    reach = [dilations[i] * (w_shape[2 + i] - 1) + 1 for i in range(spatial)]
    return [(size[i] + pads[i] + pads[i + spatial] - reach[i]) // strides[i] + 1 for i in range(spatial)]


def _weight_grad_by_windows(b: _Builder, w_shape: list[int], strides: list[int], dilations: list[int],
                            pads: list[int]) -> bool:  # fmt: skip
    """dW of a one-group convolution as, for each kernel offset, dY ([O, N P]) times the input's shifted,
    strided window taken channels last ([N P, C]): the same products summed in another order. False
    (nothing emitted) without static spatial sizes."""
    windows = _windows(b, w_shape, strides, dilations, pads, channels_last=True)
    if windows is None:
        return False
    dy, spatial = b.node.input[0], len(w_shape) - 2
    grads = b.op("Transpose", [dy], perm=[1, 0, *range(2, spatial + 2)])  # [O, N, *out]
    grads = b.op("Reshape", [grads, b.const(np.array([int(w_shape[0]), -1], np.int64))])
    rows = b.const(np.array([-1, int(w_shape[1])], np.int64))
    products = [b.op("MatMul", [grads, b.op("Reshape", [window, rows])]) for window in windows]  # [O, C] each
    stacked = b.op("Concat", [b.op("Unsqueeze", [p, b.const(np.array([2], np.int64))]) for p in products], axis=2)
    b.op("Reshape", [stacked, b.const(np.array(w_shape, np.int64))], b.node.output[1])  # [O, C, K] -> OIHW
    return True


def _depthwise_weight_grad_by_windows(b: _Builder, w_shape: list[int], strides: list[int], dilations: list[int],
                                      pads: list[int]) -> bool:  # fmt: skip
    """dW of a depthwise convolution as, for each kernel offset, the input's shifted window times dY, summed
    over batch and positions per channel: the same products summed in another order. Measured against the
    grouped convolution with the batch as channels at stride 1 (onnxruntime 1.32, 2 threads, interleaved,
    one-off): 16 channels of 32x32 1.73x, 64 of 16x16 1.84x, 128 of 8x8 1.22x faster. False (nothing emitted)
    without static spatial sizes."""
    windows = _windows(b, w_shape, strides, dilations, pads)
    if windows is None:
        return False
    dy, spatial = b.node.input[0], len(w_shape) - 2
    sums = [b.reduce("ReduceSum", b.op("Mul", [window, dy]), [0, *range(2, spatial + 2)], 0) for window in windows]
    stacked = b.op("Concat", [b.op("Unsqueeze", [v, b.const(np.array([1], np.int64))]) for v in sums], axis=1)
    b.op("Reshape", [stacked, b.const(np.array(w_shape, np.int64))], b.node.output[1])  # [C, K] -> [C, 1, *k]
    return True


def _weight_grad_by_columns(b: _Builder, w_shape: list[int], strides: list[int], dilations: list[int],
                            pads: list[int]) -> bool:  # fmt: skip
    """dW of a one-group convolution as im2col and a batched matrix product: the input's K = kh kw shifted,
    strided windows stacked ([N, C K, P]), times dY ([N, O, P]) transposed, summed over the batch. False
    (nothing emitted) without static spatial sizes."""
    windows = _windows(b, w_shape, strides, dilations, pads)
    if windows is None:
        return False
    dy, kernel = b.node.input[0], w_shape[2:]
    windows = [b.op("Unsqueeze", [window, b.const(np.array([2], np.int64))]) for window in windows]
    columns = b.op("Concat", windows, axis=2)  # [N, C, K, *out]
    rows = int(w_shape[1]) * int(np.prod(kernel))
    columns = b.op("Reshape", [columns, b.const(np.array([0, rows, -1], np.int64))])
    grads = b.op("Reshape", [dy, b.const(np.array([0, int(w_shape[0]), -1], np.int64))])
    products = f"{b.prefix}.products"  # [N, O, C K]: FusedMatMul transposes the columns as it reads them
    b.nodes.append(helper.make_node("FusedMatMul", [grads, columns], [products], domain="com.microsoft", transB=1))
    summed = b.reduce("ReduceSum", products, [0], 0)
    b.op("Reshape", [summed, b.const(np.array(w_shape, np.int64))], b.node.output[1])
    return True


def _weight_grad_by_convolution(b: _Builder, w_shape: list[int], strides: list[int], dilations: list[int],
                                pads: list[int], group: int, depthwise: bool) -> None:  # fmt: skip
    """dW as a convolution of the input with dY, the batch axis as channels (see _conv_grad)."""
    node = b.node
    dy, x = node.input[:2]
    spatial = len(w_shape) - 2
    swap = [1, 0, *range(2, spatial + 2)]
    xt, gt = b.op("Transpose", [x], perm=swap), b.op("Transpose", [dy], perm=swap)
    settings = {"strides": dilations, "dilations": strides, "pads": pads}
    if depthwise:
        folded = b.op("Reshape", [xt, b.const(np.array([1, -1] + [0] * spatial, np.int64))])
        full = b.op("Conv", [folded, gt], group=group, **settings)
        full = b.op("Reshape", [full, b.const(np.array([-1, 1] + [0] * spatial, np.int64))])
    else:
        full = b.op("Transpose", [b.op("Conv", [xt, gt], **settings)], perm=swap)
    kernel = list(w_shape[2:])
    cropped = [b.const(np.zeros(spatial, np.int64)), b.const(np.array(kernel, np.int64)),
               b.const(np.arange(2, spatial + 2, dtype=np.int64))]  # fmt: skip
    b.op("Slice", [full, *cropped], node.output[1])


def _conv_input_grad(b: _Builder, w_shape: list[int], strides: list[int], dilations: list[int], pads: list[int],
                     group: int) -> None:  # fmt: skip
    # dX is the transposed convolution of dY with the same weight; output_padding restores the
    # input's size (the rows a strided window never reached), which needs static spatial sizes.
    dy, x, w = b.node.input[:3]
    size = (b.dims.get(x) or [None])[2:]
    if len(size) != len(strides) or any(s is None for s in size):
        raise _Unlowerable(f"ConvGrad's input gradient needs the static spatial size of {x!r}")
    kernel = w_shape[2:]
    spatial = len(kernel)
    reach = [dilations[i] * (kernel[i] - 1) + 1 for i in range(spatial)]
    out = [(size[i] + pads[i] + pads[i + spatial] - reach[i]) // strides[i] + 1 for i in range(spatial)]
    extra = [size[i] - ((out[i] - 1) * strides[i] + reach[i] - pads[i] - pads[i + spatial]) for i in range(spatial)]
    b.op("ConvTranspose", [dy, w], b.node.output[0], strides=strides, dilations=dilations, pads=pads, group=group,
         kernel_shape=kernel, output_padding=extra)  # fmt: skip


class _Unlowerable(ValueError):
    pass


LOWERINGS: dict[str, Callable[[_Builder, dict[str, list[int]]], None]] = {
    "DropoutGrad": _dropout_grad,
    "SoftmaxGrad_13": _softmax_grad,
    "LogSoftmaxGrad_13": _log_softmax_grad,
    "LayerNormalizationGrad": _layer_norm_grad,
    "SimplifiedLayerNormalizationGrad": _simplified_layer_norm_grad,
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
    "BatchNormInternal": _batchnorm_internal,
    "BatchNormalizationGrad": _batchnorm_grad,
    "ConvGrad": _conv_grad,
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
    facts = _GraphFacts(model)
    constants: dict[str, onnx.TensorProto] = {}
    nodes, done = [], []
    for node in graph.node:
        known = node.domain == "com.microsoft" or node.domain in ("", "ai.onnx") and node.op_type in FUNCTIONS
        chosen = known and (only is None or node.op_type in only)
        lowering = LOWERINGS.get(node.op_type) if chosen else None
        if lowering is None:
            nodes.append(node)
            continue
        builder = _Builder(node, constants, opset, facts)
        try:
            lowering(builder, shapes)
        except _Unlowerable:
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
