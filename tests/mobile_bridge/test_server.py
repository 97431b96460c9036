"""The bridge's HTTP API: the device protocol, enrolment and every bad request (4xx, nothing stored)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from mobile_bridge import make_bundle
from mobile_bridge.server import create_app
from mobile_bridge.store import Store

SECRET = "relay-secret-for-tests"
ENROL = "enrolment-secret-for-tests"
SIZE = 17226


@pytest.fixture(scope="module")
def bundle(digits_artifacts, tmp_path_factory):
    path = tmp_path_factory.mktemp("bridge") / "bundle"
    make_bundle(digits_artifacts, path)
    return path


@pytest.fixture()
def api(bundle, tmp_path):
    app = create_app(bundle, relay_secret=SECRET, enrolment_secret=ENROL, max_examples=1000, state=tmp_path / "b.db")
    with TestClient(app) as client:
        yield client


def _b64(values: np.ndarray) -> str:
    return base64.b64encode(np.asarray(values, "<f4").tobytes()).decode()


def _device(api, name="phone-1", enrolment=ENROL) -> dict[str, str]:
    response = api.post("/v1/devices", json={"name": name, "enrolment": enrolment})
    assert response.status_code == 200, response.text
    return {"Authorization": f"Bearer {response.json()['token']}"}


def _task(api, device="phone-1", weights=None) -> str:
    body = {
        "artifacts_sha256": api.app.state.store and _artifacts_sha(api),
        "round": 3,
        "weights_b64": _b64(np.zeros(SIZE) if weights is None else weights),
        "config": {"local-epochs": 1},
        "timeout_s": 60,
    }
    response = api.post(f"/internal/devices/{device}/tasks", json=body, headers={"X-Relay-Secret": SECRET})
    assert response.status_code == 200, response.text
    return response.json()["task_id"]


def _artifacts_sha(api) -> str:
    return api.get("/v1/bundle", headers=_any_device(api)).json()["artifacts_manifest_sha256"]


def _any_device(api) -> dict[str, str]:
    if not hasattr(api, "_probe"):
        api._probe = _device(api, "probe")
    return api._probe


def _push(api, task_id, headers, weights=None, **query):
    params = {"num_examples": 12, "bundle_sha256": api.app.state.bundle_sha256, "metrics": "{}", **query}
    body = np.ones(SIZE, "<f4").tobytes() if weights is None else weights
    return api.post(f"/v1/tasks/{task_id}/update", params=params, content=body, headers=headers)


def test_device_round_trip_with_binary_weights(api):
    headers = _device(api)
    assert api.get("/v1/task", headers=headers).status_code == 204
    weights = np.arange(SIZE, dtype=np.float32)
    task_id = _task(api, weights=weights)
    task = api.get("/v1/task", headers=headers).json()
    assert task["task_id"] == task_id and task["round"] == 3 and task["weights_size"] == SIZE
    binary = api.get(task["weights_url"], headers=headers)
    assert binary.headers["content-type"] == "application/octet-stream"
    np.testing.assert_array_equal(np.frombuffer(binary.content, "<f4"), weights)
    assert api.get("/v1/bundle/checkpoint", headers=headers).status_code == 200
    relay = {"X-Relay-Secret": SECRET}
    assert api.get(f"/internal/tasks/{task_id}/update", headers=relay).status_code == 204
    assert _push(api, task_id, headers, metrics=json.dumps({"train-loss": 0.5})).status_code == 202
    update = api.get(f"/internal/tasks/{task_id}/update", headers=relay).json()
    assert update["num_examples"] == 12 and update["metrics"] == {"train-loss": 0.5}
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(update["weights_b64"]), "<f4"), np.ones(SIZE))


@pytest.mark.parametrize(
    ("change", "status", "message"),
    [
        ({"headers": {}}, 401, "missing or unknown token"),  # no token
        ({"headers": {"Authorization": "Bearer forged"}}, 401, "missing or unknown token"),  # wrong token
        ({"weights": np.ones(10, "<f4").tobytes()}, 422, f"must be {SIZE} float32 values"),  # wrong length
        ({"weights": np.full(SIZE, np.nan, "<f4").tobytes()}, 422, "NaN/Inf"),  # non-finite
        ({"query": {"num_examples": 10**9}}, 422, "num_examples must be in 1..1000"),  # absurd count
        ({"query": {"num_examples": 0}}, 422, "num_examples must be in 1..1000"),  # non-positive count
        ({"query": {"bundle_sha256": "0" * 64}}, 409, "another bundle"),  # other bundle
        ({"query": {"metrics": '{"a": "x"}'}}, 422, "finite numbers"),  # metrics that are not numbers
        ({"query": {"metrics": '{"a": true}'}}, 422, "finite numbers"),  # a boolean is not a number
        ({"query": {"metrics": "[" * 3000}}, 422, "finite numbers"),  # nested past the parser's recursion
        ({"query": {"metrics": json.dumps({str(i): 1 for i in range(40)})}}, 422, "at most 32"),  # too many
        ({"task": "nope"}, 404, "no task"),  # unknown task
    ],
)
def test_bad_updates_are_refused_and_not_stored(api, change, status, message):
    headers = _device(api)
    task_id = _task(api)
    response = _push(api, change.get("task", task_id), change.get("headers", headers), change.get("weights"),
                     **change.get("query", {}))  # fmt: skip
    assert response.status_code == status and message in str(response.json()["detail"]), response.text
    assert api.app.state.store.update(task_id) is None


def test_replayed_update_is_refused(api):
    headers = _device(api)
    task_id = _task(api)
    assert _push(api, task_id, headers).status_code == 202
    again = _push(api, task_id, headers, num_examples=99)
    assert again.status_code == 409 and "replay refused" in again.json()["detail"]
    assert api.app.state.store.update(task_id).num_examples == 12


def test_update_for_an_old_round_is_refused(api):
    headers = _device(api)
    old = _task(api)
    _task(api)  # the next round replaces the device's task
    assert _push(api, old, headers).status_code == 404


@pytest.mark.parametrize(
    ("enrolment", "status"),
    [
        ("", 403),  # no enrolment
        ("guess", 403),  # a wrong secret
        (ENROL, 200),
    ],
)
def test_registration_needs_enrolment(api, enrolment, status):
    response = api.post("/v1/devices", json={"name": "tablet", "enrolment": enrolment})
    assert response.status_code == status, response.text


def test_one_time_codes_work_once_and_tokens_are_stored_hashed(bundle, tmp_path):
    state = tmp_path / "b.db"
    store = Store(state)
    store.add_codes(["code-1"])
    store.close()
    with TestClient(create_app(bundle, relay_secret=SECRET, enrolment_secret="", state=state)) as api:
        first = api.post("/v1/devices", json={"name": "a", "enrolment": "code-1"})
        assert first.status_code == 200
        assert api.post("/v1/devices", json={"name": "b", "enrolment": "code-1"}).status_code == 403
        token = first.json()["token"]
    raw = state.read_bytes() + (tmp_path / "b.db-wal").read_bytes() if (tmp_path / "b.db-wal").exists() else b""
    assert token.encode() not in raw and b"code-1" not in raw


def test_registration_is_rate_limited_per_client(bundle, tmp_path):
    app = create_app(bundle, relay_secret=SECRET, enrolment_secret=ENROL, state=tmp_path / "b.db",
                     registrations_per_minute=3)  # fmt: skip
    with TestClient(app) as api:
        codes = [api.post("/v1/devices", json={"name": f"d{i}", "enrolment": ENROL}).status_code for i in range(5)]
    assert codes == [200, 200, 200, 429, 429]


def test_bodies_are_limited_as_they_stream_and_never_echoed(bundle, tmp_path):
    app = create_app(bundle, relay_secret=SECRET, enrolment_secret=ENROL, max_body=1000, state=tmp_path / "b.db")
    with TestClient(app) as api:
        declared = api.post("/v1/devices", content=b"x" * 5000, headers={"Content-Type": "application/json"})
        assert declared.status_code == 413 and "over 1000 bytes" in declared.json()["detail"]

        def chunks():  # no Content-Length: chunked transfer
            for _ in range(50):
                yield b"y" * 100

        chunked = api.post("/v1/devices", content=chunks(), headers={"Content-Type": "application/json"})
        assert chunked.status_code == 413
        secret_body = json.dumps({"name": "x" * 100, "enrolment": "SECRET-PAYLOAD"})
        invalid = api.post("/v1/devices", content=secret_body, headers={"Content-Type": "application/json"})
        assert invalid.status_code == 422 and "SECRET-PAYLOAD" not in invalid.text and len(invalid.text) < 500


def test_the_token_is_checked_before_the_body_is_read(api):
    seen = []

    def body():
        seen.append(1)
        yield np.ones(SIZE, "<f4").tobytes()

    response = api.post("/v1/tasks/x/update?num_examples=1&bundle_sha256=x", content=body(),
                        headers={"Authorization": "Bearer forged"})  # fmt: skip
    assert response.status_code == 401 and seen == []


def test_relay_needs_the_secret_and_matching_artifacts(api):
    body = {"artifacts_sha256": "f" * 64, "round": 1, "weights_b64": _b64(np.zeros(SIZE)), "timeout_s": 5}
    assert api.post("/internal/devices/x/tasks", json=body, headers={"X-Relay-Secret": "no"}).status_code == 401
    response = api.post("/internal/devices/x/tasks", json=body, headers={"X-Relay-Secret": SECRET})
    assert response.status_code == 409 and "other artifacts" in response.json()["detail"]


def test_duplicate_device_name(api):
    _device(api, "tablet")
    assert api.post("/v1/devices", json={"name": "tablet", "enrolment": ENROL}).status_code == 409
    assert api.post("/v1/devices", json={"name": "bad name!", "enrolment": ENROL}).status_code == 422


def test_the_page_and_its_files_are_served_cross_origin_isolated(api):
    """COOP/COEP on /web (SharedArrayBuffer, which WASM threads need); the API's JSON is unchanged."""
    for path in ("/web/", "/web/odt-web.mjs", "/web/odt-worker.mjs"):
        response = api.get(path)
        assert response.status_code == 200, path
        assert response.headers["cross-origin-opener-policy"] == "same-origin"
        assert response.headers["cross-origin-embedder-policy"] == "require-corp"
    assert "cross-origin-embedder-policy" not in api.get("/openapi.json").headers


