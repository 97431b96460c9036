"""Dropout that drops in the training graph wherever PyTorch drops, and keeps dropping on stock ORT."""

from __future__ import annotations

import onnx
from onnx import helper

__all__ = ["activate_dropout", "keep_dropout_masks", "TRAINING_MODE"]

TRAINING_MODE = "odt.dropout_training_mode"
"""The constant ``True`` every activated Dropout reads as its ``training_mode``."""


def activate_dropout(model: onnx.ModelProto) -> list[str]:
    """Give every Dropout without a ``training_mode`` input the constant ``True``; returns their names.

    ``torch.onnx.export`` writes ``F.scaled_dot_product_attention(dropout_p=p)`` (the attention
    probabilities' dropout of every Hugging Face encoder and decoder) as ``Dropout(x, p)`` with no
    ``training_mode``, which ONNX reads as inference: the forward never drops. ORT's gradient for
    that node still multiplies by ``1 / (1 - p)``, so the gradient through every attention softmax
    came out 11 % too large at p = 0.1. PyTorch applies SDPA's dropout whenever ``dropout_p`` is
    above 0, and the exporter writes the node only then, so the training graph drops there. The
    eval graph turns every Dropout off (``export.dropout_to_inference``).
    """
    activated = []
    for node in model.graph.node:
        if node.op_type == "Dropout" and (len(node.input) < 3 or not node.input[2]):
            while len(node.input) < 3:
                node.input.append("")
            node.input[2] = TRAINING_MODE
            activated.append(node.name)
    if activated and not any(i.name == TRAINING_MODE for i in model.graph.initializer):
        model.graph.initializer.append(helper.make_tensor(TRAINING_MODE, onnx.TensorProto.BOOL, [], [True]))
    return activated


def keep_dropout_masks(model: onnx.ModelProto) -> int:
    """Make every Dropout whose mask nothing reads use it once; returns how many.

    Stock ONNX Runtime's basic optimizer deletes a Dropout whose mask output is unused, even in
    training mode (measured on 1.31/1.32), so a Dropout on a frozen path (no gradient reads its
    mask: a LoRA model's embedding dropout, every layer below a last-layers model's trainable ones)
    would stop dropping on the portable engine. The output becomes ``Reshape(Y, Shape(Y) + 0 * m)``,
    ``m`` the mask's first element as an integer: the same values, and a Reshape is no copy in ONNX
    Runtime. The first version, ``Where(mask, Y, 0)``, made a pass over the tensor per Dropout: 13 ms
    of a 430 ms step on MiniLM with its last two layers trained (13 such Dropouts; onnxruntime 1.32,
    one-off profile).
    """
    read = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
    nodes: list[onnx.NodeProto] = []
    kept = 0
    for node in model.graph.node:
        nodes.append(node)
        if node.op_type != "Dropout":
            continue
        mask = node.output[1] if len(node.output) > 1 and node.output[1] else ""
        if mask and mask in read:
            continue
        if not mask:
            while len(node.output) < 2:
                node.output.append("")
            mask = node.output[1] = f"{node.output[0]}/kept_mask"
        dropped, node.output[0] = node.output[0], f"{node.output[0]}/dropped"
        nodes.extend(_read_once(mask, node.output[0], dropped, f"{node.name}/kept"))
        kept += 1
    if kept:
        present = {i.name for i in model.graph.initializer}
        model.graph.initializer.extend(helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values)
                                       for name, values in _CONSTANTS.items() if name not in present)  # fmt: skip
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return kept


_CONSTANTS = {"odt.kept_dropout.flat": [-1], "odt.kept_dropout.zero": [0], "odt.kept_dropout.one": [1]}


def _read_once(mask: str, y: str, out: str, name: str) -> list[onnx.NodeProto]:
    """``out = Reshape(y, Shape(y) + 0 * mask[0])``: ``y`` unchanged, and ``mask`` read by a one-element Slice."""
    flat, zero, one = _CONSTANTS
    first = f"{name}/first"
    return [
        helper.make_node("Reshape", [mask, flat], [f"{name}/flat"], name=f"{name}/flat"),
        helper.make_node("Slice", [f"{name}/flat", zero, one], [first], name=first),
        helper.make_node("Cast", [first], [f"{name}/bit"], name=f"{name}/bit", to=onnx.TensorProto.INT64),
        helper.make_node("Mul", [f"{name}/bit", zero], [f"{name}/nothing"], name=f"{name}/nothing"),
        helper.make_node("Shape", [y], [f"{name}/shape"], name=f"{name}/shape"),
        helper.make_node("Add", [f"{name}/shape", f"{name}/nothing"], [f"{name}/same"], name=f"{name}/same"),
        helper.make_node("Reshape", [y, f"{name}/same"], [out], name=name),
    ]
