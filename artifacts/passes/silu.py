"""SwiGLU's activation is made again in the backward instead of kept from the forward.

A SwiGLU MLP (Llama, Qwen, Mistral, SmolLM) computes ``silu(gate) * up``. Its backward reads three
tensors of the MLP's width: ``gate`` (for SiLU's gradient), ``up`` and ``silu(gate)`` (for the
product's). ``silu(gate)`` is one element-wise pass over ``gate``, which the backward keeps anyway, so
keeping it too costs a tensor of the MLP's width per layer for the whole step (SmolLM2 at 64 tokens:
384 KiB a layer; its step's peak 368 -> 359 MiB with this pass, measured).

The backward's readers of ``silu(gate)`` (``QuickGelu`` in ORT's graphs) read a copy instead, made
from ``gate + 0 * g[0]`` where ``g`` is the reader's other input, a gradient: it runs once the backward
reaches the layer (ONNX Runtime runs a node as soon as its inputs exist), and the forward's output dies
with its forward reader. The copy is the same operator on the same values, so the step is unchanged to
the bit. Not run with ``--recompute``, which copies whole layers already.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ._nodes import wait_constants, zero_after

__all__ = ["recompute_silu"]

_PREFIX = "odt.silu"


def recompute_silu(model: onnx.ModelProto) -> list[str]:
    """Rewrite ``model`` (ORT's training graph) as the module docstring says; returns the activations whose
    backward readers now read a copy."""
    graph = model.graph
    nodes = list(graph.node)
    later = {graph.output[0].name + "_grad"}  # the tensors that depend on the loss's gradient
    for node in nodes:  # ORT writes the training graph in topological order
        if later.intersection(node.input):
            later.update(out for out in node.output if out)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    added: dict[int, list[onnx.NodeProto]] = {}  # id of a reader -> the nodes to put before it
    done: list[str] = []
    for node in nodes:
        if node.op_type != "QuickGelu" or node.domain != "com.microsoft" or node.output[0] in later:
            continue
        x, activation = node.input[0], node.output[0]
        late = [r for r in readers.get(activation, []) if r.output[0] in later]
        if not late or not any(r.output[0] in later for r in readers.get(x, [])):
            continue  # nothing to gain unless the backward keeps x anyway
        for index, reader in enumerate(late):
            gradient = next((t for t in reader.input if t in later), None)
            if gradient is None:
                continue
            base = f"{activation}::silu/{index}"
            made: list[onnx.NodeProto] = []
            zero = zero_after(gradient, f"{base}/wait", _PREFIX, made)
            made.append(helper.make_node("Add", [x, zero], [f"{base}/x"], name=f"{base}/x"))
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name, copy.input[0], copy.output[0] = base, f"{base}/x", base
            made.append(copy)
            reader.input[:] = [base if t == activation else t for t in reader.input]
            added.setdefault(id(reader), []).extend(made)
        done.append(activation)
    if not done:
        return []
    ordered = wait_constants(_PREFIX)
    for node in nodes:
        ordered.extend(added.get(id(node), ()))
        ordered.append(node)
    del graph.node[:]
    graph.node.extend(ordered)
    return done
