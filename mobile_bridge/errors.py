"""Typed errors of the mobile bridge."""

from __future__ import annotations

from ondevice.errors import OdtError, UsageError

__all__ = ["BridgeError", "BridgeOptionError", "BundleError", "SignatureError"]


class BridgeError(OdtError):
    """Base class of every error the mobile bridge raises on purpose."""


class BundleError(BridgeError, ValueError):
    """A bundle cannot be built or read (missing files, hashes that do not match)."""


class SignatureError(BundleError):
    """A bundle is unsigned, signed by another key, or altered after signing."""


class BridgeOptionError(BridgeError, UsageError, ValueError):
    """A bridge option out of range (a port, a code count, a timeout)."""
