"""BatchNorm for ORT training: PyTorch's running-statistics update in the training graph, and an
inference BatchNorm in the eval graph."""

from __future__ import annotations

import math
from typing import Iterable

import onnx
from onnx import helper

__all__ = ["expose_batchnorm_updates", "strip_batchnorm_training"]

UPDATED = "/updated"
SCRATCH = "/bn_scratch"


def expose_batchnorm_updates(model: onnx.ModelProto, buffers: Iterable[str], opset: int) -> dict[str, str]:
    """Add graph outputs with each training-mode BatchNorm's new running mean and variance.

    They are computed with PyTorch's rule (``new = (1 - momentum) * old + momentum * batch``,
    unbiased batch variance) by nodes added beside the BatchNorm: ORT's own running-stat outputs
    apply the momentum twice and use the biased variance (measured on 1.19.2). Returns
    ``{buffer name: output name}`` for the buffers listed in ``buffers``.
    """
    wanted = set(buffers)
    shapes = {i.name: list(i.dims) for i in model.graph.initializer}
    updates: dict[str, str] = {}
    for node in list(model.graph.node):
        if node.op_type != "BatchNormalization" or len(node.output) < 3:
            continue
        x, _, _, mean_in, var_in = node.input[:5]
        if mean_in not in wanted or var_in not in wanted:
            continue
        keep = next((a.f for a in node.attribute if a.name == "momentum"), 0.9)
        new_mean, new_var = f"{mean_in}{UPDATED}", f"{var_in}{UPDATED}"
        # ORT's training-mode BatchNorm writes its running-stat inputs in place; give it scratch
        # copies so the nodes below read the true old values (the eval graph gets them back).
        for index, fill in ((3, 0.0), (4, 1.0)):
            scratch = f"{node.input[index]}{SCRATCH}"
            value = helper.make_tensor(
                scratch,
                onnx.TensorProto.FLOAT,
                shapes[node.input[index]],
                [fill] * math.prod(shapes[node.input[index]]),
            )
            model.graph.node.insert(0, helper.make_node("Constant", [], [scratch], name=scratch, value=value))
            node.input[index] = scratch
        model.graph.node.extend(_running_stat_nodes(node.name, x, mean_in, var_in, keep, new_mean, new_var, opset))
        for buffer, name in ((mean_in, new_mean), (var_in, new_var)):
            model.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shapes[buffer]))
            updates[buffer] = name
    return updates


def _running_stat_nodes(
    prefix: str, x: str, mean_in: str, var_in: str, keep: float, new_mean: str, new_var: str, opset: int
) -> list[onnx.NodeProto]:
    p = f"{prefix}/odt_running_stats"
    nodes: list[onnx.NodeProto] = []

    def add(op: str, inputs: list[str], **attrs: object) -> str:
        out = f"{p}/{op}_{len(nodes)}"
        nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def const(value: float | list[int], dtype: int = onnx.TensorProto.FLOAT) -> str:
        out = f"{p}/const_{len(nodes)}"
        values = value if isinstance(value, list) else [value]
        dims = [len(values)] if isinstance(value, list) else []
        nodes.append(
            helper.make_node("Constant", [], [out], name=out, value=helper.make_tensor(out, dtype, dims, values))
        )
        return out

    # Per channel over every other axis: view X as (N, C, L) and average axes 0 and 2.
    def reduce_mean(data: str) -> str:
        if opset >= 18:
            return add("ReduceMean", [data, const([0, 2], onnx.TensorProto.INT64)], keepdims=1)
        return add("ReduceMean", [data], axes=[0, 2], keepdims=1)

    def per_channel(data: str) -> str:
        return add("Reshape", [data, const([-1], onnx.TensorProto.INT64)])

    shaped = add("Reshape", [x, const([0, 0, -1], onnx.TensorProto.INT64)])
    mean_keep = reduce_mean(shaped)
    centered = add("Sub", [shaped, mean_keep])
    batch_mean = per_channel(mean_keep)
    biased = per_channel(reduce_mean(add("Mul", [centered, centered])))
    count = add("Cast", [add("Div", [add("Size", [x]), add("Size", [batch_mean])])], to=onnx.TensorProto.FLOAT)
    unbiased = add("Div", [add("Mul", [biased, count]), add("Sub", [count, const(1.0)])])
    momentum = 1.0 - keep
    for old, batch, out in ((mean_in, batch_mean, new_mean), (var_in, unbiased, new_var)):
        blended = add("Add", [add("Mul", [old, const(keep)]), add("Mul", [batch, const(momentum)])])
        nodes.append(helper.make_node("Identity", [blended], [out], name=f"{p}/{out}"))
    return nodes


def strip_batchnorm_training(model: onnx.ModelProto) -> None:
    """Turn training-mode BatchNorm into inference BatchNorm (one output, running statistics).

    ORT derives the eval model from the training graph and refuses a BatchNorm with three
    outputs once training_mode is off. The running-stat update outputs and their nodes go too.
    """
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and len(node.output) > 1:
            del node.output[1:]
            for attribute in [a for a in node.attribute if a.name == "training_mode"]:
                node.attribute.remove(attribute)
            node.input[3:5] = [name.removesuffix(SCRATCH) for name in node.input[3:5]]
    for output in [o for o in model.graph.output if o.name.endswith(UPDATED)]:
        model.graph.output.remove(output)
    _prune_dead_nodes(model)


def _prune_dead_nodes(model: onnx.ModelProto) -> None:
    needed = {o.name for o in model.graph.output}
    keep = []
    for node in reversed(model.graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(node.input)
    del model.graph.node[:]
    model.graph.node.extend(reversed(keep))
