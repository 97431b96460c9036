"""A causal LM's cached decoder that reads an int8 or float16 base as ``frozen.bin`` stores it.

The generator exports the decoder (``decoder.onnx``) from the float32 model: every linear layer reads its
weight through a ``Transpose`` into a ``MatMul``, the embedding through a ``Gather`` (and a tied head through
the embedding's ``Transpose``). Filled with widened weights, SmolLM2's decoder on an int8 base held the whole
float32 base and more: ``odt predict --prompt`` peaked at 3.4 GB. :func:`narrow_decoder` makes each such
product a ``Gemm`` over the stored matrix, which :func:`ondevice.widen.widen_in_graph` widens just in time
(the head a block of rows at a time), and adds the LoRA adapters of those matrices back as products of their
own: an adapter cannot fold into an int8 matrix without widening it for good. A head whose logits the decoder
keeps only for the last position (``logits[:, -1]``) multiplies only that position.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import OndeviceError
from .frozen import HALF
from .manifest import Adapter, Manifest
from .widen import attributes, int_constant, widen_in_graph

__all__ = ["narrow_decoder"]

_PREFIX = "odt.decoder"


def narrow_decoder(model: onnx.ModelProto, manifest: Manifest, stored: Mapping[str, np.ndarray]) -> set[str]:
    """Rewrite ``model`` (the artifacts' decoder, weights left empty) in place to read the manifest's narrow
    matrices as stored; ``stored``: each tensor of ``frozen.bin`` (:func:`ondevice.frozen.stored_arrays`: only
    their types and shapes are read).

    Returns the names of the narrow matrices it rewrote: the graph now declares them (and their scales and row
    blocks) as empty initializers of the stored type, and declares the LoRA factors of their adapters, which
    the caller must fill unfolded. A matrix read any other way keeps its float32 form."""
    frozen_file = manifest.frozen_file or {}
    int8, half = set(frozen_file.get("int8", {})), set(frozen_file.get(HALF, ()))
    initializers = {t.name: t for t in model.graph.initializer}
    narrow = {n for n in (int8 | half) if n in initializers and n in stored}
    if not narrow:
        return set()
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in model.graph.node:
        for position, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, position))
    transposes = {n.output[0]: n for n in model.graph.node if _transposes(n, narrow)}
    scalars = {n.output[0] for n in model.graph.node if n.op_type == "Constant" and _scalar(n)}
    scalars |= {t.name for t in model.graph.initializer if not t.dims and t.HasField("raw_data")}
    readable = {name for name in narrow if all(_readable(node, i, transposes, consumers)
                                               for node, i in consumers.get(name, []))}  # fmt: skip
    if not readable:
        return set()
    adapters = {a.weight: a for a in manifest.adapters if a.weight in readable}
    shapes = {p.name: p.shape for p in manifest.trainable}
    nodes = [int_constant(f"{_PREFIX}/start", [0]), int_constant(f"{_PREFIX}/stop", [-1])]
    products = [p for t in transposes.values() if t.input[0] in readable for p, _ in consumers[t.output[0]]]
    last = {p.output[0]: _last_position(p.output[0], consumers, scalars) for p in products}  # by output name
    dropped = set(last) | {g.output[0] for g in last.values() if g is not None}
    for node in model.graph.node:
        if _transposes(node, readable):
            for product, _ in consumers[node.output[0]]:
                weight = node.input[0]
                nodes.extend(_as_gemm(product, weight, tuple(initializers[weight].dims), adapters.get(weight),
                                      last[product.output[0]]))  # fmt: skip
        elif node.output[0] not in dropped:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(_without_unread(nodes, {o.name for o in model.graph.output}))
    limit = frozen_file.get("block_values")
    widen_in_graph(model, {n: tuple(initializers[n].dims) for n in readable}, half & readable, limit=limit)
    _declare(model, readable, stored, adapters, shapes)
    return readable


def _transposes(node: onnx.NodeProto, names: set[str]) -> bool:
    return node.op_type == "Transpose" and node.input[0] in names and attributes(node).get("perm") == [1, 0]


def _readable(node: onnx.NodeProto, position: int, transposes: Mapping[str, onnx.NodeProto],
              consumers: Mapping[str, list[tuple[onnx.NodeProto, int]]]) -> bool:  # fmt: skip
    """Whether this read of a narrow matrix can be rewritten: a row lookup, or a Transpose read only as the
    second factor of MatMuls."""
    if node.op_type == "Gather" and position == 0 and attributes(node).get("axis", 0) == 0:
        return True
    if node.output[0] not in transposes:
        return False
    return all(c.op_type == "MatMul" and i == 1 for c, i in consumers.get(node.output[0], []))


def _as_gemm(product: onnx.NodeProto, weight: str, shape: tuple[int, ...], adapter: Adapter | None,
             last: onnx.NodeProto | None) -> list[onnx.NodeProto]:  # fmt: skip
    """``MatMul(x, Transpose(W))`` as ``Gemm(x, W, transB=1)`` over x's rows (plus its adapter's products);
    with ``last`` (the Gather of one position that alone reads the product), that position only."""
    x, out = product.input[0], product.output[0]
    base = f"{_PREFIX}/{out}"
    if last is not None:  # logits[:, -1] of MatMul(x, W^T) is MatMul(x[:, -1], W^T): one row per prompt
        return [helper.make_node("Gather", [x, last.input[1]], [f"{base}/x"], name=f"{base}/x", axis=1),
                *_products(f"{base}/x", weight, adapter, last.output[0], base)]  # fmt: skip
    return [
        int_constant(f"{base}/rows", [-1, shape[1]]),
        helper.make_node("Reshape", [x, f"{base}/rows"], [f"{base}/x"], name=f"{base}/x"),
        *_products(f"{base}/x", weight, adapter, f"{base}/y", base),
        helper.make_node("Shape", [x], [f"{base}/shape"], name=f"{base}/shape"),
        helper.make_node("Slice", [f"{base}/shape", f"{_PREFIX}/start", f"{_PREFIX}/stop"], [f"{base}/lead"],
                         name=f"{base}/lead"),  # fmt: skip
        int_constant(f"{base}/tail", [shape[0]]),
        helper.make_node("Concat", [f"{base}/lead", f"{base}/tail"], [f"{base}/to"], name=f"{base}/to", axis=0),
        helper.make_node("Reshape", [f"{base}/y", f"{base}/to"], [out], name=product.name or out),
    ]


def _products(x: str, weight: str, adapter: Adapter | None, out: str, base: str) -> list[onnx.NodeProto]:
    """``x @ W^T`` into ``out``, plus ``scale * (x @ A^T) @ B^T`` for a LoRA adapter of ``W``."""
    if adapter is None:
        return [helper.make_node("Gemm", [x, weight], [out], name=f"{base}/gemm", transB=1)]
    return [
        helper.make_node("Gemm", [x, weight], [f"{base}/base"], name=f"{base}/gemm", transB=1),
        helper.make_node("Gemm", [x, adapter.a], [f"{base}/a"], name=f"{base}/a", transB=1),
        helper.make_node("Gemm", [f"{base}/a", adapter.b, f"{base}/base"], [out], name=f"{base}/b",
                         transB=1, alpha=float(adapter.scale)),  # fmt: skip
    ]


def _last_position(out: str, consumers: Mapping[str, list[tuple[onnx.NodeProto, int]]],
                   scalars: set[str]) -> onnx.NodeProto | None:  # fmt: skip
    """The Gather that alone reads ``out`` and picks one position on axis 1 with a scalar constant, if any."""
    readers = consumers.get(out, [])
    if len(readers) != 1:
        return None
    node, position = readers[0]
    if node.op_type != "Gather" or position != 0 or attributes(node).get("axis") != 1 or node.input[1] not in scalars:
        return None
    return node


def _scalar(node: onnx.NodeProto) -> bool:
    value = attributes(node).get("value")
    return isinstance(value, onnx.TensorProto) and numpy_helper.to_array(value).ndim == 0


def _without_unread(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` without the ones whose outputs nothing reads (the replaced logits Gather), repeatedly."""
    while True:
        read = {name for node in nodes for name in node.input} | outputs
        kept = [n for n in nodes if any(o in read for o in n.output)]
        if len(kept) == len(nodes):
            return kept
        nodes = kept


