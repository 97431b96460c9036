"""Reading a narrow frozen base (int8 rows with a scale per row, or float16) inside a graph: each product
widens its matrix to float32 just before it runs, and the float32 copy dies with the product.

ONNX Runtime constant-folds ``DequantizeLinear`` (or ``Cast``) of an initializer back into a float32 copy when
a session loads, and orders a node with no activation input early, so every widened matrix would live from the
start of the run: the float32 base again. So each product gets its own widening, made to wait for the product's
activation input ``x``: an int8 matrix's scale is read as ``scale + 0 * x[0]`` (exact), a float16 matrix is
reshaped to a shape computed as ``shape + int(0 * x[0])`` before its ``Cast``. A matrix too large to widen at
once (a tied 49,152-row embedding: 113 MB in float32) is widened and multiplied in blocks of rows, each block its
own tensor (:func:`ondevice.frozen.row_blocks`). Lookups (Gather of rows) widen only the rows they read.

The generator rewrites the step graphs with :func:`widen_in_graph` (``artifacts.narrow_base``); the runtime
rewrites a causal LM's cached decoder the same way (:mod:`ondevice.narrow_decoder`). onnx only, no torch.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Mapping

import onnx
from onnx import helper

from .frozen import SCALE_SUFFIX, block_name, row_blocks

__all__ = ["attributes", "float_constant", "int_constant", "reads", "wait_constants", "widen_in_graph", "zero_after"]

_PRODUCTS = {("Gemm", 1), ("MatMul", 1)}
"""(operator, input position) where a frozen matrix may be read as the second factor of a product."""
_PREFIX = "odt.narrow"
"""Names of the nodes this module adds start with it."""


def attributes(node: onnx.NodeProto) -> dict[str, object]:
    """``{name: value}`` of ``node``'s attributes (repeated ones as lists, strings as bytes)."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def int_constant(name: str, values: list[int]) -> onnx.NodeProto:
    """A Constant node with the int64 vector ``values`` as its output ``name``."""
    return helper.make_node(
        "Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values)
    )


def float_constant(name: str, value: float) -> onnx.NodeProto:
    """A Constant node with the float32 vector ``[value]`` as its output ``name``."""
    value_tensor = helper.make_tensor(name, onnx.TensorProto.FLOAT, [1], [value])
    return helper.make_node("Constant", [], [name], value=value_tensor)


def wait_constants(prefix: str) -> list[onnx.NodeProto]:
    """The constants :func:`zero_after` reads, named under ``prefix`` (add them to the graph once)."""
    return [int_constant(f"{prefix}/flat", [-1]), int_constant(f"{prefix}/start", [0]),
            int_constant(f"{prefix}/stop", [1]), float_constant(f"{prefix}/nothing", 0.0)]  # fmt: skip


def zero_after(x: str, base: str, prefix: str, nodes: list[onnx.NodeProto]) -> str:
    """Append nodes computing ``0 * x[0]`` (float32, shape [1]) to ``nodes``; returns its name.

    Added to a float32 tensor it changes no value (unless ``x`` holds an infinity or NaN) but makes
    every reader of the sum wait for ``x``: ONNX Runtime runs a node as soon as its inputs exist and
    never folds this into a constant, so it is how a pass schedules work late."""
    nodes.extend([
        helper.make_node("Reshape", [x, f"{prefix}/flat"], [f"{base}/x"], name=f"{base}/x"),
        helper.make_node("Slice", [f"{base}/x", f"{prefix}/start", f"{prefix}/stop"], [f"{base}/first"],
                         name=f"{base}/first"),
        helper.make_node("Mul", [f"{base}/first", f"{prefix}/nothing"], [f"{base}/zero"], name=f"{base}/zero"),
    ])  # fmt: skip
    return f"{base}/zero"


