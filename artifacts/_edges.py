"""Verification batches that seek the edge cases instead of hoping for them.

Integer inputs that index an embedding always contain its padding row, id 0 and the largest
id; attention-mask-like inputs (integers in {0, 1}) contain zeros; a second batch has another
batch size and, where an axis is dynamic, another length. Bugs that only show at those values
or sizes (a padding row with a gradient, a size baked into the graph) then fail verification.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import onnx
import torch

__all__ = ["embedding_inputs", "edge_batches"]


def embedding_inputs(model: onnx.ModelProto, padding: Mapping[str, int]) -> dict[str, list[int]]:
    """``{input name: ids to include}`` for each graph input that indexes an embedding directly."""
    sizes = {i.name: int(i.dims[0]) for i in model.graph.initializer if len(i.dims) == 2}
    inputs = {i.name for i in model.graph.input}
    casts = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Cast"}
    tables: dict[str, list[str]] = {}
    for node in model.graph.node:
        source = casts.get(node.input[1], node.input[1]) if node.op_type == "Gather" else None
        if source in inputs and node.input[0] in sizes:
            tables.setdefault(source, []).append(node.input[0])
    found = {}
    for name, weights in tables.items():
        top = min(sizes[w] for w in weights) - 1  # one input may index several tables: fit the smallest
        wanted = {0, top, *(padding[w] for w in weights if w in padding)}
        found[name] = sorted(i for i in wanted if i <= top)
    return found


def edge_batches(
    names: Sequence[str],
    example: Sequence[torch.Tensor],
    dynamic_axes: Mapping[str, Mapping[int, str]],
    ids: Mapping[str, Sequence[int]],
) -> list[list[torch.Tensor]]:
    """The example with edge values, and a second one with another batch size and dynamic lengths."""
    batch = example[0].shape[0]
    second = batch // 2 if batch >= 4 else batch + 2
    rows = torch.arange(second) % batch
    resized = []
    for name, tensor in zip(names, example):
        tensor = tensor[rows]
        for axis in dynamic_axes.get(name, {}):
            tensor = tensor.narrow(axis, 0, max(1, (tensor.shape[axis] + 1) // 2))
        resized.append(tensor)
    return [_with_edges(names, example, ids), _with_edges(names, resized, ids)]


def _with_edges(
    names: Sequence[str], example: Sequence[torch.Tensor], ids: Mapping[str, Sequence[int]]
) -> list[torch.Tensor]:
    out = []
    for name, tensor in zip(names, example):
        tensor = tensor.clone()
        flat = tensor.view(-1)
        if name in ids and flat.numel() > 1:
            values = torch.tensor(ids[name], dtype=tensor.dtype)[: flat.numel() - 1]
            flat[1 : 1 + len(values)] = values  # position 0 keeps its id (often a [CLS] token)
        elif _mask_like(tensor) and not (tensor == 0).any() and tensor.dim() > 1:
            row = tensor[0].view(-1)
            row[max(1, row.numel() * 3 // 4) :] = 0  # the tail of the first example is padding
        out.append(tensor)
    return out


def _mask_like(tensor: torch.Tensor) -> bool:
    if tensor.is_floating_point() or tensor.dtype == torch.bool:
        return False
    return bool(((tensor == 0) | (tensor == 1)).all())
