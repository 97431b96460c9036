"""Federated training with Flower over the on-device runtime (ClientApp, ServerApp, runners)."""

from __future__ import annotations

import importlib
from typing import Any

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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
