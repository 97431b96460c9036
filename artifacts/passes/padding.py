"""Embeddings with ``padding_idx``: the padding row gets no gradient, as in PyTorch.

ORT 1.19's GatherGrad scatters the output gradient of every position into its row, the
padding row included; PyTorch's embedding backward skips positions whose id is the padding
index. The rewrite zeroes the incoming gradient at those positions before GatherGrad, so the
padding row's gradient is exactly 0 (and AdamW/SGD leave the row where it is, apart from
weight decay, as in PyTorch). Only the lookup's own contribution is masked: a tied weight
still gets the gradient of its other uses.
"""

from __future__ import annotations

import onnx
from onnx import helper
from torch import nn

__all__ = ["padding_rows", "mask_padding_gradients", "lookup_table", "constant"]


def padding_rows(model: nn.Module) -> dict[str, int]:
    """``{weight name: padding index}`` of every ``nn.Embedding`` that has one (non-negative)."""
    rows = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            rows[f"{path}.weight" if path else "weight"] = module.padding_idx % module.num_embeddings
    return rows


def mask_padding_gradients(training: onnx.ModelProto, rows: dict[str, int]) -> list[str]:
    """Mask the output gradient of each padded lookup in ORT's training graph; returns the weights done.

    A lookup is ``GatherGrad(Shape(weight), ids, dY)``: ``dY`` becomes ``dY * (ids != padding)``.
    """
    producer = {o: node for node in training.graph.node for o in node.output}
    done: list[str] = []
    nodes: list[onnx.NodeProto] = []
    for node in training.graph.node:
        weight = lookup_table(node, producer)
        if weight not in rows:
            nodes.append(node)
            continue
        base = f"{node.output[0]}/odt_padding{len(done)}"
        nodes += [
            helper.make_node("Cast", [node.input[1]], [f"{base}/ids"], to=onnx.TensorProto.INT64),
            constant(f"{base}/row", onnx.TensorProto.INT64, [], [rows[weight]]),
            helper.make_node("Equal", [f"{base}/ids", f"{base}/row"], [f"{base}/is_pad"]),
            helper.make_node("Not", [f"{base}/is_pad"], [f"{base}/keep"]),
            helper.make_node("Cast", [f"{base}/keep"], [f"{base}/keep_f"], to=onnx.TensorProto.FLOAT),
            constant(f"{base}/last", onnx.TensorProto.INT64, [1], [-1]),
            helper.make_node("Unsqueeze", [f"{base}/keep_f", f"{base}/last"], [f"{base}/mask"]),
            helper.make_node("Mul", [node.input[2], f"{base}/mask"], [f"{base}/dY"]),
        ]
        node.input[2] = f"{base}/dY"
        nodes.append(node)
        done.append(weight)
    del training.graph.node[:]
    training.graph.node.extend(nodes)
    return done


def lookup_table(node: onnx.NodeProto, producer: dict[str, onnx.NodeProto]) -> str | None:
    """The table whose gradient ``node`` is, when it is a lookup's ``GatherGrad(Shape(table), ids,
    dY)`` along axis 0 in ORT's training graph (``producer``: output name -> node); else None."""
    shape = producer.get(node.input[0]) if node.op_type == "GatherGrad" else None
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    return shape.input[0] if shape is not None and shape.op_type == "Shape" and axis == 0 else None


def constant(name: str, dtype: int, dims: list[int], values: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, dtype, dims, values))
