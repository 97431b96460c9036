"""The optional outputs ORT 1.19's gradient builders read, added where the exporter omits them."""

from __future__ import annotations

import onnx

__all__ = ["complete_gradient_outputs"]


def complete_gradient_outputs(model: onnx.ModelProto) -> None:
    """Add the optional outputs ORT's gradient builders read but the exporter may omit.

    LayerNormalization needs Mean and InvStdDev (opset >= 17 exports one output); Dropout needs
    its mask (attention dropout inside scaled_dot_product_attention exports without it).
    """
    for node in model.graph.node:
        if node.op_type == "Dropout" and len(node.output) == 1:
            node.output.append(f"{node.output[0]}/mask")
        elif node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([f"{node.output[0]}/mean", f"{node.output[0]}/inv_std_dev"])
