"""Gradients of operators that move data: reshapes, slices, gathers, concatenation, reductions, tiles, pads."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx

from ._emit import MS, Emitter
from ._registry import Grads, attr, rule

# -- shapes and data movement ----------------------------------------------------------------------


@rule("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand")
def _reshape(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x = node.input[0]
    if node.op_type == "Expand":
        return [e.sum_to(dy[0], x, node.output[0]), None]
    return [e.one("Reshape", dy[0], e.shape(x)), *([None] * (len(node.input) - 1))]


@rule("Transpose")
def _transpose(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    perm = attr(node, "perm", None)
    if perm is None:
        rank = e.rank(node.input[0])
        if rank is None:
            raise NotImplementedError("Transpose without perm of unknown rank")
        perm = list(range(rank))[::-1]
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return [e.one("Transpose", dy[0], perm=inverse)]


@rule("Slice")
def _slice(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x = node.input[0]
    inputs = [dy[0], e.shape(x), *node.input[1:]]
    return [e.one("SliceGrad", *inputs, domain=MS), *([None] * (len(node.input) - 1))]


@rule("Gather")
def _gather(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    data, indices = node.input
    axis, rank, picks = attr(node, "axis", 0), e.rank(data), e.rank(indices)
    if data in e.parameters or rank is None or picks is None or picks > 1:  # a lookup table: ORT's GatherGrad,
        # which the lookup-grad and padding-rows passes rewrite
        return [e.one("GatherGrad", e.shape(data), indices, dy[0], domain=MS, axis=axis), None]
    # positions picked from an activation along ``axis``: dY added back there, in zeros of its shape
    axis = axis + rank if axis < 0 else axis
    g = dy[0] if picks == 1 else e.one("Unsqueeze", dy[0], e.const([axis], np.int64))
    shape = [1] * rank
    shape[axis] = -1
    where = e.one("Reshape", e.one("Cast", indices, to=onnx.TensorProto.INT64), e.const(shape, np.int64))
    wrapped = e.one("Where", e.one("Less", where, e.const(0, np.int64)),
                    e.one("Add", where, e.one("Gather", e.shape(data), e.const(axis, np.int64))), where)  # fmt: skip
    spread = e.one("Expand", wrapped, e.shape(g))
    return [e.one("ScatterElements", e.zeros_like(data), spread, g, axis=axis, reduction="add"), None]


@rule("GatherElements")
def _gather_elements(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    data, indices = node.input
    scattered = e.one("ScatterElements", e.zeros_like(data), indices, dy[0], axis=attr(node, "axis", 0),
                      reduction="add")  # fmt: skip
    return [scattered, None]


def _lengths(e: Emitter, inputs: Sequence[str], axis: int) -> str:
    """Each input's length along ``axis`` (>= 0), concatenated: the split of the gradient."""
    return e.one("Concat", *(e.one("Shape", x, start=axis, end=axis + 1) for x in inputs), axis=0)


