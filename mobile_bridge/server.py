"""The bridge: an HTTP service that lets phones and browsers take part in Flower rounds.

Devices enrol for a token, download the bundle, pull their task (the round's global weights, as
binary float32) and push their update (binary). In a secure round a device's tasks are the SecAgg+
stages (:mod:`mobile_bridge.secagg`): it answers the key stages in JSON and, in place of its
update, pushes its masked vector, so the bridge never holds its update in the clear.

Flower does not talk to devices: each device is represented by a SuperNode whose ClientApp runs
in relay mode (``bridge-device`` in its node config). That relay hands its task to the bridge over
the internal API (loopback, shared secret), waits for the device's update until the round's
deadline, and replies to the SuperLink like any other client.

Nothing is trusted by default: registration needs the enrolment secret or a one-time code from
`odt bridge enroll`; tokens are stored hashed; the token (or relay secret) is checked before a
request body is read; bodies are cut off at a limit that holds for chunked uploads too; error
responses never echo the body; registrations are rate-limited per client. State lives in SQLite
(`store.Store`), so a bridge killed mid-round loses nothing.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import mimetypes
import os
import secrets
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from .bundle import verify_bundle
from .secagg import KEY_STAGES, SecAgg, answer_problem, masked_size, rejected_problem
from .store import Store, Task, Update

__all__ = ["create_app", "BodyGuard"]

MAX_METRICS = 32
REGISTRATIONS_PER_MINUTE = 20
BODY_TIMEOUT = 30.0
"""Seconds a request body may pause between chunks before the bridge answers 408 and closes."""
mimetypes.add_type("text/javascript", ".mjs")
mimetypes.add_type("application/wasm", ".wasm")


class Registration(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$", description="the device id")
    enrolment: str = Field(
        default="",
        max_length=256,
        description="the bridge's enrolment secret, or a one-time code from `odt bridge enroll`",
    )


class Registered(BaseModel):
    device_id: str
    token: str = Field(description="send as `Authorization: Bearer TOKEN` on every other call")


class TaskOut(BaseModel):
    task_id: str
    round: int
    bundle_sha256: str = Field(description="manifest sha256 the update must be trained on")
    weights_url: str | None = Field(
        description="GET it for the global weights: float32 little-endian, manifest order (null: a key stage)"
    )
    weights_size: int
    config: dict[str, float | int | str] = Field(default_factory=dict)
    deadline_unix: float
    secagg: dict[str, Any] | None = Field(
        default=None, description="the SecAgg+ stage to answer in a secure round (see mobile_bridge.secagg)"
    )


class RelayTask(BaseModel):
    artifacts_sha256: str
    round: int
    weights_b64: str = ""
    config: dict[str, float | int | str] = Field(default_factory=dict)
    timeout_s: float = Field(gt=0, le=3600)
    secagg: dict[str, Any] | None = None


def _stage(task: Task) -> str | None:
    return None if task.secagg is None else str(task.secagg["stage"])


def _error(status: int, message: str) -> HTTPException:
    return HTTPException(status_code=status, detail=message)


def check_masked(raw: bytes, size: int) -> None:
    """A masked vector (uint32 little-endian: the weight factor, then the weights): only its length."""
    if len(raw) != 4 * masked_size(size):
        raise _error(422, f"a masked vector must be {masked_size(size)} uint32 values, got {len(raw)} bytes")


def check_weights(raw: bytes, size: int) -> np.ndarray:
    """A float32 little-endian buffer -> array; 422 for the wrong length or non-finite values."""
    if len(raw) != 4 * size:
        raise _error(422, f"weights must be {size} float32 values ({4 * size} bytes), got {len(raw)} bytes")
    weights = np.frombuffer(raw, dtype="<f4")
    if not np.isfinite(weights).all():
        raise _error(422, "weights hold NaN/Inf values")
    return weights


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _error(422, "weights_b64 is not valid base64") from None


def _metrics(text: str) -> dict[str, float]:
    """A device's metrics: a JSON object of at most MAX_METRICS finite numbers, else 422."""
    try:
        values = json.loads(text)
        numbers = {str(k): float(v) for k, v in values.items()} if isinstance(values, dict) else None
        if isinstance(values, dict) and any(isinstance(v, bool) for v in values.values()):
            numbers = None  # true is not a number, though Python would count it as 1
    except (ValueError, TypeError, AttributeError, RecursionError):
        numbers = None
    if numbers is None or len(numbers) > MAX_METRICS or not all(np.isfinite(v) for v in numbers.values()):
        raise _error(422, f"metrics must be a JSON object of at most {MAX_METRICS} finite numbers")
    return numbers


class _TooLarge(BaseException):  # not Exception: FastAPI turns those into a 400 while parsing
    pass


