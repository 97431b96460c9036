"""A real Flower round with two Python SuperNodes and a browser behind the bridge (relay SuperNode).

The aggregate must equal the numpy weighted average of the three updates.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from federated.processes import ProcessGroup, flower_env, free_port, started_by
from federated.task import Settings, local_epochs, node_data
from mobile_bridge import make_bundle

from . import WEB, deploy_with_browser, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.flower]


def test_browser_joins_a_flower_round_next_to_python_clients(digits_artifacts, data_dir, tmp_path):
    """`odt bridge deploy --devices 1 --nodes 2`: a real deployment whose round a headless browser joins."""
    port = free_port()
    odt = str(Path(sys.executable).parent / "odt")
    out = tmp_path / "out"
    command = [
        odt, "bridge", "deploy", "--devices", "1", "--nodes", "2", "--port", str(port), "--rounds", "1",
        "--artifacts", str(digits_artifacts), "--data", str(data_dir), "--out", str(out), "--round-timeout", "150",
        "--set", "save-updates=true",
    ]  # fmt: skip
    settings = Settings.from_config({"data": str(data_dir)})
    device_data, _ = node_data(settings, {"partition-id": 0, "num-partitions": 2}, str(digits_artifacts))
    task = {
        "module": "/web/odt-web.mjs",
        "ortBase": "/web/ort/",
        "bridge": {
            "name": "browser-1",
            "input": device_data["input"].ravel().tolist(),
            "labels": device_data["labels"].tolist(),
            "timeoutMs": 180000,
        },
    }
    device = deploy_with_browser(command, task, tmp_path, port, timeout=300)
    assert device["round"] == 1
    count, batch = len(device_data["labels"]), settings.batch_size
    epochs = local_epochs(settings.local_epochs, settings.local_steps, count, batch)
    assert epochs > 1  # the default local-steps asks for more than one epoch of this device's data
    assert len(device["losses"]) == epochs * -(-count // batch)  # the browser followed the Python clients' rule

    updates = [np.load(p) for p in sorted((out / "updates").glob("round1-*.npz"))]
    report = json.loads((out / "metrics.json").read_text())
    assert len(updates) == 3 and report["rounds"][1]["excluded"] == {}
    names = [n for n in updates[0].files if not n.startswith("__")]
    counts = np.array([int(u["__num_examples__"]) for u in updates], np.float64)
    assert len(device_data["labels"]) in counts.tolist()
    flat = [np.concatenate([u[n].ravel() for n in names]) for u in updates]
    assert any(np.array_equal(f, np.asarray(device["weights"], np.float32)) for f in flat)  # the browser's own update
    expected = np.average(np.stack(flat), axis=0, weights=counts)
    result = np.load(out / "global_weights.npz")
    np.testing.assert_allclose(np.concatenate([result[n].ravel() for n in names]), expected, atol=1e-6)
    time.sleep(0.5)
    assert started_by(str(out / "logs" / "flwr-home")) == []  # SuperLink, nodes, relay and bridge all gone
    assert (out / "logs" / "bridge.log").exists()


def test_demo_page_trains_with_visible_progress(digits_artifacts, data_dir, tmp_path):
    make_bundle(digits_artifacts, tmp_path / "bundle")
    port = free_port()
    env = {**flower_env(tmp_path / "home"), "ODT_BRIDGE_SECRET": "s", "ODT_BRIDGE_ENROLMENT": "enrol"}
    odt = str(Path(sys.executable).parent / "odt")
    shot = tmp_path / "demo.png"
    (tmp_path / "task.json").write_text(json.dumps({"click": "#train", "enrolment": "enrol", "screenshot": str(shot)}))
    serve = [
        odt,
        "bridge",
        "serve",
        str(tmp_path / "bundle"),
        "--port",
        str(port),
        "--demo-data",
        str(data_dir / "val.npz"),
    ]
    with ProcessGroup(tmp_path, env) as group:
        group.start("bridge", serve)
        wait_for(f"http://127.0.0.1:{port}/openapi.json")
        driver = ["node", str(WEB / "tools" / "run-in-browser.mjs"), f"http://127.0.0.1:{port}/web/"]
        result = subprocess.run([*driver, str(tmp_path / "task.json")], capture_output=True, text=True, timeout=300)
    page = json.loads(result.stdout)
    assert page["ok"], page
    assert len(page["losses"]) == 2 * 9 and page["losses"][-1] < page["losses"][0]  # 2 epochs of 270 / 32
    assert "verified: 17226 trainable weights" in page["log"]
    # the bridge's COOP/COEP headers make the page cross-origin isolated; ORT runs in a Web Worker
    assert "training in a Web Worker (portable engine) with 1 WASM thread(s), cross-origin isolated: yes" in page["log"]
    assert shot.stat().st_size > 10_000


class _TwoInputs(torch.nn.Module):
    """A bundle whose feeds are not the digits' ``input``: a float and an integer input."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.head = torch.nn.Linear(8 + 6, 3)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([features, self.embed(tokens).mean(1)], 1))


def _two_input_data(path: Path, count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 20, (count, 5))
    labels = tokens[:, 0] % 3  # learnable from the first token
    np.savez(path, features=rng.standard_normal((count, 6)).astype(np.float32), tokens=tokens, labels=labels)


