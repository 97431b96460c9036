"""Small readers of ONNX nodes that several passes share."""

from __future__ import annotations

import math
from typing import Callable

import onnx
from onnx import helper

from ondevice.widen import attributes, float_constant, int_constant, wait_constants, zero_after

__all__ = ["attributes", "int_constant", "float_constant", "inferred_graph", "light_model", "structure_copy",
           "wait_constants", "zero_after"]

_VALUES_READ = 1024
"""Initializers of more values than this go to shape inference without them (a shape never depends on a
weight's values; the ones inference reads, such as a Reshape's target, are a few)."""


def inferred_graph(model: onnx.ModelProto) -> onnx.GraphProto:
    """ONNX shape inference's graph of ``model`` (shapes in ``value_info``), without copying its weights.

    ``onnx.shape_inference.infer_shapes(model)`` serializes the whole model, weights included, and parses
    the result back: on 30 float32 matrices of 1,536 x 1,536 (270 MB) one call raised the process's peak
    by 1,270 MB and took 1.2 s. Here each initializer of more than :data:`_VALUES_READ` values goes in as
    its name, type and dims only: 6 MB and 0.01 s on the same graph."""
    return onnx.shape_inference.infer_shapes(light_model(model)).graph


def structure_copy(model: onnx.ModelProto, keep: Callable[[onnx.TensorProto], bool]) -> onnx.ModelProto:
    """A copy of ``model``'s nodes, inputs, outputs, value infos and functions with only the initializers
    ``keep`` accepts: no other weight is copied."""
    copy = onnx.ModelProto(ir_version=model.ir_version, producer_name=model.producer_name,
                           producer_version=model.producer_version)  # fmt: skip
    copy.opset_import.extend(model.opset_import)
    copy.functions.extend(model.functions)
    graph, source = copy.graph, model.graph
    graph.name = source.name
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(graph, field).extend(getattr(source, field))
    graph.initializer.extend(t for t in source.initializer if keep(t))
    return copy


def light_model(model: onnx.ModelProto, weights_as_inputs: bool = False) -> onnx.ModelProto:
    """``model`` without its weights' values: each initializer of more than :data:`_VALUES_READ` values is its
    name, type and dims only (or, with ``weights_as_inputs``, a graph input of that type and shape, for readers
    that would read an initializer's values), the rest copied. For the graph's structure and shapes."""
    light = structure_copy(model, lambda tensor: math.prod(tensor.dims) <= _VALUES_READ)
    graph = light.graph
    for tensor in model.graph.initializer:
        if math.prod(tensor.dims) <= _VALUES_READ:
            continue
        if weights_as_inputs:
            graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        else:
            graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
    return light


