"""Reverse-mode differentiation of an ONNX forward graph into ORT's training-graph form."""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import UnsupportedOperatorError
from ..passes._nodes import structure_copy
from ._emit import MS, Emitter, graph_facts
from .loss_graphs import LossGraph
from .rules import NOT_DIFFERENTIABLE, RULES

__all__ = ["differentiate", "eval_graph", "without_parameters", "training_forward", "ACCUMULATOR", "BUFFER_SUFFIX",
           "RESET"]

ACCUMULATOR = "InPlaceAccumulatorV2"
BUFFER_SUFFIX = "_grad.accumulation.buffer"
RESET = "lazy_reset_grad"
RANDOM = frozenset({"Dropout", "Bernoulli", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform",
                    "RandomUniformLike"})  # fmt: skip
"""Operators that draw: never computed at build time, whatever their inputs."""
FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}


def training_forward(model: onnx.ModelProto) -> None:
    """The forward as ORT's builder trains it, in place: a training-mode BatchNormalization becomes
    ``BatchNormInternal``, which also returns the batch mean and inverse deviation its gradient reads."""
    for node in model.graph.node:
        mode = next((a.i for a in node.attribute if a.name == "training_mode"), 0)
        if node.op_type == "BatchNormalization" and mode:
            node.op_type, node.domain = "BatchNormInternal", MS
            while len(node.output) < 3:
                node.output.append("")
            base = node.name or node.output[0]
            node.output.extend([f"{base}.saved_mean", f"{base}.saved_inv_std"])


def differentiate(
    model: onnx.ModelProto,
    loss: LossGraph,
    trainable: Sequence[str],
    frozen: Sequence[str],
    extra_outputs: Sequence[str],
    describe: Callable[[str], str] = lambda node: node,
) -> onnx.ModelProto:
    """The training graph of ``model`` (a forward graph whose ``loss`` nodes are appended): parameters
    as inputs, the loss and ``extra_outputs`` as outputs, and each trainable parameter's gradient added
    into its accumulation buffer (``InPlaceAccumulatorV2``, reset by ``lazy_reset_grad``), as ONNX
    Runtime's ``generate_artifacts`` writes it. An operator with no gradient rule on the way from a
    trainable parameter to the loss raises :class:`UnsupportedOperatorError` naming it and its layer."""
    model = copy.deepcopy(model)
    training_forward(model)
    _constants_to_initializers(model.graph)
    _fold_constants(model, {*trainable, *frozen})
    graph = model.graph
    shapes, types, constants = graph_facts(model)
    shapes.update(loss.shapes)
    for name in loss.shapes:
        types.setdefault(name, onnx.TensorProto.FLOAT)
    taken = {n for node in graph.node for n in (*node.input, *node.output)} | {i.name for i in graph.initializer}
    taken |= {i.name for i in graph.input}
    e = Emitter(shapes, types, constants, _opset(model), taken)
    e.parameters = {*trainable, *frozen}

    requires = _requiring(graph.node, set(trainable), types)
    useful = _reaching(graph.node, loss.output)
    seed = e.name(f"{loss.output}_grad")
    e.initializers.append(helper.make_tensor(seed, onnx.TensorProto.FLOAT, [], [1.0]))
    grads: dict[str, list[str]] = {loss.output: [seed]}

    def total(tensor: str) -> str | None:
        """The gradient of ``tensor``, named ``{tensor}_grad`` as ORT names it (the recompute pass finds a
        layer's backward by that name): the sum of its parts, or the one part (an Identity, which ONNX
        Runtime removes when it loads the graph)."""
        parts = grads.get(tensor)
        if not parts:
            return None
        if len(parts) > 1 or parts[0] != f"{tensor}_grad":
            grads[tensor] = [e.op("Sum" if len(parts) > 1 else "Identity", parts, [e.name(f"{tensor}_grad")])[0]]
        return grads[tensor][0]

    for node in reversed(list(graph.node)):
        need = [bool(i) and i in requires and i in useful for i in node.input]
        if not any(need) or not any(o in grads for o in node.output):
            continue
        rule = RULES.get(node.op_type) if node.domain in ("", "ai.onnx", MS) else None
        if rule is None or node.op_type in NOT_DIFFERENTIABLE:
            raise UnsupportedOperatorError(
                f"layer {describe(node.name)} exports as ONNX {node.op_type}, which the generator cannot "
                "differentiate. Freeze the parameters before it (--freeze) or replace the layer."
            )
        e.node_name = f"{node.name or node.output[0]}_Grad"
        try:
            found = rule(e, node, [total(o) for o in node.output], need)
        except (NotImplementedError, ValueError) as exc:
            raise UnsupportedOperatorError(
                f"layer {describe(node.name)}: the gradient of its ONNX {node.op_type} needs {exc}, which the "
                "generator does not handle. Freeze the parameters before it (--freeze) or replace the layer."
            ) from None
        for name, grad, wanted in zip(node.input, found, need):
            if wanted and grad is not None:
                grads.setdefault(name, []).append(grad)

    graph.input.append(helper.make_tensor_value_info(RESET, onnx.TensorProto.BOOL, [1]))
    del graph.output[:]
    values = {v.name: v for v in (*model.graph.value_info, *model.graph.input)}
    graph.output.append(helper.make_tensor_value_info(loss.output, onnx.TensorProto.FLOAT, []))
    graph.output.extend(_output_info(name, values, shapes, types) for name in extra_outputs)
    e.node_name = "odt_accumulate"
    for parameter in trainable:
        grad = total(parameter)
        if grad is None:
            raise UnsupportedOperatorError(f"parameter {parameter!r} gets no gradient from the loss.")
        buffer, flag = parameter + BUFFER_SUFFIX, f"{parameter}_grad.accumulation.out"
        graph.input.append(helper.make_tensor_value_info(buffer, onnx.TensorProto.FLOAT, shapes[parameter]))
        e.op(ACCUMULATOR, [buffer, grad, RESET], [flag], domain=MS)
        graph.output.append(helper.make_tensor_value_info(flag, onnx.TensorProto.BOOL, [1]))
    graph.node.extend(e.nodes)
    graph.initializer.extend(e.initializers)
    _declare_domains(model)
    return model


