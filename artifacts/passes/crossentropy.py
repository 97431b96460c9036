"""Softmax cross-entropy and its gradient as kernels ORT 1.19 runs fast.

ORT's CPU ``SoftmaxCrossEntropyLoss`` and ``SoftmaxCrossEntropyLossGrad`` walk the scores one
element at a time on one thread: for the next-word LSTM's 32 x 5000 scores they took 0.47 and
0.83 ms of its profiled step, where PyTorch's ``log_softmax`` and its backward take 0.07 and
0.05 ms. The same values from kernels that are vectorized and threaded:

    log_prob = LogSoftmax(scores, axis=1)
    loss     = -Reduce(GatherElements(log_prob, labels, axis=1))        (mean or sum)
    d scores = (exp(log_prob) - onehot(labels)) * dLoss / count          (count: 1 for sum)

where ``exp(log_prob) - onehot`` is ``exp(log_prob)`` with ``p - 1`` scattered in at each label.
The formula is the one ORT's kernels compute (they also take the gradient from ``exp`` of the
log-probabilities), rounded in another order. Only the plain loss is rewritten: with class
weights or an ``ignore_index``, ORT's kernels stay. The eval graph gets the same forward (the
kernel took 0.75 of the 6.6 ms of kernels in the LSTM's eval step). Verification against PyTorch covers it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ._nodes import attributes

__all__ = ["rewrite_cross_entropy"]

MIN_OPSET = 13
"""Unsqueeze's axes as an input (and ReduceSum's) need this opset of the default domain."""
AXES, ONE = "odt.cross_entropy_axes", "odt.cross_entropy_one"
REDUCE = {"mean": "ReduceMean", "sum": "ReduceSum"}


def _reduction(node: onnx.NodeProto) -> str | None:
    """The reduction of a plain (unweighted, no ignore_index) cross-entropy node, else None."""
    given = attributes(node)
    reduction = given.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else str(reduction)
    plain = "ignore_index" not in given and reduction in REDUCE
    return reduction if plain else None


def _forward(node: onnx.NodeProto, reduction: str) -> list[onnx.NodeProto]:
    scores, labels = node.input
    loss = node.output[0]
    log_prob = node.output[1] if len(node.output) > 1 and node.output[1] else f"{loss}.log_prob"
    return [
        helper.make_node("LogSoftmax", [scores], [log_prob], axis=1),
        helper.make_node("Unsqueeze", [labels, AXES], [f"{loss}.index"]),
        helper.make_node("GatherElements", [log_prob, f"{loss}.index"], [f"{loss}.picked"], axis=1),
        helper.make_node(REDUCE[reduction], [f"{loss}.picked"], [f"{loss}.total"], keepdims=0),
        helper.make_node("Neg", [f"{loss}.total"], [loss]),
    ]


def _backward(node: onnx.NodeProto, reduction: str) -> list[onnx.NodeProto]:
    grad, log_prob, labels = node.input
    out = node.output[0]
    nodes = [
        helper.make_node("Exp", [log_prob], [f"{out}.p"]),
        helper.make_node("Unsqueeze", [labels, AXES], [f"{out}.index"]),
        helper.make_node("GatherElements", [f"{out}.p", f"{out}.index"], [f"{out}.p_label"], axis=1),
        helper.make_node("Sub", [f"{out}.p_label", ONE], [f"{out}.p_label_minus_1"]),
        helper.make_node(
            "ScatterElements", [f"{out}.p", f"{out}.index", f"{out}.p_label_minus_1"], [f"{out}.diff"], axis=1
        ),
    ]
    scale = grad
    if reduction == "mean":
        nodes += [
            helper.make_node("Size", [labels], [f"{out}.count"]),
            helper.make_node("Cast", [f"{out}.count"], [f"{out}.count_float"], to=onnx.TensorProto.FLOAT),
            helper.make_node("Div", [grad, f"{out}.count_float"], [f"{out}.scale"]),
        ]
        scale = f"{out}.scale"
    return [*nodes, helper.make_node("Mul", [f"{out}.diff", scale], [out])]


def rewrite_cross_entropy(model: onnx.ModelProto) -> int:
    """Replace every plain cross-entropy of a training or eval graph, and its gradient, in place;
    returns how many losses."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        return 0
    nodes: list[onnx.NodeProto] = []
    done = 0
    for node in model.graph.node:
        kind = (node.op_type, len(node.input))
        reduction = (
            _reduction(node) if kind in (("SoftmaxCrossEntropyLoss", 2), ("SoftmaxCrossEntropyLossGrad", 3)) else None
        )
        if reduction and node.op_type == "SoftmaxCrossEntropyLoss":
            nodes += _forward(node, reduction)
            done += 1
        elif reduction:
            nodes += _backward(node, reduction)  # log_prob is the same tensor whichever node computed it
        else:
            nodes.append(node)
    if len(nodes) != len(model.graph.node):
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        model.graph.initializer.extend([
            numpy_helper.from_array(np.array([1], np.int64), AXES),
            numpy_helper.from_array(np.array(1.0, np.float32), ONE),
        ])  # fmt: skip
    return done
