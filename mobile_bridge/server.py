"""The bridge: an HTTP service that lets phones and browsers take part in Flower rounds.

Devices register for a token, download the bundle, pull their task (the global weights of the
round) and push their update. Flower does not talk to devices: each device is represented by a
SuperNode whose ClientApp runs in relay mode (``bridge-device`` in its node config). That
ClientApp hands its task to the bridge over the internal API (loopback, shared secret), waits
for the device's update until the round's deadline, and replies to the SuperLink like any other
client, so the ServerApp and strategy aggregate devices and Python clients alike.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import mimetypes
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from .bundle import verify_bundle

__all__ = ["create_app", "BridgeState"]

MAX_METRICS = 32
mimetypes.add_type("text/javascript", ".mjs")
mimetypes.add_type("application/wasm", ".wasm")


class Registration(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$", description="the device id")


class Registered(BaseModel):
    device_id: str
    token: str = Field(description="send as `Authorization: Bearer TOKEN` on every other call")


class TaskOut(BaseModel):
    task_id: str
    round: int
    bundle_sha256: str = Field(description="manifest sha256 the update must be trained on")
    weights_b64: str = Field(description="global weights: float32 little-endian, manifest order, base64")
    config: dict[str, float | int | str] = Field(default_factory=dict)
    deadline_unix: float


class UpdateIn(BaseModel):
    bundle_sha256: str
    num_examples: int = Field(description="examples the device trained on (1..max)")
    weights_b64: str = Field(description="trained weights: float32 little-endian, manifest order, base64")
    metrics: dict[str, float] = Field(default_factory=dict)


class RelayTask(BaseModel):
    artifacts_sha256: str
    round: int
    weights_b64: str
    config: dict[str, float | int | str] = Field(default_factory=dict)
    timeout_s: float = Field(gt=0, le=3600)


@dataclass
class _Task:
    task_id: str
    device_id: str
    round: int
    weights_b64: str
    config: dict[str, Any]
    deadline: float
    update: UpdateIn | None = None


@dataclass
class BridgeState:
    """Devices, pending tasks and received updates, behind one lock (one bridge process)."""

    bundle: Path
    description: dict[str, Any]
    relay_secret: str
    max_examples: int = 100_000
    devices: dict[str, str] = field(default_factory=dict)  # token -> device id
    tasks: dict[str, _Task] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def weights_size(self) -> int:
        return int(self.description["weights"]["size"])

    @property
    def bundle_sha256(self) -> str:
        return str(self.description["manifest_sha256"])


def _error(status: int, message: str) -> HTTPException:
    return HTTPException(status_code=status, detail=message)


def decode_weights(text: str, size: int) -> np.ndarray:
    """Base64 float32 buffer -> array; 422 for the wrong length or non-finite values."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _error(422, "weights_b64 is not valid base64") from None
    if len(raw) != 4 * size:
        raise _error(422, f"weights must be {size} float32 values ({4 * size} bytes), got {len(raw)} bytes")
    weights = np.frombuffer(raw, dtype="<f4")
    if not np.isfinite(weights).all():
        raise _error(422, "weights hold NaN/Inf values")
    return weights


