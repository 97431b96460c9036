"""The normalizations' lowerings: LayerNorm's and RMSNorm's gradients, training-mode BatchNorm and its gradient,
as the formulas ORT 1.19.2's CPU kernels evaluate (see :mod:`artifacts.passes.portable`)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ._lowering import Builder, Unlowerable, channel_shape, output
from ._nodes import attributes

__all__ = ["batchnorm_grad", "batchnorm_internal", "layer_norm_grad", "simplified_layer_norm_grad"]


def layer_norm_grad(b: Builder, shapes: dict[str, list[int]]) -> None:
    # ORT's LayerNormalizationGrad over the trailing axes that scale covers:
    #   x_hat = (X - mean) * inv_std;  dbias = sum_rows dY;  dscale = sum_rows dY * x_hat
    #   a = dY * scale;  dX = inv_std * (a - mean(a) - x_hat * mean(a * x_hat))
    node = b.node
    dy, x, scale, mean, inv_std = node.input[:5]
    b.per_row.update((mean, inv_std))
    normalized = shapes.get(scale)
    if normalized is None:
        raise Unlowerable(f"the shape of LayerNormalization's scale {scale!r} is unknown")
    axes = list(range(-len(normalized), 0))
    x_hat = b.op("Mul", [b.op("Sub", [x, mean]), inv_std])
    if output(node, 0):
        a = b.op("Mul", [dy, scale])
        mean_a = b.reduce("ReduceMean", a, axes, 1)
        mean_ax = b.reduce("ReduceMean", b.op("Mul", [a, x_hat]), axes, 1)
        inner = b.op("Sub", [b.op("Sub", [a, mean_a]), b.op("Mul", [x_hat, mean_ax])])
        b.op("Mul", [inner, inv_std], node.output[0])
    rows = b.const(np.array([-1, int(np.prod(normalized))], np.int64))
    target = b.const(np.array(normalized, np.int64))
    products = (1, b.op("Mul", [dy, x_hat]) if output(node, 1) else None), (2, dy if output(node, 2) else None)
    for index, value in products:
        if value is not None:
            summed = b.reduce("ReduceSum", b.op("Reshape", [value, rows]), [0], 0)
            b.op("Reshape", [summed, target], node.output[index])


def simplified_layer_norm_grad(b: Builder, shapes: dict[str, list[int]]) -> None:
    # ORT's SimplifiedLayerNormalizationGrad (RMSNorm, as Llama, Qwen, Mistral and SmolLM normalize):
    #   x_hat = X * inv_std;  a = dY * scale;  dX = inv_std * (a - x_hat * mean(a * x_hat))
    #   dscale = sum_rows dY * x_hat
    node = b.node
    dy, x, scale, inv_std = node.input[:4]
    b.per_row.add(inv_std)
    normalized = shapes.get(scale)
    if normalized is None:
        raise Unlowerable(f"the shape of SimplifiedLayerNormalization's scale {scale!r} is unknown")
    axes = list(range(-len(normalized), 0))
    x_hat = b.op("Mul", [x, inv_std])
    if output(node, 0):
        a = b.op("Mul", [dy, scale])
        mean_ax = b.reduce("ReduceMean", b.op("Mul", [a, x_hat]), axes, 1)
        b.op("Mul", [b.op("Sub", [a, b.op("Mul", [x_hat, mean_ax])]), inv_std], node.output[0])
    if output(node, 1):
        rows = b.const(np.array([-1, int(np.prod(normalized))], np.int64))
        summed = b.reduce("ReduceSum", b.op("Reshape", [b.op("Mul", [dy, x_hat]), rows]), [0], 0)
        b.op("Reshape", [summed, b.const(np.array(normalized, np.int64))], node.output[1])


def batchnorm_internal(b: Builder, shapes: dict[str, list[int]]) -> None:
    # Training-mode BatchNorm: batch mean and biased variance over every axis but 1,
    # inv_std = 1 / sqrt(var + eps), Y = (X - mean) inv_std scale + B; saved_mean and saved_inv_std as [C].
    node = b.node
    x, scale, bias = node.input[:3]
    if output(node, 1) in b.used or output(node, 2) in b.used:
        raise Unlowerable("BatchNormInternal's running statistics are read")
    rank = b.ranks.get(x)
    if rank is None:
        raise Unlowerable(f"the rank of BatchNorm's input {x!r} is unknown")
    eps = float(attributes(node).get("epsilon", 1e-5))
    if b.opset >= 14 and {scale, bias} <= b.inputs and scale != bias and b.batchnorm_scales[scale] == 1:
        _batchnorm_in_training_mode(b, eps)
        return
    axes = [0, *range(2, rank)]
    mean = b.reduce("ReduceMean", x, axes, 1)
    centered = b.op("Sub", [x, mean])
    variance = b.reduce("ReduceMean", b.op("Mul", [centered, centered]), axes, 1)
    inv_std = _inv_std(b, variance, eps)
    channel = channel_shape(b, rank)
    normalized = b.op("Mul", [centered, inv_std])
    scaled = b.op("Mul", [normalized, b.op("Reshape", [scale, channel])])
    b.op("Add", [scaled, b.op("Reshape", [bias, channel])], node.output[0])
    flat = b.const(np.array([-1], np.int64))
    if output(node, 3):
        b.op("Reshape", [mean, flat], node.output[3])
    if output(node, 4):
        b.op("Reshape", [inv_std, flat], node.output[4])


def _batchnorm_in_training_mode(b: Builder, eps: float) -> None:
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
    if output(node, 3):
        b.op("Identity", [mean], node.output[3])
    if output(node, 4):
        _inv_std(b, variance, eps, node.output[4])


def _inv_std(b: Builder, variance: str, eps: float, out: str | None = None) -> str:
    """1 / sqrt(variance + eps), as ORT's BatchNorm kernels compute the saved statistic."""
    return b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [variance, b.const(eps)])])], out)


def batchnorm_grad(b: Builder, shapes: dict[str, list[int]]) -> None:
    # x_hat = (X - mean) inv_std; dbias = sum dY; dscale = sum dY x_hat (over every axis but 1);
    # dX = scale inv_std (dY - mean(dY) - x_hat mean(dY x_hat))
    node = b.node
    dy, x, scale, mean, inv_std = node.input[:5]
    rank = b.ranks.get(x)
    if rank is None:
        raise Unlowerable(f"the rank of BatchNorm's input {x!r} is unknown")
    axes = [0, *range(2, rank)]
    channel = channel_shape(b, rank)
    inv = b.op("Reshape", [inv_std, channel])
    x_hat = b.op("Mul", [b.op("Sub", [x, b.op("Reshape", [mean, channel])]), inv])
    product = b.op("Mul", [dy, x_hat])
    # one pass each over dY and dY x_hat: the means dX needs are the sums that dbias and dscale are, divided
    # by the values per channel (MobileNet's eleven BatchNorms: two passes fewer each)
    sum_dy = b.reduce("ReduceSum", dy, axes, 1) if output(node, 0) or output(node, 2) else ""
    sum_product = b.reduce("ReduceSum", product, axes, 1) if output(node, 0) or output(node, 1) else ""
    if output(node, 0):
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
    if output(node, 1):
        b.op("Reshape", [sum_product, flat], node.output[1])
    if output(node, 2):
        b.op("Reshape", [sum_dy, flat], node.output[2])
