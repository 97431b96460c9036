"""The bridge's HTTP API: the device protocol and every bad request (4xx + JSON, nothing stored)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from fastapi.testclient import TestClient

from mobile_bridge import make_bundle
from mobile_bridge.server import create_app

SECRET = "relay-secret-for-tests"


@pytest.fixture(scope="module")
def bundle(digits_artifacts, tmp_path_factory):
    path = tmp_path_factory.mktemp("bridge") / "bundle"
    make_bundle(digits_artifacts, path)
    return path


@pytest.fixture()
def api(bundle):
    with TestClient(create_app(bundle, relay_secret=SECRET, max_examples=1000)) as client:
        yield client


def _b64(values: np.ndarray) -> str:
    return base64.b64encode(np.asarray(values, "<f4").tobytes()).decode()


def _device(api, name="phone-1") -> dict[str, str]:
    token = api.post("/v1/devices", json={"name": name}).json()["token"]
    return {"Authorization": f"Bearer {token}"}


def _task(api, device="phone-1", weights=None) -> str:
    body = {
        "artifacts_sha256": api.app.state.bridge.description["artifacts_manifest_sha256"],
        "round": 3,
        "weights_b64": _b64(np.zeros(17226) if weights is None else weights),
        "config": {"local-epochs": 1},
        "timeout_s": 60,
    }
    response = api.post(f"/internal/devices/{device}/tasks", json=body, headers={"X-Relay-Secret": SECRET})
    assert response.status_code == 200, response.text
    return response.json()["task_id"]


def _update(api, **overrides) -> dict:
    state = api.app.state.bridge
    return {"bundle_sha256": state.bundle_sha256, "num_examples": 12, "weights_b64": _b64(np.ones(17226)), **overrides}


def test_device_round_trip(api):
    headers = _device(api)
    assert api.get("/v1/task", headers=headers).status_code == 204
    weights = np.arange(17226, dtype=np.float32)
    task_id = _task(api, weights=weights)
    task = api.get("/v1/task", headers=headers).json()
    assert task["task_id"] == task_id and task["round"] == 3
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(task["weights_b64"]), "<f4"), weights)
    assert api.get("/v1/bundle/checkpoint", headers=headers).status_code == 200
    assert api.get("/v1/bundle", headers=headers).json()["weights"]["size"] == 17226
    relay = {"X-Relay-Secret": SECRET}
    assert api.get(f"/internal/tasks/{task_id}/update", headers=relay).status_code == 204
    assert api.post(f"/v1/tasks/{task_id}/update", json=_update(api), headers=headers).status_code == 202
    update = api.get(f"/internal/tasks/{task_id}/update", headers=relay).json()
    assert update["num_examples"] == 12
    assert "/v1/tasks/{task_id}/update" in api.get("/openapi.json").json()["paths"]


@pytest.mark.parametrize(
    ("change", "status", "message"),
    [
        ({"headers": {}}, 401, "missing or unknown token"),  # no token
        ({"headers": {"Authorization": "Bearer forged"}}, 401, "missing or unknown token"),  # wrong token
        ({"body": {"weights_b64": _b64(np.ones(10))}}, 422, "must be 17226 float32 values"),  # wrong length
        ({"body": {"weights_b64": _b64(np.full(17226, np.nan))}}, 422, "NaN/Inf"),  # non-finite
        ({"body": {"weights_b64": "***"}}, 422, "not valid base64"),  # garbage
        ({"body": {"num_examples": 10**9}}, 422, "num_examples must be in 1..1000"),  # absurd count
        ({"body": {"num_examples": 0}}, 422, "num_examples must be in 1..1000"),  # non-positive count
        ({"body": {"bundle_sha256": "0" * 64}}, 409, "another bundle"),  # other bundle
        ({"task": "nope"}, 404, "no task"),  # unknown task
    ],
)
def test_bad_updates_are_refused_and_not_stored(api, change, status, message):
    headers = _device(api)
    task_id = _task(api)
    response = api.post(
        f"/v1/tasks/{change.get('task', task_id)}/update",
        json=_update(api, **change.get("body", {})),
        headers=change.get("headers", headers),
    )
    assert response.status_code == status and message in response.json()["detail"], response.text
    assert api.app.state.bridge.tasks[task_id].update is None


def test_replayed_update_is_refused(api):
    headers = _device(api)
    task_id = _task(api)
    assert api.post(f"/v1/tasks/{task_id}/update", json=_update(api), headers=headers).status_code == 202
    again = api.post(f"/v1/tasks/{task_id}/update", json=_update(api, num_examples=99), headers=headers)
    assert again.status_code == 409 and "replay refused" in again.json()["detail"]
    assert api.app.state.bridge.tasks[task_id].update.num_examples == 12


def test_update_for_an_old_round_is_refused(api):
    headers = _device(api)
    old = _task(api)
    _task(api)  # the next round replaces the device's task
    response = api.post(f"/v1/tasks/{old}/update", json=_update(api), headers=headers)
    assert response.status_code == 404


def test_oversized_request_is_refused(bundle):
    with TestClient(create_app(bundle, relay_secret=SECRET, max_body=1000)) as api:
        response = api.post("/v1/devices", content=b"x" * 5000, headers={"Content-Type": "application/json"})
        assert response.status_code == 413 and "over 1000 bytes" in response.json()["detail"]


def test_relay_needs_the_secret_and_matching_artifacts(api):
    body = {"artifacts_sha256": "f" * 64, "round": 1, "weights_b64": _b64(np.zeros(17226)), "timeout_s": 5}
    assert api.post("/internal/devices/x/tasks", json=body, headers={"X-Relay-Secret": "no"}).status_code == 401
    response = api.post("/internal/devices/x/tasks", json=body, headers={"X-Relay-Secret": SECRET})
    assert response.status_code == 409 and "other artifacts" in response.json()["detail"]


def test_duplicate_device_name(api):
    _device(api, "tablet")
    assert api.post("/v1/devices", json={"name": "tablet"}).status_code == 409
    assert api.post("/v1/devices", json={"name": "bad name!"}).status_code == 422
