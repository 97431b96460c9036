"""Update codecs: full float32 weights, or fp16 / int8 (per-tensor scale) deltas to the global weights."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .errors import CodecError

__all__ = ["CODECS", "encode", "decode", "payload_bytes"]

CODECS = ("none", "fp16", "int8")
SCALE = "::scale"


def encode(weights: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], codec: str) -> dict[str, np.ndarray]:
    """The payload a client sends for ``weights`` given the global ``reference`` it started from.

    ``int8`` quantizes each delta tensor symmetrically with scale ``max|delta| / 127`` (sent as
    ``NAME::scale``); decoding is exact to half a step.
    """
    if codec == "none":
        return {k: np.asarray(v, np.float32) for k, v in weights.items()}
    deltas = {k: np.asarray(weights[k], np.float32) - np.asarray(reference[k], np.float32) for k in weights}
    if not all(np.isfinite(d).all() for d in deltas.values()):
        raise CodecError("the update holds NaN/Inf values; it would be refused by the server, so it is not sent.")
    if codec == "fp16":
        return {k: d.astype(np.float16) for k, d in deltas.items()}
    if codec == "int8":
        payload: dict[str, np.ndarray] = {}
        for name, delta in deltas.items():
            peak = float(np.abs(delta).max()) if delta.size else 0.0
            scale = np.float32(peak / 127.0 if peak > 0 else 1.0)
            payload[name] = np.clip(np.rint(delta / scale), -127, 127).astype(np.int8)
            payload[name + SCALE] = np.array([scale], np.float32)
        return payload
    raise CodecError(f"codec must be one of {CODECS}, got {codec!r}.")


def decode(payload: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], codec: str) -> dict[str, np.ndarray]:
    """Full float32 weights from a payload and the global weights the client started from."""
    names = [k for k in payload if not k.endswith(SCALE)]
    unknown = sorted(set(names) - set(reference))
    if unknown:
        raise CodecError(f"payload names parameters the model does not have: {unknown[:5]}.")
    if codec == "none":
        return {k: np.asarray(payload[k], np.float32) for k in names}
    if codec == "fp16":
        return {k: reference[k] + _typed(payload[k], np.float16, k).astype(np.float32) for k in names}
    if codec == "int8":
        out = {}
        for k in names:
            scale = payload.get(k + SCALE)
            if scale is None or np.asarray(scale).shape != (1,):
                raise CodecError(f"int8 payload for {k!r} has no scale.")
            out[k] = reference[k] + _typed(payload[k], np.int8, k).astype(np.float32) * np.float32(scale[0])
        return out
    raise CodecError(f"codec must be one of {CODECS}, got {codec!r}.")


def _typed(array: np.ndarray, dtype: type, name: str) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype != dtype:
        raise CodecError(f"payload tensor {name!r} is {array.dtype}, the codec sends {np.dtype(dtype)}.")
    return array


def payload_bytes(payload: Mapping[str, np.ndarray]) -> int:
    """Bytes of tensor data in a payload (what the codec saves; framing not counted)."""
    return int(sum(np.asarray(v).nbytes for v in payload.values()))
