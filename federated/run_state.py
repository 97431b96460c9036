"""A federated run's state after each completed round, so a run killed at round k resumes at k + 1.

``OUTPUT/run-state.npz`` holds the global model (weights and running statistics), the server
strategy's own state (FedAvgM's momentum, FedAdam's moments, the arrays they step from), the
report rows so far and the round number, with a sha256 over all of it. It is written atomically
after every round; resuming checks the digest and the manifest it was made with.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import Strategy

from ondevice.files import atomic_write_bytes

from .errors import FederatedError
from .protocol import from_arrays, to_arrays

__all__ = ["STATE_FILE", "RunState", "save_run_state", "load_run_state", "RunStateError"]

STATE_FILE = "run-state.npz"
_STRATEGY_STATE = ("current_arrays", "momentum_vector", "m_t", "v_t")


class RunStateError(FederatedError, ValueError):
    """A saved run state that cannot be resumed (damaged, or from other artifacts)."""


@dataclass(frozen=True)
class RunState:
    server_round: int
    arrays: dict[str, np.ndarray]
    rows: list[dict[str, Any]]


def _innermost(strategy: Strategy) -> Strategy:
    while hasattr(strategy, "strategy") and isinstance(strategy.strategy, Strategy):  # DP wrappers
        strategy = strategy.strategy
    return strategy


def _strategy_arrays(strategy: Strategy) -> dict[str, np.ndarray]:
    out = {}
    for attr in _STRATEGY_STATE:
        value = getattr(strategy, attr, None)
        if isinstance(value, ArrayRecord):
            out.update({f"strategy/{attr}/record/{k}": v for k, v in from_arrays(value).items()})
        elif isinstance(value, dict):
            out.update({f"strategy/{attr}/dict/{k}": np.asarray(v) for k, v in value.items()})
        elif isinstance(value, list):
            out.update({f"strategy/{attr}/list/{i:06d}": np.asarray(v) for i, v in enumerate(value)})
    return out


def _restore_strategy(strategy: Strategy, arrays: dict[str, np.ndarray]) -> None:
    grouped: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for name, value in arrays.items():
        _, attr, kind, key = name.split("/", 3)
        grouped.setdefault((attr, kind), {})[key] = value
    for (attr, kind), values in grouped.items():
        if kind == "record":
            setattr(strategy, attr, to_arrays(values))
        elif kind == "dict":
            setattr(strategy, attr, values)
        else:
            setattr(strategy, attr, [values[k] for k in sorted(values)])


def _digest(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(arrays):
        value = np.ascontiguousarray(arrays[name])
        digest.update(name.encode() + str(value.dtype).encode() + str(value.shape).encode() + value.tobytes())
    return digest.hexdigest()


def save_run_state(
    out: Path, *, server_round: int, arrays: dict[str, np.ndarray], strategy: Strategy, rows: list[dict[str, Any]],
    manifest_sha256: str,
) -> Path:  # fmt: skip
    """Write the state after ``server_round`` atomically (temp file + fsync + rename)."""
    everything = {**{f"global/{k}": v for k, v in arrays.items()}, **_strategy_arrays(_innermost(strategy))}
    meta = {"round": server_round, "rows": rows, "manifest_sha256": manifest_sha256}
    buffer = io.BytesIO()
    header = json.dumps({**meta, "sha256": _digest(everything, meta)})
    np.savez(buffer, __meta__=np.frombuffer(header.encode(), np.uint8), **everything)
    out.mkdir(parents=True, exist_ok=True)
    path = out / STATE_FILE
    atomic_write_bytes(path, buffer.getvalue())
    return path


def load_run_state(out: Path, strategy: Strategy, manifest_sha256: str) -> RunState | None:
    """The saved state of the run in ``out`` (None if there is none); the strategy's own state is restored."""
    path = out / STATE_FILE
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as archive:
            everything = {k: archive[k] for k in archive.files}
        header = json.loads(everything.pop("__meta__").tobytes().decode())
        meta = {k: header[k] for k in ("round", "rows", "manifest_sha256")}
    except Exception as exc:  # any damage: zip, npy, JSON
        problem = type(exc).__name__
        raise RunStateError(f"{path} is damaged ({problem}); the run cannot resume. Start it again.") from exc
    if header.get("sha256") != _digest(everything, meta):
        raise RunStateError(f"{path} was altered (sha256 differs); the run cannot resume. Start it again.")
    if meta["manifest_sha256"] != manifest_sha256:
        raise RunStateError(f"{path} belongs to a run with other artifacts; resume with the artifacts it used.")
    _restore_strategy(_innermost(strategy), {k: v for k, v in everything.items() if k.startswith("strategy/")})
    arrays = {k.removeprefix("global/"): v for k, v in everything.items() if k.startswith("global/")}
    return RunState(int(meta["round"]), arrays, list(meta["rows"]))