def eval_graph(model: onnx.ModelProto, outputs: Sequence[str]) -> onnx.ModelProto:
    """The eval graph: the forward with its loss (parameters already inputs), ``outputs`` out (ORT's form)."""
    model = copy.deepcopy(model)
    graph = model.graph
    shapes, types, _ = graph_facts(model)
    values = {v.name: v for v in (*graph.value_info, *graph.input)}
    del graph.output[:]
    graph.output.extend(_output_info(name, values, shapes, types) for name in outputs)
    return model


def _output_info(name: str, values: dict, shapes: dict, types: dict) -> onnx.ValueInfoProto:
    if name in values:
        return copy.deepcopy(values[name])
    return helper.make_tensor_value_info(name, types.get(name, onnx.TensorProto.FLOAT), shapes.get(name))


def _constants_to_initializers(graph: onnx.GraphProto) -> None:
    """``Constant`` nodes become initializers, as in ORT's training graphs: the lowerings read constant
    inputs (a Slice's steps, say) from initializers."""
    kept = []
    for node in graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            tensor = copy.deepcopy(node.attribute[0].t)
            tensor.name = node.output[0]
            graph.initializer.append(tensor)
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)


FOLDED_MAX = 64
"""Constant subgraphs are computed at build time when every value they make has at most this many elements
(the index arithmetic exporters write: Unsqueeze and Concat of constants feeding a Slice)."""


def _fold_constants(model: onnx.ModelProto, parameters: set[str]) -> None:
    """Compute the small constant subgraphs (nodes whose inputs are all small initializers, parameters
    excepted), as ORT's constant folding does before its builder: the lowerings read a Slice's starts,
    ends and steps as initializers."""
    from onnx.reference import ReferenceEvaluator

    graph = model.graph
    known = {t.name: numpy_helper.to_array(t) for t in graph.initializer
             if t.name not in parameters and int(np.prod(t.dims)) <= FOLDED_MAX
             and t.data_location != onnx.TensorProto.EXTERNAL}  # fmt: skip
    opsets = list(model.opset_import)
    kept = []
    for node in graph.node:
        inputs = [i for i in node.input if i]
        foldable = node.domain in ("", "ai.onnx") and node.op_type not in RANDOM and all(i in known for i in inputs)
        foldable = foldable and bool(inputs)
        values = None
        if foldable:
            single = helper.make_model(helper.make_graph([node], "fold", [], [
                helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output],
                [numpy_helper.from_array(known[i], i) for i in inputs]), opset_imports=opsets)  # fmt: skip
            try:
                values = ReferenceEvaluator(single).run(None, {})
            except Exception:  # an operator the reference runtime lacks: the node stays
                values = None
        if values is None or any(np.asarray(v).size > FOLDED_MAX for v in values):
            kept.append(node)
            continue
        for name, value in zip(node.output, values):
            value = np.asarray(value)
            known[name] = value
            graph.initializer.append(numpy_helper.from_array(value, name))
    del graph.node[:]
    graph.node.extend(kept)


def without_parameters(model: onnx.ModelProto, parameters: Sequence[str]) -> tuple[onnx.ModelProto, list]:
    """A copy of ``model`` without the ``parameters``' initializers (no weight is copied), and their graph-input
    declarations in the given order: ORT's training and eval graphs read parameters as inputs."""
    wanted = set(parameters)
    skeleton = structure_copy(model, lambda tensor: tensor.name not in wanted)
    found = {t.name: (t.data_type, list(t.dims)) for t in model.graph.initializer if t.name in wanted}
    inputs = [helper.make_tensor_value_info(name, *found[name]) for name in parameters if name in found]
    return skeleton, inputs


def _requiring(nodes: Sequence[onnx.NodeProto], trainable: set[str], types: dict[str, int]) -> set[str]:
    """Tensors that depend on a trainable parameter through differentiable operators."""
    requires = set(trainable)
    for node in nodes:
        if node.op_type in NOT_DIFFERENTIABLE or not any(i in requires for i in node.input):
            continue
        requires.update(o for o in node.output if o and types.get(o, onnx.TensorProto.FLOAT) in FLOATS)
    return requires


def _reaching(nodes: Sequence[onnx.NodeProto], loss: str) -> set[str]:
    """Tensors the loss depends on."""
    useful = {loss}
    for node in reversed(list(nodes)):
        if any(o in useful for o in node.output):
            useful.update(i for i in node.input if i)
    return useful


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)


def _declare_domains(model: onnx.ModelProto) -> None:
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))
