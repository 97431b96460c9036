"""Workstation side: PyTorch model to verified ONNX Runtime training artifacts."""

from __future__ import annotations

from ondevice.lazy import lazy_exports

from .errors import (
    ArtifactError,
    ExportError,
    InputSpecError,
    ModelLoadError,
    OptionError,
    OutputExistsError,
    SelectionError,
    UnsupportedOperatorError,
    VerificationError,
)

# Everything else loads on first use, so `import PACKAGE` (and `odt --help`) stays cheap.
_LAZY = {
    "generate": ".build",
    "Spec": ".spec",
    "L1": ".losses",
    "MSE": ".losses",
    "BCEWithLogits": ".losses",
    "CrossEntropy": ".losses",
    "CustomLoss": ".losses",
    "ModelLoss": ".losses",
    "SGD": ".optimizers",
    "AdamW": ".optimizers",
    "Tolerances": ".verify",
    "Lora": ".lora",
    "plan": ".planner",
    "load_into": ".weights",
}

__all__ = [
    "generate",
    "Spec",
    "load_into",
    "Lora",
    "plan",
    "Tolerances",
    "CrossEntropy",
    "MSE",
    "L1",
    "BCEWithLogits",
    "ModelLoss",
    "CustomLoss",
    "AdamW",
    "SGD",
    "ArtifactError",
    "ExportError",
    "InputSpecError",
    "ModelLoadError",
    "OptionError",
    "OutputExistsError",
    "SelectionError",
    "UnsupportedOperatorError",
    "VerificationError",
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
