"""On-device runtime: train ONNX Runtime training artifacts with numpy and ORT only (never torch)."""

from .errors import (
    ArtifactIntegrityError,
    CheckpointError,
    ConfigError,
    DataError,
    ManifestError,
    OdtError,
    OndeviceError,
    SchemaVersionError,
    UsageError,
    VersionMismatchError,
    WeightsError,
)
from .manifest import Manifest
from .predict import Predictor
from .schedules import Schedule, lr_at
from .trainer import History, StepResult, Trainer

__all__ = [
    "Trainer",
    "StepResult",
    "History",
    "Schedule",
    "lr_at",
    "Manifest",
    "Predictor",
    "OdtError",
    "OndeviceError",
    "UsageError",
    "ManifestError",
    "SchemaVersionError",
    "ArtifactIntegrityError",
    "VersionMismatchError",
    "DataError",
    "WeightsError",
    "CheckpointError",
    "ConfigError",
]
