"""What every lowering of :mod:`artifacts.passes.portable` builds with: the facts it reads about the whole
graph and a builder of the nodes that replace one training-only node."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ._nodes import inferred_graph, zero_after

__all__ = ["Builder", "GraphFacts", "Unlowerable", "channel_shape", "output"]

WAIT = "odt.portable.wait"
WAIT_CONSTANTS = {
    f"{WAIT}/flat": np.array([-1], np.int64),
    f"{WAIT}/start": np.array([0], np.int64),
    f"{WAIT}/stop": np.array([1], np.int64),
    f"{WAIT}/nothing": np.array([0.0], np.float32),
}
"""What :func:`zero_after` reads (``wait_constants``' values) as initializers, shared by every lowered gradient."""

class GraphFacts:
    """What lowerings read about the whole graph: ranks (from ONNX shape inference), the values some
    node reads, and constant initializers."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self._initializers = {i.name: i for i in graph.initializer if i.data_location != 1}
        self._values: dict[str, np.ndarray] = {}  # each initializer's value, read once when a lowering asks
        self.used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        self.inputs = {i.name for i in graph.input}
        self.batchnorm_scales = Counter(n.input[1] for n in graph.node if n.op_type == "BatchNormInternal")
        """how many training-mode BatchNorms read each scale (more than one: a module applied twice)"""
        try:
            inferred = inferred_graph(model)
        except Exception:  # noqa: BLE001 - ranks are a help; a lowering that needs one declines without
            inferred = graph
        values = [v for v in (*inferred.input, *inferred.value_info, *inferred.output)
                  if v.type.tensor_type.HasField("shape")]  # fmt: skip
        self.ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in values}
        self.dims = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
                     for v in values}  # fmt: skip

    def is_constant(self, name: str) -> bool:
        """Whether ``name`` is an initializer (its value is not read)."""
        return name in self._initializers

    def constant(self, name: str) -> np.ndarray | None:
        """The value of the initializer ``name`` (None when there is none)."""
        if name not in self._values and name in self._initializers:
            self._values[name] = numpy_helper.to_array(self._initializers[name])
        return self._values.get(name)


class Builder:
    """Names and constants for one lowered node."""

    def __init__(self, node: onnx.NodeProto, constants: dict[str, onnx.TensorProto], opset: int,
                 graph: GraphFacts) -> None:  # fmt: skip
        self.node, self.constants, self.opset = node, constants, opset
        self.ranks, self.dims, self.used, self._graph = graph.ranks, graph.dims, graph.used, graph
        self.inputs, self.batchnorm_scales = graph.inputs, graph.batchnorm_scales
        self.per_row: set[str] = set()
        """inputs a lowering knows hold one value per row (a norm's statistics), whatever shape inference knew"""
        self.prefix = (node.name or node.output[0]) + ".portable"
        self.nodes: list[onnx.NodeProto] = []

    def const(self, value: np.ndarray | float | list[int]) -> str:
        array = np.asarray(value, dtype=np.float32 if isinstance(value, float) else None)
        name = f"odt.portable.{array.dtype}.{'_'.join(map(str, array.shape))}.{array.tobytes().hex()}"
        self.constants.setdefault(name, numpy_helper.from_array(array, name))
        return name

    def constant_value(self, name: str) -> np.ndarray:
        if name in self.constants:
            return numpy_helper.to_array(self.constants[name])
        value = self._graph.constant(name)
        if value is None:
            raise Unlowerable(f"{name!r} is not a constant")
        return value

    def known(self, name: str) -> np.ndarray | None:
        """``name``'s value when it is a constant, else None."""
        try:
            return self.constant_value(name)
        except Unlowerable:
            return None

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: object) -> str:
        out = out or f"{self.prefix}.{len(self.nodes)}.{op_type}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def wait_for(self, gradient: str) -> None:
        """Make the lowering's forward-only arithmetic (what it computes from saved activations alone, like
        SiLU's sigmoid) wait for ``gradient``: ORT's priority order would run it in the forward, as soon as
        the activation exists, and keep its results (new tensors of the activation's size) until the
        backward. Each such node that reads a float constant reads that constant plus ``0 * gradient[0]``
        instead (SmolLM2's step: 377 -> 367 MiB, measured). Others stay as they are."""
        made = {n.output[0] for n in self.nodes}
        later = {gradient}
        for node in self.nodes:
            if later.intersection(node.input):
                later.update(node.output)
        early = []  # (node, input position of a float constant) of nodes that read activations alone
        for node in self.nodes:
            reads = [i for i in node.input if i]
            if later.intersection(reads) or made.intersection(reads) or all(self._constant(i) for i in reads):
                continue  # waits already, waits through what it reads, or is constant (DropoutGrad's 1 - ratio
                # waited for dY: 4 nodes, and a Slice the profile gave 139 us of a 360 us digits step)
            slots = [k for k, i in enumerate(node.input) if self._waitable(i)]
            early += [(node, slots[0])] if slots else []
        if not early:
            return
        at = f"{self.prefix}.wait"
        waits: list[onnx.NodeProto] = []
        for name, array in WAIT_CONSTANTS.items():
            self.constants.setdefault(name, numpy_helper.from_array(array, name))
        zero = zero_after(gradient, at, WAIT, waits)  # [1]; as a scalar, the sums keep each constant's shape
        scalar = self.const(np.array([], np.int64))
        waits.append(helper.make_node("Reshape", [zero, scalar], [f"{at}.zero"], name=f"{at}.zero"))
        for index, (node, slot) in enumerate(early):
            waited = f"{at}.{index}"
            waits.append(helper.make_node("Add", [node.input[slot], f"{at}.zero"], [waited], name=waited))
            node.input[slot] = waited
        self.nodes[:0] = waits

    def _constant(self, name: str) -> bool:
        return name in self.constants or self._graph.is_constant(name)

    def _waitable(self, name: str) -> bool:
        """A float constant, or one of :attr:`per_row`: cheap to add a zero to."""
        if name in self.constants:
            return self.constants[name].data_type == onnx.TensorProto.FLOAT
        return name in self.per_row

    def reduce(self, op_type: str, x: str, axes: list[int], keepdims: int, out: str | None = None) -> str:
        """A reduction over ``axes`` in this opset's form (axes became an input in 13 or 18)."""
        if op_type == "ReduceSum" and self.opset >= 13 or self.opset >= 18:
            return self.op(op_type, [x, self.const(np.array(axes, np.int64))], out, keepdims=keepdims)
        return self.op(op_type, [x], out, axes=axes, keepdims=keepdims)


def output(node: onnx.NodeProto, index: int) -> str | None:
    """``node``'s output ``index`` where the graph has it (optional outputs may be missing or empty)."""
    return node.output[index] if len(node.output) > index and node.output[index] else None


class Unlowerable(ValueError):
    """A node this lowering cannot write in standard operators: it stays, and ``unportable`` reports it."""


def channel_shape(b: Builder, rank: int) -> str:
    """[C] -> [C, 1, ...] for broadcasting over a rank-``rank`` NC... tensor."""
    return b.const(np.array([-1] + [1] * (rank - 2), np.int64))
