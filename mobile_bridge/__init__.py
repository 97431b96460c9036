"""Bundles for phones and browsers: baked learning rate, Ed25519 signatures, verification."""

from __future__ import annotations

from ondevice.lazy import lazy_exports

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

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