def widen_in_graph(
    model: onnx.ModelProto, rows: Mapping[str, tuple[int, int]], half: Iterable[str] = (), limit: int | None = None
) -> int:
    """Rewrite every read of the narrow matrices ``rows`` (name -> (rows, columns)) in ``model`` as
    described in the module docstring: int8 ones (``name + SCALE_SUFFIX`` is each one's scale input),
    or float16 ones where named in ``half``. A large one's row blocks (``ondevice.frozen.row_blocks``)
    are tensors of their own, so no Slice copies them (ORT folds a Slice of an initializer into a new
    one: SmolLM2's embedding twice more; ``limit``: the artifacts' ``block_values``). Returns the number of
    reads rewritten."""
    graph = model.graph
    half = set(half)
    nodes: list[onnx.NodeProto] = []
    zeros: dict[str, str] = {}  # activation -> its "0 * x[0]" (one per activation, shared by its products)
    count = 0

    def zero_of(x: str) -> str:
        if x not in zeros:
            zeros[x] = zero_after(x, f"{_PREFIX}/{len(zeros)}", _PREFIX, nodes)
        return zeros[x]

    nodes.extend(wait_constants(_PREFIX))  # shared by every zero_after; an unused one is dropped at session load

    for node in graph.node:
        weight = next((n for i, n in enumerate(node.input) if n in rows and reads(node, i)), None)
        if weight is None:
            nodes.append(node)
            continue
        count += 1
        base = f"{weight}::widened/{count}"
        if node.op_type == "Gather":
            nodes.extend(_lookup(node, weight, base, weight in half))
            continue
        blocks = row_blocks(rows[weight], limit) if _blockable(node) else [(0, rows[weight][0])]
        widen = functools.partial(_widen, weight, rows[weight], weight in half, blocked=len(blocks) > 1)
        if len(blocks) == 1:
            nodes.extend(widen(0, rows[weight][0], zero_of(node.input[0]), f"{base}/w"))
            node.input[1] = f"{base}/w"
            nodes.append(node)
        else:
            nodes.extend(_blocked_product(node, widen, zero_of(node.input[0]), base, blocks))
    del graph.node[:]
    graph.node.extend(nodes)
    return count


def _widen(weight: str, shape: tuple[int, int], half: bool, start: int, stop: int, zero: str, out: str,
           blocked: bool = False) -> list[onnx.NodeProto]:
    """Nodes widening rows ``start:stop`` of ``weight`` (its row block's own tensor when ``blocked``) into
    ``out`` once ``zero`` (a float32 ``[0.0]`` computed from an activation) exists."""
    stored = block_name(weight, start) if blocked else weight
    if half:  # Reshape to a shape that waits for `zero`: no copy (the output is a view), then the Cast
        return [
            helper.make_node("Cast", [zero], [f"{out}/wait"], name=f"{out}/wait", to=onnx.TensorProto.INT64),
            int_constant(f"{out}/rows", [stop - start, shape[1]]),
            helper.make_node("Add", [f"{out}/rows", f"{out}/wait"], [f"{out}/shape"], name=f"{out}/shape"),
            helper.make_node("Reshape", [stored, f"{out}/shape"], [f"{out}/half"], name=f"{out}/half"),
            helper.make_node("Cast", [f"{out}/half"], [out], name=out, to=onnx.TensorProto.FLOAT),
        ]  # fmt: skip
    made = [helper.make_node("Add", [weight + SCALE_SUFFIX, zero], [f"{out}/scale"], name=f"{out}/scale")]
    scale = f"{out}/scale"
    if blocked:
        made += [int_constant(f"{out}/start", [start]), int_constant(f"{out}/stop", [stop]),
                 helper.make_node("Slice", [scale, f"{out}/start", f"{out}/stop"], [f"{out}/rows"],
                                  name=f"{out}/rows")]  # fmt: skip
        scale = f"{out}/rows"
    return made + [helper.make_node("DequantizeLinear", [stored, scale], [out], name=out, axis=0)]


def reads(node: onnx.NodeProto, position: int) -> bool:
    return (node.op_type, position) in _PRODUCTS or _is_lookup(node, position)


def _is_lookup(node: onnx.NodeProto, position: int) -> bool:
    return node.op_type == "Gather" and position == 0 and attributes(node).get("axis", 0) == 0


def _blockable(node: onnx.NodeProto) -> bool:
    """A Gemm without a bias term and without a transposed A: its product splits by the weight's rows."""
    return node.op_type == "Gemm" and len(node.input) == 2 and not attributes(node).get("transA", 0)


