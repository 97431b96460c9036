"""Names the generator and the portable engine agree on (no ONNX Runtime import: the generator reads it too)."""

from __future__ import annotations

__all__ = ["PORTABLE_TRAINING", "PORTABLE_OPTIMIZER", "OPTIMIZER_INPUTS", "state_names"]

PORTABLE_TRAINING = "training_model.portable.onnx"
"""The training graph with every training-only operator lowered (``artifacts/passes/portable.py``)."""
PORTABLE_OPTIMIZER = "optimizer_model.portable.onnx"
"""The optimizer update as a standard graph (``artifacts/portable_optimizer.py``)."""
OPTIMIZER_INPUTS = ("odt.lr", "odt.lr_corrected", "odt.lr_decay")
"""The optimizer graph's scalar inputs: the learning rate, AdamW's bias-corrected rate, rate x weight decay."""


def state_names(parameter: str) -> dict[str, object]:
    """The optimizer graph's tensor names for one parameter: value, gradient, moments, updated values."""
    return {
        "value": parameter,
        "grad": f"{parameter}_grad",
        "moments": (f"{parameter}.momentum0", f"{parameter}.momentum1"),
        "updated": (f"{parameter}.updated", f"{parameter}.momentum0.updated", f"{parameter}.momentum1.updated"),
    }
