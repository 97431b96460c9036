"""Relay mode of the ClientApp: a SuperNode that stands for one phone or browser.

It hands the round's task to the bridge, waits for the device's update until the round's
deadline, and replies to the SuperLink like a Python client would. In a secure round it hands on
each SecAgg+ stage (:mod:`mobile_bridge.secagg`) and replies with the device's answer: the device
masks its own update, and the relay passes on the masked vector, never the update.
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
from flwr.app import ConfigRecord, Context, Message, RecordDict

from federated.codec import encode
from federated.flower_internals import KEY_CLIPPING_NORM
from federated.pacing import MIN_WAIT
from federated.protocol import ARRAYS, CONFIG, flatten, from_arrays, train_reply, unflatten
from federated.secure_checks import REJECTED
from federated.task import Settings, manifest_sha256
from ondevice import Manifest

from .errors import BridgeError
from .secagg import SecAgg, stage_task, stage_values

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


class _Bridge:
    """The bridge as this relay node sees it: where, which device, the shared secret."""

    def __init__(self, context: Context) -> None:
        node = context.node_config
        self.settings = Settings.from_config(context.run_config)
        self.url = str(node["bridge-url"]).rstrip("/")
        self.device = str(node["bridge-device"])
        self.secret = str(node.get("bridge-secret") or os.environ.get("ODT_BRIDGE_SECRET", ""))
        self.artifacts = Path(str(node.get("artifacts", self.settings.artifacts)))
        # The server waits round-timeout, or at least MIN_WAIT when the wait follows the work (0): reply before.
        self.timeout = max(1.0, (self.settings.round_timeout or MIN_WAIT) - 5.0)

    def sha256(self) -> str:
        try:
            return manifest_sha256(self.artifacts)
        except OSError:
            raise BridgeError(
                f"relay {self.device}: no artifacts at {self.artifacts}; copy the server's artifacts there, or name "
                "them in the node config (artifacts=PATH)."
            ) from None

    def manifest(self, sha: str) -> Manifest:
        if self.sha256() != sha:
            raise BridgeError(
                f"relay {self.device}: its artifacts differ from the server's; copy the server's artifacts."
            )
        return Manifest.load(self.artifacts)

    def exchange(self, task: dict[str, Any], what: str) -> dict[str, Any]:
        """Hand ``task`` to the device and wait for its answer until the deadline."""
        task = {**task, "timeout_s": self.timeout}
        _, created = _call(f"{self.url}/internal/devices/{self.device}/tasks", self.secret, task)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            status, update = _call(f"{self.url}/internal/tasks/{created['task_id']}/update", self.secret)
            if status == 200:
                return update
            if status == 410:
                break
            time.sleep(0.5)
        raise DeviceTimeoutError(
            f"device {self.device!r} sent no {what} for round {task['round']} within {self.timeout:.0f} s"
        )


def _train_config(settings: Settings) -> dict[str, float | int | str]:
    return {
        "local-epochs": settings.local_epochs,
        "local-steps": settings.local_steps,
        "batch-size": settings.batch_size,
        "lr": settings.lr,
    }


def relay_train(msg: Message, context: Context) -> Message:
    if SecAgg.CONFIGS in msg.content.config_records:
        return relay_stage(msg, context)
    bridge = _Bridge(context)
    config = msg.content[CONFIG]
    manifest = bridge.manifest(str(config["manifest-sha256"]))
    global_weights = from_arrays(msg.content[ARRAYS])
    flat = flatten(manifest, global_weights)
    task = {
        "artifacts_sha256": str(config["manifest-sha256"]),
        "round": int(config.get("server-round", 0)),
        "weights_b64": base64.b64encode(flat.tobytes()).decode(),
        "config": _train_config(bridge.settings),
    }
    update = bridge.exchange(task, "update")
    return _reply(
        msg, manifest, update, global_weights, str(config.get("codec", "none")), str(config["manifest-sha256"])
    )


def relay_stage(msg: Message, context: Context) -> Message:
    """One SecAgg+ stage of a secure round, answered by the device behind the bridge."""
    bridge = _Bridge(context)
    configs = msg.content.config_records[SecAgg.CONFIGS]
    stage = str(configs[SecAgg.Key.STAGE])
    node = msg.metadata.dst_node_id
    group = msg.metadata.group_id  # SecureGrid names a round's stages by its number
    task: dict[str, Any] = {"artifacts_sha256": bridge.sha256(),
                            "round": int(group) if group.isdigit() else 0}  # fmt: skip
    if stage != SecAgg.Stage.COLLECT_MASKED_VECTORS:
        task["secagg"] = stage_task(configs, node)
        answer = bridge.exchange(task, f"answer to the {stage} stage").get("secagg")
        return _stage_reply(msg, bridge.device, stage, answer)
    config = msg.content[CONFIG]
    sha = str(config["manifest-sha256"])
    manifest = bridge.manifest(sha)
    global_weights = from_arrays(msg.content[ARRAYS])
    by_name = {p.name: p for p in manifest.trainable}
    if set(global_weights) != set(by_name):
        raise BridgeError(
            f"relay {bridge.device}: a secure round must exchange exactly the trainable weights, the server sent "
            f"{len(global_weights)} arrays for {len(by_name)} trainable tensors."
        )
    order = [(by_name[n].offset, by_name[n].size) for n in sorted(by_name)]  # the order Python clients mask in
    clipping = config.get(KEY_CLIPPING_NORM)
    task.update(
        weights_b64=base64.b64encode(flatten(manifest, global_weights).tobytes()).decode(),
        config=_train_config(bridge.settings),
        secagg=stage_task(configs, node, order=order, clipping_norm=None if clipping is None else float(clipping)),
    )
    update = bridge.exchange(task, "masked update")
    answered = update.get("secagg") or {}
    if "declined" in answered:
        _stage_reply(msg, bridge.device, stage, answered)  # raises: the device left the round
    masked = np.frombuffer(base64.b64decode(update["weights_b64"]), dtype="<u4")
    shapes = [(1,), *(by_name[n].shape for n in sorted(by_name))]
    bounds = np.cumsum([0, *(int(np.prod(s)) for s in shapes)])
    vectors = [masked[a:b].reshape(s) for a, b, s in zip(bounds[:-1], bounds[1:], shapes)]
    reply = train_reply(msg, {}, int(update["num_examples"]), sha, **_device_metrics(update))
    del reply.content[ARRAYS]  # the update left the device masked only
    reply.content[SecAgg.CONFIGS] = ConfigRecord(
        {SecAgg.Key.MASKED_PARAMETERS: [SecAgg.ndarray_to_bytes(v) for v in vectors],
         REJECTED: [int(n) for n in answered.get("rejected", [])]}, False
    )  # fmt: skip
    return reply


def _stage_reply(msg: Message, device: str, stage: str, answer: dict[str, Any] | None) -> Message:
    if not isinstance(answer, dict) or "declined" in answer:
        reason = answer.get("declined") if isinstance(answer, dict) else "no answer"
        raise BridgeError(f"device {device!r} left the secure round at the {stage} stage: {reason}")
    return Message(RecordDict({SecAgg.CONFIGS: ConfigRecord(stage_values(stage, answer), False)}), reply_to=msg)


def _device_metrics(update: dict[str, Any]) -> dict[str, float]:
    device = update.get("metrics", {})
    return {
        "train-loss": float(device.get("train-loss", float("nan"))),
        "train-accuracy": float(device.get("train-accuracy", float("nan"))),
        "skipped-steps": int(device.get("skipped-steps", 0)),
    }


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
    return train_reply(msg, payload, int(update["num_examples"]), sha, **_device_metrics(update))
