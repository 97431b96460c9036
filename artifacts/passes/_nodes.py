"""Small readers of ONNX nodes that several passes share."""

from __future__ import annotations

import onnx
from onnx import helper

__all__ = ["attributes", "int_constant"]


def attributes(node: onnx.NodeProto) -> dict[str, object]:
    """``{name: value}`` of ``node``'s attributes (repeated ones as lists, strings as bytes)."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def int_constant(name: str, values: list[int]) -> onnx.NodeProto:
    """A Constant node with the int64 vector ``values`` as its output ``name``."""
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values)
    )
