"""AveragePool as a depthwise Conv: ORT 1.19.2's CPU AveragePoolGrad dies with SIGFPE."""

from __future__ import annotations

import math

import onnx
from onnx import helper

from ._nodes import attributes, inferred_graph

__all__ = ["average_pool_to_conv"]


def average_pool_to_conv(model: onnx.ModelProto) -> int:
    """Rewrite AveragePool as a depthwise Conv with fixed 1/k weights; returns the count.

    ORT 1.19.2's CPU AveragePoolGrad dies with SIGFPE (measured, any kernel size); Conv's
    gradient works. Exact for ceil_mode=0 with count_include_pad=1 or no padding.
    """
    inferred = inferred_graph(model)
    values = (*inferred.value_info, *inferred.input)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}
    count = 0
    for node in model.graph.node:
        if node.op_type != "AveragePool":
            continue
        attrs = attributes(node)
        kernel = list(attrs["kernel_shape"])
        pads = list(attrs.get("pads", [0] * 2 * len(kernel)))
        channels = (shapes.get(node.input[0]) or [0, 0])[1]
        if attrs.get("ceil_mode", 0) or (any(pads) and not attrs.get("count_include_pad", 0)) or not channels:
            continue
        weight = f"{node.name}/odt_average_weight"
        values = [1.0 / math.prod(kernel)] * (channels * math.prod(kernel))
        model.graph.initializer.append(
            helper.make_tensor(weight, onnx.TensorProto.FLOAT, [channels, 1, *kernel], values)
        )
        conv = helper.make_node(
            "Conv",
            [node.input[0], weight],
            list(node.output),
            name=node.name,
            group=channels,
            kernel_shape=kernel,
            pads=pads,
            strides=list(attrs.get("strides", [1] * len(kernel))),
        )
        node.CopyFrom(conv)
        count += 1
    return count
