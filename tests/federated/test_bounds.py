"""Finite poisoning: updates far outside the round's norm are rejected (or clipped) before aggregation."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from federated.codec import encode
from federated.protocol import from_arrays, hash_tag, to_arrays
from federated.strategy import GuardedStrategy
from federated.task import manifest_sha256
from federated.validation import norm_bounds, update_norm
from ondevice import Manifest, Trainer


@pytest.fixture(autouse=True)
def task_identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


def _reply(node: int, payload: dict, count: int, sha: str) -> Message:
    task = Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    metrics = MetricRecord({"num-examples": count, "train-loss": 0.5, "manifest-tag": hash_tag(sha)})
    return Message(RecordDict({"arrays": to_arrays(payload), "metrics": metrics}), reply_to=task)


def test_norm_bounds_use_the_low_median_of_the_moved_updates():
    norms = {1: 1.0, 2: 2.0, 3: 3.0, 4: 1e30, 5: 0.0}
    assert norm_bounds(norms, multiple=10, absolute=0) == {4: 20.0}  # median of 1, 2, 3, 1e30 (low) = 2
    assert norm_bounds({1: 1.0, 2: 1e30}, multiple=10, absolute=0) == {2: 10.0}  # two updates: the smaller
    assert norm_bounds(norms, multiple=0, absolute=2.5) == {3: 2.5, 4: 2.5}
    assert norm_bounds({1: 0.0, 2: 0.0}, multiple=10, absolute=0) == {}
    rng = np.random.default_rng(0)
    a, b = {"w": rng.standard_normal(50)}, {"w": rng.standard_normal(50)}
    assert update_norm(a, b) == pytest.approx(np.linalg.norm(a["w"] - b["w"]))


@pytest.fixture()
def setup(digits_artifacts):
    manifest, sha = Manifest.load(digits_artifacts), manifest_sha256(digits_artifacts)
    return manifest, sha, Trainer.load(digits_artifacts).get_weights()


def _good(start: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {k: v + (0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in start.items()}


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_finite_poison_is_excluded_under_fedavg(setup, codec):
    manifest, sha, start = setup
    strategy = GuardedStrategy(FedAvg(), manifest, sha, codec=codec, max_examples=1000)
    strategy._global = start
    good = {n: (_good(start, n), 100) for n in (1, 2, 3)}
    replies = [_reply(n, encode(w, start, codec), c, sha) for n, (w, c) in good.items()]
    poison = {k: np.full_like(v, 1e30) for k, v in start.items()}  # finite, with the largest allowed count
    if codec == "int8":
        payload = encode(_good(start, 9), start, "int8")
        payload = {k: (np.array([1e30], np.float32) if k.endswith("::scale") else v) for k, v in payload.items()}
    else:
        payload = encode(poison, start, codec)
    replies.append(_reply(4, payload, 1000, sha))
    arrays, _ = strategy.aggregate_train(1, replies)
    assert list(strategy.rounds[1].excluded) == [4] and "update norm" in strategy.rounds[1].excluded[4]
    result = from_arrays(arrays)
    for p in manifest.trainable:
        expected = np.average(np.stack([w[p.name] for w, _ in good.values()]), axis=0, weights=[100, 100, 100])
        np.testing.assert_allclose(result[p.name], expected, atol={"none": 1e-6, "int8": 2e-4}[codec], err_msg=p.name)


def test_clip_mode_scales_the_outlier_to_its_bound(setup):
    manifest, sha, start = setup
    strategy = GuardedStrategy(FedAvg(), manifest, sha, codec="none", max_examples=1000, norm_action="clip")
    strategy._global = start
    updates = {n: _good(start, n) for n in (1, 2, 3)}
    updates[4] = {k: v + np.float32(5.0) for k, v in start.items()}
    norms = {n: update_norm(w, start) for n, w in updates.items()}
    bound = 10 * sorted(norms.values())[1]
    arrays, _ = strategy.aggregate_train(1, [_reply(n, w, 10, sha) for n, w in updates.items()])
    assert 4 in strategy.rounds[1].clipped and not strategy.rounds[1].excluded
    clipped = {k: start[k] + (v - start[k]) * (bound / norms[4]) for k, v in updates[4].items()}
    assert update_norm(clipped, start) == pytest.approx(bound, rel=1e-5)
    result = from_arrays(arrays)
    for p in manifest.trainable:
        expected = np.mean([updates[1][p.name], updates[2][p.name], updates[3][p.name], clipped[p.name]], axis=0)
        np.testing.assert_allclose(result[p.name], expected, atol=1e-5, err_msg=p.name)
