"""Bundles for phones and browsers: baked learning rate, Ed25519 signatures, verification."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    BridgeError,
    BundleError,
    SignatureError,
)

# Everything else loads on first use, so `import PACKAGE` (and `odt --help`) stays cheap.
_LAZY = {
    "load_trainer": ".bundle",
    "make_bundle": ".bundle",
    "verify_bundle": ".bundle",
    "keygen": ".signing",
}

__all__ = [
    "make_bundle",
    "verify_bundle",
    "load_trainer",
    "keygen",
    "BridgeError",
    "BundleError",
    "SignatureError",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