class _Stalled(BaseException):
    pass


class BodyGuard:
    """ASGI middleware: the caller is authenticated from the headers before any body is read, and a
    body is cut off at ``limit`` bytes as it streams in (Content-Length or chunked alike).

    ``authorized(method, path, headers)`` returns ``(status, message)`` to refuse, or the caller's
    device id (None for calls without a device), which endpoints read as ``request.state.device``.
    """

    def __init__(self, app: Any, *, limit: int, authorized: Any, read_timeout: float = BODY_TIMEOUT) -> None:
        self.app, self.limit, self.authorized, self.read_timeout = app, limit, authorized, read_timeout

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        verdict = self.authorized(scope["method"], scope["path"], headers)
        if isinstance(verdict, tuple):
            return await _json(send, *verdict)
        scope.setdefault("state", {})["device"] = verdict
        if int(headers.get("content-length") or 0) > self.limit:
            return await _json(send, 413, f"request body over {self.limit} bytes")
        seen, started, complete = 0, False, False

        async def counted() -> dict[str, Any]:
            nonlocal seen, complete
            if complete:  # the body is in; what follows is waiting for a disconnect (a long download)
                return await receive()
            try:  # a body that stops short of its Content-Length must not hold a connection for ever
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except asyncio.TimeoutError:
                raise _Stalled() from None
            complete = message.get("type") != "http.request" or not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge()
            return message

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                await _json(send, 413, f"request body over {self.limit} bytes")
        except _Stalled:
            if not started:
                await _json(send, 408, f"request body not received within {self.read_timeout:g} s")


ISOLATION_HEADERS = [
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-embedder-policy", b"require-corp"),
]


class CrossOriginIsolated:
    """ASGI middleware: the demo page and its files come with COOP/COEP headers, so the page is
    cross-origin isolated (SharedArrayBuffer, which onnxruntime-web's WASM threads need)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/web"):
            return await self.app(scope, receive, send)

        async def isolated(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *ISOLATION_HEADERS]}
            await send(message)

        await self.app(scope, receive, isolated)


async def _json(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status in (408, 413):
        headers.append((b"connection", b"close"))  # stop the upload instead of draining it
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _RateLimit:
    """At most ``per_minute`` events per key in any 60 s (registrations per client address).

    Keys whose events are all older than a minute are forgotten once ``keep`` keys are held, so
    many addresses cannot grow it without bound.
    """

    def __init__(self, per_minute: int, keep: int = 1024) -> None:
        self.per_minute, self.keep, self.events, self.lock = per_minute, keep, {}, threading.Lock()

    def allow(self, key: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        with self.lock:
            if len(self.events) >= self.keep:
                self.events = {k: t for k, t in self.events.items() if t and now - t[-1] < 60}
            recent = [t for t in self.events.get(key, []) if now - t < 60]
            allowed = len(recent) < self.per_minute
            self.events[key] = recent + [now] if allowed else recent
        return allowed


def _demo_arrays(path: str | Path, bundle: Path) -> dict[str, list]:
    """The demo data, checked against the bundle's manifest once at start (not in every request)."""
    from ondevice import Manifest
    from ondevice.data import check_data, load_npz
    from ondevice.errors import OdtError

    from .errors import BridgeError

    try:
        arrays = check_data(Manifest.load(bundle), load_npz(str(path)))
    except OdtError as exc:
        raise BridgeError(f"--demo-data {path}: {exc}") from None
    return {name: array.ravel().tolist() for name, array in arrays.items()}


