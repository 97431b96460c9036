"""SecAgg+ in the Message-API app: the sum against numpy, masked vectors only, dropouts, thresholds.

Nodes here are the client's real SecAgg+ mod (Flower's stage functions, real keys, shares and
masks) behind federated.loopback's in-process grid, which delivers each message to its node and
keeps the node's Context between stages; their train handler returns known updates.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from federated.client_app import clipping_when_asked
from federated.errors import RoundFailedError
from federated.flower_internals import KEY_CLIPPING_NORM, SecAgg
from federated.loopback import LoopbackGrid
from federated.protocol import ARRAYS, CONFIG, METRICS, from_arrays, to_arrays
from federated.secure import SecureGrid, SecureSettings, group_size, levels_for, secure_mod

SHAPES = {"a.weight": (40, 30), "a.bias": (40,), "b.weight": (5, 40)}


@pytest.fixture(autouse=True)
def task_identity():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


class Nodes(LoopbackGrid):
    """Nodes whose train handler returns known updates (``updates``: node -> (update, examples)),
    behind the app's own mods: SecAgg+ outermost, then client-side clipping, as in federated.client_app."""

    def __init__(self, updates: dict[int, tuple[dict[str, np.ndarray], int]], vanish: dict[int, str] | None = None):
        self.updates = updates
        super().__init__({n: self._node for n in updates}, vanish)

    def _node(self, message: Message, context: Context) -> Message:
        return secure_mod(message, context, lambda m, c: clipping_when_asked(m, c, self._train))

    def _train(self, message: Message, context: Context) -> Message:
        update, count = self.updates[context.node_id]
        start = from_arrays(message.content[ARRAYS])
        trained = {k: start[k] + update[k] for k in start}
        metrics = MetricRecord({"num-examples": count, "train-loss": float(count), "manifest-tag": 7})
        return Message(RecordDict({ARRAYS: to_arrays(trained), METRICS: metrics}), reply_to=message)


def _updates(nodes: int, scale: float = 0.05, seed: int = 0) -> dict[int, tuple[dict[str, np.ndarray], int]]:
    rng = np.random.default_rng(seed)
    return {
        100 + i: ({k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()},
                  int(rng.integers(20, 200)))
        for i in range(nodes)
    }  # fmt: skip


def _round(grid: Grid, nodes: list[int], settings: SecureSettings, start: dict[str, np.ndarray], clip=None):
    config = ConfigRecord({KEY_CLIPPING_NORM: clip} if clip else {"server-round": 1})
    tasks = [
        Message(RecordDict({ARRAYS: to_arrays(start), CONFIG: config}), dst_node_id=n, message_type="train",
                group_id="1")
        for n in nodes
    ]  # fmt: skip
    secure = SecureGrid(grid, settings)
    (reply,) = secure.send_and_receive(tasks)
    return secure, from_arrays(reply.content[ARRAYS]), reply.content[METRICS]


def _expected(updates, nodes, start):
    total = sum(updates[n][1] for n in nodes)
    return {
        k: start[k] + sum(updates[n][0][k].astype(np.float64) * updates[n][1] for n in nodes) / total for k in start
    }


def _bound(settings: SecureSettings, updates, survivors) -> float:
    """The sum's quantization error: under a level per node, divided by the summed weights; plus float32."""
    level = 2 * settings.clipping_range / (settings.quantization or levels_for(len(updates)))
    total = sum(updates[n][1] for n in survivors) / settings.max_weight
    return len(survivors) * level / total + 1e-6


