"""Workstation side: PyTorch model to verified ONNX Runtime training artifacts."""

from __future__ import annotations

import importlib
from typing import Any

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
    "L1": ".losses",
    "MSE": ".losses",
    "BCEWithLogits": ".losses",
    "CrossEntropy": ".losses",
    "CustomLoss": ".losses",
    "ModelLoss": ".losses",
    "SGD": ".optimizers",
    "AdamW": ".optimizers",
    "Tolerances": ".verify",
}

__all__ = [
    "generate",
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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
