"""Workstation side: PyTorch model to verified ONNX Runtime training artifacts."""

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
from .generate import generate
from .losses import L1, MSE, BCEWithLogits, CrossEntropy, CustomLoss, ModelLoss
from .optimizers import SGD, AdamW
from .verify import Tolerances

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