START = {k: np.random.default_rng(9).standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


@pytest.mark.parametrize("shares", [1.0, 0.5], ids=["secagg", "secagg+"])
def test_the_aggregate_is_fedavg_of_the_updates_within_the_quantization_bound(shares):
    updates = _updates(9)
    settings = SecureSettings(shares=shares, max_weight=1000.0)
    secure, aggregate, metrics = _round(Nodes(updates), list(updates), settings, START)
    expected = _expected(updates, list(updates), START)
    for name in SHAPES:
        np.testing.assert_allclose(
            aggregate[name], expected[name], atol=_bound(settings, updates, list(updates)), rtol=0
        )
    assert metrics["num-examples"] == sum(c for _, c in updates.values())
    counts = np.array([c for _, c in updates.values()], np.float64)
    assert metrics["train-loss"] == pytest.approx(np.sum(counts * counts) / counts.sum())  # metrics stay clear
    assert not secure.rounds[-1].dropped


def test_the_server_holds_masked_vectors_only():
    """No vector the server received equals, or correlates with, any node's true update."""
    updates = _updates(5)
    secure, _, _ = _round(Nodes(updates), list(updates), SecureSettings(max_weight=1000.0), START)
    held = secure.rounds[-1].masked
    assert sorted(held) == sorted(updates)
    for node, vector in held.items():
        flat = np.concatenate([v.ravel() for v in vector[1:]]).astype(np.float64)  # [0] is the weight factor
        assert flat.min() >= 0 and flat.max() < 2**32
        for other, (update, _) in updates.items():
            truth = np.concatenate([update[k].ravel() for k in sorted(update)]).astype(np.float64)
            # independent noise correlates as N(0, 1/n); 6 sigma keeps 25 pairs from a chance failure
            # (about 1e-8 per run) while the quantized update itself would correlate near 1
            assert abs(np.corrcoef(flat, truth)[0, 1]) < 6 / np.sqrt(flat.size), (node, other)
        assert np.std(flat) > 0.25 * 2**32 / np.sqrt(12) * 0.9  # spread like uniform noise over the modulus


@pytest.mark.parametrize("shares", [1.0, 0.6], ids=["secagg", "secagg+"])
def test_nodes_that_vanish_after_sharing_keys_are_unmasked_by_the_others(shares):
    updates = _updates(10, seed=1)
    vanish = {101: "collect_masked_vectors", 104: "collect_masked_vectors", 107: "unmask"}
    settings = SecureSettings(shares=shares, threshold=0.5, max_weight=1000.0)
    secure, aggregate, metrics = _round(Nodes(updates, vanish), list(updates), settings, START)
    survivors = [n for n in updates if n not in (101, 104)]  # 107 sent its masked update, then left
    expected = _expected(updates, survivors, START)
    for name in SHAPES:
        np.testing.assert_allclose(aggregate[name], expected[name], atol=_bound(settings, updates, survivors), rtol=0)
    assert secure.rounds[-1].dropped == vanish
    assert metrics["num-examples"] == sum(updates[n][1] for n in survivors)


def test_too_few_survivors_fail_the_round_with_the_threshold():
    updates = _updates(5, seed=2)
    vanish = {n: "collect_masked_vectors" for n in list(updates)[:3]}
    with pytest.raises(RoundFailedError, match=r"2 of 5 nodes answered the collect_masked_vectors stage.*the 3 needed"):
        _round(Nodes(updates, vanish), list(updates), SecureSettings(threshold=0.6, max_weight=1000.0), START)


def test_one_node_cannot_aggregate_securely():
    updates = _updates(1)
    with pytest.raises(RoundFailedError, match="at least 2 sampled nodes"):
        _round(Nodes(updates), list(updates), SecureSettings(), START)


def test_other_messages_pass_through():
    class Echo(Grid):
        def send_and_receive(self, messages, *, timeout=None):  # type: ignore[no-untyped-def]
            return ["passed"]

        create_message = run = set_run = push_messages = pull_messages = get_node_ids = None  # type: ignore

    evaluate = Message(RecordDict(), dst_node_id=1, message_type="evaluate", group_id="1")
    assert SecureGrid(Echo(), SecureSettings()).send_and_receive([evaluate]) == ["passed"]


def test_levels_leave_the_sum_room_in_the_modulus():
    for nodes in (2, 3, 10, 100, 1000):
        levels = levels_for(nodes)
        assert levels * nodes <= 2**31 < 2 * levels * nodes  # the most a power of two can be, with 2x to spare


def test_a_relay_node_hands_the_stages_to_its_device_and_others_answer_them(digits_artifacts):
    """A node that trains itself answers a stage with Flower's client; a relay node (a browser behind
    the bridge) answers nothing itself: it hands the stage to the bridge (here: one that is down)."""
    from flwr.app import ConfigRecord

    from federated.client_app import secure_or_relayed
    from mobile_bridge.errors import BridgeError

    values = {"stage": "setup", "sample_num": 3, "share_num": 3, "threshold": 2, "clipping_range": 4.0,
              "target_range": 2**22, "mod_range": 2**32, "max_weight": 1000.0}  # fmt: skip

    def setup() -> Message:
        return Message(RecordDict({SecAgg.CONFIGS: ConfigRecord(values)}), dst_node_id=5, message_type="train",
                       group_id="1")  # fmt: skip

    own = Context(1, 5, {}, RecordDict(), {})
    reply = secure_or_relayed(setup(), own, lambda m, c: pytest.fail("the train handler runs in the collect stage"))
    assert set(reply.content.config_records[SecAgg.CONFIGS]) == {SecAgg.Key.PUBLIC_KEY_1, SecAgg.Key.PUBLIC_KEY_2}
    from federated.processes import free_port

    down = f"http://127.0.0.1:{free_port()}"
    node = {"bridge-url": down, "bridge-device": "phone-1", "bridge-secret": "s", "artifacts": "nowhere"}
    relay = Context(1, 5, node, RecordDict(), {})
    with pytest.raises(BridgeError, match="no artifacts at nowhere"):
        secure_or_relayed(setup(), relay, lambda m, c: pytest.fail("a relay node has no keys of its own"))
    relay.node_config["artifacts"] = str(digits_artifacts)
    with pytest.raises(BridgeError, match="not reachable"):
        secure_or_relayed(setup(), relay, lambda m, c: pytest.fail("a relay node has no keys of its own"))
    assert SecAgg.STATE not in relay.state.config_records  # nothing of the protocol was kept on the relay


def test_client_side_dp_clipping_runs_inside_the_protocol():
    """DP composes: each node's clipping mod bounds its update before SecAgg+ masks it, so the sum is
    the average of the clipped updates (the server adds the noise to that sum)."""
    updates = _updates(4, scale=0.5, seed=3)
    clip = 2.0
    settings = SecureSettings(max_weight=1000.0)
    _, aggregate, _ = _round(Nodes(updates), list(updates), settings, START, clip=clip)
    clipped = {}
    for node, (update, count) in updates.items():
        norm = np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in update.values()))
        assert norm > clip  # every update here is clipped
        clipped[node] = ({k: v * np.float32(clip / norm) for k, v in update.items()}, count)
    expected = _expected(clipped, list(clipped), START)
    for name in SHAPES:
        np.testing.assert_allclose(aggregate[name], expected[name], atol=_bound(settings, clipped, list(clipped)))