def test_a_refused_registration_spends_no_code(bundle, tmp_path):
    """409 (name taken) used to spend the one-time code; now the code still works for another name."""
    state = tmp_path / "b.db"
    store = Store(state)
    store.add_codes(["code-1", "code-2"])
    store.close()
    with TestClient(create_app(bundle, relay_secret=SECRET, enrolment_secret="", state=state)) as api:
        assert api.post("/v1/devices", json={"name": "a", "enrolment": "code-1"}).status_code == 200
        taken = api.post("/v1/devices", json={"name": "a", "enrolment": "code-2"})
        assert taken.status_code == 409 and "not spent" in taken.text
        assert api.post("/v1/devices", json={"name": "b", "enrolment": "code-2"}).status_code == 200
        assert api.post("/v1/devices", json={"name": "c", "enrolment": "code-2"}).status_code == 403


# State files a bridge must refuse at start, and leave as they are (they hold every device's enrolment).
DAMAGED = [
    ("empty", lambda good: b""),
    ("truncated", lambda good: good[: len(good) // 2]),
    ("garbage", lambda good: b"not a database" * 100),
    ("flipped header", lambda good: good[:16] + bytes([good[16] ^ 0xFF]) + good[17:]),
]


@pytest.mark.parametrize("damage", [d for _, d in DAMAGED], ids=[n for n, _ in DAMAGED])
def test_a_damaged_state_database_is_refused_and_kept(bundle, tmp_path, damage):
    from mobile_bridge.errors import BridgeError

    state = tmp_path / "b.db"
    store = Store(state)
    store.add_codes([f"code-{i}" for i in range(200)])  # a few pages
    store.close()
    (tmp_path / "b.db-wal").unlink(missing_ok=True)
    state.write_bytes(damage(state.read_bytes()))
    before = state.read_bytes()
    with pytest.raises(BridgeError, match="is damaged .*left as it is"):
        create_app(bundle, relay_secret=SECRET, enrolment_secret=ENROL, state=state)
    assert state.read_bytes() == before


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_a_state_path_that_cannot_be_a_database_is_a_typed_error(bundle, tmp_path, where):
    from mobile_bridge.errors import BridgeError

    (tmp_path / "file").write_text("")
    state = tmp_path if where == "a directory" else tmp_path / "file" / "b.db"
    with pytest.raises(BridgeError, match="is not a file|cannot open bridge state"):
        create_app(bundle, relay_secret=SECRET, enrolment_secret=ENROL, state=state)


def test_garbage_demo_data_is_refused_at_start(bundle, tmp_path):
    from mobile_bridge.errors import BridgeError

    (tmp_path / "demo.npz").write_bytes(b"garbage")
    with pytest.raises(BridgeError, match="--demo-data .* is not an .npz archive"):
        create_app(bundle, relay_secret=SECRET, state=tmp_path / "b.db", demo_data=tmp_path / "demo.npz")


def test_the_rate_limiter_forgets_quiet_addresses():
    from mobile_bridge.server import _RateLimit

    limit = _RateLimit(2, keep=100)
    assert all(limit.allow(f"10.0.0.{i}", now=0.0) for i in range(5000))  # a crowd within one minute...
    assert len(limit.events) == 5000  # all still recent: none may be forgotten yet
    assert [limit.allow("a", now=1.0), limit.allow("a", now=2.0), limit.allow("a", now=3.0)] == [True, True, False]
    limit.allow("b", now=120.0)  # ...a minute later only the recent ones are held
    assert set(limit.events) == {"b"}
    assert limit.allow("a", now=121.0)


def test_the_body_timeout_ends_with_the_body():
    """BodyGuard times out a stalled request body, but not an app that, the body read, waits for the
    client's disconnect while it streams a long response (as Starlette's StreamingResponse does)."""
    import asyncio

    from mobile_bridge.server import BodyGuard

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        assert (await receive())["body"] == b"{}"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        assert (await receive())["type"] == "http.disconnect"  # arrives 0.3 s later: over the 0.1 s limit
        await send({"type": "http.response.body", "body": b"done"})

    async def client() -> list[dict]:
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            await asyncio.sleep(0.3)
            return {"type": "http.disconnect"}

        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        guard = BodyGuard(app, limit=1000, authorized=lambda *a: None, read_timeout=0.1)
        await guard({"type": "http", "method": "POST", "path": "/v1/x", "headers": []}, receive, send)
        return sent

    sent = asyncio.run(client())
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [200]
    assert sent[-1]["body"] == b"done"


# -- secure rounds: the SecAgg+ stages through the bridge -----------------------------------------


def _stage(api, secagg: dict, device="phone-1", weights=None) -> str:
    body = {"artifacts_sha256": _artifacts_sha(api), "round": 4, "timeout_s": 60, "secagg": secagg}
    if weights is not None:
        body["weights_b64"] = _b64(weights)
    response = api.post(f"/internal/devices/{device}/tasks", json=body, headers={"X-Relay-Secret": SECRET})
    assert response.status_code == 200, response.text
    return response.json()["task_id"]


def _answer(api, task_id, headers, answer):
    return api.post(f"/v1/tasks/{task_id}/secagg", content=json.dumps(answer), headers=headers)


NODE, PEER = str(2**64 - 5), "17"  # node ids beyond 2^53 travel as decimal strings
SHARE_KEYS = {"stage": "share_keys", "node": NODE, "keys": [[NODE, "YQ==", "Yg=="], [PEER, "Yw==", "ZA=="]]}
UNMASK = {"stage": "unmask", "node": NODE, "active": [NODE, PEER], "dead": []}
PROVE = {"stage": "odt-prove", "node": NODE, "accusers": [PEER]}


def _pem_keys() -> list[str]:
    """Two real SecAgg+ public keys (PEM, SECP384R1), as base64."""
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

    return [base64.b64encode(public_key_to_bytes(generate_key_pairs()[1])).decode() for _ in range(2)]


def _token() -> str:
    from cryptography.fernet import Fernet

    return base64.b64encode(Fernet(Fernet.generate_key()).encrypt(b"shares" * 50)).decode()


def _shares(count: int = 2) -> list[str]:
    from flwr.common.secure_aggregation.crypto.shamir import create_shares

    return [base64.b64encode(s).decode() for s in create_shares(bytes(32), 2, count)]


def test_a_secure_rounds_stages_pass_through_the_bridge(api):
    headers, relay = _device(api), {"X-Relay-Secret": SECRET}
    setup = {"stage": "setup", "node": NODE, "sample_num": 2, "share_num": 2, "threshold": 2}
    task_id = _stage(api, setup)
    task = api.get("/v1/task", headers=headers).json()
    assert task["secagg"] == setup and task["weights_url"] is None and task["weights_size"] == 0
    assert _push(api, task_id, headers).status_code == 409  # a key stage takes no weights
    pk1, pk2 = _pem_keys()
    keys = {"pk1": pk1, "pk2": pk2}
    assert _answer(api, task_id, headers, keys).status_code == 202
    assert api.get(f"/internal/tasks/{task_id}/update", headers=relay).json()["secagg"] == keys
    assert _answer(api, task_id, headers, keys).status_code == 409  # replay

    shared = _stage(api, SHARE_KEYS)
    answer = {"destinations": [PEER], "ciphertexts": [_token()], "ephemeral": [pk1]}
    assert _answer(api, shared, headers, answer).status_code == 202
    prove = _stage(api, PROVE)
    assert _answer(api, prove, headers, {"secrets": [SECRET_KEY]}).status_code == 202
    assert api.get(f"/internal/tasks/{prove}/update", headers=relay).json()["secagg"] == {"secrets": [SECRET_KEY]}
    unmask = _stage(api, UNMASK)
    assert _answer(api, unmask, headers, {"nodes": [NODE, PEER], "shares": _shares()}).status_code == 202

    collect = {"stage": "collect_masked_vectors", "node": NODE, "sources": [PEER], "ciphertexts": ["dA=="],
               "ephemeral": [pk1], "order": [[0, SIZE]], "clipping_norm": None}  # fmt: skip
    masked_task = _stage(api, collect, weights=np.arange(SIZE, dtype=np.float32))
    task = api.get("/v1/task", headers=headers).json()
    assert task["secagg"] == collect and task["weights_size"] == SIZE
    masked = np.random.default_rng(0).integers(0, 2**32, SIZE + 1, dtype=np.uint64).astype("<u4")
    assert _push(api, masked_task, headers, np.ones(SIZE, "<f4").tobytes()).status_code == 422  # not a masked vector
    for rejected, why in [("18", "rejected names node 18"), (f"{PEER},{PEER}", "each once"), ("x", "node ids")]:
        response = _push(api, masked_task, headers, masked.tobytes(), rejected=rejected)
        assert response.status_code == 422 and why in response.json()["detail"], response.text
    assert _push(api, masked_task, headers, masked.tobytes(), rejected=PEER).status_code == 202
    update = api.get(f"/internal/tasks/{masked_task}/update", headers=relay).json()
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(update["weights_b64"]), "<u4"), masked)
    assert update["secagg"] == {"rejected": [PEER]}  # the relay reports the sources it could not decrypt
    plain = _task(api)
    assert _push(api, plain, headers, rejected=PEER).status_code == 422  # only a collect stage rejects

    plain = _task(api)  # a plain task is not answered in JSON
    assert _answer(api, plain, headers, {"declined": "no"}).status_code == 409


