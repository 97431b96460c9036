"""Swapping layers of a PyTorch model before export (a copy: the caller's model is not changed)."""

from __future__ import annotations

import copy
from typing import Callable

from torch import nn

__all__ = ["replace_modules"]


def replace_modules(
    model: nn.Module, matches: Callable[[nn.Module], bool], build: Callable[[nn.Module], nn.Module]
) -> nn.Module:
    """A copy of ``model`` with ``build(layer)`` in place of every layer that ``matches``
    (``model`` itself when none does)."""
    found = [name for name, module in model.named_modules() if matches(module)]
    if not found:
        return model
    copied = copy.deepcopy(model)
    if found == [""]:  # the model is such a layer itself
        return build(copied)
    for name in found:
        parent_name, _, attr = name.rpartition(".")
        parent = copied.get_submodule(parent_name) if parent_name else copied
        setattr(parent, attr, build(getattr(parent, attr)))
    return copied
