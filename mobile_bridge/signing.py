"""Ed25519 keys and signatures for bundles (PEM files; the browser imports the same SPKI key)."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ondevice.files import atomic_write_bytes

from .errors import SignatureError

__all__ = ["keygen", "sign", "verify"]


def keygen(path: str | os.PathLike[str], *, force: bool = False) -> tuple[Path, Path]:
    """Write a new private key to ``path`` (mode 0600) and its public key to ``path.pub``."""
    private, public = Path(path), Path(f"{path}.pub")
    if not force and (private.exists() or public.exists()):
        raise SignatureError(f"{private} or {public} exists; pass --force to replace the key pair.")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    spki = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        private.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(private, pem, secret=True)
        atomic_write_bytes(public, spki)
    except OSError as exc:
        raise SignatureError(
            f"cannot write the key pair to {private}: {exc.strerror}. Choose a writable --out."
        ) from None
    return private, public


def sign(data: bytes, private_key: str | os.PathLike[str]) -> bytes:
    text = _read(private_key, "private key")
    if b"PUBLIC KEY" in text:
        raise SignatureError(f"{private_key} is a public key; sign with the private key (the file without .pub).")
    try:
        key = serialization.load_pem_private_key(text, password=None)
    except (ValueError, TypeError) as exc:
        raise SignatureError(f"{private_key} is not a PEM private key made by `odt keygen`: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"{private_key} is not an Ed25519 private key (make one with `odt keygen`).")
    return key.sign(data)


def verify(data: bytes, signature: bytes, public_key: str | os.PathLike[str]) -> None:
    """Raise SignatureError unless ``signature`` is the key's signature of ``data``."""
    try:
        key = serialization.load_pem_public_key(_read(public_key, "public key"))
    except ValueError as exc:
        raise SignatureError(f"{public_key} is not a PEM public key: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"{public_key} is not an Ed25519 public key.")
    try:
        key.verify(signature, data)
    except InvalidSignature:
        raise SignatureError(
            "the bundle's signature does not match: it was altered after signing or signed with another key."
        ) from None


def _read(path: str | os.PathLike[str], what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SignatureError(f"cannot read {what} {path}: {exc.strerror}.") from exc
