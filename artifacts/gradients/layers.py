"""Gradients of products, normalizations, convolutions, poolings and the losses' own operator."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx

from ._emit import MS, Emitter
from ._registry import Grads, attr, copied_attrs, rule

# -- products --------------------------------------------------------------------------------------


@rule("Gemm")
def _gemm(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    (g,), y = dy, node.output[0]
    a, b = node.input[:2]
    alpha, beta = attr(node, "alpha", 1.0), attr(node, "beta", 1.0)
    ta, tb = attr(node, "transA", 0), attr(node, "transB", 0)
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


# -- layers with ORT gradient kernels ----------------------------------------------------------------


@rule("LayerNormalization")
def _layer_norm(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    if len(node.output) < 3 or not node.output[1] or not node.output[2]:
        raise NotImplementedError("LayerNormalization without its Mean and InvStdDev outputs")
    x, scale = node.input[:2]
    outputs = [e.name(f"{x}_grad.ln"), e.name(f"{scale}_grad.ln"), e.name(f"{scale}_bias_grad.ln")]
    e.op("LayerNormalizationGrad", [dy[0], x, scale, node.output[1], node.output[2]], outputs, domain=MS,
         axis=attr(node, "axis", -1), epsilon=attr(node, "epsilon", 1e-5))  # fmt: skip
    return [outputs[0], outputs[1], outputs[2] if len(node.input) > 2 else None]


@rule("Conv")
def _conv(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x, w = node.input[:2]
    has_bias = len(node.input) > 2 and bool(node.input[2])
    wanted = [need[0], need[1], has_bias and need[2]]
    outputs = [e.name(f"{name}_grad.conv") if want else "" for name, want in zip((x, w, "bias"), wanted)]
    e.op("ConvGrad", [dy[0], x, w], outputs, domain=MS, **copied_attrs(node))
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
         epsilon=attr(node, "epsilon", 1e-5))  # fmt: skip
    return [*outputs, None, None]


# -- the losses' own operators -----------------------------------------------------------------------


@rule("SoftmaxCrossEntropyLoss")
def _softmax_cross_entropy(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    if len(node.output) < 2 or not node.output[1]:  # the gradient reads the log-probabilities: ask the node for them
        while len(node.output) < 2:
            node.output.append("")
        node.output[1] = e.name(f"{node.output[0]}.log_prob")
    inputs = [dy[0], node.output[1], *node.input[1:]]
    return [e.one("SoftmaxCrossEntropyLossGrad", *inputs, domain=MS, **copied_attrs(node)), None, None]


@rule("Softplus")
def _softplus(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    return [e.one("Mul", dy[0], e.one("Sigmoid", node.input[0]))]
