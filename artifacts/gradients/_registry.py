"""The rule registry: what a gradient rule is, where rules are registered, and their shared readers."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import onnx

from ._emit import Emitter

__all__ = ["Grads", "Rule", "RULES", "NOT_DIFFERENTIABLE", "rule", "attr", "copied_attrs"]

Grads = list[Optional[str]]
Rule = Callable[[Emitter, onnx.NodeProto, Grads, Sequence[bool]], Grads]
"""``(emitter, forward node, its outputs' gradients, which inputs need one) -> a gradient (or None) per input``"""
RULES: dict[str, Rule] = {}

NOT_DIFFERENTIABLE = frozenset({
    "Shape", "Size", "Constant", "ConstantOfShape", "Range", "Equal", "Greater", "GreaterOrEqual", "Less",
    "LessOrEqual", "And", "Or", "Not", "Xor", "IsNaN", "IsInf", "NonZero", "ArgMax", "ArgMin", "Mod", "Floor",
    "Ceil", "Round", "Sign", "OneHot", "EyeLike", "RandomNormal", "RandomUniform", "RandomNormalLike",
    "RandomUniformLike", "Bernoulli",
})  # fmt: skip
"""Operators whose outputs carry no gradient (integer, boolean or piecewise-constant results)."""


def rule(*op_types: str) -> Callable[[Rule], Rule]:
    """Register the decorated function as the gradient rule of ``op_types``."""

    def register(fn: Rule) -> Rule:
        for op_type in op_types:
            RULES[op_type] = fn
        return fn

    return register


def attr(node: onnx.NodeProto, name: str, default):  # type: ignore[no-untyped-def]
    """The value of ``node``'s attribute ``name``, or ``default``."""
    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default


def copied_attrs(node: onnx.NodeProto) -> dict:
    """Every attribute of ``node`` by name, to give a gradient kernel the forward's settings."""
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
