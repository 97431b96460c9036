"""On-device runtime: train ONNX Runtime training artifacts with numpy and ORT only (never torch)."""

from __future__ import annotations

from .errors import (
    ArtifactIntegrityError,
    CheckpointCorruptError,
    CheckpointError,
    ConfigError,
    DataError,
    EngineError,
    InUseError,
    ManifestError,
    OdtError,
    OndeviceError,
    OutputRefusedError,
    SchemaVersionError,
    UsageError,
    VersionMismatchError,
    WeightsError,
)
from .lazy import lazy_exports

# Everything else loads on first use, so `import PACKAGE` (and `odt --help`) stays cheap.
_LAZY = {
    "Manifest": ".manifest",
    "Predictor": ".predict",
    "Schedule": ".schedules",
    "lr_at": ".schedules",
    "EarlyStopping": ".stopping",
    "History": ".trainer",
    "StepResult": ".trainer",
    "Trainer": ".trainer",
}

__all__ = [
    "Trainer",
    "StepResult",
    "History",
    "Schedule",
    "lr_at",
    "EarlyStopping",
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
    "CheckpointCorruptError",
    "ConfigError",
    "EngineError",
    "InUseError",
    "OutputRefusedError",
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
