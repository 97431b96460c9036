"""BatchNorm running statistics travel and are averaged by examples; DP noise matches Flower's formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity
from torch import nn

from artifacts import generate
from federated.buffers import average_buffers, split_state
from federated.codec import encode
from federated.protocol import from_arrays, hash_tag, to_arrays
from federated.runner import simulate
from federated.strategy import GuardedStrategy, make_strategy
from federated.task import manifest_sha256
from ondevice import Manifest, Predictor, Trainer


@pytest.fixture(autouse=True)
def task_identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


class Nodes(Grid):
    """The one thing a strategy asks a Grid when it samples: which nodes are connected."""

    def __init__(self, count: int) -> None:
        self.count = count

    def get_node_ids(self):  # type: ignore[no-untyped-def]
        return list(range(1, self.count + 1))

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # type: ignore[no-untyped-def]
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id)

    run = set_run = push_messages = pull_messages = send_and_receive = None  # type: ignore[assignment]


def bn_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


@pytest.fixture(scope="module")
def bn_artifacts(tmp_path_factory):
    out = tmp_path_factory.mktemp("bn") / "artifacts"
    generate(bn_mlp(), {"input": torch.randn(16, 64)}, out)
    return out


def _reply(node: int, payload: dict, count: int, sha: str) -> Message:
    task = Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    metrics = MetricRecord({"num-examples": count, "train-loss": 0.5, "manifest-tag": hash_tag(sha)})
    return Message(RecordDict({"arrays": to_arrays(payload), "metrics": metrics}), reply_to=task)


def test_average_buffers_pools_like_the_union_of_the_data():
    """Means average by examples; variances pool as the variance of all clients' data together."""
    rng = np.random.default_rng(0)
    data = [rng.normal(loc, 1.0 + loc, size=(n, 4)) for loc, n in ((0.0, 300), (2.0, 1000), (-1.0, 700))]
    updates = [(len(x), {"bn.running_mean": x.mean(0), "bn.running_var": x.var(0), "bn.count": np.ones(1)})
               for x in data]  # fmt: skip
    pooled = average_buffers(updates)
    union = np.concatenate(data)
    np.testing.assert_allclose(pooled["bn.running_mean"], union.mean(0), rtol=1e-5)
    np.testing.assert_allclose(pooled["bn.running_var"], union.var(0), rtol=1e-5)
    np.testing.assert_allclose(pooled["bn.count"], [1.0])
    assert average_buffers([]) == {}


@pytest.mark.parametrize("codec", ["none", "fp16", "int8"])
def test_guard_averages_statistics_by_examples_and_tasks_carry_them(bn_artifacts, codec):
    manifest, sha = Manifest.load(bn_artifacts), manifest_sha256(bn_artifacts)
    trainer = Trainer.load(bn_artifacts)
    start = {**trainer.get_weights(), **trainer.get_buffers()}
    strategy = GuardedStrategy(FedAvg(min_available_nodes=1), manifest, sha, codec=codec, max_examples=1000)
    messages = list(strategy.configure_train(1, to_arrays(start), ConfigRecord(), Nodes(4)))
    assert all(set(from_arrays(m.content["arrays"])) == set(start) for m in messages)

    rng = np.random.default_rng(1)
    sent = {}
    replies = []
    for node, count in ((1, 30), (2, 10)):
        state = {k: v + rng.uniform(0, 0.1, v.shape).astype(np.float32) for k, v in start.items()}
        sent[node] = (count, state)
        replies.append(_reply(node, encode(state, start, codec), count, sha))
    weights_only, _ = split_state(manifest, sent[1][1])
    replies.append(_reply(3, encode(weights_only, start, codec), 60, sha))  # a browser: no statistics
    partial = {**weights_only, "1.running_mean": sent[1][1]["1.running_mean"]}
    replies.append(_reply(4, encode(partial, start, codec), 5, sha))  # some statistics only: refused
    negative = {**sent[1][1], "1.running_var": -np.ones(32, np.float32)}
    replies.append(_reply(5, encode(negative, start, "none") if codec == "none" else encode(negative, start, codec),
                          5, sha))  # fmt: skip
    arrays, _ = strategy.aggregate_train(1, replies)
    assert set(strategy.rounds[1].excluded) == {4, 5}
    result = from_arrays(arrays)
    tolerance = {"none": 1e-6, "fp16": 1e-4, "int8": 1e-3}[codec]
    decoded = {n: strategy.rounds[1].buffers[n][1] for n in (1, 2)}  # what the server decoded
    expected = average_buffers([(30, decoded[1]), (10, decoded[2])])
    for b in manifest.buffers:
        np.testing.assert_allclose(result[b.name], expected[b.name], rtol=1e-6, err_msg=b.name)
        mean = np.average([sent[1][1][b.name], sent[2][1][b.name]], axis=0, weights=[30, 10])
        np.testing.assert_allclose(result[b.name], mean, atol=0.01, err_msg=b.name)  # mean + small spread
    for p in manifest.trainable:  # the weights: FedAvg over all three accepted clients
        stacked = [sent[1][1][p.name], sent[2][1][p.name], weights_only[p.name]]
        expected = np.average(stacked, axis=0, weights=[30, 10, 60])
        np.testing.assert_allclose(result[p.name], expected, atol=tolerance * 10, err_msg=p.name)


