"""Names the generator and the portable engine agree on (no ONNX Runtime import: the generator reads it too)."""

from __future__ import annotations

__all__ = ["PORTABLE_TRAINING", "PORTABLE_NCHWC", "PORTABLE_OPTIMIZER", "PORTABLE_STEP", "PORTABLE_ORT", "FUSED_MAX",
           "OPTIMIZER_INPUTS", "OPTIMIZER_STATE", "OPTIMIZER_UPDATED", "SLICEABLE", "gradient_output", "gradient_seed",
           "ort_copy_name"]

PORTABLE_TRAINING = "training_model.portable.onnx"
"""The training graph with every training-only operator lowered (``artifacts/passes/portable.py`` and its
modules)."""
PORTABLE_NCHWC = "training_model.portable.nchwc.onnx"
"""Its variant for x86 runtimes, convolutions on ORT's NCHWc kernels (``artifacts/passes/nchwc.py``); the
manifest's ``portable["nchwc"]`` names it when the model has such convolutions."""
PORTABLE_OPTIMIZER = "optimizer_model.portable.onnx"
"""The optimizer update as a standard graph (``artifacts/portable_optimizer.py``)."""
PORTABLE_STEP = "step_model.portable.onnx"
"""The training graph and the optimizer update fused, a whole step in one run (``ondevice/engines/step_graph.py``)."""
PORTABLE_ORT = {"training": "training_ort", "step": "step_ort", "eval": "eval_ort"}
"""The manifest's ``portable`` keys of the ORT-format copies of the training, step and eval graphs, which
artifacts with a ``frozen.bin`` carry: there the frozen weights are graph inputs, bound to the runtime's one
mapping of the file (``ondevice.frozen``), so a copy holds no weight. The files are named by
:func:`ort_copy_name`."""
FUSED_MAX = 1 << 18
"""The generator writes :data:`PORTABLE_STEP` for trainable vectors up to this many values (and no NCHWc
variant): there a session run's fixed cost is a large part of a step, and the update fits in the one slice
the portable engine would run it in anyway (``ondevice.engines.portable.SLICE``)."""
OPTIMIZER_INPUTS = ("odt.lr", "odt.lr_corrected", "odt.lr_decay")
"""The optimizer graph's scalar inputs: the learning rate, AdamW's bias-corrected rate, rate x weight decay."""
OPTIMIZER_STATE = ("odt.parameters", "odt.gradients", "odt.momentum0", "odt.momentum1")
"""The optimizer graph's tensor inputs: every trainable parameter, gradient and moment as one flat float32
vector each, in the manifest's order (the flat buffer's): one update of a few long element-wise passes."""
OPTIMIZER_UPDATED = ("odt.parameters.updated", "odt.momentum0.updated", "odt.momentum1.updated")
"""Its outputs (SGD: the parameters only), which the engine binds onto the inputs' buffers."""
SLICEABLE = "odt.n"
"""The symbolic length of an optimizer graph that is element-wise (no clipping): it may run over any
consecutive slice of the flat vectors. A clipping graph has the static length of the whole vectors."""


def ort_copy_name(graph: str) -> str:
    """The ORT-format copy's file name: ``training_model.portable.ort``; the shared eval graph's copy is
    ``eval_model.portable.ort``, the classic engine keeping ``eval_model.onnx``."""
    stem = graph.removesuffix(".onnx")
    return f"{stem if stem.endswith('.portable') else stem + '.portable'}.ort"


def gradient_output(parameter: str) -> str:
    """The portable training graph's output that carries ``parameter``'s gradient of one step."""
    return f"{parameter}_grad"


def gradient_seed(parameter: str) -> str:
    """The portable training graph's input that ``parameter``'s gradient is scattered into (a lookup table's:
    ``ScatterElements(seed, ids, dY, reduction="add")``). The engine binds the gradient's own buffer there,
    zeroed, and as the output, so ONNX Runtime adds the rows in place instead of making table-sized zeros of its
    own every step. Graphs without the engine's bindings get the zeros back (:func:`~.step_graph.unseed`)."""
    return f"{parameter}_grad.seed"
