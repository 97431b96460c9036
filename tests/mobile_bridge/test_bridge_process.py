"""The bridge as a real process: it survives kill -9 mid-round, and a 400 MB chunked upload costs it nothing."""

from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from federated.processes import free_port
from mobile_bridge import make_bundle

ODT = str(Path(sys.executable).parent / "odt")
SIZE = 17226


@pytest.fixture()
def bridge(digits_artifacts, tmp_path):
    make_bundle(digits_artifacts, tmp_path / "bundle")
    port = free_port()
    env = {**os.environ, "ODT_BRIDGE_SECRET": "relay", "ODT_BRIDGE_ENROLMENT": "enrol"}
    command = [ODT, "bridge", "serve", str(tmp_path / "bundle"), "--port", str(port), "--state", str(tmp_path / "b.db")]
    processes = []

    def start(*extra: str) -> subprocess.Popen:
        process = subprocess.Popen([*command, *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        processes.append(process)
        for _ in range(150):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/openapi.json", timeout=1).close()
                return process
            except OSError:
                time.sleep(0.1)
        raise AssertionError("the bridge did not start")

    yield port, start
    for process in processes:
        process.kill()
        process.wait()


def _call(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request(method, path, body=body, headers=headers or {})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, data


def test_a_bridge_killed_between_pull_and_push_loses_nothing(bridge, digits_artifacts):
    port, start = bridge
    process = start()
    status, data = _call(port, "POST", "/v1/devices", json.dumps({"name": "phone", "enrolment": "enrol"}).encode(),
                         {"Content-Type": "application/json"})  # fmt: skip
    device = {"Authorization": f"Bearer {json.loads(data)['token']}"}
    status, data = _call(port, "GET", "/v1/bundle", headers=device)
    artifacts_sha = json.loads(data)["artifacts_manifest_sha256"]
    task = {"artifacts_sha256": artifacts_sha, "round": 4, "timeout_s": 600,
            "weights_b64": base64.b64encode(np.zeros(SIZE, "<f4").tobytes()).decode()}  # fmt: skip
    relay = {"X-Relay-Secret": "relay", "Content-Type": "application/json"}
    status, data = _call(port, "POST", "/internal/devices/phone/tasks", json.dumps(task).encode(), relay)
    task_id = json.loads(data)["task_id"]
    status, data = _call(port, "GET", "/v1/task", headers=device)  # the device pulled its task...
    assert status == 200 and json.loads(data)["task_id"] == task_id

    os.kill(process.pid, signal.SIGKILL)  # ...and the bridge dies
    process.wait()
    start()

    query = f"/v1/tasks/{task_id}/update?num_examples=7&bundle_sha256={json.loads(data)['bundle_sha256']}"
    status, _ = _call(port, "POST", query, np.full(SIZE, 0.5, "<f4").tobytes(),
                      {**device, "Content-Type": "application/octet-stream"})  # fmt: skip
    assert status == 202  # the same token, the same task
    status, data = _call(port, "GET", f"/internal/tasks/{task_id}/update", headers=relay)
    update = json.loads(data)
    assert status == 200 and update["num_examples"] == 7
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(update["weights_b64"]), "<f4"), 0.5)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_400mb_chunked_upload_is_cut_off_with_bounded_memory(bridge):
    port, start = bridge
    process = start()
    before = _rss(process.pid)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.putrequest("POST", "/v1/devices")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Transfer-Encoding", "chunked")  # no Content-Length to check
    connection.endheaders()
    chunk = b"x" * (1 << 20)
    sent = 0
    try:
        while sent < 400 * (1 << 20):
            connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        connection.send(b"0\r\n\r\n")
    except OSError:  # the bridge stopped reading and closed the connection
        pass
    response = connection.getresponse()
    assert response.status == 413 and b"request body over" in response.read()
    connection.close()
    assert sent < 400 * (1 << 20)  # it did not take the whole upload
    assert _rss(process.pid) - before < 50 * (1 << 20)


def test_forwarded_for_headers_do_not_dodge_the_registration_limit(bridge):
    """60 registrations from one peer, each claiming another X-Forwarded-For address: the peer's own
    address is counted (before, uvicorn trusted the header from loopback: 60 x 403 and no 429)."""
    port, start = bridge
    start()
    statuses = []
    for i in range(60):
        body = json.dumps({"name": f"d{i}", "enrolment": "wrong"}).encode()
        headers = {"Content-Type": "application/json", "X-Forwarded-For": f"10.0.{i // 250}.{i % 250 + 1}"}
        statuses.append(_call(port, "POST", "/v1/devices", body, headers)[0])
    assert statuses[:20] == [403] * 20 and set(statuses[20:]) == {429}


def test_a_body_that_stops_short_is_answered_and_closed(bridge):
    """Content-Length 1000, 10 bytes sent, then silence: a 408 after --body-timeout, not a held connection."""
    import socket

    port, start = bridge
    start("--body-timeout", "1")
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST /v1/devices HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"name": "')  # fmt: skip
        answer = b""
        while chunk := sock.recv(4096):  # until the bridge closes the connection
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"not received within 1 s" in answer


def test_headers_that_never_end_are_cut_off(bridge):
    """A request line, then one header byte a second (slowloris): the connection is closed once
    --body-timeout passes, where it was held for as long as the client kept sending."""
    import socket

    port, start = bridge
    start("--body-timeout", "1")
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"GET /v1/task HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for _ in range(60):  # up to a minute of trickled header bytes
            try:
                sock.sendall(b"X")
                sock.settimeout(1.0)
                closed = sock.recv(4096) == b""
            except socket.timeout:
                continue
            except OSError:  # reset by the bridge
                closed = True
            if closed:
                break
    assert closed, "the bridge kept a connection whose headers never ended"


@pytest.mark.flower
def test_bridge_deploy_stops_with_the_cause_when_its_bridge_dies(digits_artifacts, data_dir, tmp_path, capsys):
    """The port is taken, so the bridge exits at once: before, `odt bridge deploy` still told the user
    to open the page after 30 s; now it stops with the bridge's own last lines, and stops Flower."""
    import socket

    from federated.processes import started_by
    from ondevice.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["bridge", "deploy", "--devices", "1", "--port", str(port), "--artifacts", str(digits_artifacts),
                "--data", str(data_dir), "--out", str(tmp_path / "out"), "--rounds", "1"]  # fmt: skip
        assert main(argv) == 1
    out, err = capsys.readouterr()
    assert "the bridge exited with code" in err and "open http" not in out
    assert started_by(str(tmp_path / "out" / "logs" / "flwr-home")) == []
