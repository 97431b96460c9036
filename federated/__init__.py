"""Federated training with Flower over the on-device runtime (ClientApp, ServerApp, runners)."""

from __future__ import annotations

from ondevice.lazy import lazy_exports

from .errors import (
    ArtifactMismatchError,
    CodecError,
    DeployError,
    FederatedError,
    PartitionError,
)

# Everything else loads on first use, so `import PACKAGE` (and `odt --help`) stays cheap.
_LAZY = {
    "CODECS": ".codec",
    "decode": ".codec",
    "encode": ".codec",
    "dirichlet": ".partitions",
    "iid": ".partitions",
    "partition": ".partitions",
    "deploy": ".runner",
    "simulate": ".runner",
    "STRATEGIES": ".strategy",
    "GuardedStrategy": ".strategy",
    "make_strategy": ".strategy",
}

__all__ = [
    "simulate",
    "deploy",
    "make_strategy",
    "GuardedStrategy",
    "STRATEGIES",
    "partition",
    "iid",
    "dirichlet",
    "encode",
    "decode",
    "CODECS",
    "FederatedError",
    "PartitionError",
    "CodecError",
    "ArtifactMismatchError",
    "DeployError",
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
