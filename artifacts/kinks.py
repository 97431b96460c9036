"""Inputs of piecewise operators that lie within a few rounding steps of a kink.

At a kink (ReLU's 0, Hardswish's -3 and 3, a clip bound, a tie in a max-pooling window) one
rounding step in the operator's input picks the other branch: a value of 4.5e-8 in PyTorch and
exactly 0 in ORT turn one ReLU's gradient off, and BatchNorm's backward spreads that element over
its whole channel. Verification then fails although no kernel is wrong. :func:`near_kinks` finds
such inputs in ORT's forward, so that verification can say so and retry on other data.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import onnx
from numpy.lib.stride_tricks import sliding_window_view
from onnx import helper, numpy_helper

__all__ = ["Kink", "kink_outputs", "near_kinks", "with_torch_side", "ULPS"]

ULPS = 4
"""How close counts as at the kink: this many float32 spacings of the tensor's largest magnitude."""


@dataclass(frozen=True)
class Kink:
    node: str
    op: str
    at: float
    """The kink (for a max pooling: the gap between a window's two largest values, at 0)."""
    item: int
    """The example in the batch."""
    value: float
    """ORT's input there (for a max pooling: the gap)."""
    index: int = 0
    """The element within the item (flat)."""
    torch_value: float | None = None
    """PyTorch's input at the same element, when its forward has a matching tensor."""

    def __str__(self) -> str:
        if self.op == "MaxPool":
            return (f"MaxPool {self.node!r}, item {self.item}: its window's two largest values differ by "
                    f"{self.value:.3g}")  # fmt: skip
        torch = f", {self.torch_value:.3g} in PyTorch" if self.torch_value is not None else ""
        where = f"{self.op} {self.node!r}, item {self.item}"
        return f"{where}: input {self.value:.3g} in ONNX Runtime{torch} (kink at {self.at:g})"


def kink_outputs(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, tuple[float, ...]]]:
    """Every piecewise node of ``model`` with the points where its derivative jumps."""
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    attrs = {n.name: {a.name: helper.get_attribute_value(a) for a in n.attribute} for n in model.graph.node}
    found = []
    for node in model.graph.node:
        a = attrs[node.name]
        if node.op_type in ("Relu", "LeakyRelu"):
            found.append((node, (0.0,)))
        elif node.op_type == "HardSwish":
            found.append((node, (-3.0, 3.0)))
        elif node.op_type == "HardSigmoid":
            alpha, beta = float(a.get("alpha", 0.2)), float(a.get("beta", 0.5))
            found.append((node, (-beta / alpha, (1 - beta) / alpha)))
        elif node.op_type == "Clip":
            bounds = [float(constants[n]) for n in node.input[1:3] if n and n in constants]
            if bounds:
                found.append((node, tuple(bounds)))
        elif node.op_type == "MaxPool" and len(node.output) == 1 and not a.get("dilations") and a.get("kernel_shape"):
            found.append((node, (0.0,)))
    return found


def near_kinks(nodes: Sequence[tuple[onnx.NodeProto, tuple[float, ...]]], inputs: Sequence[np.ndarray],
               ulps: int = ULPS) -> list[Kink]:  # fmt: skip
    """The inputs (``inputs[i]`` for ``nodes[i]``, batch first) within ``ulps`` spacings of a kink,
    the closest per node and item."""
    found = []
    for (node, points), x in zip(nodes, inputs):
        x = np.asarray(x, dtype=np.float32)
        if not x.size or x.ndim < 1:
            continue
        if node.op_type == "MaxPool":
            distance, values, points = _window_gaps(node, x), _window_gaps(node, x), (0.0,)
        else:
            values = x
            distance = np.min([np.abs(x.astype(np.float64) - p) for p in points], axis=0)
        scale = np.spacing(np.float32(max(float(np.abs(x).max()), *(abs(p) for p in points))))
        close = distance <= ulps * scale
        for item in np.unique(np.nonzero(close)[0]):
            flat = np.where(close[item], distance[item], np.inf).ravel()
            index = int(flat.argmin())
            value = float(values[item].ravel()[index])
            at = min(points, key=lambda p: abs(value - p))
            found.append(Kink(node.name, node.op_type, float(at), int(item), value, index))
    return found


def with_torch_side(kink: Kink, ort_input: np.ndarray, torch_inputs: Sequence[np.ndarray]) -> Kink:
    """``kink`` with PyTorch's value of the same element: from the tensor of ``torch_inputs`` (the
    inputs of PyTorch's piecewise calls) that has ORT's shape and is closest to ORT's input."""
    same = [t for t in torch_inputs if t.shape == ort_input.shape]
    if not same or kink.op == "MaxPool":
        return kink
    closest = min(same, key=lambda t: float(np.abs(t.astype(np.float64) - ort_input).max()))
    return replace(kink, torch_value=float(closest[kink.item].ravel()[kink.index]))


def _window_gaps(node: onnx.NodeProto, x: np.ndarray) -> np.ndarray:
    """The gap between the two largest values of every pooling window (batch first, like ``x``)."""
    a = {attr.name: helper.get_attribute_value(attr) for attr in node.attribute}
    kernel = list(a["kernel_shape"])
    strides = list(a.get("strides") or [1] * len(kernel))
    pads = list(a.get("pads") or [0] * 2 * len(kernel))
    spatial = len(kernel)
    width = [(0, 0)] * (x.ndim - spatial) + list(zip(pads[:spatial], pads[spatial:]))
    padded = np.pad(x, width, constant_values=-np.inf)
    axes = tuple(range(x.ndim - spatial, x.ndim))
    windows = sliding_window_view(padded, kernel, axis=axes)
    windows = windows[(slice(None),) * (x.ndim - spatial) + tuple(slice(None, None, s) for s in strides)]
    flat = np.sort(windows.reshape(*windows.shape[: x.ndim], -1), axis=-1)
    with np.errstate(invalid="ignore"):
        gap = flat[..., -1].astype(np.float64) - flat[..., -2]
    return np.where(np.isfinite(gap), gap, np.inf)
