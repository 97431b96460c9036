"""A pixel shuffle's six-axis ``Transpose`` (and its gradient's) as ``DepthToSpace`` (and ``SpaceToDepth``).

A ``ConvTranspose`` whose kernel equals its stride is generated as a 1x1 convolution and a pixel shuffle
(``artifacts/upsampling.py``): ``[N, C, b, b, H, W] -> [N, C, H, b, W, b]``, a ``Transpose`` with perm
``[0, 1, 4, 2, 5, 3]``, and in the backward its inverse, perm ``[0, 1, 3, 5, 2, 4]``. Stock onnxruntime 1.32 runs
such six-axis transposes element by element: on the U-Net-style benchmark model's [32, 16, 2, 2, 14, 14]
activation 1.04 ms forward and 0.88 ms backward (2 threads, medians of 50 runs; onnxruntime-training 1.19.2
0.65 and 0.35), 3.3 ms of a 15 ms step in the training session's profile. The same moves as ONNX's own
block operators (onnxruntime 1.32, the same tensors):

- forward: ``DepthToSpace`` in ``CRD`` mode over the tensor seen as ``[N, C b b, H, W]``, 0.41 ms;
- backward: ``SpaceToDepth`` (whose only mode, ``DCR``, puts the block offset before the channel), then the
  block axis and the channel axis swapped with a four-axis ``Transpose`` of contiguous ``H W`` rows, 0.19 ms.

The Reshapes around them are views. The values are moved, never computed: the rewrite is exact (tested
against the transposes on random tensors, and by verification against PyTorch). Rewritten: a ``Transpose``
with one of the two perms over a tensor of six axes whose channel, block and spatial sizes are static and
whose two block sizes are equal (the 2-D case); others stay.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["shuffle_as_depth_to_space"]

FORWARD = [0, 1, 4, 2, 5, 3]
"""[N, C, b, b, H, W] -> [N, C, H, b, W, b]"""
BACKWARD = [0, 1, 3, 5, 2, 4]
"""[N, C, H, b, W, b] -> [N, C, b, b, H, W]"""


def _shapes(graph: onnx.GraphProto) -> dict[str, list[int | None]]:
    shapes: dict[str, list[int | None]] = {}
    for value in [*graph.value_info, *graph.input, *graph.output]:
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    return shapes


def shuffle_as_depth_to_space(model: onnx.ModelProto, opset: int) -> int:
    """Rewrite every qualifying ``Transpose`` of ``model`` in place; returns how many."""
    if opset < 11:  # DepthToSpace's mode attribute
        return 0
    graph = model.graph
    shapes = _shapes(graph)
    # a gradient's tensors carry no shapes: the inverse transpose reads its forward's, through the gradient
    # builders' names (ORT's and artifacts.gradients' alike: "<forward node>_Grad/Transpose")
    inverse: dict[str, list[int | None]] = {}
    for node in graph.node:
        forward = shapes.get(node.input[0], []) if node.op_type == "Transpose" and node.name else []
        if _perm(node) == FORWARD and len(forward) == 6:
            n, c, b1, b2, h, w = forward
            inverse[f"{node.name}_Grad/Transpose"] = [n, c, h, b1, w, b2]
    nodes: list[onnx.NodeProto] = []
    constants: list[onnx.TensorProto] = []
    done = 0
    for node in graph.node:
        new = None
        if node.op_type == "Transpose":
            shape = shapes.get(node.input[0]) or inverse.get(node.name, [])
            new = _rewrite(node, shape, constants)
        nodes.extend(new or [node])
        done += new is not None
    if done:
        del graph.node[:]
        graph.node.extend(nodes)
        graph.initializer.extend(constants)
    return done


def _perm(node: onnx.NodeProto) -> list[int] | None:
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None)


def _rewrite(node: onnx.NodeProto, shape: list[int | None],
             constants: list[onnx.TensorProto]) -> list[onnx.NodeProto] | None:  # fmt: skip
    perm = _perm(node)
    if perm not in (FORWARD, BACKWARD) or len(shape) != 6 or any(d is None for d in shape[1:]):
        return None
    prefix = f"{node.name or node.output[0]}/odt_shuffle"
    made: list[onnx.NodeProto] = []

    def const(name: str, values: list[int]) -> str:
        constants.append(numpy_helper.from_array(np.array(values, np.int64), f"{prefix}/shape.{name}"))
        return f"{prefix}/shape.{name}"

    def step(kind: str, inputs: list[str], name: str, output: str | None = None, **attributes: object) -> str:
        out = output or f"{prefix}/{name}"
        made.append(helper.make_node(kind, inputs, [out], name=f"{prefix}/{name}", **attributes))
        return out

    source, target = node.input[0], node.output[0]
    if perm == FORWARD:
        c, b, b2, h, w = (int(d) for d in shape[1:])  # type: ignore[arg-type]
        if b != b2:
            return None
        flat = step("Reshape", [source, const("depth", [0, c * b * b, h, w])], "depth")
        spread = step("DepthToSpace", [flat], "d2s", blocksize=b, mode="CRD")
        step("Reshape", [spread, const("out", [0, c, h, b, w, b])], "out", target)
    else:
        c, h, b, w, b2 = (int(d) for d in shape[1:])  # type: ignore[arg-type]
        if b != b2:
            return None
        plane = step("Reshape", [source, const("space", [0, c, h * b, w * b])], "space")
        blocks = step("SpaceToDepth", [plane], "s2d", blocksize=b)  # [N, (i b + j) C + c, H, W]
        split = step("Reshape", [blocks, const("blocks", [0, b * b, c, h * w])], "blocks")
        swapped = step("Transpose", [split], "swap", perm=[0, 2, 1, 3])  # [N, C, b b, H W]
        step("Reshape", [swapped, const("out", [0, c, b, b, h, w])], "out", target)
    return made
