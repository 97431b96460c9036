"""BatchNorm for ORT training: PyTorch's running-statistics update in the training graph, and an
inference BatchNorm in the eval graph."""

from __future__ import annotations

import math
from typing import Callable, Iterable

import onnx
from onnx import helper

__all__ = ["expose_batchnorm_updates", "reuse_batch_statistics", "strip_batchnorm_training"]

UPDATED = "/updated"
SCRATCH = "/bn_scratch"
RUNNING = "/odt_running_stats"
BATCH_MEAN, BATCH_VARIANCE = "batch_mean", "batch_variance"


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
    p = f"{prefix}{RUNNING}"
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

    def named(name: str, data: str) -> str:  # the batch's statistics, which reuse_batch_statistics finds by name
        nodes.append(helper.make_node("Reshape", [data, const([-1], onnx.TensorProto.INT64)], [f"{p}/{name}"],
                                      name=f"{p}/{name}"))  # fmt: skip
        return f"{p}/{name}"

    shaped = add("Reshape", [x, const([0, 0, -1], onnx.TensorProto.INT64)])
    mean_keep = reduce_mean(shaped)
    centered = add("Sub", [shaped, mean_keep])
    batch_mean = named(BATCH_MEAN, mean_keep)
    biased = named(BATCH_VARIANCE, reduce_mean(add("Mul", [centered, centered])))
    count = add("Cast", [add("Div", [add("Size", [x]), add("Size", [batch_mean])])], to=onnx.TensorProto.FLOAT)
    unbiased = add("Div", [add("Mul", [biased, count]), add("Sub", [count, const(1.0)])])
    momentum = 1.0 - keep
    for old, batch, out in ((mean_in, batch_mean, new_mean), (var_in, unbiased, new_var)):
        blended = add("Add", [add("Mul", [old, const(keep)]), add("Mul", [batch, const(momentum)])])
        nodes.append(helper.make_node("Identity", [blended], [out], name=f"{p}/{out}"))
    return nodes


def reuse_batch_statistics(training: onnx.ModelProto) -> int:
    """Feed the running-statistics update from the batch mean and variance ORT's BatchNorm computes.

    In ORT's training graph each BatchNorm is a ``BatchNormInternal`` whose outputs 3 and 4 are the
    batch mean and ``1 / sqrt(variance + epsilon)`` (its gradient reads them). The update added by
    :func:`expose_batchnorm_updates` computed both again from ``X``: two ``ReduceMean`` and two
    full-size passes per BatchNorm (3.65 ms of the MobileNet-style benchmark's 40 ms of kernels).
    Here the mean is ORT's and the biased variance ``1 / inv_std**2 - epsilon`` (the same value,
    rounded differently), and the passes over ``X`` go. Returns how many BatchNorms changed.
    """
    graph = training.graph
    producer = {o: n for n in graph.node for o in n.output}
    reshapes: dict[str, list[str]] = {}  # tensor -> names of the running-statistics Reshapes reading it
    for n in graph.node:
        if n.op_type == "Reshape" and RUNNING in n.name:
            reshapes.setdefault(n.input[0], []).append(n.name)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type != "BatchNormInternal" or len(node.output) < 5 or not node.output[3] or not node.output[4]:
            continue
        prefixes = [name[: name.index(RUNNING) + len(RUNNING)] for name in reshapes.get(node.input[0], [])]
        if len(prefixes) != 1:
            continue
        mean, variance = producer.get(f"{prefixes[0]}/{BATCH_MEAN}"), producer.get(f"{prefixes[0]}/{BATCH_VARIANCE}")
        if mean is None or variance is None:
            continue
        epsilon = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        p, inv_std = f"{prefixes[0]}/saved", node.output[4]
        replaced[id(mean)] = [helper.make_node("Identity", [node.output[3]], list(mean.output), name=mean.name)]
        replaced[id(variance)] = [
            helper.make_node("Mul", [inv_std, inv_std], [f"{p}/inv_variance"], name=f"{p}/inv_variance"),
            helper.make_node("Reciprocal", [f"{p}/inv_variance"], [f"{p}/shifted"], name=f"{p}/shifted"),
            helper.make_node("Constant", [], [f"{p}/epsilon"], name=f"{p}/epsilon",
                             value=helper.make_tensor(f"{p}/epsilon", onnx.TensorProto.FLOAT, [], [epsilon])),
            helper.make_node("Sub", [f"{p}/shifted", f"{p}/epsilon"], list(variance.output), name=variance.name),
        ]  # fmt: skip
    if not replaced:
        return 0
    nodes = [new for n in graph.node for new in replaced.get(id(n), [n])]
    del graph.node[:]
    graph.node.extend(nodes)
    _prune_dead_nodes(training, lambda n: RUNNING in n.name)  # the passes over X that nothing reads any more
    return len(replaced) // 2


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


def _prune_dead_nodes(model: onnx.ModelProto, prunable: Callable[[onnx.NodeProto], bool] = lambda n: True) -> None:
    """Drop the ``prunable`` nodes whose outputs neither a graph output nor a kept node reads."""
    needed = {o.name for o in model.graph.output}
    keep = []
    for node in reversed(model.graph.node):
        if not prunable(node) or any(o in needed for o in node.output):
            keep.append(node)
            needed.update(node.input)
    del model.graph.node[:]
    model.graph.node.extend(reversed(keep))