def test_dp_noise_is_calibrated_to_the_clients_actually_sampled(digits_artifacts):
    """Flower's std is noise_multiplier * clipping_norm / num_sampled_clients: 5 sampled, not min_nodes=2."""
    manifest, sha = Manifest.load(digits_artifacts), manifest_sha256(digits_artifacts)
    start = Trainer.load(digits_artifacts).get_weights()
    inner = make_strategy("fedavg", min_nodes=2, dp_noise=0.8, dp_clip=0.5)
    strategy = GuardedStrategy(inner, manifest, sha, codec="none", max_examples=1000)
    messages = list(strategy.configure_train(1, to_arrays(start), ConfigRecord(), Nodes(5)))
    assert len(messages) == 5
    moved = {k: v + np.float32(1e-5) for k, v in start.items()}  # one tiny update (norm << clip) from all
    replies = [_reply(int(m.metadata.dst_node_id), moved, 10, sha) for m in messages]
    np.random.seed(0)
    arrays, _ = strategy.aggregate_train(1, replies)
    noise = np.concatenate([(from_arrays(arrays)[k] - moved[k]).ravel() for k in start])
    expected = 0.8 * 0.5 / 5
    assert strategy.rounds[1].dp_noise_std == pytest.approx(expected)
    assert noise.std() == pytest.approx(expected, rel=0.03)  # 17k draws: well inside 3 %


@pytest.mark.flower
def test_batchnorm_federated_run_matches_recomputed_statistics(digits_data, data_dir, tmp_path):
    """The global model's statistics are the clients' example-weighted average: its test accuracy is
    that of the same weights with statistics recomputed on all training data."""
    artifacts = tmp_path / "artifacts"
    model = bn_mlp()
    generate(model, {"input": torch.randn(16, 64)}, artifacts)
    config = {"artifacts": str(artifacts), "data": str(data_dir), "output": str(tmp_path / "out"),
              "num-server-rounds": 5, "local-epochs": 1, "local-steps": 0, "lr": 0.01}  # fmt: skip
    report = simulate(4, config, work=tmp_path / "w")
    central = report["rounds"][-1]["central.accuracy"]

    with np.load(tmp_path / "out" / "global_weights.npz") as saved:
        state = {k: torch.from_numpy(saved[k]) for k in saved.files if not k.startswith("__")}
    assert {"1.running_mean", "1.running_var"} <= set(state)
    model.load_state_dict({**model.state_dict(), **state})
    held_out = {k: np.concatenate([digits_data["val"][k], digits_data["test"][k]]) for k in ("input", "labels")}

    def accuracy() -> float:
        model.eval()
        with torch.no_grad():
            predicted = model(torch.from_numpy(held_out["input"])).argmax(1).numpy()
        return float((predicted == held_out["labels"]).mean())

    federated = accuracy()
    with torch.no_grad():
        logits = model(torch.from_numpy(held_out["input"])).numpy()
    model[1].reset_running_stats()
    model[1].momentum = None  # cumulative average over one pass of all training data
    model.train()
    with torch.no_grad():
        model(torch.from_numpy(digits_data["train"]["input"]))
    recomputed = accuracy()
    assert central > 0.8
    assert abs(federated - recomputed) <= 0.005, (federated, recomputed)

    # the exported global model carries the same weights and statistics
    exported = Predictor(tmp_path / "out" / "global_model.onnx", Manifest.load(artifacts))
    np.testing.assert_allclose(exported.predict({"input": held_out["input"]})["output"], logits, atol=1e-4)
