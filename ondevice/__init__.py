"""On-device runtime: train ONNX Runtime training artifacts with numpy and ORT only (never torch)."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    ArtifactIntegrityError,
    CheckpointCorruptError,
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

# Everything else loads on first use, so `import PACKAGE` (and `odt --help`) stays cheap.
_LAZY = {
    "Manifest": ".manifest",
    "Predictor": ".predict",
    "Schedule": ".schedules",
    "lr_at": ".schedules",
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
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
