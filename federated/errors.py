"""Typed errors of the federated layer."""

from __future__ import annotations

from ondevice.errors import OdtError, UsageError

__all__ = [
    "FederatedError",
    "PartitionError",
    "CodecError",
    "ArtifactMismatchError",
    "DeployError",
    "RunConfigError",
    "RoundFailedError",
    "RunFailedError",
]


class FederatedError(OdtError):
    """Base class of every error the federated layer raises on purpose."""


class PartitionError(FederatedError, ValueError):
    """A partitioning request that cannot be met (too many partitions, bad alpha, ...)."""


class CodecError(FederatedError, ValueError):
    """An update payload that does not decode against the global weights."""


class ArtifactMismatchError(FederatedError, ValueError):
    """A node's artifacts differ from the server's (manifest sha256 mismatch)."""


class DeployError(FederatedError, RuntimeError):
    """A SuperLink/SuperNode process could not be started or did not finish the run."""


class RunConfigError(FederatedError, UsageError, ValueError):
    """A run-config key that does not exist, or a value of the wrong type or out of range."""


class RoundFailedError(FederatedError, RuntimeError):
    """A round got no usable update: no replies, fewer than min-nodes, or every client failed."""


class RunFailedError(FederatedError, RuntimeError):
    """A federated run ended without its report: the ServerApp failed (the cause is quoted)."""