@rule("Concat")
def _concat(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    axis = attr(node, "axis", 0)
    rank = e.rank(node.output[0])
    if axis < 0:
        if rank is None:
            raise NotImplementedError("Concat on a negative axis of unknown rank")
        axis += rank
    parts = [e.name(f"{x}_grad.part") for x in node.input]
    e.op("Split", [dy[0], _lengths(e, node.input, axis)], parts, axis=axis)
    return [p if n else None for p, n in zip(parts, need)]


@rule("Split")
def _split(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    parts = [g if g is not None else e.zeros_like(y) for g, y in zip(dy, node.output)]
    return [e.one("Concat", *parts, axis=attr(node, "axis", 0)), *([None] * (len(node.input) - 1))]


def _reduce_axes(e: Emitter, node: onnx.NodeProto) -> list[int] | None:
    """The reduced axes, normalized, or None for all of them."""
    axes = attr(node, "axes", None)
    if axes is None and len(node.input) > 1 and node.input[1]:
        value = e.value(node.input[1])
        if value is None:
            raise NotImplementedError(f"{node.op_type} over axes computed in the graph")
        axes = [int(v) for v in value.reshape(-1)]
    if not axes:
        return None
    rank = e.rank(node.input[0])
    if rank is None and any(a < 0 for a in axes):
        raise NotImplementedError(f"{node.op_type} over negative axes of unknown rank")
    return sorted(a + rank if a < 0 else a for a in axes)  # type: ignore[operator]


@rule("ReduceSum", "ReduceMean")
def _reduce(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x, g = node.input[0], dy[0]
    axes = _reduce_axes(e, node)
    if axes is None and len(node.input) > 1 and node.input[1] and attr(node, "noop_with_empty_axes", 0):
        return [g, None]
    if not attr(node, "keepdims", 1):
        if axes is None:
            rank = e.rank(x)
            if rank is None:
                raise NotImplementedError(f"{node.op_type} of unknown rank")
            axes = list(range(rank))
        g = e.one("Unsqueeze", g, e.const(axes, np.int64))
    spread = e.one("Expand", g, e.shape(x))
    if node.op_type == "ReduceMean":
        count = e.one("Div", e.one("Cast", e.one("Size", x), to=onnx.TensorProto.FLOAT),
                      e.one("Cast", e.one("Size", node.output[0]), to=onnx.TensorProto.FLOAT))  # fmt: skip
        spread = e.one("Div", spread, count)
    return [spread, *([None] * (len(node.input) - 1))]


@rule("GlobalAveragePool")
def _global_average_pool(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x, y = node.input[0], node.output[0]
    count = e.one("Div", e.one("Cast", e.one("Size", x), to=onnx.TensorProto.FLOAT),
                  e.one("Cast", e.one("Size", y), to=onnx.TensorProto.FLOAT))  # fmt: skip
    return [e.one("Div", e.one("Expand", dy[0], e.shape(x)), count)]


@rule("Tile")
def _tile(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    x, repeats = node.input
    known, rank = e.value(repeats), e.rank(x)
    if known is None and rank is None:
        raise NotImplementedError("Tile with repeats computed in the graph over an input of unknown rank")
    rank = len(known.reshape(-1)) if known is not None else rank
    # dY as [r0, d0, r1, d1, ...] (the repeats as given, or read from the graph's tensor), summed over the repeats
    dims = e.shape(x)

    def entry(tensor: str, axis: int) -> str:
        return e.one("Slice", tensor, e.const([axis], np.int64), e.const([axis + 1], np.int64))

    parts = []
    for axis in range(rank):
        count = e.const([int(known.reshape(-1)[axis])], np.int64) if known is not None else entry(repeats, axis)
        parts += [count, entry(dims, axis)]
    split = e.one("Reshape", dy[0], e.one("Concat", *parts, axis=0))
    summed = e.one("ReduceSum", split, e.const(list(range(0, 2 * rank, 2)), np.int64), keepdims=0)
    return [summed, None]


@rule("Pad")
def _pad(e: Emitter, node: onnx.NodeProto, dy: Grads, need: Sequence[bool]) -> Grads:
    mode = attr(node, "mode", b"constant")
    pads = e.value(node.input[1]) if len(node.input) > 1 else None
    if mode not in (b"constant", "constant") or pads is None or (len(node.input) > 3 and node.input[3]):
        raise NotImplementedError("Pad other than constant padding by constant amounts on every axis")
    pads = [int(p) for p in pads.reshape(-1)]
    rank = len(pads) // 2
    if any(p < 0 for p in pads):
        raise NotImplementedError("Pad with negative amounts")
    starts, ends = pads[:rank], [-p if p else np.iinfo(np.int64).max for p in pads[rank:]]
    cut = e.one("Slice", dy[0], e.const(starts, np.int64), e.const(ends, np.int64),
                e.const(list(range(rank)), np.int64))  # fmt: skip
    return [cut, *([None] * (len(node.input) - 1))]
