"""One graph for a whole training step: the portable training graph and the optimizer update, fused.

Every session run has a fixed cost, large beside a small model's step: in onnxruntime-web 1.30 on the
digits bundle the optimizer's run took 0.46-0.67 ms of a 1.0-1.55 ms step (one-off runs), for an update
of a few microseconds, and in Python a run and its bindings cost tens of microseconds. The fused graph
does a step in one run: parameters, moments, the rates and a batch in; the loss, the outputs and the
updated vectors out. The gradients stay inside. (Micro-batches still need the two graphs: their
gradients add up before one update.) The generator writes it for small models
(:data:`~ondevice.engines.contract.FUSED_MAX`), the bundle for every portable one; it needs ``onnx``,
so only the workstation and the bridge import this module.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..lora import prune
from .contract import OPTIMIZER_STATE, gradient_output, gradient_seed

__all__ = ["fuse_step", "unseed"]

FLAT = "odt.step.flat_shape"


def fuse_step(training: onnx.ModelProto, optimizer: onnx.ModelProto, trainable: Sequence[str],
              finite_check: str | None = None) -> onnx.ModelProto:  # fmt: skip
    """The training graph followed by the update: each parameter of ``trainable`` (the manifest's order) and
    its gradient flattened and concatenated into the optimizer's ``odt.parameters`` and ``odt.gradients``.
    The training graph's ``finite_check`` output (the manifest's), if given, is then computed over the
    concatenated gradients: two reductions where the training graph has one per gradient."""
    fused = onnx.ModelProto()
    fused.CopyFrom(training)
    graph, update = fused.graph, optimizer.graph
    names = list(trainable)
    unseed(graph, names)  # the gradients stay inside: no buffer of the engine's to scatter into
    gradients = {gradient_output(n) for n in names}
    kept = [o for o in graph.output if o.name not in gradients]
    del graph.output[:]
    graph.output.extend([*kept, *update.output])
    graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), FLAT))
    for flat, sources in ((OPTIMIZER_STATE[0], names), (OPTIMIZER_STATE[1], [gradient_output(n) for n in names])):
        pieces = []
        for source in sources:
            pieces.append(f"{flat}/{source}")
            graph.node.append(helper.make_node("Reshape", [source, FLAT], [pieces[-1]]))
        graph.node.append(helper.make_node("Concat", pieces, [flat], axis=0))
    fed = {i.name for i in graph.input}
    graph.input.extend(i for i in update.input if i.name not in fed and i.name not in OPTIMIZER_STATE[:2])
    graph.initializer.extend(update.initializer)
    graph.node.extend(update.node)
    if finite_check is not None:
        _check_concatenated(graph, finite_check)
    graph.name = "odt_step"
    return fused


def unseed(graph: onnx.GraphProto, trainable: Sequence[str]) -> list[str]:
    """Replace each seed input of ``graph`` (:func:`~.contract.gradient_seed` of a ``trainable`` parameter: the
    zeros a lookup table's gradient is scattered into, which the portable engine binds to its own buffer) by
    zeros the graph makes, in place, for runtimes that bind no such buffer (the fused step, phones, browsers);
    returns the seeds replaced. The zeros' shape is computed from the scattered rows' (dynamic) shape, so that
    ONNX Runtime cannot fold them into a table-sized initializer that would stay in memory."""
    inputs = {i.name for i in graph.input}
    replaced = []
    for seed in [gradient_seed(name) for name in trainable if gradient_seed(name) in inputs]:
        value = next(i for i in graph.input if i.name == seed)
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        scatter = next(n for n in graph.node if n.op_type == "ScatterElements" and n.input[0] == seed)
        prefix = f"{seed}/zeros"
        graph.initializer.extend([numpy_helper.from_array(np.zeros(len(dims), np.int64), f"{prefix}/none"),
                                  numpy_helper.from_array(np.array(dims, np.int64), f"{prefix}/dims")])  # fmt: skip
        made = [
            helper.make_node("Shape", [scatter.input[2]], [f"{prefix}/rows_shape"]),
            helper.make_node("Mul", [f"{prefix}/rows_shape", f"{prefix}/none"], [f"{prefix}/nothing"]),
            helper.make_node("Add", [f"{prefix}/nothing", f"{prefix}/dims"], [f"{prefix}/shape"]),
            helper.make_node("ConstantOfShape", [f"{prefix}/shape"], [seed],
                             value=numpy_helper.from_array(np.zeros(1, np.float32))),  # fmt: skip
        ]
        nodes = list(graph.node)
        index = nodes.index(scatter)
        nodes[index:index] = made
        del graph.node[:]
        graph.node.extend(nodes)
        kept = [i for i in graph.input if i.name != seed]
        del graph.input[:]
        graph.input.extend(kept)
        replaced.append(seed)
    return replaced


def _check_concatenated(graph: onnx.GraphProto, name: str) -> None:
    """Compute ``name`` (the norm of the loss and every gradient, only ever tested for being finite) as
    ``sqrt(loss^2 + sum(odt.gradients^2))``; the nodes only its old computation needed go. The graph's inputs
    all stay, read or not (the bundles' clients feed each one, ``odt.lr_decay`` without weight decay too)."""
    nodes = [node for node in graph.node if name not in node.output]
    del graph.node[:]
    graph.node.extend(nodes)
    loss, prefix = graph.output[0].name, f"{name}.flat"
    graph.node.extend([
        helper.make_node("ReduceSumSquare", [loss], [f"{prefix}.loss"], keepdims=0),
        helper.make_node("ReduceSumSquare", [OPTIMIZER_STATE[1]], [f"{prefix}.gradients"], keepdims=0),
        helper.make_node("Add", [f"{prefix}.loss", f"{prefix}.gradients"], [f"{prefix}.sum"]),
        helper.make_node("Sqrt", [f"{prefix}.sum"], [name]),
    ])
    prune(graph, inputs=False)
