"""Bake a learning rate (and its schedule) into an ORT optimizer graph, for runtimes without a
learning-rate setter (onnxruntime-web's training API has none)."""

from __future__ import annotations

import math

import onnx
from onnx import TensorProto, helper

from .errors import BundleError

__all__ = ["bake_learning_rate"]

LR_INPUT = "learning_rate"


def bake_learning_rate(
    model: onnx.ModelProto, *, base: float, kind: str = "constant", total: int = 1, warmup: int = 0, min_lr: float = 0.0
) -> onnx.ModelProto:
    """A copy of ``model`` whose optimizer reads the rate from its ``step`` input instead of the
    ``learning_rate`` input: step ``k`` (ORT counts from 1) gets ``ondevice.lr_at(k - 1, ...)``.

    The ``learning_rate`` input stays (unused) so every runtime can bind the graph as before.
    """
    if kind not in ("constant", "linear", "cosine"):
        raise BundleError(f"schedule must be constant, linear or cosine, got {kind!r}.")
    baked = onnx.ModelProto()
    baked.CopyFrom(model)
    graph = baked.graph
    nodes: list[onnx.NodeProto] = []

    def add(op: str, *inputs: str, **attrs: object) -> str:
        out = f"odt.lr/{op}_{len(nodes)}"
        nodes.append(helper.make_node(op, list(inputs), [out], name=out, **attrs))
        return out

    def const(value: float) -> str:
        out = f"odt.lr/const_{len(nodes)}"
        nodes.append(
            helper.make_node(
                "Constant", [], [out], name=out, value=helper.make_tensor(out, TensorProto.FLOAT, [1], [value])
            )
        )
        return out

    if kind == "constant":
        rate = add("Identity", const(base))
    else:
        k = add("Sub", add("Cast", "step", to=TensorProto.FLOAT), const(1.0))
        progress = add(
            "Clip",
            add("Div", add("Sub", k, const(float(warmup))), const(float(max(total - warmup, 1)))),
            const(0.0),
            const(1.0),
        )
        if kind == "linear":
            shape = add("Sub", const(1.0), progress)
        else:
            shape = add("Mul", const(0.5), add("Add", const(1.0), add("Cos", add("Mul", const(math.pi), progress))))
        rate = add("Add", const(min_lr), add("Mul", const(base - min_lr), shape))
        if warmup > 0:
            ramp = add("Mul", const(base / warmup), add("Add", k, const(1.0)))
            rate = add("Where", add("Less", k, const(float(warmup))), ramp, rate)
    consumers = [n for n in graph.node if LR_INPUT in n.input]
    if not consumers:
        raise BundleError("the optimizer graph has no 'learning_rate' input to replace; regenerate the artifacts.")
    for node in consumers:
        node.input[list(node.input).index(LR_INPUT)] = rate
    for index, node in enumerate(nodes):
        graph.node.insert(index, node)
    return baked
