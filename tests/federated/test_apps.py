"""The guarded strategy on real Flower messages (against numpy) and a ClientApp round on real artifacts."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from federated.client_app import app as client_app
from federated.codec import encode
from federated.errors import ArtifactMismatchError
from federated.partitions import partition
from federated.protocol import from_arrays, hash_tag, to_arrays
from federated.strategy import GuardedStrategy, make_strategy
from federated.task import Settings, local_epochs, manifest_sha256, node_data, node_trainer
from ondevice import Manifest, Trainer
from ondevice.errors import ArtifactIntegrityError


@pytest.fixture(autouse=True)
def task_identity():
    # Flower stamps messages with the identity of the running task; tests are that task.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


@pytest.fixture()
def setup(digits_artifacts):
    manifest = Manifest.load(digits_artifacts)
    sha = manifest_sha256(digits_artifacts)
    global_weights = Trainer.load(digits_artifacts).get_weights()
    return manifest, sha, global_weights


def _reply(node: int, payload: dict, count, tag) -> Message:
    task = Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    metrics = MetricRecord({"num-examples": count, "train-loss": 0.5, "manifest-tag": tag})
    return Message(RecordDict({"arrays": to_arrays(payload), "metrics": metrics}), reply_to=task)


def _shifted(weights: dict, by: float) -> dict:
    return {k: v + np.float32(by) for k, v in weights.items()}


@pytest.mark.parametrize("codec", ["none", "fp16", "int8"])
def test_guard_excludes_bad_updates_and_fedavg_equals_numpy(setup, codec):
    manifest, sha, global_weights = setup
    tag = hash_tag(sha)
    strategy = GuardedStrategy(FedAvg(), manifest, sha, codec=codec, max_examples=1000)
    strategy._global = global_weights  # what configure_train stores for the round
    good = {7: (_shifted(global_weights, 0.01), 30), 8: (_shifted(global_weights, -0.02), 10), 9: (global_weights, 60)}
    replies = [_reply(n, encode(w, global_weights, codec), count, tag) for n, (w, count) in good.items()]
    nan = encode(global_weights, global_weights, codec)
    nan["5.bias"] = np.full(10, np.nan, np.float16 if codec == "fp16" else np.float32)
    if codec == "int8":
        nan["5.bias"], nan["5.bias::scale"] = np.zeros(10, np.int8), np.array([np.nan], np.float32)
    bad_size = {**global_weights, "5.bias": np.zeros(12, np.float32)}
    replies += [
        _reply(20, nan, 10, tag),  # NaN
        _reply(21, encode(bad_size, global_weights, "none"), 10, tag),  # wrong size (and wrong dtype for codecs)
        _reply(22, encode(global_weights, global_weights, codec), 10**9, tag),  # absurd example count
        _reply(23, encode(global_weights, global_weights, codec), 10, tag + 1),  # foreign manifest hash
        Message(
            Error(code=0, reason="node crashed"),
            reply_to=Message(RecordDict(), dst_node_id=24, message_type=MessageType.TRAIN),
        ),
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert set(strategy.rounds[1].excluded) == {20, 21, 22, 23, 24}
    counts = np.array([c for _, c in good.values()], np.float64)
    result = from_arrays(arrays)
    tolerance = {"none": 1e-6, "fp16": 2e-5, "int8": 2e-4}[codec]
    for p in manifest.trainable:
        expected = np.average(np.stack([w[p.name] for w, _ in good.values()]), axis=0, weights=counts)
        np.testing.assert_allclose(result[p.name], expected, atol=tolerance, err_msg=p.name)
    assert "manifest-tag" not in metrics and metrics["train-loss"] == pytest.approx(0.5)


def test_make_strategy_by_name():
    assert type(make_strategy("fedprox", min_nodes=2, proximal_mu=0.1)).__name__ == "FedProx"
    assert make_strategy("fedprox", min_nodes=2, proximal_mu=0.1).proximal_mu == 0.1
    dp = make_strategy("fedavg", min_nodes=3, dp_noise=0.5, dp_clip=1.0)
    assert type(dp).__name__ == "DifferentialPrivacyServerSideFixedClipping"
    expected = {"fedavgm": "FedAvgM", "fedadam": "FedAdam", "fedmedian": "FedMedian",
                "fedtrimmedavg": "FedTrimmedAvg", "krum": "Krum"}  # fmt: skip
    for name, cls in expected.items():
        assert type(make_strategy(name, min_nodes=2)).__name__ == cls
    from federated.errors import FederatedError

    with pytest.raises(FederatedError, match="strategy must be one of"):
        make_strategy("fedbest", min_nodes=2)


def _context(digits_artifacts, data_dir, **node) -> Context:
    run = {"artifacts": str(digits_artifacts), "data": str(data_dir), "local-epochs": 1, "batch-size": 16}
    node = {"partition-id": 1, "num-partitions": 4, **node}
    return Context(run_id=1, node_id=5, node_config=node, state=RecordDict(), run_config=run)


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_client_round_on_real_artifacts(setup, digits_artifacts, data_dir, codec):
    manifest, sha, global_weights = setup
    config = ConfigRecord({"manifest-sha256": sha, "codec": codec, "server-round": 1, "proximal-mu": 0.0})
    task = Message(
        RecordDict({"arrays": to_arrays(global_weights), "config": config}),
        dst_node_id=5,
        message_type=MessageType.TRAIN,
    )
    reply = client_app(task, _context(digits_artifacts, data_dir))
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    metrics = reply.content["metrics"]
    assert metrics["num-examples"] == 1257 // 4 - (1257 // 4) // 5  # partition minus the 20 % held out
    assert metrics["manifest-tag"] == hash_tag(sha)
    strategy = GuardedStrategy(FedAvg(), manifest, sha, codec=codec, max_examples=10_000)
    strategy._global = global_weights
    arrays, _ = strategy.aggregate_train(1, [reply])
    trained = from_arrays(arrays)
    moved = max(float(np.abs(trained[k] - global_weights[k]).max()) for k in trained)
    assert moved > 1e-3  # it trained


@pytest.mark.parametrize("local_steps", [0, 40])
def test_client_trains_local_epochs_or_more_until_the_local_steps(setup, digits_artifacts, data_dir, local_steps):
    _, sha, global_weights = setup
    config = ConfigRecord({"manifest-sha256": sha, "codec": "none", "server-round": 3, "proximal-mu": 0.0})
    task = Message(
        RecordDict({"arrays": to_arrays(global_weights), "config": config}),
        dst_node_id=5,
        message_type=MessageType.TRAIN,
    )
    context = _context(digits_artifacts, data_dir)
    context.run_config["local-steps"] = local_steps
    reply = client_app(task, context)
    settings = Settings.from_config(dict(context.run_config))
    data, _ = node_data(settings, context.node_config, str(digits_artifacts))
    size = len(data["labels"])  # 251 examples: 16 steps per epoch of 16
    epochs = {0: 1, 40: 3}[local_steps]
    assert local_epochs(settings.local_epochs, local_steps, size, settings.batch_size) == epochs
    reference = Trainer.load(digits_artifacts)  # the same training by hand, for that many epochs
    reference.set_weights(global_weights)
    reference.set_lr(settings.lr)
    reference.fit(data, epochs=epochs, batch_size=settings.batch_size, seed=settings.seed * 100_003 + 3, progress=False)
    trained = from_arrays(reply.content["arrays"])
    for name, value in reference.get_weights().items():
        np.testing.assert_array_equal(trained[name], value, err_msg=name)


def test_client_refuses_foreign_artifacts(setup, digits_artifacts, digits_sgd, data_dir):
    _, sha, global_weights = setup
    config = ConfigRecord({"manifest-sha256": sha, "codec": "none", "server-round": 1})
    task = Message(
        RecordDict({"arrays": to_arrays(global_weights), "config": config}),
        dst_node_id=5,
        message_type=MessageType.TRAIN,
    )
    # Called directly the ClientApp raises; Flower's runtime turns that into an error reply
    # that the server logs (see the deployment test).
    with pytest.raises(ArtifactMismatchError, match="differ from the server's"):
        client_app(task, _context(digits_artifacts, data_dir, artifacts=str(digits_sgd)))


def test_client_uses_its_own_npz(setup, digits_artifacts, data_dir, digits_data, tmp_path):
    _, sha, global_weights = setup
    own = tmp_path / "own.npz"
    np.savez(own, **{k: v[:50] for k, v in digits_data["train"].items()})
    config = ConfigRecord({"manifest-sha256": sha, "codec": "none", "server-round": 1})
    task = Message(
        RecordDict({"arrays": to_arrays(global_weights), "config": config}),
        dst_node_id=5,
        message_type=MessageType.TRAIN,
    )
    reply = client_app(task, _context(digits_artifacts, data_dir, data=str(own)))
    assert reply.content["metrics"]["num-examples"] == 40


def test_client_side_is_torch_free():
    import subprocess
    import sys

    code = "import sys, federated.client_app; assert 'torch' not in sys.modules; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr


def test_client_side_clipping_mod_clips_the_update(setup, digits_artifacts, data_dir):
    from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

    _, sha, global_weights = setup
    config = ConfigRecord({"manifest-sha256": sha, "codec": "none", "server-round": 1, KEY_CLIPPING_NORM: 0.05})
    task = Message(
        RecordDict({"arrays": to_arrays(global_weights), "config": config}),
        dst_node_id=5,
        message_type=MessageType.TRAIN,
    )
    reply = client_app(task, _context(digits_artifacts, data_dir))
    update = from_arrays(reply.content["arrays"])
    norm = np.sqrt(sum(float(((update[k] - global_weights[k]) ** 2).sum()) for k in update))
    assert norm == pytest.approx(0.05, rel=1e-3)  # trained far beyond 0.05, then clipped to it


def test_client_side_dp_strategy_by_name():
    strategy = make_strategy("fedavg", min_nodes=2, dp_noise=0.1, dp_clip=0.5, dp_mode="client")
    assert type(strategy).__name__ == "DifferentialPrivacyClientSideFixedClipping"


def _evaluation(weights: dict, sha: str) -> Message:
    config = ConfigRecord({"manifest-sha256": sha, "codec": "none", "server-round": 1})
    return Message(
        RecordDict({"arrays": to_arrays(weights), "config": config}), dst_node_id=5, message_type=MessageType.EVALUATE
    )


def test_evaluation_reuses_one_trainer_and_leaks_nothing_between_tasks(setup, digits_artifacts, data_dir, tmp_path):
    """Evaluate tasks share one loaded trainer per process; each one's metrics are those of a fresh
    trainer given the same weights, and a file replaced on disk is loaded (and hash-checked) again."""
    _, sha, global_weights = setup
    artifacts = tmp_path / "artifacts"
    shutil.copytree(digits_artifacts, artifacts)
    context = _context(artifacts, data_dir)
    _, val = node_data(Settings.from_config(context.run_config), context.node_config, str(artifacts))
    first = node_trainer(str(artifacts), sha, for_evaluation=True)
    first.set_weights({k: np.zeros_like(v) for k, v in global_weights.items()})
    again = node_trainer(str(artifacts), sha, for_evaluation=True)
    assert again is first  # loaded once...
    for k, v in again.get_weights().items():  # ...and handed out as loaded
        np.testing.assert_array_equal(v, global_weights[k])
    for shift in (0.0, 0.01, -0.02):
        weights = _shifted(global_weights, shift)
        metrics = client_app(_evaluation(weights, sha), context).content["metrics"]
        fresh = Trainer.load(artifacts)
        fresh.set_weights(weights)
        assert metrics["eval-loss"] == pytest.approx(fresh.evaluate(val)["loss"], rel=1e-6)

    checkpoint = artifacts / "checkpoint"
    raw = bytearray(checkpoint.read_bytes())
    raw[-1] ^= 0xFF
    checkpoint.write_bytes(bytes(raw))
    with pytest.raises(ArtifactIntegrityError, match="checkpoint was altered"):
        node_trainer(str(artifacts), sha, for_evaluation=True)


def test_node_data_is_read_once_and_again_when_its_file_changes(digits_data, tmp_path):
    directory = tmp_path / "data"
    directory.mkdir()
    train = directory / "train.npz"
    np.savez(train, **digits_data["train"])
    settings = Settings.from_config({"artifacts": "unused", "data": str(directory), "partitioning": "dirichlet"})
    node = {"partition-id": 2, "num-partitions": 5}
    first, _ = node_data(settings, node, "unused")
    second, _ = node_data(settings, node, "unused")
    for k in first:
        np.testing.assert_array_equal(first[k], second[k])
    changed = {k: v[::-1].copy() for k, v in digits_data["train"].items()}  # same size, other order
    os.replace(_saved(tmp_path / "new.npz", changed), train)
    third, _ = node_data(settings, node, "unused")
    labels = np.asarray(changed["labels"])
    parts = partition(labels, 5, scheme="dirichlet", alpha=settings.dirichlet_alpha, seed=settings.seed)
    order = np.random.default_rng(settings.seed).permutation(len(parts[2]))
    expected = changed["input"][parts[2]][order[max(1, len(order) // 5) :]]
    np.testing.assert_array_equal(third["input"], expected)


def _saved(path, arrays: dict):  # type: ignore[no-untyped-def]
    np.savez(path, **arrays)
    return path


def test_a_node_that_sends_nothing_is_named_in_the_report_and_on_the_console(setup, capsys):
    from federated.round_log import RoundLog

    manifest, sha, global_weights = setup
    strategy = GuardedStrategy(FedAvg(), manifest, sha, codec="none", max_examples=1000, round_timeout=45.0)
    strategy._global = global_weights
    strategy.rounds[1] = RoundLog(sampled=[7, 8, 31])  # what configure_train records: three nodes asked
    replies = [_reply(n, encode(_shifted(global_weights, 0.01), global_weights, "none"), 10, hash_tag(sha))
               for n in (7, 8)]  # fmt: skip
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None and strategy.rounds[1].excluded == {31: "no reply within round-timeout (45 s)"}
    assert (
        "odt: round 1: node 31 sent no update within round-timeout (45 s); the round goes on" in capsys.readouterr().out
    )


def test_a_round_that_uses_most_of_its_time_is_warned_about():
    from federated.round_log import slow_round

    assert slow_round(3, 59.0, 120.0) is None
    assert slow_round(3, 700.0, 0.0) is None  # the default: each wait follows the work, the user has nothing to raise
    assert slow_round(3, 61.4, 120.0) == (
        "odt: warning: round 3 took 61 s, more than half of round-timeout (120 s): on a busier machine clients "
        "would miss it. Raise --round-timeout."
    )
