"""Small readers of ONNX nodes that several passes share."""

from __future__ import annotations

import onnx
from onnx import helper

__all__ = ["attributes"]


def attributes(node: onnx.NodeProto) -> dict[str, object]:
    """``{name: value}`` of ``node``'s attributes (repeated ones as lists, strings as bytes)."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}
