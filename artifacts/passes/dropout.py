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
    mask: a LoRA model's embedding dropout) would stop dropping on the portable engine. The output
    becomes ``Where(mask, Y, 0)``: ``Y`` is already 0 wherever the mask is false, so the values are
    the same. (The exported models compute in float32: a frozen float16 or int8 base is
    dequantized before it is used.)
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
        nodes.append(helper.make_node("Where", [mask, node.output[0], _ZERO], [dropped], name=f"{node.name}/kept"))
        kept += 1
    if kept:
        if not any(i.name == _ZERO for i in model.graph.initializer):
            model.graph.initializer.append(helper.make_tensor(_ZERO, onnx.TensorProto.FLOAT, [], [0.0]))
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return kept


_ZERO = "odt.kept_dropout_zero"
