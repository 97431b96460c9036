"""Depthwise convolutions on ORT's blocked-channel (NCHWc) kernels, for x86 runtimes.

ORT 1.19 runs a depthwise ``Conv`` (one group per channel) as one tiny matrix product per
channel and image: 1.43 ms for 64 channels of 16x16 at batch 32 (2 threads). Its NCHWc kernels
run the same convolution in 0.17 ms, but ORT only switches to them when the weight is a constant
(it reorders the filter once, at load), and a trained weight is not. Here the reorder is part of
the graph: the filter ``[C, 1, kh, kw]`` becomes ``[C/B, kh, kw, B]`` (Reshape, Transpose) each
step, the input is reordered to blocks of ``B`` channels (``ReorderInput``), and the output back
(``ReorderOutput``). ``B`` is the runtime's block size (8 with AVX2, 16 with AVX-512), read in the
graph from the shape ``ReorderInput`` gives one value, so one graph serves both.

NCHWc kernels exist only in ORT's x86 builds: the result is a variant training graph beside the
portable one, which the runtime loads when its ORT has the kernels (``ondevice.session``). Every
qualifying ``Conv`` is rewritten: the model's depthwise layers and, at stride 1, the grouped Conv
the conv-grad pass made for their input gradient (its flipped kernel's shape is in value_info);
``ConvGrad`` still computes the weight gradients. Rewritten: 2-D, ``group`` = channels (a multiple
of 16), a weight of known static shape (graph input, initializer or value_info), explicit padding.
The same products in another order: verification against PyTorch covers it.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from .padding import constant

__all__ = ["depthwise_to_nchwc", "NCHWC_DOMAIN"]

NCHWC_DOMAIN = "com.microsoft.nchwc"
MULTIPLE = 16
"""Channel counts must be a multiple of every x86 block size (8, 16)."""
INT64 = TensorProto.INT64


def depthwise_to_nchwc(model: onnx.ModelProto) -> int:
    """Rewrite every qualifying depthwise ``Conv`` of ``model`` in place; returns how many."""
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
    a = {attr.name: helper.get_attribute_value(attr) for attr in node.attribute}
    if len(node.input) < 2:
        return None
    w = node.input[1]
    w_shape = shapes.get(w, [])
    if len(w_shape) != 4 or 0 in w_shape or w_shape[1] != 1:
        return None
    channels, kernel = w_shape[0], w_shape[2:]
    explicit = a.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
    if a.get("group", 1) != channels or channels % MULTIPLE or not explicit:
        return None
    prefix = f"{node.name or node.output[0]}/odt_nchwc"
    made: list[onnx.NodeProto] = []

    def const(name: str, values: list[int]) -> str:
        made.append(constant(f"{prefix}/{name}", INT64, [len(values)], values))
        return f"{prefix}/{name}"

    # [C, 1, kh, kw] -> [C/B, B, kh, kw] -> [C/B, kh, kw, B] -> back to [C, 1, kh, kw] (the blocked order)
    made += [
        helper.make_node("Div", [const("channels", [channels]), block], [f"{prefix}/groups"]),
        helper.make_node("Concat", [f"{prefix}/groups", block, const("kernel", kernel)], [f"{prefix}/split"], axis=0),
        helper.make_node("Reshape", [w, f"{prefix}/split"], [f"{prefix}/w_split"]),
        helper.make_node("Transpose", [f"{prefix}/w_split"], [f"{prefix}/w_last"], perm=[0, 2, 3, 1]),
        helper.make_node("Reshape", [f"{prefix}/w_last", const("shape", w_shape)], [f"{prefix}/w"]),
        helper.make_node("ReorderInput", [node.input[0]], [f"{prefix}/x"], domain=NCHWC_DOMAIN),
    ]
    options = {
        "group": channels,
        "kernel_shape": kernel,
        "pads": list(a.get("pads") or [0, 0, 0, 0]),
        "strides": list(a.get("strides") or [1, 1]),
        "dilations": list(a.get("dilations") or [1, 1]),
    }
    inputs = [f"{prefix}/x", f"{prefix}/w", *node.input[2:]]
    made.append(helper.make_node("Conv", inputs, [f"{prefix}/y"], domain=NCHWC_DOMAIN, **options))
    made.append(helper.make_node("ReorderOutput", [f"{prefix}/y"], list(node.output), domain=NCHWC_DOMAIN,
                                 channels=channels))  # fmt: skip
    return made
