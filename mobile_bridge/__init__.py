"""Bundles for phones and browsers: baked learning rate, Ed25519 signatures, verification."""

from .bundle import load_trainer, make_bundle, verify_bundle
from .errors import BridgeError, BundleError, SignatureError
from .signing import keygen

__all__ = [
    "make_bundle",
    "verify_bundle",
    "load_trainer",
    "keygen",
    "BridgeError",
    "BundleError",
    "SignatureError",
]