def create_app(
    bundle: str | Path,
    *,
    relay_secret: str | None = None,
    enrolment_secret: str | None = None,
    state: str | Path | None = None,
    max_examples: int = 100_000,
    max_body: int | None = None,
    demo_data: str | Path | None = None,
    registrations_per_minute: int = REGISTRATIONS_PER_MINUTE,
    body_timeout: float = BODY_TIMEOUT,
    public_key: str | os.PathLike[str] | None = None,
    skip_signature: bool = False,
) -> FastAPI:
    """The bridge application over a verified bundle directory.

    ``state`` is the SQLite file (default: ``BUNDLE.bridge.db`` beside the bundle);
    ``enrolment_secret`` (default: ``ODT_BRIDGE_ENROLMENT``) lets devices register, as do
    one-time codes from `odt bridge enroll`; ``demo_data`` is an .npz the demo page may train on. A signed
    bundle is served only when its signature verifies against ``public_key`` (or with ``skip_signature``).
    """
    bundle = Path(bundle)
    description = verify_bundle(bundle, public_key, skip_signature=skip_signature)
    demo_arrays = _demo_arrays(demo_data, bundle) if demo_data is not None else None
    store = Store(Path(state) if state else bundle.with_name(f"{bundle.name}.bridge.db"))
    relay_secret = relay_secret or secrets.token_urlsafe(32)
    enrolment = enrolment_secret if enrolment_secret is not None else os.environ.get("ODT_BRIDGE_ENROLMENT", "")
    size = int(description["weights"]["size"])
    sha = str(description["manifest_sha256"])
    limit = max_body or 2 * 4 * size + 65_536  # base64 of one buffer plus JSON (the relay's task)
    registrations = _RateLimit(registrations_per_minute)

    def authorized(method: str, path: str, headers: dict[str, str]) -> tuple[int, str] | str | None:
        if path.startswith("/internal/"):
            if not hmac.compare_digest(headers.get("x-relay-secret", ""), relay_secret):
                return 401, "wrong relay secret"
        elif path.startswith("/v1/") and not (method == "POST" and path == "/v1/devices"):
            token = headers.get("authorization", "").removeprefix("Bearer ").strip()
            found = store.device_of(token) if token else None
            return (
                found if found is not None else (401, "missing or unknown token: register with POST /v1/devices first")
            )
        return None

    app = FastAPI(
        title="ondevice-training bridge",
        version="2",
        description="Phones and browsers join Flower rounds: enrol, get the bundle, pull a task, push an update.",
    )
    app.state.store, app.state.size, app.state.bundle_sha256 = store, size, sha
    app.add_middleware(BodyGuard, limit=limit, authorized=authorized, read_timeout=body_timeout)
    app.add_middleware(CrossOriginIsolated)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes the whole request body back ("input"): only say where and what.
        problems = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()[:10]]
        return JSONResponse({"detail": problems}, status_code=422)

    def device(request: Request, authorization: str = Header(default="")) -> str:
        """The device BodyGuard authenticated (the header parameter documents the scheme in OpenAPI)."""
        return str(request.state.device)

    @app.post("/v1/devices", response_model=Registered, summary="enrol a device and get its token")
    def register(body: Registration, request: Request) -> Registered:
        """The name is the device id its relay SuperNode names in `bridge-device`; `enrolment` is the
        bridge's enrolment secret or a one-time code."""
        # The peer's address (uvicorn rewrites it from X-Forwarded-For only for --trusted-proxy peers).
        client = request.client.host if request.client else "?"
        if not registrations.allow(client):
            raise _error(429, "too many registrations from this address; wait a minute")
        token = secrets.token_urlsafe(24)
        by_secret = bool(enrolment) and hmac.compare_digest(body.enrolment, enrolment)
        refused = "code" if not (by_secret or body.enrolment) else store.enrol(
            body.name, token, None if by_secret else body.enrolment
        )  # fmt: skip
        if refused == "code":
            raise _error(403, "enrolment refused: give the bridge's enrolment secret or an unused code "
                              "from `odt bridge enroll`")  # fmt: skip
        if refused == "name":
            raise _error(409, f"a device named {body.name!r} is registered already; the code was not spent")
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
        if demo_arrays is None:
            raise _error(404, "this bridge was started without --demo-data")
        return demo_arrays

    @app.get("/v1/task", response_model=TaskOut, responses={204: {"description": "no task yet: poll again"}})
    def pull_task(device_id: str = Depends(device)) -> Any:
        task = store.open_task(device_id, time.time())
        if task is None:
            return Response(status_code=204)
        has_weights = bool(task.weights)
        return TaskOut(
            task_id=task.task_id, round=task.round, bundle_sha256=sha,
            weights_url=f"/v1/tasks/{task.task_id}/weights" if has_weights else None,
            weights_size=size if has_weights else 0, config=task.config, deadline_unix=task.deadline,
            secagg=task.secagg,
        )  # fmt: skip

    @app.get("/v1/tasks/{task_id}/weights", summary="the task's global weights: float32 little-endian, binary",
             response_class=Response)  # fmt: skip
    def task_weights(task_id: str, device_id: str = Depends(device)) -> Response:
        task = store.task(task_id)
        if task is None or task.device != device_id:
            raise _error(404, f"no task {task_id!r} for this device")
        return Response(task.weights, media_type="application/octet-stream")

    def open_task(task_id: str, device_id: str) -> Task:
        """The device's task, while its deadline has not passed (404, 409 otherwise)."""
        task = store.task(task_id)
        if task is None or task.device != device_id:
            raise _error(404, f"no task {task_id!r} for this device")
        if task.deadline <= time.time():
            raise _error(409, f"the deadline of round {task.round} has passed; pull the next task")
        return task

    @app.post(
        "/v1/tasks/{task_id}/update",
        status_code=202,
        summary="push the trained weights of a task (float32 little-endian, binary), or in a secure round's "
        "collect stage the masked vector (uint32 little-endian: the weight factor, then the weights)",
    )
    async def push_update(
        task_id: str,
        request: Request,
        num_examples: int,
        bundle_sha256: str,
        metrics: str = "{}",
        rejected: str = "",
        device_id: str = Depends(device),
    ) -> dict[str, str]:
        """Query: `num_examples` (1..max), `bundle_sha256`, `metrics` (a JSON object of at most 32 numbers);
        in a secure round's collect stage, `rejected`: the sources whose shares the device could not
        decrypt (comma-separated node ids)."""
        if bundle_sha256 != sha:
            raise _error(409, "the update was trained on another bundle (bundle_sha256 differs)")
        if not 0 < num_examples <= max_examples:
            raise _error(422, f"num_examples must be in 1..{max_examples}, got {num_examples}")
        values = _metrics(metrics)
        raw = await request.body()
        task = open_task(task_id, device_id)
        if _stage(task) in KEY_STAGES:
            raise _error(409, f"this task is the SecAgg+ {_stage(task)} stage: answer it at /v1/tasks/{task_id}/secagg")
        secagg = None
        if _stage(task) == SecAgg.Stage.COLLECT_MASKED_VECTORS:
            check_masked(raw, size)
            problem = rejected_problem(rejected, task.secagg or {})
            if problem:
                raise _error(422, problem)
            secagg = {"rejected": [n for n in rejected.split(",") if n]}
        elif rejected:
            raise _error(422, "rejected is for a secure round's collect stage only")
        else:
            check_weights(raw, size)
        if not store.put_update(task_id, Update(raw, num_examples, values, bundle_sha256, secagg)):
            raise _error(409, "this task already has an update (replay refused)")
        return {"status": "accepted"}

    @app.post(
        "/v1/tasks/{task_id}/secagg",
        status_code=202,
        summary="answer a secure round's key stage (setup, share_keys, unmask) in JSON, or decline a stage",
    )
    async def answer_stage(task_id: str, request: Request, device_id: str = Depends(device)) -> dict[str, str]:
        """The answer's fields by stage are listed in `mobile_bridge.secagg`; `{"declined": "why"}` leaves
        the round."""
        try:
            answer = json.loads(await request.body())
        except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
            raise _error(422, "the answer must be JSON (of at most a few hundred levels of nesting)") from None
        task = open_task(task_id, device_id)
        if task.secagg is None:
            raise _error(409, f"this task is not a SecAgg+ stage: push its update at /v1/tasks/{task_id}/update")
        problem = answer_problem(str(_stage(task)), answer, task.secagg)
        if problem is not None:
            raise _error(422, problem)
        if not store.put_update(task_id, Update(b"", 0, {}, sha, answer)):
            raise _error(409, "this task already has an answer (replay refused)")
        return {"status": "accepted"}

    @app.post("/internal/devices/{device_id}/tasks", include_in_schema=False)
    def relay_task(device_id: str, body: RelayTask) -> dict[str, str]:
        if body.artifacts_sha256 != description.get("artifacts_manifest_sha256"):
            raise _error(409, "the server trains other artifacts than this bridge's bundle was made from")
        stage = None if body.secagg is None else body.secagg.get("stage")
        if body.secagg is not None and stage not in (*KEY_STAGES, SecAgg.Stage.COLLECT_MASKED_VECTORS):
            raise _error(422, f"unknown SecAgg+ stage {stage!r}")
        raw = _b64(body.weights_b64)
        if stage not in KEY_STAGES:  # key stages carry no weights
            check_weights(raw, size)
        task = Task(uuid.uuid4().hex, device_id, body.round, raw, body.config, time.time() + body.timeout_s,
                    body.secagg)  # fmt: skip
        store.put_task(task)
        return {"task_id": task.task_id}

    @app.get("/internal/tasks/{task_id}/update", include_in_schema=False)
    def relay_update(task_id: str) -> Any:
        task = store.task(task_id)
        if task is None:
            raise _error(404, "unknown task")
        update = store.update(task_id)
        if update is None:
            return Response(status_code=410 if task.deadline <= time.time() else 204)
        return {
            "bundle_sha256": update.bundle_sha256,
            "num_examples": update.num_examples,
            "weights_b64": base64.b64encode(update.weights).decode(),
            "metrics": update.metrics,
            "secagg": update.secagg,
        }

    @app.get("/", include_in_schema=False)
    def home() -> RedirectResponse:
        return RedirectResponse("/web/")

    web = Path(__file__).resolve().parent / "web"
    app.mount("/web", StaticFiles(directory=web, html=True), name="web")
    return app
