"""Recompute each layer in the backward (gradient checkpointing, as a graph rewrite).

A training step keeps, from the forward to the backward, every activation a gradient reads: every
layer's attention scores, MLP products and norms, alive at once when the backward starts (an 8-layer
Llama at 4 x 256 tokens: a 609 MB peak on the classic engine, 217 MB with this pass). With this pass
only each layer's input stays; the backward runs the layer's forward again from that input just
before it needs the values, and the activations live about one layer at a time.

How, on ORT's training graph:

- A *layer* is the forward nodes whose names share a module path ending in ``name.N`` (``/model/
  layers.3/...``, ``/bert/encoder/layer.3/...``, ``/transformer/h.3/...``: the exporter writes the
  module path into each node's name). Forward nodes are those that do not depend on the loss's
  gradient.
- The layer's *saved* tensors are those it makes and the backward reads. Its nodes that lead to a
  saved tensor from the layer's float inputs are copied; the backward reads the copies.
- The copies must not run early (ONNX Runtime runs a node as soon as its inputs exist, and then the
  copies would be kept as long as the originals were). Each float input of the layer is read by the
  copies as ``input + 0 * g[0]``, where ``g`` is the gradient of the layer's output: exact, and the
  copies wait for the backward to reach the layer.
- What cannot be run twice to the same values stays saved: random operators (``Dropout``: a second
  draw would give another mask) and nodes with subgraphs. Their outputs are read by the copies.

The values are the same operators on the same inputs, so the step computes what it computed without
the pass (tested to be bit-identical). The cost is a second forward of each layer (that Llama's step
took 1.38x as long).
"""

from __future__ import annotations

import heapq
import re
from collections import defaultdict

import onnx
from onnx import helper

from ..errors import ExportError
from ._nodes import wait_constants, zero_after

__all__ = ["recompute_layers", "layer_of", "LAYER_NAME"]