def _declare(model: onnx.ModelProto, narrow: set[str], stored: Mapping[str, np.ndarray],
             adapters: Mapping[str, Adapter], shapes: Mapping[str, tuple[int, ...]]) -> None:  # fmt: skip
    """Every tensor the rewritten graph reads from ``frozen.bin`` or from the adapters, as an empty initializer of
    its type and shape (the narrow matrices' float32 declarations retyped)."""
    graph = model.graph
    made = {name for node in graph.node for name in node.output} | {i.name for i in graph.input}
    read = {name for node in graph.node for name in node.input if name not in made}
    declared = {t.name: t for t in graph.initializer}
    for name in narrow:
        declared[name].data_type = helper.np_dtype_to_tensor_dtype(stored[name].dtype)
    for name in sorted(read - set(declared) - {n for a in adapters.values() for n in (a.a, a.b)}):
        if name not in stored:
            raise OndeviceError(f"the decoder reads {name!r}, which frozen.bin does not hold. Regenerate the "
                                "artifacts with `odt generate`.")
        graph.initializer.add(name=name, data_type=helper.np_dtype_to_tensor_dtype(stored[name].dtype),
                              dims=stored[name].shape)
    for adapter in adapters.values():
        for name in (adapter.a, adapter.b):
            graph.initializer.add(name=name, data_type=onnx.TensorProto.FLOAT, dims=shapes[name])
