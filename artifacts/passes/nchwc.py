"""Convolutions on ORT's blocked-channel (NCHWc) kernels, for x86 runtimes.

ORT 1.19 runs a ``Conv`` whose weight is a graph input (a trained weight) on its im2col kernels:
3.17 ms for the benchmark CNN's 32 -> 64 channel 3x3 convolution at batch 64 (2 threads), and a
depthwise ``Conv`` (one group per channel) as one tiny matrix product per channel and image:
1.43 ms for 64 channels of 16x16 at batch 32. Its NCHWc kernels run the same convolutions in
1.91 ms and 0.17 ms, but ORT only switches to them when the weight is a constant (it reorders the
filter once, at load), and a trained weight is not. Here the reorder is part of the graph, each
step: the filter becomes MLAS's blocked layout (Reshape, Transpose, Reshape: ``[C/B, kh, kw, B]``
for a depthwise filter, ``OIHWBiBo`` for a full one, ``OIHWBo`` when the input has fewer channels
than a block and is read as NCHW), the input is reordered to blocks of ``B`` channels
(``ReorderInput``), and the output back (``ReorderOutput``). ``B`` is the runtime's block size
(8 with AVX2, 16 with AVX-512), read in the graph from the shape ``ReorderInput`` gives one
value, so one graph serves both.

NCHWc kernels exist only in ORT's x86 builds: the result is a variant training graph beside the
portable one, which the runtime loads when its ORT has the kernels (``ondevice.session``). Every
qualifying ``Conv`` is rewritten: the model's own and, at stride 1, the Convs the conv-grad pass
made for their input gradients (the flipped kernels' shapes are in value_info); ``ConvGrad`` still
computes the weight gradients. Rewritten: 2-D, a weight of known static shape (graph input,
initializer or value_info), explicit padding, output channels a multiple of 16, and either
depthwise or a full ``Conv`` (group 1) with a kernel larger than 1x1 whose input channels are a
multiple of 16 or fewer than 8 (1x1 kernels measured no faster). The same products in another
order: verification against PyTorch covers it.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ._nodes import attributes
from .padding import constant

__all__ = ["convs_to_nchwc", "NCHWC_DOMAIN"]

NCHWC_DOMAIN = "com.microsoft.nchwc"
MULTIPLE = 16
"""Channel counts must be a multiple of every x86 block size (8, 16)."""
MIN_BLOCK = 8
"""The smallest x86 block size: a Conv with fewer input channels reads its input as NCHW."""
INT64 = TensorProto.INT64


def convs_to_nchwc(model: onnx.ModelProto) -> int:
    """Rewrite every qualifying ``Conv`` of ``model`` in place; returns how many."""
    graph = model.graph
    values = [*graph.input, *graph.value_info]  # value_info: the conv-grad pass's flipped kernels
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}
    shapes.update({i.name: list(i.dims) for i in graph.initializer})
    nodes: list[onnx.NodeProto] = []
    block = "odt_nchwc/block"
    done = 0
    for node in graph.node:
        made = _rewrite(node, shapes, block) if node.op_type == "Conv" and node.domain in ("", "ai.onnx") else None
        nodes.extend(made or [node])
        done += made is not None
    if done:
        probe = [
            helper.make_node("Constant", [], ["odt_nchwc/four"],
                             value=helper.make_tensor("four", TensorProto.FLOAT, [1, 4, 1, 1], [0.0] * 4)),
            helper.make_node("ReorderInput", ["odt_nchwc/four"], ["odt_nchwc/blocked"], domain=NCHWC_DOMAIN),
            helper.make_node("Shape", ["odt_nchwc/blocked"], [block], start=1, end=2),  # [B]
        ]  # fmt: skip
        del graph.node[:]
        graph.node.extend(probe + nodes)
        if not any(o.domain == NCHWC_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(NCHWC_DOMAIN, 1))
    return done


def _rewrite(node: onnx.NodeProto, shapes: dict[str, list[int]], block: str) -> list[onnx.NodeProto] | None:
    a = attributes(node)
    if len(node.input) < 2:
        return None
    w = node.input[1]
    w_shape = shapes.get(w, [])
    if len(w_shape) != 4 or 0 in w_shape:
        return None
    out_channels, in_channels, kernel = w_shape[0], w_shape[1], w_shape[2:]
    group = a.get("group", 1)
    explicit = a.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
    depthwise = in_channels == 1 and group == out_channels
    # a full Conv: blocked input channels (a multiple of every block size), or so few that the kernel reads
    # NCHW directly (below every block size); 1x1 kernels are left alone (no faster on NCHWc, measured)
    full = group == 1 and (in_channels % MULTIPLE == 0 or in_channels < MIN_BLOCK) and kernel != [1, 1]
    if not (depthwise or full) or out_channels % MULTIPLE or not explicit:
        return None
    prefix = f"{node.name or node.output[0]}/odt_nchwc"
    made: list[onnx.NodeProto] = []

    def const(name: str, values: list[int]) -> str:
        made.append(constant(f"{prefix}/{name}", INT64, [len(values)], values))
        return f"{prefix}/{name}"

    def blocks(role: str, channels: int) -> str:
        made.append(helper.make_node("Div", [const(role, [channels]), block], [f"{prefix}/{role}_blocks"]))
        return f"{prefix}/{role}_blocks"

    blocked_input = not depthwise and in_channels >= MIN_BLOCK
    if depthwise:  # [C, 1, kh, kw] -> [C/B, B, kh, kw] -> [C/B, kh, kw, B]
        split, perm = [blocks("out", out_channels), block, const("kernel", kernel)], [0, 2, 3, 1]
    elif blocked_input:  # OIHW -> [O/B, Bo, I/B, Bi, kh, kw] -> [O/B, I/B, kh, kw, Bi, Bo] (MLAS's OIHWBiBo)
        split = [blocks("out", out_channels), block, blocks("in", in_channels), block, const("kernel", kernel)]
        perm = [0, 2, 4, 5, 3, 1]
    else:  # OIHW -> [O/B, Bo, I, kh, kw] -> [O/B, I, kh, kw, Bo] (MLAS's OIHWBo, for an NCHW input)
        split, perm = [blocks("out", out_channels), block, const("kernel", [in_channels, *kernel])], [0, 2, 3, 4, 1]
    made += [
        helper.make_node("Concat", split, [f"{prefix}/split"], axis=0),
        helper.make_node("Reshape", [w, f"{prefix}/split"], [f"{prefix}/w_split"]),
        helper.make_node("Transpose", [f"{prefix}/w_split"], [f"{prefix}/w_blocked"], perm=perm),
        helper.make_node("Reshape", [f"{prefix}/w_blocked", const("shape", w_shape)], [f"{prefix}/w"]),
    ]
    x = node.input[0]
    if depthwise or blocked_input:
        made.append(helper.make_node("ReorderInput", [x], [f"{prefix}/x"], domain=NCHWC_DOMAIN))
        x = f"{prefix}/x"
    options = {
        "group": group,
        "kernel_shape": kernel,
        "pads": list(a.get("pads") or [0, 0, 0, 0]),
        "strides": list(a.get("strides") or [1, 1]),
        "dilations": list(a.get("dilations") or [1, 1]),
    }
    made.append(helper.make_node("Conv", [x, f"{prefix}/w", *node.input[2:]], [f"{prefix}/y"], domain=NCHWC_DOMAIN,
                                 **options))  # fmt: skip
    made.append(helper.make_node("ReorderOutput", [f"{prefix}/y"], list(node.output), domain=NCHWC_DOMAIN,
                                 channels=out_channels))  # fmt: skip
    return made
