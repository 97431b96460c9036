"""PyTorch to ONNX, and the graph repairs ORT training 1.19 needs (BatchNorm, LayerNorm, Dropout)."""

from __future__ import annotations

import io
import logging
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import onnx
import torch
from onnx import helper, numpy_helper
from torch import nn
from torch.nn import functional as F

from .errors import ExportError, InputSpecError, UnsupportedOperatorError
from .passes._nodes import light_model

__all__ = [
    "export_onnx",
    "infer_shapes",
    "zero_dropout",
    "dropout_to_inference",
    "check_gradient_ops",
    "on_trained_path",
    "torch_module",
    "reaching",
]

log = logging.getLogger(__name__)

# Operators with no gradient builder or no CPU gradient kernel in ORT 1.19.2 (measured).
NO_GRADIENT = {
    "Elu": "ReLU or GELU",
    "Selu": "ReLU or GELU",
    "Softplus": "ReLU",
    "HardSigmoid": "Sigmoid",
    "HardSwish": "ReLU6 (Clip) or GELU",
    "Mish": "GELU",
    "PRelu": "LeakyReLU",
    "GlobalMaxPool": "AdaptiveAvgPool (GlobalAveragePool) or MaxPool with a fixed kernel",
    "InstanceNormalization": "LayerNorm or BatchNorm",
    "GroupNormalization": "LayerNorm or BatchNorm",
    "ReduceMax": "a mean or LogSumExp reduction",
    "Einsum": "matmul/bmm",
    "CumSum": "a matmul with a triangular matrix",
    "RNN": "generating from the PyTorch model: its nn.RNN is unrolled into gates that train",
    "LSTM": "generating from the PyTorch model: its nn.LSTM is unrolled into gates that train",
    "GRU": "generating from the PyTorch model: its nn.GRU is unrolled into gates that train",
    "Attention": "nn.MultiheadAttention exported without fusion",
    "ConvTranspose": "generating from the PyTorch model: its nn.ConvTranspose is rewritten as a Conv that trains",
    "Resize": "nn.Upsample(scale_factor=INTEGER) with mode nearest, linear, bilinear or trilinear "
    "(rewritten into ops that train)",
}


def export_onnx(
    model: nn.Module,
    example: Sequence[torch.Tensor],
    input_names: Sequence[str],
    output_names: Sequence[str] | None,
    opset: int,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
) -> tuple[onnx.ModelProto, list[str]]:
    """Export ``model`` in training mode (Dropout and BatchNorm as in training), batch dynamic.

    ``dynamic_axes`` names further dynamic input axes (``{input: {axis: name}}``).

    The model's parameters and buffers are left exactly as they were.
    Returns the model and its output names.
    """
    # Tracing runs forward passes in training mode, which move buffers (BatchNorm's running statistics) and
    # nothing else: those are saved and put back (a copy of every weight cost SmolLM2 540 MB)
    saved = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    was_training = model.training
    model.train()
    try:
        with torch.no_grad():
            try:
                result = model(*example)
            except Exception as exc:
                shapes = ", ".join(
                    f"{n}{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for n, t in zip(input_names, example)
                )
                raise InputSpecError(
                    f"the model rejects the example input ({shapes}): {type(exc).__name__}: {exc}"
                ) from exc
        outputs = list(result) if isinstance(result, (tuple, list)) else [result]
        if not outputs or not all(isinstance(o, torch.Tensor) for o in outputs):
            raise ExportError("forward must return a tensor or a tuple of tensors.")
        if output_names is None:
            output_names = ["output"] if len(outputs) == 1 else [f"output{i}" for i in range(len(outputs))]
        if len(output_names) != len(outputs):
            raise InputSpecError(
                f"{len(output_names)} output names given, but the model returns {len(outputs)} outputs."
            )
        dynamic = {name: {0: "batch"} for name in (*input_names, *output_names)}
        for name, axes in (dynamic_axes or {}).items():
            dynamic[name].update(axes)
        for name, out in zip(output_names, outputs):
            if out.dim() == 0:
                dynamic.pop(name)
        buffer = io.BytesIO()
        try:
            with warnings.catch_warnings(), _gqa_as_repeated_heads():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    model,
                    tuple(example),
                    buffer,
                    input_names=list(input_names),
                    output_names=list(output_names),
                    dynamic_axes=dynamic,
                    opset_version=opset,
                    training=torch.onnx.TrainingMode.TRAINING,
                    do_constant_folding=False,
                    dynamo=False,
                )
        except Exception as exc:
            raise ExportError(f"torch.onnx.export failed: {type(exc).__name__}: {exc}") from exc
    finally:
        with torch.no_grad():
            for name, value in model.named_buffers():
                value.copy_(saved[name])
        model.train(was_training)
    exported = onnx.ModelProto()
    with buffer.getbuffer() as view:  # parsed from the buffer's own bytes, not a copy of them
        exported.ParseFromString(view)
    del buffer
    # Tracing in training mode ran forward passes that moved BatchNorm's running statistics:
    # put the model's own values back into the graph.
    for index, initializer in enumerate(exported.graph.initializer):
        if initializer.name in saved:
            value = saved[initializer.name].detach().cpu().numpy()
            exported.graph.initializer[index].CopyFrom(numpy_helper.from_array(value, initializer.name))
    return exported, list(output_names)


