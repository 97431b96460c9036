"""A 2-D convolution's input gradient as a forward convolution, taken out of ORT's ``ConvGrad``.

ORT 1.19's CPU ``ConvGrad`` computes the input, weight and bias gradients together, slowly: 11.6 ms
for a 32 -> 16 channel 3x3 convolution at batch 32 over 28x28 maps (2 threads), where PyTorch runs
that layer's forward and backward in 5.2 ms. The input gradient is an ordinary convolution, which
ORT's forward kernel (MLAS) runs well, and in the training graph it needs no gradient of its own:
for stride 1, ``dY`` convolved with the kernel flipped and its channel axes swapped, padded by
``kernel - 1 - padding`` (1.8 ms in the case above); for larger strides a ``ConvTranspose`` of
``dY`` with the kernel itself, whose output padding restores the input's size. The bias gradient
is ``dY`` summed over the batch and positions; ``ConvGrad`` keeps only the weight gradient
(U-Net-style benchmark model, one pair of runs: 20.97 -> 17.65 ms a step).

Tried and not kept: the weight gradient as one Gemm per kernel offset over strided windows of the
input took 4.1 ms alone in an inference session, but 12 ms of Slices inside the training session
(the step went to 44 ms); a convolution of the transposed input with the transposed ``dY`` took
12.5 ms alone.

Rewritten: 2-D, one group (or depthwise at stride 1: one group per channel, whose kernel needs no
channel swap; MobileNet-style benchmark model 47 -> 44.5 ms a train step), no dilation, padding
within the kernel's reach, static channel and spatial sizes (others keep their ``ConvGrad`` as it
is). The flipped kernels' shapes go into the graph's value_info for later passes (the NCHWc
variant). Verification against PyTorch covers it.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ._nodes import attributes
from .padding import constant

__all__ = ["rewrite_conv_grad"]

INT64 = TensorProto.INT64
LOWEST = -(2**63) + 1
"""An end index before the first element, for a Slice that walks backwards to the start."""


def _static(dims: list[int | str]) -> bool:
    return all(isinstance(d, int) and d > 0 for d in dims)


def rewrite_conv_grad(training: onnx.ModelProto) -> int:
    """Replace each qualifying ``ConvGrad`` of ORT's training graph in place; returns how many."""
    graph = training.graph
    shapes: dict[str, list[int | str]] = {}
    for value in [*graph.value_info, *graph.input, *graph.output]:
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]
    for init in graph.initializer:
        shapes[init.name] = list(init.dims)
    nodes: list[onnx.NodeProto] = []
    shaped: list[onnx.ValueInfoProto] = []  # the flipped kernels' shapes, for later passes
    done = 0
    for node in graph.node:
        convgrad = node.op_type == "ConvGrad" and node.domain == "com.microsoft"
        new = _rewrite(node, shapes, shaped) if convgrad else None
        if new is None:
            nodes.append(node)
        else:
            nodes.extend(new)
            done += 1
    if done:
        del graph.node[:]
        graph.node.extend(nodes)
        graph.value_info.extend(shaped)
    return done


def _rewrite(
    node: onnx.NodeProto, shapes: dict[str, list[int | str]], shaped: list[onnx.ValueInfoProto]
) -> list[onnx.NodeProto] | None:
    a = attributes(node)
    dy, x, w = node.input
    x_shape, w_shape = shapes.get(x, []), shapes.get(w, [])
    if len(x_shape) != 4 or len(w_shape) != 4 or not _static(x_shape[1:]) or not _static(w_shape):
        return None
    kernel = list(a.get("kernel_shape") or w_shape[2:])
    pads = list(a.get("pads") or [0, 0, 0, 0])  # top, left, bottom, right
    strides = list(a.get("strides") or [1, 1])
    auto_pad = a.get("auto_pad", b"NOTSET")
    group = a.get("group", 1)
    depthwise = group > 1 and group == w_shape[0] == x_shape[1] and w_shape[1] == 1
    plain = (group == 1 or depthwise) and all(d == 1 for d in a.get("dilations") or [1, 1])
    if not plain or auto_pad not in (b"NOTSET", "NOTSET") or any(p > k - 1 for p, k in zip(pads, kernel + kernel)):
        return None
    if depthwise and strides != [1, 1]:
        return None  # a grouped ConvTranspose is no faster than ConvGrad
    size = [int(s) for s in x_shape[2:]]
    out = [(size[i] + pads[i] + pads[i + 2] - kernel[i]) // strides[i] + 1 for i in range(2)]
    prefix = f"{node.name or node.output[0]}/odt_convgrad"
    made: list[onnx.NodeProto] = []

    def const(name: str, values: list[int]) -> str:
        made.append(constant(f"{prefix}/{name}", INT64, [len(values)], values))
        return f"{prefix}/{name}"

    dx, dw, db = (list(node.output) + ["", "", ""])[:3]
    if not dx:
        return None  # no input gradient to take out (a first layer)
    if strides == [1, 1]:
        swapped, flipped = f"{prefix}/w_swapped", f"{prefix}/w_flipped"
        if depthwise:  # one input and one output channel per group: nothing to swap
            swapped = w
        else:
            made.append(helper.make_node("Transpose", [w], [swapped], perm=[1, 0, 2, 3]))
        ends = const("flip_ends", [LOWEST, LOWEST])
        made.append(helper.make_node("Slice", [swapped, const("flip_starts", [-1, -1]), ends, const("hw", [2, 3]),
                                               const("flip_steps", [-1, -1])], [flipped]))  # fmt: skip
        flipped_shape = w_shape if depthwise else [w_shape[1], w_shape[0], *w_shape[2:]]
        shaped.append(helper.make_tensor_value_info(flipped, TensorProto.FLOAT, flipped_shape))
        border = [kernel[i % 2] - 1 - pads[i] for i in range(4)]
        made.append(helper.make_node("Conv", [dy, flipped], [dx], pads=border, kernel_shape=kernel, group=group))
    else:
        extra = [size[i] - ((out[i] - 1) * strides[i] + kernel[i] - pads[i] - pads[i + 2]) for i in range(2)]
        if any(e < 0 or e >= s for e, s in zip(extra, strides)):
            return None
        made.append(helper.make_node("ConvTranspose", [dy, w], [dx], pads=pads, strides=strides, kernel_shape=kernel,
                                     output_padding=extra))  # fmt: skip
    # ORT's kernel keeps the weight gradient only
    made.append(helper.make_node("ConvGrad", [dy, x, w], ["", dw], domain="com.microsoft", name=prefix, **a))
    if db:
        made.append(helper.make_node("ReduceSum", [dy, const("bias_axes", [0, 2, 3])], [db], keepdims=0))
    return made