PK1, PK2 = _pem_keys()
TOKEN, SHARES = _token(), _shares()
SECRET_KEY = base64.b64encode(b"-----BEGIN PRIVATE KEY-----\nMIG2\n-----END PRIVATE KEY-----\n").decode()


def _rsa_pem() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key()
    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(pem).decode()


SETUP = {"stage": "setup", "node": NODE, "sample_num": 2, "share_num": 2, "threshold": 2}


def _sent(answer: dict) -> dict:
    """A share_keys answer with a one-off public key beside each ciphertext."""
    ciphertexts = answer.get("ciphertexts")
    return {**answer, "ephemeral": [PK1] * len(ciphertexts)} if isinstance(ciphertexts, list) else answer


@pytest.mark.parametrize(
    ("stage", "answer", "message"),
    [
        (SHARE_KEYS, [1, 2], "JSON object"),
        (SHARE_KEYS, {"destinations": [PEER]}, "exactly ['ciphertexts', 'destinations', 'ephemeral']"),
        (SHARE_KEYS, {"destinations": [PEER], "ciphertexts": [TOKEN], "ephemeral": [TOKEN]}, "not a PEM public key"),
        (PROVE, {"secrets": []}, "secrets must hold 1 keys"),
        (PROVE, {"secrets": [SECRET_KEY] * 2}, "more than the 1 nodes"),
        (PROVE, {"keys": [SECRET_KEY]}, "exactly ['secrets']"),
        (SHARE_KEYS, _sent({"destinations": [PEER], "ciphertexts": [TOKEN], "extra": 1}), "exactly"),
        (SHARE_KEYS, _sent({"destinations": [PEER], "ciphertexts": ["not base64!"]}), "ciphertexts must be base64"),
        (SHARE_KEYS, _sent({"destinations": [17], "ciphertexts": [TOKEN]}), "node ids as decimal strings"),  # a number
        (SHARE_KEYS, _sent({"destinations": [str(2**64)], "ciphertexts": [TOKEN]}), "node ids as decimal strings"),
        (SHARE_KEYS, _sent({"destinations": [PEER] * 3, "ciphertexts": [TOKEN] * 3}), "more than the 2 nodes"),
        (SHARE_KEYS, _sent({"destinations": [PEER], "ciphertexts": [TOKEN, TOKEN]}), "lists of the same length"),
        (SHARE_KEYS, _sent({"destinations": [PEER], "ciphertexts": ["YQ" * 4000]}), "base64"),  # longer than any token
        (SHARE_KEYS, {"declined": "x" * 301}, "at most 300"),
        # what the server would refuse too: the protocol, not only the types
        (SHARE_KEYS, _sent({"destinations": [PEER, PEER], "ciphertexts": [TOKEN] * 2}), "more than once"),
        (SHARE_KEYS, _sent({"destinations": ["18"], "ciphertexts": [TOKEN]}), "not one of the 1 peers"),
        (SHARE_KEYS, _sent({"destinations": [], "ciphertexts": []}), "sent no shares to node 17"),
        (SHARE_KEYS, _sent({"destinations": [PEER], "ciphertexts": ["YQ=="]}), "a ciphertext that is not"),
        (SHARE_KEYS, _sent({"destinations": [PEER], "ciphertexts": [base64.b64encode(b"YWJj").decode()]}),
         "not a Fernet"),
        (SETUP, {"pk1": base64.b64encode(b"key one").decode(), "pk2": PK2}, "pk1: not a PEM public key"),
        (SETUP, {"pk1": PK1, "pk2": _rsa_pem()}, "pk2: not a secp384r1 key"),
        (SETUP, {"pk1": PK1, "pk2": PK1}, "the same"),
        (UNMASK, {"nodes": [PEER, NODE], "shares": SHARES}, "nodes must list the task's active nodes"),
        (UNMASK, {"nodes": [NODE], "shares": SHARES[:1]}, "nodes must list"),
        (UNMASK, {"nodes": [NODE, PEER], "shares": [SHARES[0], base64.b64encode(b"abc").decode()]}, "a share of 3"),
        (SHARE_KEYS, json.loads("[" * 90 + "]" * 90), "JSON object"),
    ],
)  # fmt: skip
def test_hostile_stage_answers_are_refused_and_not_stored(api, stage, answer, message):
    headers = _device(api)
    task_id = _stage(api, stage)
    response = _answer(api, task_id, headers, answer)
    assert response.status_code == 422 and message in response.json()["detail"], response.text
    assert api.app.state.store.update(task_id) is None


