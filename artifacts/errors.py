"""Typed errors of the artifact generator: each names what was expected, what was found and the fix."""

from __future__ import annotations

from ondevice.errors import OdtError, UsageError

__all__ = [
    "ArtifactError",
    "ModelLoadError",
    "InputSpecError",
    "SelectionError",
    "OptionError",
    "UnsupportedOperatorError",
    "ExportError",
    "OutputExistsError",
    "ToleranceError",
    "VerificationError",
]


class ArtifactError(OdtError):
    """Base class of every error the generator raises on purpose."""


class ModelLoadError(ArtifactError, ValueError):
    """The model factory or the weights file cannot be used."""


class InputSpecError(ArtifactError, UsageError, ValueError):
    """An example input is malformed or the model rejects it."""


class SelectionError(ArtifactError, ValueError):
    """The choice of trainable parameters matches nothing or leaves nothing to train."""


class OptionError(ArtifactError, ValueError):
    """A loss or optimizer option that ONNX Runtime training cannot express."""


class UnsupportedOperatorError(ArtifactError, ValueError):
    """An operator on the trained path has no gradient (or no kernel) in ONNX Runtime 1.19."""


class ExportError(ArtifactError, RuntimeError):
    """PyTorch's ONNX export or ORT's artifact generation failed for another reason."""


class OutputExistsError(ArtifactError, FileExistsError):
    """The output directory exists and --force was not given."""


class ToleranceError(ArtifactError, UsageError, ValueError):
    """A verification tolerance that is negative or not finite."""


class VerificationError(ArtifactError, RuntimeError):
    """The generated artifacts disagree with PyTorch beyond tolerance (``.verification`` has the rows)."""

    def __init__(self, message: str, verification: object = None) -> None:
        super().__init__(message)
        self.verification = verification
