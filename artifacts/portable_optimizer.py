"""The portable engine's optimizer step as a standard ONNX graph (ORT 1.19.2's kernels, written out).

Every trainable parameter, gradient and moment is one flat float32 vector (the engine keeps them
contiguous, in the manifest's order), so one update is a few long element-wise passes, whatever the
number of tensors. The outputs are bound onto the inputs' buffers: an update in place (each output is
written by the last node that reads its input). Without clipping the update is element-wise, so the
vectors' length is symbolic (``odt.n``) and a runtime may run the graph over consecutive slices of them:
the Python engine does, so that the fourteen passes stay in the CPU's cache. Clipping reads the norm of
all the gradients, so a clipping graph keeps the static length and runs over the whole vectors.

The learning rate and AdamW's bias-corrected rate are inputs, computed by
:func:`ondevice.engines.portable.adamw_rates` as ORT's kernel does (float32), so no rate is baked in
and no float64 ``Pow`` is needed.

- AdamW (``AdamWOptimizer``, adam_mode 1, the Hugging Face form)::

      m = b1 m + (1 - b1) g;  v = b2 v + ((1 - b2) g) g
      w = w - (lr_corrected m) / (sqrt(v) + eps);  w = w - (lr wd) w

- SGD (``SGDOptimizerV2``): ``w = w - lr g``
- ``max_grad_norm`` (``InplaceClipGradNorm``): ``g *= min(max_norm / (||g||_2 + 1e-6), 1)``, the norm
  over every gradient (summed in another order than the kernel's per-tensor sums: the last bit of
  the coefficient may differ).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ondevice.engines.contract import OPTIMIZER_INPUTS, OPTIMIZER_STATE, OPTIMIZER_UPDATED, SLICEABLE

from .optimizers import SGD, AdamW

__all__ = ["build_optimizer_graph"]


def build_optimizer_graph(optimizer: AdamW | SGD, size: int, opset: int, ir_version: int) -> onnx.ModelProto:
    """One update of ``size`` trainable values by ``optimizer``'s rule."""
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
    w, g, m, v = OPTIMIZER_STATE
    adamw = isinstance(optimizer, AdamW)
    state = OPTIMIZER_STATE if adamw else OPTIMIZER_STATE[:2]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in OPTIMIZER_INPUTS]
    length: int | str = size if optimizer.max_grad_norm is not None else SLICEABLE
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [length]) for n in state]
    updated = OPTIMIZER_UPDATED if adamw else OPTIMIZER_UPDATED[:1]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [length]) for n in updated]
    if optimizer.max_grad_norm is not None:
        norm = op("Sqrt", [op("ReduceSumSquare", [g], "odt.grad_norm.square", keepdims=0)], "odt.grad_norm")
        ratio = op("Div", [const(optimizer.max_grad_norm), op("Add", [norm, const(1e-6)], "odt.grad_norm.eps")],
                   "odt.clip.ratio")  # fmt: skip
        g = op("Mul", [g, op("Min", [ratio, const(1.0)], "odt.clip.coefficient")], "odt.gradients.clipped")
    if not adamw:
        op("Sub", [w, op("Mul", [g, lr], "odt.step")], updated[0])
    else:
        b1, b2 = (np.float32(b) for b in optimizer.betas)
        m_new = op("Add", [op("Mul", [m, const(b1)], "odt.m.decayed"), op("Mul", [g, const(1 - b1)], "odt.m.fresh")],
                   updated[1])  # fmt: skip
        fresh = op("Mul", [op("Mul", [g, const(1 - b2)], "odt.v.scaled"), g], "odt.v.fresh")
        v_new = op("Add", [op("Mul", [v, const(b2)], "odt.v.decayed"), fresh], updated[2])
        denominator = op("Add", [op("Sqrt", [v_new], "odt.v.sqrt"), const(optimizer.eps)], "odt.denominator")
        step = op("Div", [op("Mul", [m_new, lr_corrected], "odt.numerator"), denominator], "odt.step")
        if optimizer.weight_decay:
            moved = op("Sub", [w, step], "odt.moved")
            op("Sub", [moved, op("Mul", [moved, lr_decay], "odt.decay")], updated[0])
        else:
            op("Sub", [w, step], updated[0])
    initializers = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in constants.items()]
    graph = helper.make_graph(nodes, "odt_optimizer", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model