def test_any_stage_may_be_declined(api):
    headers = _device(api)
    collect = {"stage": "collect_masked_vectors", "node": NODE, "sources": [], "ciphertexts": [], "order": [],
               "clipping_norm": None}  # fmt: skip
    task_id = _stage(api, collect, weights=np.zeros(SIZE, np.float32))
    assert _answer(api, task_id, headers, {"destinations": [], "ciphertexts": []}).status_code == 422
    assert _answer(api, task_id, headers, {"declined": "joined after the setup"}).status_code == 202
    assert api.app.state.store.update(task_id).secagg == {"declined": "joined after the setup"}


def test_json_nested_thousands_deep_is_refused_not_a_500(api):
    headers = _device(api)
    task_id = _stage(api, SHARE_KEYS)
    response = api.post(f"/v1/tasks/{task_id}/secagg", content="[" * 30_000 + "]" * 30_000, headers=headers)
    assert response.status_code == 422 and "nesting" in response.json()["detail"]
    assert api.app.state.store.update(task_id) is None


def test_the_relay_cannot_send_an_unknown_stage(api):
    body = {"artifacts_sha256": _artifacts_sha(api), "round": 1, "timeout_s": 5, "secagg": {"stage": "reveal-all"}}
    response = api.post("/internal/devices/phone-1/tasks", headers={"X-Relay-Secret": SECRET}, json=body)
    assert response.status_code == 422 and "unknown SecAgg+ stage" in response.json()["detail"]