def create_app(
    bundle: str | Path,
    *,
    relay_secret: str | None = None,
    max_examples: int = 100_000,
    max_body: int | None = None,
    demo_data: str | Path | None = None,
) -> FastAPI:
    """The bridge application over a verified bundle directory (``demo_data``: an .npz the demo
    page may train on, served at /v1/demo-data)."""
    bundle = Path(bundle)
    description = verify_bundle(bundle)
    state = BridgeState(bundle, description, relay_secret or secrets.token_urlsafe(32), max_examples)
    limit = max_body or 2 * 4 * state.weights_size + 65_536  # base64 of one buffer plus JSON
    app = FastAPI(
        title="ondevice-training bridge",
        version="1",
        description="Phones and browsers join Flower rounds: register, get the bundle, pull a task, push an update.",
    )
    app.state.bridge = state

    @app.middleware("http")
    async def body_limit(request: Request, call_next: Any) -> Response:
        length = request.headers.get("content-length")
        if length is not None and int(length) > limit:
            return JSONResponse({"detail": f"request body over {limit} bytes"}, status_code=413)
        return await call_next(request)

    def device(authorization: str = Header(default="")) -> str:
        token = authorization.removeprefix("Bearer ").strip()
        with state.lock:
            found = next((d for t, d in state.devices.items() if hmac.compare_digest(t, token)), None)
        if not token or found is None:
            raise _error(401, "missing or unknown token: register with POST /v1/devices first")
        return found

    def relay(x_relay_secret: str = Header(default="")) -> None:
        if not hmac.compare_digest(x_relay_secret, state.relay_secret):
            raise _error(401, "wrong relay secret")

    @app.post("/v1/devices", response_model=Registered, summary="register a device and get its token")
    def register(body: Registration) -> Registered:
        """The name is the device id that its relay SuperNode names in `bridge-device`."""
        token = secrets.token_urlsafe(24)
        with state.lock:
            if body.name in state.devices.values():
                raise _error(409, f"a device named {body.name!r} is registered already")
            state.devices[token] = body.name
        return Registered(device_id=body.name, token=token)

    @app.get("/v1/bundle", summary="the bundle description (bundle.json)")
    def bundle_description(_: str = Depends(device)) -> dict[str, Any]:
        return description

    @app.get("/v1/bundle/{name}", summary="one bundle file (see bundle.json for its sha256)")
    def bundle_file(name: str, _: str = Depends(device)) -> FileResponse:
        allowed = set(description["files"]) | {"bundle.json", "bundle.sig"}
        if name not in allowed or not (bundle / name).is_file():
            raise _error(404, f"no bundle file {name!r}")
        return FileResponse(bundle / name)

    @app.get("/v1/demo-data", summary="the demo page's training data (only with --demo-data)")
    def demo(_: str = Depends(device)) -> dict[str, Any]:
        if demo_data is None:
            raise _error(404, "this bridge was started without --demo-data")
        from ondevice.data import load_npz

        return {name: array.ravel().tolist() for name, array in load_npz(str(demo_data)).items()}

    @app.get("/v1/task", response_model=TaskOut, responses={204: {"description": "no task yet: poll again"}})
    def pull_task(device_id: str = Depends(device)) -> Any:
        with state.lock:
            now = time.time()
            task = next(
                (t for t in state.tasks.values() if t.device_id == device_id and t.update is None and t.deadline > now),
                None,
            )
        if task is None:
            return Response(status_code=204)
        return TaskOut(
            task_id=task.task_id, round=task.round, bundle_sha256=state.bundle_sha256,
            weights_b64=task.weights_b64, config=task.config, deadline_unix=task.deadline,
        )  # fmt: skip

    @app.post("/v1/tasks/{task_id}/update", status_code=202, summary="push the trained weights of a task")
    def push_update(task_id: str, body: UpdateIn, device_id: str = Depends(device)) -> dict[str, str]:
        if body.bundle_sha256 != state.bundle_sha256:
            raise _error(409, "the update was trained on another bundle (bundle_sha256 differs)")
        if not 0 < body.num_examples <= state.max_examples:
            raise _error(422, f"num_examples must be in 1..{state.max_examples}, got {body.num_examples}")
        if len(body.metrics) > MAX_METRICS or not all(np.isfinite(v) for v in body.metrics.values()):
            raise _error(422, f"metrics must be at most {MAX_METRICS} finite numbers")
        decode_weights(body.weights_b64, state.weights_size)
        with state.lock:
            task = state.tasks.get(task_id)
            if task is None or task.device_id != device_id:
                raise _error(404, f"no task {task_id!r} for this device")
            if task.update is not None:
                raise _error(409, "this task already has an update (replay refused)")
            if task.deadline <= time.time():
                raise _error(409, f"the deadline of round {task.round} has passed; pull the next task")
            task.update = body
        return {"status": "accepted"}

    @app.post("/internal/devices/{device_id}/tasks", dependencies=[Depends(relay)], include_in_schema=False)
    def relay_task(device_id: str, body: RelayTask) -> dict[str, str]:
        if body.artifacts_sha256 != state.description.get("artifacts_manifest_sha256"):
            raise _error(409, "the server trains other artifacts than this bridge's bundle was made from")
        decode_weights(body.weights_b64, state.weights_size)
        task = _Task(
            uuid.uuid4().hex, device_id, body.round, body.weights_b64, body.config, time.time() + body.timeout_s
        )
        with state.lock:
            for old in [t for t in state.tasks.values() if t.device_id == device_id]:
                del state.tasks[old.task_id]  # a device works on one round at a time
            state.tasks[task.task_id] = task
        return {"task_id": task.task_id}

    @app.get("/internal/tasks/{task_id}/update", dependencies=[Depends(relay)], include_in_schema=False)
    def relay_update(task_id: str) -> Any:
        with state.lock:
            task = state.tasks.get(task_id)
        if task is None:
            raise _error(404, "unknown task")
        if task.update is None:
            return Response(status_code=410 if task.deadline <= time.time() else 204)
        return task.update.model_dump()

    @app.get("/", include_in_schema=False)
    def home() -> RedirectResponse:
        return RedirectResponse("/web/")

    web = Path(__file__).resolve().parent / "web"
    # The wheel ships web/ort (copied by `make` from the npm lock); a fresh checkout has node_modules only.
    ort_files = next((d for d in (web / "ort", web / "node_modules" / "onnxruntime-web" / "dist") if d.is_dir()), None)
    if ort_files is not None:
        app.mount("/web/ort", StaticFiles(directory=ort_files), name="ort")
    app.mount("/web", StaticFiles(directory=web, html=True), name="web")
    return app
