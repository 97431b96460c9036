"""A headless browser in a SecAgg+ round beside Python nodes: the browser masks its own update.

The server side is the app's real SecureGrid; the Python nodes are the ClientApp's SecAgg+ mod
with known updates (federated.loopback delivers their messages in-process); the browser's node is
the ClientApp's relay mode talking to a real bridge process, behind which Chromium runs
``BridgeClient.joinRound``: its own keys, Shamir shares, Fernet channels and masks in JavaScript.
The aggregate must be the numpy weighted average of the three updates within the quantization
bound, and neither the server nor the bridge may hold the browser's update in the clear.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cryptography.fernet import Fernet
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from federated.client_app import clipping_when_asked, secure_or_relayed
from federated.flower_internals import KEY_CLIPPING_NORM, SecAgg
from federated.loopback import LoopbackGrid
from federated.processes import ProcessGroup, flower_env, free_port
from federated.protocol import ARRAYS, CONFIG, METRICS, from_arrays, to_arrays
from federated.secure import SecureGrid, SecureSettings, levels_for, secure_mod
from federated.secure_checks import REJECTED
from federated.task import manifest_sha256
from mobile_bridge import make_bundle
from ondevice import Manifest, Trainer

from . import WEB, wait_for

pytestmark = [pytest.mark.browser]

BROWSER, PYTHON = 103, (101, 102, 104, 105)
LIAR, FORGER = 101, 102


def _known(updates: dict[int, tuple[dict[str, np.ndarray], int]], hostile: str | None = None):
    """A node's train handler that returns its known update (the app's SecAgg+ mod around it). With
    ``hostile``, node 101 says it could not decrypt the browser's shares ("liar"), or node 102 sends
    the browser shares under a key nobody shares ("forger")."""

    def train(message: Message, context: Context) -> Message:
        update, count = updates[context.node_id]
        start = from_arrays(message.content[ARRAYS])
        trained = {k: start[k] + update[k] for k in start}
        metrics = MetricRecord({"num-examples": count, "train-loss": 1.0, "manifest-tag": 7})
        return Message(RecordDict({ARRAYS: to_arrays(trained), METRICS: metrics}), reply_to=message)

    def node(message: Message, context: Context) -> Message:
        stage = message.content.config_records[SecAgg.CONFIGS][SecAgg.Key.STAGE]
        reply = secure_mod(message, context, lambda m, c: clipping_when_asked(m, c, train))
        configs = reply.content.config_records.get(SecAgg.CONFIGS)
        if hostile == "liar" and context.node_id == LIAR and stage == "collect_masked_vectors":
            configs[REJECTED] = [BROWSER]
        if hostile == "forger" and context.node_id == FORGER and stage == "share_keys":
            forged = Fernet(Fernet.generate_key()).encrypt(b"x" * 400)
            sent = zip(configs[SecAgg.Key.DESTINATION_LIST], configs[SecAgg.Key.CIPHERTEXT_LIST])
            configs[SecAgg.Key.CIPHERTEXT_LIST] = [forged if d == BROWSER else c for d, c in sent]
        return reply

    return node


@pytest.mark.parametrize(
    ("vanish", "clip", "hostile"),
    [({}, None, None), ({102: "collect_masked_vectors"}, None, None), ({}, 0.2, None), ({}, None, "liar"),
     ({}, None, "forger")],
    ids=["all", "python-node-drops", "dp-clipping", "python-node-accuses-the-browser-falsely",
         "python-node-sends-the-browser-bad-shares"],
)  # fmt: skip
def test_a_browser_masks_its_own_update_in_a_secure_round(
    digits_artifacts, data_dir, tmp_path, vanish, clip, hostile
):
    """With client-side DP (``clip``) every node, the browser too, clips its update before it masks it.
    A Python node that says it could not decrypt the browser's shares is excluded once the browser
    reveals the one-off key of that ciphertext; one that sends the browser shares that do not open is
    reported by the browser, cannot prove them, and is excluded; the browser stays in both."""
    bundle = tmp_path / "bundle"
    make_bundle(digits_artifacts, bundle)
    manifest = Manifest.load(digits_artifacts)
    start = Trainer.load(digits_artifacts).get_weights()
    rng = np.random.default_rng(5)
    updates = {n: ({k: (0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in start.items()},
                   int(rng.integers(50, 400))) for n in PYTHON}  # fmt: skip
    device = np.load(data_dir / "train.npz")
    inputs, labels = device["input"][:120], device["labels"][:120]

    port = free_port()
    env = {**flower_env(tmp_path / "home"), "ODT_BRIDGE_SECRET": "relay-secret", "ODT_BRIDGE_ENROLMENT": "enrol"}
    odt = str(Path(sys.executable).parent / "odt")
    task = {"module": "/web/odt-web.mjs", "ortBase": "/web/ort/",
            "bridge": {"name": "browser-1", "enrolment": "enrol", "input": inputs.ravel().tolist(),
                       "labels": labels.tolist(), "timeoutMs": 180000}}  # fmt: skip
    (tmp_path / "task.json").write_text(json.dumps(task))
    with ProcessGroup(tmp_path, env) as group:
        bridge = group.start("bridge", [odt, "bridge", "serve", str(bundle), "--port", str(port)])
        wait_for(f"http://127.0.0.1:{port}/openapi.json", bridge)
        driver = ["node", str(WEB / "tools" / "run-in-browser.mjs"), f"http://127.0.0.1:{port}/web/"]
        browser = subprocess.Popen([*driver, str(tmp_path / "task.json")], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            nodes = {**{n: _known(updates, hostile) for n in PYTHON}, BROWSER: secure_or_relayed_node}
            grid = LoopbackGrid(nodes, vanish)
            relay = {"bridge-url": f"http://127.0.0.1:{port}", "bridge-device": "browser-1",
                     "bridge-secret": "relay-secret", "artifacts": str(digits_artifacts)}  # fmt: skip
            run = {"round-timeout": 60.0, "local-epochs": 1, "local-steps": 0, "batch-size": 32}
            grid.contexts[BROWSER] = Context(1, BROWSER, relay, RecordDict(), run)
            config = ConfigRecord({"server-round": 1, "manifest-sha256": manifest_sha256(digits_artifacts)})
            if clip is not None:
                config[KEY_CLIPPING_NORM] = clip
            tasks = [
                Message(RecordDict({ARRAYS: to_arrays(start), CONFIG: config}), dst_node_id=n, message_type="train",
                        group_id="1")
                for n in (*PYTHON, BROWSER)
            ]  # fmt: skip
            settings = SecureSettings(max_weight=1000.0)
            secure = SecureGrid(grid, settings)
            (reply,) = secure.send_and_receive(tasks)
        except Exception as exc:
            browser.kill()
            raise AssertionError(f"the round failed; the browser said: {browser.communicate()[1][-3000:]}") from exc
        out, err = browser.communicate(timeout=120)
    result = json.loads(out)
    assert result["ok"] and result["secure"] and result["round"] == 1, err[-3000:]

    trained = np.asarray(result["weights"], np.float32)
    flat_start = np.concatenate([start[p.name].ravel() for p in manifest.trainable])
    browser_update = {p.name: (trained[p.offset : p.offset + p.size] - flat_start[p.offset : p.offset + p.size])
                      .reshape(p.shape) for p in manifest.trainable}  # fmt: skip
    assert np.abs(trained - flat_start).max() > 1e-3  # the browser trained
    everyone = {**updates, BROWSER: (browser_update, len(labels))}
    if clip is not None:  # what each node masked: its update scaled to the clipping norm (every one is longer)
        for node, (update, count) in list(everyone.items()):
            norm = np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in update.values()))
            assert norm > clip
            everyone[node] = ({k: v * np.float32(clip / norm) for k, v in update.items()}, count)
    out = {"liar": {LIAR}, "forger": {FORGER}}.get(hostile, set())
    assert set(secure.rounds[-1].excluded) == out, secure.rounds[-1].excluded
    survivors = [n for n in everyone if n not in vanish and n not in out]
    total = sum(everyone[n][1] for n in survivors)
    aggregate = from_arrays(reply.content[ARRAYS])
    level = 2 * settings.clipping_range / levels_for(len(everyone))
    bound = len(survivors) * level / (total / settings.max_weight) + 1e-6
    for name, value in start.items():
        expected = value + sum(everyone[n][0][name].astype(np.float64) * everyone[n][1] for n in survivors) / total
        np.testing.assert_allclose(aggregate[name], expected, atol=bound, rtol=0)
    assert reply.content[METRICS]["num-examples"] == total
    assert secure.rounds[-1].dropped == vanish

    # What the server held from the browser: a masked vector, uniform noise, not its update.
    truth = np.concatenate([browser_update[n].ravel() for n in sorted(browser_update)]).astype(np.float64)
    held = np.concatenate([v.ravel() for v in secure.rounds[-1].masked[BROWSER][1:]]).astype(np.float64)
    assert abs(np.corrcoef(held, truth)[0, 1]) < 0.1
    # What reached the bridge's disk (its state, with freed pages and the write-ahead log): never the
    # browser's trained weights, which a plain round would have sent.
    changed = int(np.argmax(np.abs(trained - flat_start)))
    window = trained[max(0, changed - 8) : changed + 8].tobytes()
    state = bundle.with_name("bundle.bridge.db")
    stored = b"".join(p.read_bytes() for p in (state, state.with_name(state.name + "-wal")) if p.exists())
    assert len(stored) > 4 * len(trained) and window not in stored


def secure_or_relayed_node(message: Message, context: Context) -> Message:
    """The browser's node: the ClientApp's outermost mod, which hands a relay node's stages to its device."""
    return secure_or_relayed(message, context, lambda m, c: pytest.fail("a relay node trains nothing itself"))
