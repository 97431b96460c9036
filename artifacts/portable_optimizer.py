"""The portable engine's optimizer step as a standard ONNX graph (ORT 1.19.2's kernels, written out).

Inputs are the rates of this step and, per trainable parameter, its value, gradient and state;
outputs are the new value and state, which the runtime binds onto the input buffers (an update in
place: each output is written by the last node that reads its input). The learning rate and
AdamW's bias-corrected rate are inputs, computed by :func:`ondevice.engines.portable.adamw_rates`
as ORT's kernel does (float32), so no rate is baked in and no float64 ``Pow`` is needed.

- AdamW (``AdamWOptimizer``, adam_mode 1, the Hugging Face form)::

      m = b1 m + (1 - b1) g;  v = b2 v + ((1 - b2) g) g
      w = w - (lr_corrected m) / (sqrt(v) + eps);  w = w - (lr wd) w

- SGD (``SGDOptimizerV2``): ``w = w - lr g``
- ``max_grad_norm`` (``InplaceClipGradNorm``): ``g *= min(max_norm / (||g||_2 + 1e-6), 1)``
  with the norm over every gradient.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ondevice.engines.contract import OPTIMIZER_INPUTS, state_names

from .optimizers import SGD, AdamW

__all__ = ["build_optimizer_graph"]


def build_optimizer_graph(
    optimizer: AdamW | SGD, parameters: list[tuple[str, tuple[int, ...]]], opset: int, ir_version: int
) -> onnx.ModelProto:
    """One update of ``parameters`` (name, shape) by ``optimizer``'s rule."""
    nodes: list[onnx.NodeProto] = []
    constants: dict[str, float] = {}

    def const(value: float) -> str:
        name = f"odt.optimizer.{np.float32(value).tobytes().hex()}"
        constants[name] = value
        return name

    def op(kind: str, inputs: list[str], out: str, **attributes: int) -> str:
        nodes.append(helper.make_node(kind, inputs, [out], **attributes))
        return out

    lr, lr_corrected, lr_decay = OPTIMIZER_INPUTS
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in OPTIMIZER_INPUTS]
    outputs = []
    grads = {name: state_names(name)["grad"] for name, _ in parameters}
    if optimizer.max_grad_norm is not None:
        squares = [op("ReduceSumSquare", [g], f"{g}.square_sum", keepdims=0) for g in grads.values()]
        norm = op("Sqrt", [op("Sum", squares, "odt.grad_norm.square")], "odt.grad_norm")
        ratio = op("Div", [const(optimizer.max_grad_norm), op("Add", [norm, const(1e-6)], "odt.grad_norm.eps")],
                   "odt.clip.ratio")  # fmt: skip
        coefficient = op("Min", [ratio, const(1.0)], "odt.clip.coefficient")
        grads = {name: op("Mul", [g, coefficient], f"{g}.clipped") for name, g in grads.items()}
    for name, shape in parameters:
        names = state_names(name)
        tensors = [names["value"], names["grad"], *names["moments"]] if optimizer.kind == "adamw" else [
            names["value"], names["grad"]]  # fmt: skip
        inputs += [helper.make_tensor_value_info(t, TensorProto.FLOAT, list(shape)) for t in tensors]
        g, w = grads[name], names["value"]
        if isinstance(optimizer, SGD):
            op("Sub", [w, op("Mul", [g, lr], f"{w}.step")], names["updated"][0])
        else:
            b1, b2 = (float(np.float32(b)) for b in optimizer.betas)
            m, v = names["moments"]
            m_new, v_new = names["updated"][1:]
            op("Add", [op("Mul", [m, const(b1)], f"{m}.decayed"),
                       op("Mul", [g, const(1.0 - np.float32(b1))], f"{m}.fresh")], m_new)  # fmt: skip
            fresh = op("Mul", [op("Mul", [g, const(1.0 - np.float32(b2))], f"{v}.scaled"), g], f"{v}.fresh")
            op("Add", [op("Mul", [v, const(b2)], f"{v}.decayed"), fresh], v_new)
            denominator = op("Add", [op("Sqrt", [v_new], f"{v}.sqrt"), const(optimizer.eps)], f"{v}.denominator")
            step = op("Div", [op("Mul", [m_new, lr_corrected], f"{w}.numerator"), denominator], f"{w}.step")
            if optimizer.weight_decay:
                moved = op("Sub", [w, step], f"{w}.moved")
                op("Sub", [moved, op("Mul", [moved, lr_decay], f"{w}.decay")], names["updated"][0])
            else:
                op("Sub", [w, step], names["updated"][0])
        count = 1 if isinstance(optimizer, SGD) else 3
        outputs += [helper.make_tensor_value_info(t, TensorProto.FLOAT, list(shape)) for t in names["updated"][:count]]
    initializers = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in constants.items()]
    graph = helper.make_graph(nodes, "odt_optimizer", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model