_PREFIX = "odt.recompute"
_SUFFIX = "::recompute"
LAYER_NAME = r"[A-Za-z_]\w*\.\d+"
"""A repeated layer's module name, ``layers.3``: what the pass recomputes (and the planner's estimate counts)."""
_LAYER = re.compile(rf"^(/(?:[^/]*/)*?{LAYER_NAME})/")
_UNREPEATABLE = {"Dropout", "BitmaskDropout", "BiasDropout", "BitmaskBiasDropout", "RandomNormal",
                 "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}  # fmt: skip


def layer_of(name: str) -> str | None:
    """The module path of the repeated layer a node's name places it in (``/model/layers.3``), or None."""
    match = _LAYER.match(name)
    return match.group(1) if match else None


def recompute_layers(model: onnx.ModelProto) -> list[str]:
    """Rewrite ``model`` (ORT's training graph) so that the backward recomputes each layer from its
    inputs; returns the layers recomputed, in graph order."""
    graph = model.graph
    nodes = list(graph.node)
    producer = {out: index for index, node in enumerate(nodes) for out in node.output if out}
    backward = _backward(nodes, graph.output[0].name + "_grad")
    types = _types(graph, nodes)

    layers: dict[str, list[int]] = defaultdict(list)
    placed: dict[str, str] = {}  # tensor -> the layer that makes it
    for index, node in enumerate(nodes):
        if index in backward:
            continue
        layer = layer_of(node.name)
        if layer is None and not node.name:  # a node ORT added without a name belongs where its input is made
            layer = next((placed[t] for t in node.input if t in placed), None)
        if layer is not None:
            layers[layer].append(index)
            placed.update((out, layer) for out in node.output if out)
    readers: dict[str, list[int]] = defaultdict(list)
    for index, node in enumerate(nodes):
        for name in node.input:
            readers[name].append(index)

    added: dict[int, list[onnx.NodeProto]] = defaultdict(list)  # before which node -> the nodes to put there
    done: list[str] = []
    for layer, members in layers.items():
        made = _recompute(layer, set(members), nodes, producer, readers, backward, types)
        if made is not None:
            first_reader, copies = made
            added[first_reader].extend(copies)
            done.append(layer)
    if not done:
        return []
    ordered: list[onnx.NodeProto] = wait_constants(_PREFIX)
    for index, node in enumerate(nodes):
        ordered.extend(added.get(index, ()))
        ordered.append(node)
    del graph.node[:]
    graph.node.extend(_topological(ordered))
    return done


def _backward(nodes: list[onnx.NodeProto], seed: str) -> set[int]:
    """Indices of the nodes that depend on the loss's gradient ``seed``."""
    reached, found = {seed}, set()
    for index, node in enumerate(nodes):  # ORT writes the training graph in topological order
        if any(name in reached for name in node.input):
            found.add(index)
            reached.update(out for out in node.output if out)
    return found


def _recompute(
    layer: str,
    members: set[int],
    nodes: list[onnx.NodeProto],
    producer: dict[str, int],
    readers: dict[str, list[int]],
    backward: set[int],
    types: dict[str, int],
) -> tuple[int, list[onnx.NodeProto]] | None:
    """The copies of ``layer``'s nodes that the backward should read, and the index of the first
    backward node that reads one; None when the layer has nothing to recompute or no gradient to wait for."""
    made = {out for i in members for out in nodes[i].output if out}
    outputs = {t for t in made if any(r not in members and r not in backward for r in readers[t])}
    # the layer's backward starts when the gradient of its last output exists
    last = sorted((producer[t], t) for t in outputs if t + "_grad" in producer)
    gradient = last[-1][1] + "_grad" if last else None
    inputs = {t for i in members for t in nodes[i].input if t and t not in made}
    # activations, not weights or graph inputs; float32 ones, as the wait adds a float32 zero
    waiting = {t for t in inputs if types.get(t) == onnx.TensorProto.FLOAT and t in producer}
    if gradient is None or not waiting:
        return None

    # the nodes that can run again: they make data (not integer shapes or indices: the copies read the
    # forward's, which are small) from a waiting input through repeatable nodes
    repeatable: set[int] = set()
    reach = set(waiting)
    for i in sorted(members):
        node = nodes[i]
        if node.op_type in _UNREPEATABLE or any(a.type in (a.GRAPH, a.GRAPHS) for a in node.attribute):
            continue
        if all(types.get(out) in _INTEGERS for out in node.output if out):
            continue
        if any(t in reach for t in node.input):
            repeatable.add(i)
            reach.update(out for out in node.output if out)
    saved = {t for t in made - outputs if producer[t] in repeatable and any(r in backward for r in readers[t])}
    if not saved:
        return None

    # copy what the saved tensors need, backwards from them through repeatable nodes
    needed: set[int] = set()
    stack = [producer[t] for t in saved]
    while stack:
        i = stack.pop()
        if i in needed:
            continue
        needed.add(i)
        stack.extend(producer[t] for t in nodes[i].input if t in producer and producer[t] in repeatable)
    upstream = _upstream(gradient, nodes, producer)
    readers_of_saved = sorted({r for t in saved for r in readers[t] if r in backward})
    if upstream.intersection(readers_of_saved):
        return None  # the gradient waited for needs a saved value itself: this layer keeps its activations
    copied = {out for i in needed for out in nodes[i].output if out}
    base = f"{_PREFIX}{layer}"
    copies: list[onnx.NodeProto] = []
    zero = zero_after(gradient, f"{base}/wait", _PREFIX, copies)
    renamed: dict[str, str] = {t: t + _SUFFIX for t in copied}
    for t in sorted(waiting):
        if any(t in nodes[i].input for i in needed):
            renamed[t] = f"{base}/waited/{t}"  # per layer: a shared input is waited for by each
            copies.append(helper.make_node("Add", [t, zero], [renamed[t]], name=renamed[t]))
    for i in sorted(needed):
        node = onnx.NodeProto()
        node.CopyFrom(nodes[i])
        node.name = (node.name or f"{layer}/{node.op_type}_{i}") + _SUFFIX
        node.input[:] = [renamed.get(t, t) for t in node.input]
        node.output[:] = [renamed.get(t, t) if t else t for t in node.output]
        copies.append(node)
    for r in readers_of_saved:
        node = nodes[r]
        node.input[:] = [renamed[t] if t in saved else t for t in node.input]
    for i in _read_late(members - needed, nodes, readers, backward, upstream):
        nodes[i].input[:] = [t + _SUFFIX if t in copied else t for t in nodes[i].input]
    return readers_of_saved[0], copies


def _read_late(
    candidates: set[int],
    nodes: list[onnx.NodeProto],
    readers: dict[str, list[int]],
    backward: set[int],
    upstream: set[int],
) -> list[int]:
    """The layer's forward nodes (not copied) that only the backward reads, directly or through each
    other, after the layer's gradient (none of their readers is ``upstream`` of it): the gradient
    builder's ``Shape`` of an activation and the shape arithmetic on it. They may read the copies
    instead of the forward's tensors. Otherwise a runtime that runs a node just before its reader
    (onnxruntime 1.32 does) keeps the forward's tensor alive until the backward."""
    late: set[int] = set()
    for i in sorted(candidates, reverse=True):  # readers before what they read
        outputs = [out for out in nodes[i].output if out]
        read_by = [r for out in outputs for r in readers[out]]
        if read_by and all((r in backward and r not in upstream) or r in late for r in read_by):
            late.add(i)
    return sorted(late)


_INTEGERS = {onnx.TensorProto.INT64, onnx.TensorProto.INT32}
_INTEGER_OUTPUTS = {"Shape", "Size", "ArgMax", "ArgMin", "NonZero"}
_BOOLEAN_OUTPUTS = {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN",
                    "IsInf"}  # fmt: skip


def _types(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> dict[str, int]:
    """Each tensor's element type: as shape inference recorded it, else as its operator makes it (the
    gradient builder's and ORT's fused nodes have no recorded type): a Cast by its target, a Shape an
    integer, a comparison a boolean, others like their first typed data input (0: not known)."""
    known = {v.name: v.type.tensor_type.elem_type for v in (*graph.value_info, *graph.input, *graph.output)}
    known |= {i.name: i.data_type for i in graph.initializer}
    for node in nodes:  # topological order: inputs are typed before their readers
        for position, out in enumerate(node.output):
            if not out or out in known:
                continue
            if node.op_type in _INTEGER_OUTPUTS or (node.op_type in ("ConcatTraining", "SplitTraining") and position):
                known[out] = onnx.TensorProto.INT64
            elif node.op_type in _BOOLEAN_OUTPUTS:
                known[out] = onnx.TensorProto.BOOL
            elif node.op_type == "Cast":
                known[out] = next((int(a.i) for a in node.attribute if a.name == "to"), 0)
            else:
                data = node.input[1:] if node.op_type == "Where" else node.input
                known[out] = next((known[t] for t in data if t and known.get(t)), 0)
    return known


def _upstream(tensor: str, nodes: list[onnx.NodeProto], producer: dict[str, int]) -> set[int]:
    """The nodes ``tensor`` is computed from."""
    seen: set[int] = set()
    stack = [producer[tensor]]
    while stack:
        i = stack.pop()
        if i not in seen:
            seen.add(i)
            stack.extend(producer[t] for t in nodes[i].input if t in producer)
    return seen


def _topological(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` ordered so that each comes after what it reads, keeping the given order where it can."""
    producer = {out: index for index, node in enumerate(nodes) for out in node.output if out}
    waiting_on = [{producer[t] for t in node.input if t in producer} for node in nodes]
    readers: dict[int, list[int]] = defaultdict(list)
    for index, needs in enumerate(waiting_on):
        for need in needs:
            readers[need].append(index)
    ready = [i for i, needs in enumerate(waiting_on) if not needs]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for r in readers[i]:
            waiting_on[r].discard(i)
            if not waiting_on[r]:
                heapq.heappush(ready, r)
    if len(order) != len(nodes):
        raise ExportError("recomputing layers made a cycle in the training graph (a bug in "
                          "artifacts.passes.recompute): generate without --recompute; please report the model.")
    return [nodes[i] for i in order]