def test_demo_page_trains_any_bundle_once_registered(tmp_path):
    """Feeds come from the bundle's spec; two clicks reuse one registration; a user's own .npz works."""
    from artifacts import AdamW, generate

    torch.manual_seed(0)
    example = {"features": torch.randn(8, 6), "tokens": torch.randint(0, 20, (8, 5))}
    generate(_TwoInputs(), example, tmp_path / "artifacts", optimizer=AdamW(lr=0.03))
    make_bundle(tmp_path / "artifacts", tmp_path / "bundle")
    _two_input_data(tmp_path / "demo.npz", 96, 0)
    _two_input_data(tmp_path / "mine.npz", 64, 1)
    port = free_port()
    env = {**flower_env(tmp_path / "home"), "ODT_BRIDGE_SECRET": "s", "ODT_BRIDGE_ENROLMENT": "enrol"}
    odt = str(Path(sys.executable).parent / "odt")
    serve = [odt, "bridge", "serve", str(tmp_path / "bundle"), "--port", str(port), "--demo-data",
             str(tmp_path / "demo.npz")]  # fmt: skip
    runs = {}
    with ProcessGroup(tmp_path, env) as group:
        group.start("bridge", serve)
        wait_for(f"http://127.0.0.1:{port}/openapi.json")
        driver = ["node", str(WEB / "tools" / "run-in-browser.mjs"), f"http://127.0.0.1:{port}/web/"]
        for name, task in (
            ("demo", {"clicks": ["#train", "#train"], "enrolment": "enrol"}),
            ("own", {"click": "#train", "name": "browser-2", "enrolment": "enrol", "file": str(tmp_path / "mine.npz")}),
        ):
            (tmp_path / f"{name}.json").write_text(json.dumps(task))
            result = subprocess.run([*driver, str(tmp_path / f"{name}.json")], capture_output=True, text=True,
                                    timeout=300)  # fmt: skip
            runs[name] = json.loads(result.stdout)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/") as home:  # / leads to the page
            assert home.url.endswith("/web/")
    demo, own = runs["demo"], runs["own"]
    assert demo["statuses"] == ["done", "done"], demo  # the second click did not register again (HTTP 409)
    assert demo["log"].count("registered as") == 1 and "feeds features, tokens, labels" in demo["log"]
    assert len(demo["losses"]) == 2 * 2 * 3 and demo["losses"][-1] < demo["losses"][0]  # 2 clicks x 2 epochs x 3
    assert "96 examples" in demo["log"] and "accuracy in the last epoch" in demo["log"]
    assert own["ok"] and "64 examples" in own["log"], own


def test_a_browser_joins_a_secure_round_of_a_real_deployment(digits_artifacts, data_dir, tmp_path):
    """`odt bridge deploy --set secure-aggregation=true`: SuperLink, two Python SuperNodes and a relay
    SuperNode whose browser masks its own update. The aggregate is checked against the three updates:
    the browser's, and the Python nodes' recomputed here by the ClientApp's own train handler."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from federated.client_app import train
    from federated.flower_internals import act_as_server_app
    from federated.protocol import ARRAYS, CONFIG, METRICS, from_arrays, to_arrays
    from federated.task import manifest_sha256
    from ondevice import Manifest, Trainer

    port = free_port()
    odt = str(Path(sys.executable).parent / "odt")
    out = tmp_path / "out"
    command = [
        odt, "bridge", "deploy", "--devices", "1", "--nodes", "2", "--port", str(port), "--rounds", "1",
        "--artifacts", str(digits_artifacts), "--data", str(data_dir), "--out", str(out), "--round-timeout", "150",
        "--set", "secure-aggregation=true",
    ]  # fmt: skip
    device_data = np.load(data_dir / "val.npz")
    task = {"module": "/web/odt-web.mjs", "ortBase": "/web/ort/",
            "bridge": {"name": "browser-1", "input": device_data["input"].ravel().tolist(),
                       "labels": device_data["labels"].tolist(), "timeoutMs": 240000}}  # fmt: skip
    device = deploy_with_browser(command, task, tmp_path, port, timeout=400)
    assert device["secure"] and device["round"] == 1
    report = json.loads((out / "metrics.json").read_text())
    assert report["rounds"][1]["excluded"] == {} and len(report["rounds"][1]["bytes_up_per_client"]) == 3

    # The three updates: the browser's, and each Python node's from the ClientApp's train handler.
    manifest = Manifest.load(digits_artifacts)
    start = Trainer.load(digits_artifacts).get_weights()
    flat = np.concatenate([start[p.name].ravel() for p in manifest.trainable])
    browser = np.asarray(device["weights"], np.float32) - flat
    updates = [({p.name: browser[p.offset : p.offset + p.size].reshape(p.shape) for p in manifest.trainable},
                len(device_data["labels"]))]  # fmt: skip
    settings = report["settings"]
    run_config = {key.replace("_", "-"): value for key, value in settings.items()}
    act_as_server_app()
    config = ConfigRecord({"server-round": 1, "manifest-sha256": manifest_sha256(digits_artifacts)})
    for partition in range(2):
        message = Message(RecordDict({ARRAYS: to_arrays(start), CONFIG: config}), dst_node_id=1, message_type="train")
        context = Context(1, 1, {"partition-id": partition, "num-partitions": 2}, RecordDict(), run_config)
        reply = train(message, context).content
        trained = from_arrays(reply[ARRAYS])
        updates.append(({k: trained[k] - start[k] for k in start}, int(reply[METRICS]["num-examples"])))
    total = sum(count for _, count in updates)
    result = np.load(out / "global_weights.npz")
    for name, value in start.items():
        expected = value + sum(u[name].astype(np.float64) * count for u, count in updates) / total
        np.testing.assert_allclose(result[name], expected, atol=1e-5, rtol=0)
    time.sleep(0.5)
    assert started_by(str(out / "logs" / "flwr-home")) == []
