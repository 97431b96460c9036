"""What a gradient rule writes with: nodes, constants, shapes, and the sum over broadcast axes."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..passes._nodes import inferred_graph

__all__ = ["Emitter", "Dims", "graph_facts"]

Dims = list  # one entry per axis: an int (static), a str (symbolic) or None (unknown)

MS = "com.microsoft"


def graph_facts(model: onnx.ModelProto) -> tuple[dict[str, Dims], dict[str, int], dict[str, np.ndarray]]:
    """Shapes, element types and small constant values of ``model``'s tensors, by name. Shapes come from
    the model's own value infos where it has them (symbolic shape inference ran before), else from ONNX's
    shape inference on a copy without the weights' values."""
    graph = model.graph
    if not graph.value_info:
        try:
            graph = inferred_graph(model)  # ONNX's inference without copying the weights
        except Exception:  # an operator ONNX's inference does not know: ranks stay unknown where it stopped
            pass
    shapes: dict[str, Dims] = {}
    types: dict[str, int] = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor = value.type.tensor_type
        if tensor.elem_type:
            types[value.name] = tensor.elem_type
        if tensor.HasField("shape"):
            shapes[value.name] = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
            ]
    constants: dict[str, np.ndarray] = {}
    for tensor in model.graph.initializer:
        shapes[tensor.name], types[tensor.name] = list(tensor.dims), tensor.data_type
        if int(np.prod(tensor.dims)) <= 64 and tensor.data_location != onnx.TensorProto.EXTERNAL:
            constants[tensor.name] = numpy_helper.to_array(tensor)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            value = numpy_helper.to_array(node.attribute[0].t)
            constants[node.output[0]] = value
            shapes[node.output[0]], types[node.output[0]] = list(value.shape), node.attribute[0].t.data_type
    return shapes, types, constants


class Emitter:
    """Appends the backward's nodes and constants; one per build. Names are unique under ``prefix``."""

    def __init__(self, shapes: dict[str, Dims], types: dict[str, int], constants: dict[str, np.ndarray],
                 opset: int, taken: set[str]) -> None:  # fmt: skip
        self.shapes, self.types, self.constants, self.opset = shapes, types, constants, opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._taken = taken
        self._consts: dict[tuple, str] = {}
        self._shape_of: dict[str, str] = {}
        self.node_name = "odt_grad"
        self.parameters: set[str] = set()
        """The graph's parameters (trainable and frozen): lookup tables among them keep ORT's GatherGrad."""

    def name(self, hint: str) -> str:
        base, index = hint, 0
        while hint in self._taken:
            index += 1
            hint = f"{base}.{index}"
        self._taken.add(hint)
        return hint

    def op(self, op_type: str, inputs: Sequence[str], outputs: int | Sequence[str] = 1, domain: str = "",
           **attrs) -> list[str]:  # type: ignore[no-untyped-def]  # fmt: skip
        """Append ``op_type`` and return its output names (fresh ones for a count)."""
        if isinstance(outputs, int):
            outputs = [self.name(f"{self.node_name}/{op_type}_{i}") for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), list(outputs), name=self.name(
            f"{self.node_name}/{op_type}"), domain=domain, **attrs))  # fmt: skip
        return list(outputs)

    def one(self, op_type: str, *inputs: str, **attrs) -> str:  # type: ignore[no-untyped-def]
        return self.op(op_type, inputs, **attrs)[0]

    def const(self, value: float | int | Sequence, dtype: type = np.float32) -> str:
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            name = self.name(f"odt.grad.const.{len(self._consts)}")
            self.initializers.append(numpy_helper.from_array(array, name))
            self._consts[key] = name
            self.shapes[name], self.constants[name] = list(array.shape), array
        return self._consts[key]

    def shape(self, tensor: str) -> str:
        """``Shape(tensor)``, made once per tensor."""
        if tensor not in self._shape_of:
            self._shape_of[tensor] = self.one("Shape", tensor)
        return self._shape_of[tensor]

    def rank(self, tensor: str) -> int | None:
        dims = self.shapes.get(tensor)
        return None if dims is None else len(dims)

    def value(self, tensor: str) -> np.ndarray | None:
        """The value of a constant tensor (an initializer or Constant of at most 64 elements), else None."""
        return self.constants.get(tensor)

    def zeros_like(self, tensor: str) -> str:
        return self.one("ConstantOfShape", self.shape(tensor), value=numpy_helper.from_array(np.zeros(1, np.float32)))

    def sum_to(self, grad: str, target: str, result: str) -> str:
        """``grad`` (the shape of a broadcast result) summed over the axes along which ``target`` was
        broadcast, shaped like ``target``: from static shapes where they decide it, else computed in the graph."""
        out, tgt = self.shapes.get(result), self.shapes.get(target)
        if out is not None and tgt is not None and len(tgt) <= len(out):
            lead = len(out) - len(tgt)
            decided, axes = True, list(range(lead))
            for i, dim in enumerate(tgt):
                other = out[lead + i]
                if dim == other and dim is not None:
                    continue
                if dim == 1 and isinstance(other, (int, str)) and other != 1:
                    axes.append(lead + i)
                elif isinstance(dim, str) and isinstance(other, str) and dim != other:
                    decided = False
                elif dim is None or other is None:
                    decided = False
            if decided:
                if not axes:
                    return grad
                if axes == list(range(lead)):  # leading axes only (a bias): one ReduceSum, as ORT writes it
                    return self.one("ReduceSum", grad, self.const(axes, np.int64), keepdims=0)
                summed = self.one("ReduceSum", grad, self.const(axes, np.int64), keepdims=1)
                return self.one("Reshape", summed, self.shape(target)) if lead else summed
        return self._dynamic_sum_to(grad, target, result)

    def _dynamic_sum_to(self, grad: str, target: str, result: str) -> str:
        # axes where the target's padded shape is 1 and the gradient's is not, found when the graph runs
        out_rank, tgt_rank = self.rank(result), self.rank(target)
        target_shape = self.shape(target)
        if out_rank is None or tgt_rank is None:  # the ranks too: ones to pad with, as many as they differ by
            missing = self.one("Sub", self.one("Size", self.shape(grad)), self.one("Size", target_shape))
            ones = self.one("ConstantOfShape", self.one("Reshape", missing, self.const([1], np.int64)),
                            value=numpy_helper.from_array(np.ones(1, np.int64)))  # fmt: skip
            target_shape = self.one("Concat", ones, target_shape, axis=0)
        elif out_rank > tgt_rank:
            target_shape = self.one("Concat", self.const([1] * (out_rank - tgt_rank), np.int64), target_shape, axis=0)
        ones = self.one("Equal", target_shape, self.const([1], np.int64))
        kept = self.one("Equal", self.shape(grad), self.const([1], np.int64))
        broadcast = self.one("And", ones, self.one("Not", kept))
        axes = self.one("Reshape", self.one("NonZero", broadcast), self.const([-1], np.int64))
        summed = self.one("ReduceSum", grad, axes, keepdims=1, noop_with_empty_axes=1)
        return self.one("Reshape", summed, self.shape(target))
