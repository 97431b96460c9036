"""Fold LoRA adapters into their base weights: an adapted inference graph becomes a plain one.

Uses the ``onnx`` package, which onnxruntime-training itself depends on (no torch).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .errors import CheckpointError
from .manifest import Adapter

__all__ = ["fold_adapters", "fold_weight"]


def fold_weight(weight: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """``W + scale * B @ A`` in float64, returned in W's dtype (a LoRA adapter merged into its layer)."""
    merged = weight.astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))
    return merged.astype(weight.dtype)


def fold_adapters(model, adapters: Iterable[Adapter], base_dir: str | None = None):  # type: ignore[no-untyped-def]
    """Return ``model`` (an onnx.ModelProto) with ``W + scale * B @ A`` in each adapted weight.

    Each adapter's branch (from its A and B to the Add that joins the base layer's output) is
    removed, and A and B with it; the graph computes the same function with one MatMul per layer.
    A ``W`` kept as external data is read from ``base_dir`` (the folded one is then held in the graph).
    """
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    for adapter in adapters:
        if adapter.weight in initializers and initializers[adapter.weight].data_type == onnx.TensorProto.INT8:
            continue  # an int8 base (widened in the graph) keeps its branch: the file computes the same function
        missing = [n for n in (adapter.weight, adapter.a, adapter.b) if n not in initializers]
        if missing:
            raise CheckpointError(f"cannot fold the LoRA adapter into {adapter.weight}: the graph lacks {missing}.")
        w, a, b = (numpy_helper.to_array(initializers[n], base_dir or "") for n in (adapter.weight, adapter.a,
                                                                                       adapter.b))  # fmt: skip
        merged = fold_weight(w, a, b, adapter.scale)
        initializers[adapter.weight].CopyFrom(numpy_helper.from_array(merged, adapter.weight))
        _bypass(graph, adapter)
    prune(graph)
    return model


def _reached(graph, sources: set[str]) -> set[str]:  # type: ignore[no-untyped-def]
    """Every value computed from ``sources`` (nodes are in topological order)."""
    reached = set(sources)
    for node in graph.node:
        if any(i in reached for i in node.input):
            reached.update(node.output)
    return reached


def _bypass(graph, adapter: Adapter) -> None:  # type: ignore[no-untyped-def]
    """Route the consumers of the Add that joins base and adapter branch to the base output."""
    from_adapter = _reached(graph, {adapter.a, adapter.b})
    from_base = _reached(graph, {adapter.weight})
    for node in graph.node:
        if node.op_type != "Add" or len(node.input) != 2:
            continue
        flags = [i in from_adapter for i in node.input]
        if sum(flags) != 1:
            continue
        base = node.input[flags.index(False)]
        if base not in from_base:
            continue
        joined = node.output[0]
        node.op_type, node.input[:] = "Identity", [base]
        for other in graph.node:
            if other is not node:
                other.input[:] = [base if i == joined else i for i in other.input]
        return
    raise CheckpointError(f"cannot fold the LoRA adapter of {adapter.weight}: no Add joins it to the base layer.")


def prune(graph, inputs: bool = True) -> None:  # type: ignore[no-untyped-def]
    """Drop nodes no graph output needs, then initializers no node reads and, with ``inputs``, graph inputs
    (without: a graph whose inputs are an interface keeps them all)."""
    needed = {o.name for o in graph.output}
    keep = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(keep))
    used = [i for i in graph.initializer if i.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(used)
    if inputs:
        kept = [i for i in graph.input if i.name in needed]
        del graph.input[:]
        graph.input.extend(kept)
