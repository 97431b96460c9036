"""The losses as standard ONNX nodes appended to a forward graph (what ORT's ``onnxblock`` losses build)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import OptionError
from ..losses import Loss

__all__ = ["LossGraph", "loss_graph", "attach_loss"]


@dataclass(frozen=True)
class LossGraph:
    """A loss over one model output: its nodes, constants, target input and the scalar it computes."""

    output: str
    nodes: tuple[onnx.NodeProto, ...] = ()
    initializers: tuple[onnx.TensorProto, ...] = ()
    target: onnx.ValueInfoProto | None = None
    shapes: dict[str, list] = field(default_factory=dict)
    """Shapes of the tensors the loss adds (the gradient rules read ranks)."""


def _dims(value: onnx.ValueInfoProto | None) -> list | None:
    if value is None or not value.type.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in value.type.tensor_type.shape.dim]


def loss_graph(loss: Loss, model: onnx.ModelProto, output: str) -> LossGraph:
    """The nodes of ``loss`` on ``model``'s output ``output`` (the loss named ``loss`` in the graph)."""
    if loss.kind == "model":
        return LossGraph(output=output)
    values = {v.name: v for v in (*model.graph.output, *model.graph.value_info)}
    dims = _dims(values.get(output))
    if dims is None:
        raise OptionError(f"the shape of the loss input {output!r} is unknown; the loss cannot be attached.")
    taken = {n for node in model.graph.node for n in (*node.input, *node.output)}
    taken |= {i.name for i in (*model.graph.input, *model.graph.initializer)}
    name = "loss" if "loss" not in taken else f"loss.{len(taken)}"
    reduce_op = "ReduceMean" if getattr(loss, "reduction", "mean") == "mean" else "ReduceSum"
    target = loss.target_name
    if target in taken:
        raise OptionError(f"the model already has a tensor named {target!r}, the loss's target input.")
    if loss.kind == "cross_entropy":
        weight = getattr(loss, "weight", None)
        inputs = [output, target]
        inits = []
        if weight is not None:
            inputs.append(f"{name}.class_weight")
            inits.append(numpy_helper.from_array(np.asarray(weight, np.float32), f"{name}.class_weight"))
        ignore = getattr(loss, "ignore_index", None)
        ignored = {} if ignore is None else {"ignore_index": ignore}
        node = helper.make_node("SoftmaxCrossEntropyLoss", inputs, [name, f"{name}.log_prob"], name=name,
                                reduction=loss.reduction, **ignored)  # fmt: skip
        label = helper.make_tensor_value_info(target, onnx.TensorProto.INT64, dims[:-1])
        return LossGraph(name, (node,), tuple(inits), label, {name: [], f"{name}.log_prob": dims})
    value = helper.make_tensor_value_info(target, onnx.TensorProto.FLOAT, dims)
    diff, each = f"{name}.diff", f"{name}.each"
    if loss.kind == "mse":
        nodes = [helper.make_node("Sub", [output, target], [diff]), helper.make_node("Mul", [diff, diff], [each])]
        shapes = {diff: dims, each: dims}
    elif loss.kind == "l1":
        nodes = [helper.make_node("Sub", [output, target], [diff]), helper.make_node("Abs", [diff], [each])]
        shapes = {diff: dims, each: dims}
    elif loss.kind == "bce_with_logits":
        nodes, shapes, inits = _bce(loss, output, target, name, dims)
        nodes.append(helper.make_node(reduce_op, [each], [name], keepdims=0))
        return LossGraph(name, tuple(nodes), tuple(inits), value, {**shapes, name: []})
    else:
        raise OptionError(
            f"loss {loss.kind!r} is an onnxblock of ONNX Runtime's training build, which is not installed here. "
            "Use one of cross_entropy, mse, l1, bce_with_logits or model, or generate where "
            "onnxruntime-training 1.19.2 installs."
        )
    nodes.append(helper.make_node(reduce_op, [each], [name], keepdims=0))
    return LossGraph(name, tuple(nodes), (), value, {**shapes, name: []})


def _bce(loss: Loss, x: str, y: str, name: str, dims: list) -> tuple[list, dict, list]:
    """PyTorch's stable form: w (pw y softplus(-x) + (1 - y) softplus(x))."""
    one = f"{name}.one"
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), one)]
    t = {k: f"{name}.{k}" for k in ("neg", "sp_neg", "sp", "not_y", "pos", "negpart", "each")}
    nodes = [
        helper.make_node("Neg", [x], [t["neg"]]),
        helper.make_node("Softplus", [t["neg"]], [t["sp_neg"]]),
        helper.make_node("Softplus", [x], [t["sp"]]),
        helper.make_node("Sub", [one, y], [t["not_y"]]),
        helper.make_node("Mul", [y, t["sp_neg"]], [t["pos"]]),
        helper.make_node("Mul", [t["not_y"], t["sp"]], [t["negpart"]]),
    ]
    pos = t["pos"]
    pos_weight = getattr(loss, "pos_weight", None)
    if pos_weight is not None:
        inits.append(numpy_helper.from_array(np.asarray(pos_weight, np.float32), f"{name}.pos_weight"))
        nodes.append(helper.make_node("Mul", [pos, f"{name}.pos_weight"], [f"{pos}.weighted"]))
        pos = f"{pos}.weighted"
    each = f"{name}.each"
    weight = getattr(loss, "weight", None)
    if weight is not None:
        inits.append(numpy_helper.from_array(np.asarray(weight, np.float32), f"{name}.weight"))
        nodes.append(helper.make_node("Add", [pos, t["negpart"]], [f"{name}.unweighted"]))
        nodes.append(helper.make_node("Mul", [f"{name}.unweighted", f"{name}.weight"], [each]))
    else:
        nodes.append(helper.make_node("Add", [pos, t["negpart"]], [each]))
    shapes = {v: dims for v in (*t.values(), f"{pos}", f"{name}.unweighted")}
    return nodes, shapes, inits


def attach_loss(model: onnx.ModelProto, loss: LossGraph) -> None:
    """Append ``loss``'s nodes, constants and target input to ``model`` in place."""
    model.graph.node.extend(loss.nodes)
    model.graph.initializer.extend(loss.initializers)
    if loss.target is not None:
        model.graph.input.append(loss.target)