def test_a_state_file_from_before_secure_rounds_opens_with_its_devices(tmp_path):
    import sqlite3

    from mobile_bridge.store import Task, digest

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:  # the first release's schema
        db.executescript("""
            CREATE TABLE devices (name TEXT PRIMARY KEY, token_sha256 TEXT UNIQUE NOT NULL, created REAL NOT NULL);
            CREATE TABLE codes (code_sha256 TEXT PRIMARY KEY, used_by TEXT, created REAL NOT NULL);
            CREATE TABLE tasks (task_id TEXT PRIMARY KEY, device TEXT NOT NULL, round INTEGER NOT NULL,
                weights BLOB NOT NULL, config TEXT NOT NULL, deadline REAL NOT NULL);
            CREATE TABLE updates (task_id TEXT PRIMARY KEY REFERENCES tasks (task_id) ON DELETE CASCADE,
                weights BLOB NOT NULL, num_examples INTEGER NOT NULL, metrics TEXT NOT NULL,
                bundle_sha256 TEXT NOT NULL, received REAL NOT NULL);
        """)
        db.execute("INSERT INTO devices VALUES ('phone-1', ?, 0)", (digest("token-1"),))
        db.execute("INSERT INTO tasks VALUES ('t1', 'phone-1', 1, x'00', '{}', 1e12)")
    store = Store(path)
    assert store.device_of("token-1") == "phone-1"
    assert store.task("t1") == Task("t1", "phone-1", 1, b"\x00", {}, 1e12, None)
    store.put_task(Task("t2", "phone-1", 2, b"", {}, 1e12, {"stage": "setup"}))
    assert store.open_task("phone-1", 0).secagg == {"stage": "setup"}
    store.close()


def test_a_declined_stage_fails_the_relay_with_the_devices_reason():
    """The relay turns a device's decline (or a missing answer) into an error: its node leaves the round."""
    from flwr.app import ConfigRecord, Message, RecordDict

    from federated.flower_internals import SecAgg, act_as_server_app
    from mobile_bridge.errors import BridgeError
    from mobile_bridge.relay import _stage_reply

    act_as_server_app()
    task = Message(RecordDict({SecAgg.CONFIGS: ConfigRecord({"stage": "unmask"})}), dst_node_id=3, message_type="train")
    with pytest.raises(BridgeError, match="'phone-1' left the secure round at the unmask stage: page reloaded"):
        _stage_reply(task, "phone-1", "unmask", {"declined": "page reloaded"})
    with pytest.raises(BridgeError, match="no answer"):
        _stage_reply(task, "phone-1", "unmask", None)
    answer = {"nodes": [NODE], "shares": [base64.b64encode(b"share").decode()]}
    reply = _stage_reply(task, "phone-1", "unmask", answer).content.config_records[SecAgg.CONFIGS]
    assert reply[SecAgg.Key.NODE_ID_LIST] == [2**64 - 5] and reply[SecAgg.Key.SHARE_LIST] == [b"share"]