def _lookup(node: onnx.NodeProto, weight: str, base: str, half: bool) -> list[onnx.NodeProto]:
    """Gather(W, ids) as Cast(Gather(W16, ids)), or Gather(q, ids) * Gather(scale, ids)[..., None]: only the
    rows read are widened."""
    ids, out = node.input[1], node.output[0]
    rows = [helper.make_node("Gather", [weight, ids], [f"{base}/q"], name=f"{base}/q", axis=0)]
    if half:
        return [*rows, helper.make_node("Cast", [f"{base}/q"], [out], name=node.name or f"{base}/lookup",
                                        to=onnx.TensorProto.FLOAT)]  # fmt: skip
    return [
        *rows,
        helper.make_node("Cast", [f"{base}/q"], [f"{base}/rows"], name=f"{base}/rows", to=onnx.TensorProto.FLOAT),
        helper.make_node("Gather", [weight + SCALE_SUFFIX, ids], [f"{base}/s"], name=f"{base}/s", axis=0),
        int_constant(f"{base}/last", [-1]),
        helper.make_node("Unsqueeze", [f"{base}/s", f"{base}/last"], [f"{base}/scale"], name=f"{base}/scale"),
        helper.make_node("Mul", [f"{base}/rows", f"{base}/scale"], [out], name=node.name or f"{base}/lookup"),
    ]


def _blocked_product(
    node: onnx.NodeProto, widen: Callable[..., list[onnx.NodeProto]], zero: str, base: str,
    blocks: list[tuple[int, int]],
) -> list[onnx.NodeProto]:
    """A Gemm over a large narrow matrix, a block of its rows at a time (``widen`` as :func:`_widen`, after
    ``zero`` of the activation): with ``transB`` the blocks give column blocks of the result (concatenated),
    without it they give partial products over slices of the activation's columns (summed). Each block's
    widening waits for the previous block's product, so the blocks are widened one after another, not all
    at once (about two alive at a time, measured)."""
    given = attributes(node)
    transposed, alpha = bool(given.get("transB", 0)), float(given.get("alpha", 1.0))
    x, out = node.input[0], node.output[0]
    made: list[onnx.NodeProto] = [int_constant(f"{base}/axis1", [1])]
    parts: list[str] = []
    for index, (start, stop) in enumerate(blocks):
        at = f"{base}/{index}"
        waited = zero_after(parts[-1], f"{at}/wait", _PREFIX, made) if parts else zero
        made += widen(start, stop, waited, f"{at}/w")
        factor = x
        if not transposed:
            factor = f"{at}/x"
            made += [int_constant(f"{at}/start", [start]), int_constant(f"{at}/stop", [stop])]
            bounds = [f"{at}/start", f"{at}/stop"]
            if parts:  # the activation's slice waits too, or ORT fuses all the slices into one Split: a copy of x
                none = [f"{at}/size", f"{_PREFIX}/start"]  # 0 * the previous part's size: waits for it
                made += [helper.make_node("Size", [parts[-1]], [f"{at}/size"], name=f"{at}/size"),
                         helper.make_node("Mul", none, [f"{at}/none"], name=f"{at}/none")]  # fmt: skip
                for bound in ("start", "stop"):
                    made.append(helper.make_node("Add", [f"{at}/{bound}", f"{at}/none"], [f"{at}/{bound}/waited"],
                                                 name=f"{at}/{bound}/waited"))  # fmt: skip
                bounds = [f"{at}/start/waited", f"{at}/stop/waited"]
            made.append(helper.make_node("Slice", [x, *bounds, f"{base}/axis1"], [factor], name=factor))  # fmt: skip
        made.append(helper.make_node("Gemm", [factor, f"{at}/w"], [f"{at}/y"], name=f"{at}/y", alpha=alpha,
                                     transB=int(transposed)))  # fmt: skip
        parts.append(f"{at}/y")
    if transposed:
        made.append(helper.make_node("Concat", parts, [out], name=node.name or f"{base}/concat", axis=1))
    else:
        made.append(helper.make_node("Sum", parts, [out], name=node.name or f"{base}/sum"))
    return made
