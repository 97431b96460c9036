"""Typed errors of the on-device runtime: each says what was expected, what was found, what to do."""

from __future__ import annotations

__all__ = [
    "OdtError",
    "UsageError",
    "OndeviceError",
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
    "OutputRefusedError",
    "InUseError",
]


class OdtError(Exception):
    """Root of every error the SDK raises on purpose; the CLI shows these as one line."""


class UsageError(OdtError):
    """The caller asked for something invalid (an option, a format, a value): the CLI exits 2."""


class OndeviceError(OdtError):
    """Base class of every error the runtime raises on purpose."""


class ManifestError(OndeviceError, ValueError):
    """The manifest is missing, unreadable or does not describe a valid artifact directory."""


class SchemaVersionError(ManifestError):
    """The manifest was written by a newer (or unknown) schema than this runtime reads."""


class ArtifactIntegrityError(OndeviceError, ValueError):
    """An artifact file is missing or its bytes differ from the sha256 the manifest recorded."""


class VersionMismatchError(OndeviceError, RuntimeError):
    """The installed ONNX Runtime cannot run artifacts made for another version."""


class DataError(OndeviceError, ValueError):
    """Training or evaluation data does not match the manifest (names, dtypes, shapes, values)."""


class WeightsError(OndeviceError, ValueError):
    """Weights handed to the trainer have the wrong names, length, shape or non-finite values."""


class CheckpointError(OndeviceError, ValueError):
    """A checkpoint is missing, truncated, from other artifacts, or cannot be written."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's bytes are not what was saved (truncated, altered, no header): refused."""


class ConfigError(OndeviceError, UsageError, ValueError):
    """An option is out of range or of the wrong kind (epochs, batch size, learning rate, schedule)."""


class EngineError(OndeviceError, RuntimeError):
    """The engine asked for cannot run here or these artifacts lack its graphs (the message says which to use)."""


class OutputRefusedError(OndeviceError, UsageError, FileExistsError):
    """An --out that odt must not write: it exists and odt did not write it, or it is a link, a device,
    the artifact directory or the working directory."""


class InUseError(OndeviceError, RuntimeError):
    """Another odt process holds what this one needs (a checkpoint being written, artifacts being
    replaced or trained, a federated run's output); the message names its pid."""
