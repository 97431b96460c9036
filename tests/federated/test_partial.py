"""Mixed tiers and personal tensors: partial updates on real Flower messages, against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp.strategy import FedAvg, FedProx
from flwr.supercore.task_identity import TaskIdentity
from torch import nn

from artifacts import Lora, generate
from federated.client_app import PERSONAL
from federated.client_app import app as client_app
from federated.errors import FederatedError, RoundFailedError
from federated.partial import aggregate_partial, union_of
from federated.protocol import from_arrays, to_arrays
from federated.strategy import GuardedStrategy
from ondevice import Trainer


@pytest.fixture(autouse=True)
def task_identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.value, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.query(x).relu() + self.value(x))


@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    """One base model, three trainable sets: head only, LoRA rank 2 + head, LoRA rank 4 + head."""
    root = tmp_path_factory.mktemp("tiers")
    torch.manual_seed(0)
    base = Tiny()
    example = {"x": torch.randn(8, 8)}
    generate(base, example, root / "head", trainable=["head"])
    generate(base, example, root / "r2", lora=Lora(2, 4, ("query", "value")), trainable=["head"])
    generate(base, example, root / "r4", lora=Lora(4, 8, ("query", "value")), trainable=["head"])
    rng = np.random.default_rng(0)
    for node in range(3):
        x = rng.normal(size=(60, 8)).astype(np.float32)
        np.savez(root / f"node{node}.npz", x=x, labels=(x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 1))
    return {name: Trainer.load(root / name) for name in ("head", "r2", "r4")}, root


def _context(root, artifacts, node: int, **run) -> Context:
    config = {"artifacts": str(root / "r4"), "local-epochs": 1, "batch-size": 16, "lr": 0.05, **run}
    node_config = {"artifacts": str(root / artifacts), "data": str(root / f"node{node}.npz"), "partition-id": node}
    return Context(run_id=1, node_id=node, node_config=node_config, state=RecordDict(), run_config=config)


def _task(strategy: GuardedStrategy, global_weights: dict, node: int) -> Message:
    config = strategy._stamp(ConfigRecord({"server-round": 1}))
    content = RecordDict({"arrays": to_arrays(global_weights), "config": config})
    return Message(content, dst_node_id=node, message_type=MessageType.TRAIN)


def test_aggregate_partial_averages_each_element_over_who_trained_it():
    global_weights = {"a": np.zeros((4, 3), np.float32), "b": np.ones(2, np.float32), "c": np.full(3, 7, np.float32)}
    updates = [(10, {"a": np.full((4, 3), 1.0), "b": np.full(2, 3.0)}), (30, {"a": np.full((2, 3), 5.0)})]
    merged = aggregate_partial(global_weights, updates)
    expected_a = np.full((4, 3), 1.0)
    expected_a[:2] = (10 * 1 + 30 * 5) / 40
    np.testing.assert_allclose(merged["a"], expected_a)
    np.testing.assert_allclose(merged["b"], 3.0)  # only the first trained it
    np.testing.assert_array_equal(merged["c"], global_weights["c"])  # nobody trained it
    with pytest.raises(ValueError, match="neither inside the other"):
        union_of([{"a": np.zeros((2, 4))}, {"a": np.zeros((4, 2))}])


def test_mixed_tiers_join_one_round_and_average_like_numpy(tiers):
    trainers, root = tiers
    main = trainers["r4"]
    others = {t.manifest_sha256: t.manifest for name, t in trainers.items() if name != "r4"}
    strategy = GuardedStrategy(
        FedAvg(), main.manifest, main.manifest_sha256, codec="none", max_examples=1000, tiers=others
    )
    global_weights = union_of([t.get_weights() for t in trainers.values()])
    strategy._global = global_weights
    replies = [
        client_app(_task(strategy, global_weights, n), _context(root, tier, n)) for n, tier in enumerate(trainers)
    ]
    sent = [from_arrays(r.content["arrays"]) for r in replies]
    counts = [int(r.content["metrics"]["num-examples"]) for r in replies]
    # each client sends exactly what its tier trains, at its own shapes
    for payload, trainer in zip(sent, trainers.values()):
        assert {k: v.shape for k, v in payload.items()} == {p.name: p.shape for p in trainer.manifest.trainable}
    assert sent[1]["query.lora_A"].shape == (2, 8) and global_weights["query.lora_A"].shape == (4, 8)

    arrays, metrics = strategy.aggregate_train(1, replies)
    assert not strategy.rounds[1].excluded
    result = from_arrays(arrays)
    # numpy: the head averaged over all three; the first 2 rank rows over r2 and r4; the rest from r4 alone
    np.testing.assert_allclose(
        result["head.weight"], np.average([s["head.weight"] for s in sent], axis=0, weights=counts), atol=1e-6
    )
    a = global_weights["query.lora_A"].copy()
    a[:2] = (counts[1] * sent[1]["query.lora_A"] + counts[2] * sent[2]["query.lora_A"][:2]) / (counts[1] + counts[2])
    a[2:] = sent[2]["query.lora_A"][2:]
    np.testing.assert_allclose(result["query.lora_A"], a, atol=1e-6)
    b = sent[2]["value.lora_B"].copy()
    b[:, :2] = (counts[1] * sent[1]["value.lora_B"] + counts[2] * sent[2]["value.lora_B"][:, :2]) / (
        counts[1] + counts[2]
    )
    np.testing.assert_allclose(result["value.lora_B"], b, atol=1e-6)
    losses = [r.content["metrics"]["train-loss"] for r in replies]
    assert metrics["train-loss"] == pytest.approx(np.average(losses, weights=counts))


def test_a_tier_may_send_only_what_it_trains(tiers):
    trainers, root = tiers
    main = trainers["r4"]
    head = trainers["head"]
    strategy = GuardedStrategy(
        FedAvg(), main.manifest, main.manifest_sha256, codec="none", max_examples=1000,
        tiers={head.manifest_sha256: head.manifest},
    )  # fmt: skip
    global_weights = union_of([main.get_weights(), head.get_weights()])
    strategy._global = global_weights
    reply = client_app(_task(strategy, global_weights, 0), _context(root, "head", 0))
    forged = {**from_arrays(reply.content["arrays"]), "query.lora_A": global_weights["query.lora_A"] + 1}
    reply.content["arrays"] = to_arrays(forged)
    with pytest.raises(RoundFailedError, match="every one of the 1 clients failed or was excluded.*not one its tier"):
        strategy.aggregate_train(1, [reply])  # nothing left to aggregate: the round fails loudly
    assert "is not one its tier trains" in strategy.rounds[1].excluded[0]
    with pytest.raises(FederatedError, match="strategy fedavg"):
        GuardedStrategy(FedProx(), main.manifest, main.manifest_sha256, codec="none", max_examples=9, partial=True)


def test_personal_tensors_never_leave_and_persist_between_rounds(tiers, tmp_path):
    trainers, root = tiers
    main = trainers["r4"]
    strategy = GuardedStrategy(
        FedAvg(), main.manifest, main.manifest_sha256, codec="none", max_examples=1000, partial=True
    )
    global_weights = main.get_weights()
    strategy._global = global_weights
    context = _context(root, "r4", 0, personal="head.*", output=str(tmp_path))
    reply = client_app(_task(strategy, global_weights, 0), context)
    sent = from_arrays(reply.content["arrays"])
    assert not [k for k in sent if k.startswith("head.")] and "query.lora_B" in sent
    kept = from_arrays(context.state.array_records[PERSONAL])
    assert set(kept) == {"head.weight", "head.bias"}
    from safetensors.numpy import load_file  # the node keeps its personal head on its own disk, too

    on_disk = load_file(tmp_path / "personal" / "client-0.safetensors")
    assert sorted(on_disk) == sorted(kept) and all(np.array_equal(on_disk[k], kept[k]) for k in kept)
    assert not np.allclose(kept["head.weight"], global_weights["head.weight"])  # trained locally
    arrays, _ = strategy.aggregate_train(1, [reply])
    np.testing.assert_array_equal(from_arrays(arrays)["head.weight"], global_weights["head.weight"])  # untouched

    # next round: the node starts from its own head, not the global one
    evaluation = Message(
        RecordDict({"arrays": arrays, "config": strategy._stamp(ConfigRecord({"server-round": 1}))}),
        dst_node_id=0,
        message_type=MessageType.EVALUATE,
    )
    metrics = client_app(evaluation, context).content["metrics"]
    personal = Trainer.load(root / "r4")
    personal.set_weights({**from_arrays(arrays), **kept})
    data = dict(np.load(root / "node0.npz"))
    order = np.random.default_rng(0).permutation(60)[:12]  # the node's held-out 20 % (seed 0)
    expected = personal.evaluate({k: v[order] for k, v in data.items()})
    assert metrics["eval-loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert metrics["global-eval-loss"] != pytest.approx(expected["loss"], rel=1e-3)


@pytest.mark.flower
def test_three_tiers_in_a_real_simulation(tiers, tmp_path):
    """A real SuperLink and ClientApp processes: node 0 trains LoRA rank 4 + head, node 1 the head, node 2 rank 2."""
    from federated.runner import simulate

    _, root = tiers
    data = tmp_path / "data"
    (data / "clients").mkdir(parents=True)
    for node in range(3):
        (data / "clients" / f"node{node}.npz").write_bytes((root / f"node{node}.npz").read_bytes())
    (data / "test.npz").write_bytes((root / "node0.npz").read_bytes())
    config = {"num-server-rounds": 2, "artifacts": str(root / "r4"), "tiers": f"{root / 'head'},{root / 'r2'}",
              "data": str(data), "output": str(tmp_path / "out"), "partitioning": "files", "lr": 0.05,
              "batch-size": 16, "round-timeout": 120.0}  # fmt: skip
    report = simulate(3, config, work=tmp_path / "w")
    for row in report["rounds"][1:]:
        assert row["excluded"] == {}
        sizes = sorted(row["bytes_up_per_client"].values())
        assert sizes == [4 * 27, 4 * (27 + 2 * (2 * 8 + 8 * 2)), 4 * (27 + 2 * (4 * 8 + 8 * 4))]  # head, r2, r4
        # every per-client figure is keyed by partition id, and the report names each client's tier
        assert set(row["bytes_up_per_client"]) == set(row["tier_per_client"]) == set(row["clients"]) == {"0", "1", "2"}
        by_tier = {row["tier_per_client"][k]: v for k, v in row["bytes_up_per_client"].items()}
        assert by_tier == {"head": 4 * 27, "r2": sizes[1], "r4": sizes[2]}
    final = dict(np.load(tmp_path / "out" / "global_weights.npz"))
    assert final["query.lora_A"].shape == (4, 8)
    # a LoRA run ends with a PEFT adapter of the global model too: PEFT loads it
    from peft import PeftModel

    adapter = PeftModel.from_pretrained(Tiny(), tmp_path / "out" / "global_peft")
    lora_a = adapter.state_dict()["base_model.model.query.lora_A.default.weight"].numpy()
    np.testing.assert_array_equal(lora_a, final["query.lora_A"])
    assert np.isfinite(report["rounds"][-1]["central.loss"])


def test_a_tier_of_another_base_model_is_refused_up_front(tiers, digits_artifacts, data_dir, tmp_path, capsys):
    from federated.partial import tier_problem
    from ondevice.cli import main

    trainers, root = tiers
    assert tier_problem(trainers["r4"].manifest, trainers["head"].manifest) is None
    assert tier_problem(trainers["r4"].manifest, trainers["r2"].manifest) is None  # rank 2 inside rank 4
    assert "inputs ['input'] differ" in tier_problem(trainers["r4"].manifest, Trainer.load(digits_artifacts).manifest)
    argv = ["fl", "simulate", "--artifacts", str(digits_artifacts), "--data", str(data_dir), "--out", str(tmp_path),
            "--set", f"tiers={root / 'head'}"]  # fmt: skip
    assert main(argv) == 2
    assert "is not a tier of" in capsys.readouterr().err and not (tmp_path / "logs").exists()
