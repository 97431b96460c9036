"""Relay mode of the ClientApp: a SuperNode that stands for one phone or browser.

It hands the round's task to the bridge, waits for the device's update until the round's
deadline, and replies to the SuperLink like a Python client would.
"""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context, Message

from federated.codec import encode
from federated.protocol import ARRAYS, CONFIG, flatten, from_arrays, train_reply, unflatten
from federated.task import Settings, manifest_sha256
from ondevice import Manifest

from .errors import BridgeError

__all__ = ["relay_train", "DeviceTimeoutError"]


class DeviceTimeoutError(BridgeError, TimeoutError):
    """The device sent no update before the round's deadline."""


def _call(url: str, secret: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET")
    request.add_header("X-Relay-Secret", secret)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
            return response.status, json.loads(text) if text else None
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        if exc.code in (404, 409, 401, 422):
            raise BridgeError(f"bridge refused the relay ({exc.code}): {detail}") from None
        return exc.code, None
    except urllib.error.URLError as exc:
        raise BridgeError(f"bridge at {url} is not reachable: {exc.reason}") from None


def relay_train(msg: Message, context: Context) -> Message:
    settings = Settings.from_config(context.run_config)
    node = context.node_config
    url = str(node["bridge-url"]).rstrip("/")
    device = str(node["bridge-device"])
    secret = str(node.get("bridge-secret") or os.environ.get("ODT_BRIDGE_SECRET", ""))
    config = msg.content[CONFIG]
    artifacts = Path(str(node.get("artifacts", settings.artifacts)))
    if manifest_sha256(artifacts) != str(config["manifest-sha256"]):
        raise BridgeError(f"relay {device}: its artifacts differ from the server's; copy the server's artifacts.")
    manifest = Manifest.load(artifacts)
    global_weights = from_arrays(msg.content[ARRAYS])
    flat = flatten(manifest, global_weights)
    timeout = max(1.0, settings.round_timeout - 5.0)
    task = {
        "artifacts_sha256": str(config["manifest-sha256"]),
        "round": int(config.get("server-round", 0)),
        "weights_b64": base64.b64encode(flat.tobytes()).decode(),
        "config": {
            "local-epochs": settings.local_epochs,
            "local-steps": settings.local_steps,
            "batch-size": settings.batch_size,
            "lr": settings.lr,
        },
        "timeout_s": timeout,
    }
    _, created = _call(f"{url}/internal/devices/{device}/tasks", secret, task)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, update = _call(f"{url}/internal/tasks/{created['task_id']}/update", secret)
        if status == 200:
            return _reply(
                msg, manifest, update, global_weights, str(config.get("codec", "none")), str(config["manifest-sha256"])
            )
        if status == 410:
            break
        time.sleep(0.5)
    raise DeviceTimeoutError(f"device {device!r} sent no update for round {task['round']} within {timeout:.0f} s")


def _reply(
    msg: Message,
    manifest: Manifest,
    update: dict[str, Any],
    global_weights: dict[str, np.ndarray],
    codec: str,
    sha: str,
) -> Message:
    flat = np.frombuffer(base64.b64decode(update["weights_b64"]), dtype="<f4")
    # weights only: a device trains no BatchNorm statistics, the server pools the Python clients'
    payload = encode(unflatten(manifest, flat), global_weights, codec)
    device = update.get("metrics", {})
    return train_reply(
        msg,
        payload,
        int(update["num_examples"]),
        sha,
        **{
            "train-loss": float(device.get("train-loss", float("nan"))),
            "train-accuracy": float(device.get("train-accuracy", float("nan"))),
            "skipped-steps": int(device.get("skipped-steps", 0)),
        },
    )