@contextmanager
def _gqa_as_repeated_heads() -> Iterator[None]:
    """Export ``scaled_dot_product_attention(..., enable_gqa=True)`` (grouped-query attention: fewer
    key/value heads than query heads, as Llama 3, Qwen, Mistral and SmolLM have) as the same call on
    key and value heads repeated to the query heads: exactly what ``enable_gqa`` computes, which
    torch's ONNX exporter refuses ("not implemented if enable_gqa is True")."""
    original = F.scaled_dot_product_attention

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, enable_gqa: bool = False,
                  **kwargs: Any) -> torch.Tensor:  # fmt: skip
        if enable_gqa and key.size(-3) != query.size(-3):
            repeat = query.size(-3) // key.size(-3)
            key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
        return original(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with symbolic shapes on every value (ONNX Runtime's symbolic shape inference), in place.

    ORT 1.19's gradient builder reads broadcast shapes from the graph: where ONNX's own inference
    leaves a dimension unknown (a Slice with computed ends, as in Hugging Face's
    ``position_ids[:, :seq]``), it assumes no broadcast and a ``(1, seq)`` lookup added to a
    ``(batch, seq)`` activation gets the unreduced gradient (measured: position row 0 wrong).
    Falls back to the model as it is when the inference cannot handle it, with a warning: the
    verification against PyTorch then decides whether such a broadcast gradient came out wrong.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the weights go in as inputs: no copy of them (SmolLM2: 1.3 GB)
            inferred = _symbolic_shapes(light_model(model, weights_as_inputs=True))
    except Exception as exc:  # an op it does not know: ORT's own inference still runs
        inferred, reason = None, f"{type(exc).__name__}: {exc}"
    else:
        reason = "Incomplete symbolic shape inference"
    if inferred is None:
        log.warning(
            "symbolic shape inference failed (%s); where a broadcast dimension stays unknown, ORT 1.19 may "
            "build a wrong gradient for it. Keep verification on: it compares every gradient with PyTorch.",
            reason,
        )
        return model
    graph = model.graph  # the shapes found, on the model itself
    del graph.value_info[:]
    graph.value_info.extend(inferred.graph.value_info)
    outputs = {o.name: o for o in inferred.graph.output}
    shaped = [outputs.get(o.name, o) for o in graph.output]
    del graph.output[:]
    graph.output.extend(shaped)
    return model


def _symbolic_shapes(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``SymbolicShapeInference.infer_shapes`` of ORT 1.19 without its failure path, which saves the
    half-inferred model as ``sym_shape_infer_temp.onnx`` into the working directory (the user's)."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference, get_opset

    if (get_opset(model) or 0) < 7:
        return None
    inference = SymbolicShapeInference(2**31 - 1, True, False, 0)  # int_max, auto_merge, guess_output_rank, verbose
    complete = False
    inference._preprocess(model)
    while inference.run_:
        complete = inference._infer_impl()
    inference._update_output_from_vi()
    return inference.out_mp_ if complete else None


def dropout_to_inference(model: onnx.ModelProto) -> None:
    """Switch every Dropout to inference (identity): the exporter hard-codes training_mode=True."""
    false = "odt.dropout_training_mode_false"
    model.graph.initializer.append(helper.make_tensor(false, onnx.TensorProto.BOOL, [], [False]))
    for node in model.graph.node:
        if node.op_type == "Dropout":
            while len(node.input) < 3:
                node.input.append("")
            node.input[2] = false


def zero_dropout(model: onnx.ModelProto) -> int:
    """Set every Dropout ratio to 0 (a deterministic twin for verification); returns the count."""
    zero = "odt.zero_dropout_ratio"
    model.graph.initializer.append(helper.make_tensor(zero, onnx.TensorProto.FLOAT, [], [0.0]))
    ratios = set()
    count = 0
    for node in model.graph.node:
        if node.op_type == "Dropout":
            count += 1
            if len(node.input) > 1 and node.input[1]:
                ratios.add(node.input[1])
            elif len(node.input) == 1:
                node.input.append(zero)
            else:
                node.input[1] = zero
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in ratios:
                node.input[i] = zero
    return count


def on_trained_path(model: onnx.ModelProto, trainable: Iterable[str]) -> set[str]:
    """First output names of the nodes that depend on a trainable parameter (forward from it)."""
    live = set(trainable)
    nodes = set()
    for node in model.graph.node:  # exported graphs are topologically sorted
        if any(name in live for name in node.input):
            nodes.add(node.output[0])
            live.update(o for o in node.output if o)
    return nodes


def check_gradient_ops(
    model: onnx.ModelProto, trainable: Iterable[str], describe: Callable[[str], tuple[str, str]]
) -> None:
    """Raise UnsupportedOperatorError for an op without gradient on the path from a trainable weight.

    ``describe`` maps a node name to the layer it came from and that layer's type.
    """
    trainable = list(trainable)
    live = on_trained_path(model, trainable)
    for node in model.graph.node:
        if node.output[0] in live and node.op_type in NO_GRADIENT:
            path, kind = describe(node.name)
            upstream = set().union(*(reaching(model, trainable, i) for i in node.input if i))
            owners = sorted({n.rsplit(".", 1)[0] if "." in n else n for n in upstream})
            freeze = " ".join(f"--freeze '{o}.*'" for o in owners)
            raise UnsupportedOperatorError(
                f"layer {path or node.name!r} ({kind}) exports as ONNX {node.op_type}, which has no gradient "
                f"in ONNX Runtime 1.19 training. Freeze the parameters before it ({freeze}) or replace it "
                f"with {NO_GRADIENT[node.op_type]}."
            )


def torch_module(node_name: str, model: nn.Module) -> tuple[str, str]:
    """The innermost module (dotted path, type name) that an exported node belongs to.

    TorchScript names nodes by their module scopes, each the module's full dotted path:
    ``/classifier/classifier.3/classifier.3.1/Celu``.
    """
    parts = [p for p in node_name.split("/") if p]
    op = parts[-1].split("_")[0].lower() if parts else ""
    for scope in reversed(parts[:-1]):
        try:
            module = model.get_submodule(scope)
        except AttributeError:
            continue
        # a leaf module exported as one op (ConvTranspose1d -> ConvTranspose) may have no scope of its own
        below = [
            (f"{scope}.{n}", m) for n, m in module.named_modules() if n and type(m).__name__.lower().startswith(op)
        ]
        path, module = below[0] if len(below) == 1 else (scope, module)
        return path, type(module).__name__
    return "", type(model).__name__


def reaching(model: onnx.ModelProto, names: Iterable[str], output: str) -> set[str]:
    """The subset of ``names`` (initializers or inputs) that ``output`` depends on."""
    producer = {o: node for node in model.graph.node for o in node.output}
    seen: set[str] = set()
    stack = [output]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in producer:
            stack.extend(i for i in producer[name].input if i)
    return seen & set(names)
