"""Each ONNX operator's gradient, one rule per operator, registered in :data:`RULES`.

The rules live in :mod:`.elementwise`, :mod:`.shapes` and :mod:`.layers`. A rule gets the
forward node, the gradient of each of its outputs (None where nothing downstream needs one) and which
inputs need a gradient; it appends the backward's nodes through the
:class:`~artifacts.gradients._emit.Emitter` and returns a gradient name (or None) per input.

Where ONNX Runtime's training build has a gradient kernel, the rule writes that kernel's node
(``ReluGrad``, ``SoftmaxGrad_13``, ``LayerNormalizationGrad``, ``ConvGrad``...) with the inputs ORT's
own gradient builder gives it: the project's lowering table (:mod:`artifacts.passes.portable`) is then
the one definition of each kernel in standard ONNX, tested against ORT's kernels, and the training
graph reads exactly as ORT's builder would have written it. Everything else is standard ONNX here.
"""

from __future__ import annotations

from . import elementwise, layers, shapes  # noqa: F401  (each registers its rules on import)
from ._registry import NOT_DIFFERENTIABLE, RULES, Grads, Rule, rule

__all__ = ["RULES", "Rule", "Grads", "NOT_DIFFERENTIABLE", "rule"]