def test_large_rounds_share_keys_in_logarithmic_groups():
    assert [group_size(n) for n in (2, 10, 20, 21, 100, 1000)] == [2, 10, 20, 11, 15, 21]
    updates = _updates(25, scale=0.02, seed=4)
    vanish = {n: "collect_masked_vectors" for n in list(updates)[5:8]}
    settings = SecureSettings(max_weight=1000.0)  # the default: groups of 11 in a round of 25
    secure, aggregate, _ = _round(Nodes(updates, vanish), list(updates), settings, START)
    survivors = [n for n in updates if n not in vanish]
    expected = _expected(updates, survivors, START)
    for name in SHAPES:
        np.testing.assert_allclose(aggregate[name], expected[name], atol=_bound(settings, updates, survivors), rtol=0)
    # each node exchanged keys and shares with its group only: fewer bytes than with all 25
    everyone, _, _ = _round(Nodes(updates), list(updates), SecureSettings(shares=1.0, max_weight=1000.0), START)
    for direction in ("bytes_down", "bytes_up"):
        grouped, full = (max(getattr(s.rounds[-1], direction).values()) for s in (secure, everyone))
        assert grouped < full - 10 * 400, direction  # at least 10 fewer peers' keys or shares


@pytest.mark.parametrize(
    "stage, damage",
    [
        ("setup", lambda c: c.config_records[SecAgg.CONFIGS].pop(SecAgg.Key.PUBLIC_KEY_2)),
        ("share_keys", lambda c: c.config_records[SecAgg.CONFIGS].__setitem__(SecAgg.Key.DESTINATION_LIST, [1.5])),
        ("collect_masked_vectors", lambda c: c.config_records[SecAgg.CONFIGS].__setitem__(
            SecAgg.Key.MASKED_PARAMETERS, [SecAgg.ndarray_to_bytes(np.zeros(3, np.uint32))])),
        ("collect_masked_vectors", lambda c: c.metric_records[METRICS].__setitem__("num-examples", -5)),
    ],
    ids=["no-key", "float-ids", "wrong-shapes", "negative-count"],
)  # fmt: skip
def test_a_hostile_reply_takes_its_node_out_and_the_round_goes_on(stage, damage):
    """A reply the stage cannot use leaves the round like a dropout: never a crash of the server."""

    class Hostile(Nodes):
        def _node(self, message: Message, context: Context) -> Message:
            current = message.content.config_records[SecAgg.CONFIGS][SecAgg.Key.STAGE]  # the mod pops it
            reply = super()._node(message, context)
            if context.node_id == 102 and current == stage:
                damage(reply.content)
            return reply

    updates = _updates(6, seed=5)
    settings = SecureSettings(max_weight=1000.0)
    secure, aggregate, _ = _round(Hostile(updates), list(updates), settings, START)
    assert secure.rounds[-1].dropped == {102: stage}
    survivors = [n for n in updates if n != 102]
    expected = _expected(updates, survivors, START)
    for name in SHAPES:
        np.testing.assert_allclose(aggregate[name], expected[name], atol=_bound(settings, updates, survivors), rtol=0)
