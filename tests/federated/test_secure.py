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
from federated.secure_checks import ACCUSERS, EPHEMERAL, PROVE, REJECTED, SECRETS

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
    assert secure.rounds[-1].dropped == {101: "collect_masked_vectors", 104: "collect_masked_vectors"}
    assert list(secure.rounds[-1].flagged) == [107] and "in the sum" in secure.rounds[-1].flagged[107]
    assert metrics["num-examples"] == sum(updates[n][1] for n in survivors)


def test_too_few_survivors_fail_the_round_with_the_threshold():
    updates = _updates(5, seed=2)
    vanish = {n: "collect_masked_vectors" for n in list(updates)[:3]}
    with pytest.raises(RoundFailedError, match=r"2 of 5 nodes answered the collect_masked_vectors stage usably.*the 3"):
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


# ---- one hostile node (102 of 6): each row damages what it sends at one stage ---------------------------

HOSTILE = 102


def _configs(content: RecordDict) -> ConfigRecord:
    return content.config_records[SecAgg.CONFIGS]


def _set(key, value):
    return lambda c, memory: _configs(c).__setitem__(key, value(_configs(c)[key], memory) if callable(value) else value)


def _masked_add(element, amount):
    """Add ``amount`` to the masked vector's element ``element`` (0 is the weight factor), modulo 2^32."""

    def damage(c, memory):
        vector = [SecAgg.bytes_to_ndarray(b).astype(np.uint64) for b in _configs(c)[SecAgg.Key.MASKED_PARAMETERS]]
        flat = np.concatenate([v.ravel() for v in vector])
        flat[element if element is not None else slice(None)] += amount
        out, at = [], 0
        for v in vector:
            out.append(SecAgg.ndarray_to_bytes((flat[at : at + v.size] % 2**32).astype(np.uint32).reshape(v.shape)))
            at += v.size
        _configs(c)[SecAgg.Key.MASKED_PARAMETERS] = out

    return damage


def _replay(c, memory):
    """Send the previous round's masked vector again (the first round was honest)."""
    _configs(c)[SecAgg.Key.MASKED_PARAMETERS] = memory["previous"]


def _forge(to=None, spare=None):
    """Replace its ciphertexts to node ``to`` (None: all but ``spare``) by Fernet tokens under a key
    nobody shares."""
    from cryptography.fernet import Fernet

    def damage(c, memory):
        forged = Fernet(Fernet.generate_key())
        _configs(c)[CIPHER] = [forged.encrypt(b"x" * 400) if d == to or (to is None and d != spare) else t
                               for d, t in zip(_configs(c)[DEST], _configs(c)[CIPHER])]  # fmt: skip

    return damage


def _copy_key(c, memory):
    _configs(c)[SecAgg.Key.PUBLIC_KEY_1] = memory["keys"][101]


def _garble_shares(c, memory):
    shares = _configs(c)[SecAgg.Key.SHARE_LIST]
    rng = np.random.default_rng(0)
    _configs(c)[SecAgg.Key.SHARE_LIST] = [s[:4] + rng.bytes(len(s) - 4) for s in shares]


def _rsa_key(c, memory):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key()
    _configs(c)[SecAgg.Key.PUBLIC_KEY_2] = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


DEST, CIPHER = SecAgg.Key.DESTINATION_LIST, SecAgg.Key.CIPHERTEXT_LIST
EXCLUDED, ALSO_101, FLAGGED, REFUSED = "excluded", "excluded with 101", "flagged", "refused"
HOSTILE_ROWS = [
    # setup: its keys
    ("setup", lambda c, m: _configs(c).pop(SecAgg.Key.PUBLIC_KEY_2), EXCLUDED, "lacks"),
    ("setup", _set(SecAgg.Key.PUBLIC_KEY_2, b"-----BEGIN PUBLIC KEY-----\nnot a key"), EXCLUDED, "not a PEM"),
    ("setup", _rsa_key, EXCLUDED, "not a secp384r1 key"),
    ("setup", _set(SecAgg.Key.PUBLIC_KEY_2, lambda v, m: _configs_of(m)[SecAgg.Key.PUBLIC_KEY_1]), EXCLUDED,
     "same"),
    ("setup", _copy_key, ALSO_101, "same public key"),  # who copied whom cannot be told: both leave
    # share_keys: where its shares go
    ("share_keys", _set(DEST, [1.5]), EXCLUDED, "lacks"),
    ("share_keys", lambda c, m: [_configs(c)[k].append(_configs(c)[k][0]) for k in (DEST, CIPHER, EPHEMERAL)],
     EXCLUDED, "more than once"),
    ("share_keys", _set(DEST, lambda v, m: [999, *v[1:]]), EXCLUDED, "not one of the 5 peers"),
    ("share_keys", lambda c, m: [_configs(c)[k].pop() for k in (DEST, CIPHER, EPHEMERAL)], EXCLUDED,
     "sent no shares"),
    ("share_keys", lambda c, m: _configs(c).pop(EPHEMERAL), EXCLUDED, "lacks 'odt-ephemeral-keys'"),
    ("share_keys", _set(EPHEMERAL, lambda v, m: [m["keys"][101], *v[1:]]), EXCLUDED,  # another node's key
     "could not decrypt its shares: the key it revealed is not the one it encrypted with"),
    ("share_keys", _set(EPHEMERAL, lambda v, m: [b"junk", *v[1:]]), EXCLUDED, "a one-off key that is not a PEM"),
    ("share_keys", _set(CIPHER, lambda v, m: [b"garbage", *v[1:]]), EXCLUDED, "not url-safe base64"),
    # its peers accuse it, it reveals the one-off keys, the server opens the tokens: they do not open
    ("share_keys", _forge(), EXCLUDED, "node 103 could not decrypt its shares: the ciphertext does not decrypt"),
    # 101 alone took its shares, so 101's masks with 102 cannot be removed: 101 leaves too
    ("share_keys", _forge(spare=101), ALSO_101, "could not decrypt its shares"),
    ("share_keys", _forge(101), EXCLUDED, "node 101 could not decrypt its shares"),  # the accuser stays
    # collect_masked_vectors: its masked vector and its weight
    ("collect_masked_vectors", _set(SecAgg.Key.MASKED_PARAMETERS, [SecAgg.ndarray_to_bytes(np.zeros(3, np.uint32))]),
     EXCLUDED, "shapes"),
    ("collect_masked_vectors", lambda c, m: c.metric_records[METRICS].__setitem__("num-examples", -5), EXCLUDED,
     "example count is -5"),
    ("collect_masked_vectors", lambda c, m: c.metric_records[METRICS].__setitem__("num-examples", 10**6),
     EXCLUDED, "example count is 1000000"),
    # a false accuser: the accused reveal their one-off keys and the server opens their tokens
    ("collect_masked_vectors", _set(REJECTED, lambda v, m: [101, 103, 104, 105]), EXCLUDED,
     "it said it could not decrypt the shares of node 101, which open under the key 101 revealed"),
    ("collect_masked_vectors", _set(REJECTED, [101]), EXCLUDED, "it said it could not decrypt the shares of node 101"),
    ("collect_masked_vectors", _masked_add(None, 2**31), None, REFUSED),
    ("collect_masked_vectors", _masked_add(7, 2**31), None, REFUSED),  # one element
    ("collect_masked_vectors", _masked_add(0, 2**31), None, REFUSED),  # the weight factor
    ("collect_masked_vectors", _replay, None, REFUSED),
    # unmask: the shares it reveals (its update is already in the sum and stays)
    ("unmask", _garble_shares, FLAGGED, "does not fit the other shares"),
    ("unmask", _set(SecAgg.Key.SHARE_LIST, lambda v, m: [v[0], v[0], *v[2:]]), FLAGGED, "does not fit"),
    ("unmask", _set(SecAgg.Key.SHARE_LIST, lambda v, m: [v[0][:30], *v[1:]]), FLAGGED, "a share of 30 bytes"),
    ("unmask", _set(SecAgg.Key.NODE_ID_LIST, lambda v, m: v[::-1]), FLAGGED, "other nodes than"),
    ("unmask", lambda c, m: [_configs(c)[k].pop() for k in (SecAgg.Key.NODE_ID_LIST, SecAgg.Key.SHARE_LIST)],
     FLAGGED, "other nodes than"),
    ("unmask", _set(SecAgg.Key.SHARE_LIST, lambda v, m: [b"\x09\x00\x00\x00" + v[0][4:], *v[1:]]), FLAGGED,
     "index 9"),
]  # fmt: skip


def _configs_of(memory):
    return memory["own"]


class Hostile(Nodes):
    """Node 102 damages its reply to one stage; every node's setup keys are remembered (for copying)."""

    def __init__(self, updates, stage, damage):
        super().__init__(updates)
        self.stage, self.damage, self.memory = stage, damage, {"keys": {}}

    def _node(self, message: Message, context: Context) -> Message:
        current = message.content.config_records[SecAgg.CONFIGS][SecAgg.Key.STAGE]  # the mod pops it
        reply = super()._node(message, context)
        if current == "setup":
            self.memory["keys"][context.node_id] = _configs(reply.content)[SecAgg.Key.PUBLIC_KEY_1]
        if context.node_id == HOSTILE and current == "collect_masked_vectors":
            self.memory.setdefault("vectors", []).append(list(_configs(reply.content)[SecAgg.Key.MASKED_PARAMETERS]))
            self.memory["previous"] = self.memory["vectors"][-2] if len(self.memory["vectors"]) > 1 else None
        if context.node_id == HOSTILE and current == self.stage:
            self.memory["own"] = _configs(reply.content)
            self.damage(reply.content, self.memory)
        return reply


@pytest.mark.parametrize(("stage", "damage", "outcome", "said"), HOSTILE_ROWS)
def test_one_hostile_node_is_named_and_left_out_or_the_sum_is_refused(stage, damage, outcome, said):
    """Every damage a node can do to its own messages: it is excluded (named, its update not in the
    sum), flagged (named; it broke the protocol after its update was summed, which stays), or the
    unmasked sum is refused as one no honest inputs make (nothing applied). Applied sums are the
    honest nodes' FedAvg within the quantization bound."""
    updates = _updates(6, seed=5)
    settings = SecureSettings(max_weight=1000.0)
    grid = Hostile(updates, stage, damage)
    if damage is _replay:  # an honest first round to replay
        grid.stage = "none"
        _round(grid, list(updates), settings, START)
        grid.stage = stage
    secure = SecureGrid(grid, settings)
    tasks = [Message(RecordDict({ARRAYS: to_arrays(START), CONFIG: ConfigRecord({"server-round": 2})}),
                     dst_node_id=n, message_type="train", group_id="2") for n in updates]  # fmt: skip
    replies = list(secure.send_and_receive(tasks))
    log = secure.rounds[-1]
    assert not log.dropped
    if said == REFUSED:
        assert replies == [] and "not one honest updates can make" in log.refused
        assert not log.excluded and not log.flagged
        return
    assert log.refused is None
    named = log.flagged if outcome == FLAGGED else log.excluded
    out = {HOSTILE, 101} if outcome == ALSO_101 else {HOSTILE}
    assert set(named) == out and said in named[HOSTILE], named
    assert not (log.flagged if outcome != FLAGGED else log.excluded)
    survivors = [n for n in updates if outcome == FLAGGED or n not in out]
    expected = _expected(updates, survivors, START)
    (reply,) = replies
    aggregate = from_arrays(reply.content[ARRAYS])
    for name in SHAPES:
        np.testing.assert_allclose(aggregate[name], expected[name], atol=_bound(settings, updates, survivors), rtol=0)


@pytest.mark.parametrize("multiple", [0.5, 2.5, 3.5])
def test_a_shift_inside_the_field_moves_the_average_at_most_by_the_rounds_shift_bound(multiple):
    """A client that adds ``multiple`` x levels to every element of its masked vector (its weight
    factor left alone) stays in the field: the sum check cannot tell it from honest inputs while the
    sum stays in 0..nodes x levels (6 inputs near levels / 2 each: up to about 3 x levels more), and
    the average moves by exactly that many levels, within the round's reported shift bound. Beyond
    it, the round is refused."""
    updates = _updates(6, seed=5)
    settings = SecureSettings(max_weight=1000.0)
    levels = levels_for(len(updates))
    shift = int(multiple * levels)
    grid = Hostile(updates, "collect_masked_vectors", _masked_add(slice(1, None), shift))
    secure = SecureGrid(grid, settings)
    tasks = [Message(RecordDict({ARRAYS: to_arrays(START), CONFIG: ConfigRecord({"server-round": 1})}),
                     dst_node_id=n, message_type="train", group_id="1") for n in updates]  # fmt: skip
    replies = list(secure.send_and_receive(tasks))
    log = secure.rounds[-1]
    assert not log.excluded and not log.flagged  # nothing tells the shift apart
    if multiple > 3:
        assert replies == [] and "outside 0.." in log.refused
        return
    factor = sum(round(c / settings.max_weight * levels) for _, c in updates.values())
    moved = shift * 2 * settings.clipping_range / factor
    assert log.refused is None and moved <= log.shift_bound
    assert log.shift_bound == pytest.approx(2 * 6 * settings.clipping_range * levels / factor)
    (reply,) = replies
    aggregate, expected = from_arrays(reply.content[ARRAYS]), _expected(updates, list(updates), START)
    atol = _bound(settings, updates, list(updates)) + 4e-6  # float32 weights near 37
    for name in SHAPES:
        np.testing.assert_allclose(aggregate[name] - expected[name], moved, atol=atol, rtol=0)


class Liars(Nodes):
    """``liars`` mask with every peer as honest nodes do, then say they could not decrypt the shares of
    ``targets`` (in the collect reply)."""

    def __init__(self, updates, liars, targets):
        super().__init__(updates)
        self.liars, self.targets = liars, targets

    def _node(self, message: Message, context: Context) -> Message:
        current = message.content.config_records[SecAgg.CONFIGS][SecAgg.Key.STAGE]
        reply = super()._node(message, context)
        if context.node_id in self.liars and current == "collect_masked_vectors":
            _configs(reply.content)[REJECTED] = [t for t in self.targets if t != context.node_id]
        return reply


@pytest.mark.parametrize("nodes", [6, 9])
@pytest.mark.parametrize("liars", [1, 2, 3])
@pytest.mark.parametrize("targets", ["one", "all"])
def test_false_accusers_are_named_and_excluded_and_the_accused_stay(nodes, liars, targets):
    """Colluding nodes below the threshold say they could not decrypt honest peers' shares (node 101's,
    or every honest node's) while masking with them: each accused reveals the one-off keys of those
    ciphertexts, the server opens them, and only the liars leave. The aggregate is the honest nodes'
    FedAvg within the quantization bound."""
    updates = _updates(nodes, seed=nodes + liars)
    liar_ids = {102 + i for i in range(liars)}
    honest = [n for n in updates if n not in liar_ids]
    settings = SecureSettings(threshold=0.5, max_weight=1000.0)
    grid = Liars(updates, liar_ids, [101] if targets == "one" else honest)
    secure, aggregate, _ = _round(grid, list(updates), settings, START)
    log = secure.rounds[-1]
    assert log.refused is None and not log.dropped and not log.flagged
    assert set(log.excluded) == liar_ids, log.excluded
    assert all("which open under the key 101 revealed" in log.excluded[n] for n in liar_ids)
    expected = _expected(updates, honest, START)
    for name in SHAPES:
        np.testing.assert_allclose(aggregate[name], expected[name], atol=_bound(settings, updates, honest), rtol=0)


@pytest.mark.parametrize(
    ("proof", "said"),
    [
        (lambda r: _configs(r.content).__setitem__(SECRETS, [b"junk"] * len(_configs(r.content)[SECRETS])),
         "node 100 could not decrypt its shares: the key it revealed is not the one it encrypted with"),
        (lambda r: _configs(r.content).__setitem__(SECRETS, []), "its odt-prove reply broke the protocol: 0 keys"),
        (lambda r: _configs(r.content).pop(SECRETS), "its odt-prove reply broke the protocol: it lacks"),
        (lambda r: r.content.config_records.clear(), "its odt-prove reply broke the protocol: no SecAgg+ record"),
    ],
    ids=["wrong keys", "too few", "no keys", "no record"],
)
def test_an_accused_node_that_does_not_prove_its_shares_leaves_and_its_accuser_stays(proof, said):
    """Node 102 sends 100 shares that do not open, and answers the prove stage wrongly: 102 is excluded
    and named, 100 stays (an accused node that cannot show its ciphertext opens is at fault)."""

    class Forger(Hostile):
        def _node(self, message, context):
            current = _configs(message.content)[SecAgg.Key.STAGE]
            reply = super()._node(message, context)
            if context.node_id == HOSTILE and current == PROVE:
                proof(reply)
            return reply

    updates = _updates(6, seed=11)
    grid = Forger(updates, "share_keys", _forge(100))
    settings = SecureSettings(max_weight=1000.0)
    secure, aggregate, _ = _round(grid, list(updates), settings, START)
    log = secure.rounds[-1]
    assert set(log.excluded) == {102} and said in log.excluded[102], log.excluded
    survivors = [n for n in updates if n != 102]
    expected = _expected(updates, survivors, START)
    for name in SHAPES:
        np.testing.assert_allclose(aggregate[name], expected[name], atol=_bound(settings, updates, survivors), rtol=0)


def test_a_node_reveals_one_off_keys_once_and_only_for_peers_it_sent_shares_to():
    """The client's prove stage: once per round, after the collect stage, for peers it sent shares to;
    a request naming another node, or a second request, is refused (the server can collect no more
    than the accusers already hold)."""
    refused = []

    def prove(context, accusers):
        task = RecordDict({SecAgg.CONFIGS: ConfigRecord({SecAgg.Key.STAGE: PROVE, ACCUSERS: accusers})})
        message = Message(task, dst_node_id=102, message_type="train", group_id="1")
        try:
            return secure_mod(message, context, lambda m, c: pytest.fail("the prove stage trains nothing"))
        except ValueError as exc:
            refused.append(str(exc))

    class Asked(Liars):
        def _node(self, message, context):
            if message.content.config_records[SecAgg.CONFIGS].get(SecAgg.Key.STAGE) == PROVE:
                prove(context, [100, 999])  # 999 is no peer of 102
                reply = super()._node(message, context)
                prove(context, [100])  # the same request again
                return reply
            return super()._node(message, context)

    updates = _updates(4, seed=12)
    secure, _, _ = _round(Asked(updates, {100}, [102]), list(updates), SecureSettings(max_weight=1000.0), START)
    assert set(secure.rounds[-1].excluded) == {100}  # 102's real answer proved its shares
    assert len(refused) == 2
    assert "must name peers this node sent shares to" in refused[0] and "once, after the collect stage" in refused[1]


def test_a_refused_sum_leaves_the_global_model_and_the_report_says_so(digits_artifacts):
    """Through the app's strategy: a round whose unmasked sum is refused applies nothing (the
    strategy returns no arrays, so Flower keeps the global model), and its report row says why;
    the next round, with the hostile node honest again, is applied."""
    from flwr.serverapp.strategy import FedAvg

    from federated.protocol import hash_tag
    from federated.report import round_row
    from federated.strategy import GuardedStrategy
    from federated.task import manifest_sha256
    from ondevice import Manifest, Trainer

    manifest, sha = Manifest.load(digits_artifacts), manifest_sha256(digits_artifacts)
    start = Trainer.load(digits_artifacts).get_weights()
    rng = np.random.default_rng(3)
    updates = {100 + i: ({k: (0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in start.items()}, 50)
               for i in range(4)}  # fmt: skip

    class Tagged(Hostile):
        def _train(self, message, context):
            reply = super()._train(message, context)
            reply.content[METRICS]["manifest-tag"] = hash_tag(sha)
            return reply

    grid = Tagged(updates, "collect_masked_vectors", _masked_add(None, 2**31))
    strategy = GuardedStrategy(FedAvg(), manifest, sha, codec="none", max_examples=1000, min_nodes=2)
    strategy.secure = secure = SecureGrid(grid, SecureSettings(max_weight=1000.0))
    for server_round in (1, 2):
        messages = strategy.configure_train(server_round, to_arrays(start), ConfigRecord({}), secure)
        arrays, _ = strategy.aggregate_train(server_round, secure.send_and_receive(messages))
        if server_round == 1:
            assert arrays is None
            row = round_row(1, {}, strategy.rounds[1], 1.0)
            assert "not one honest updates can make" in row["refused"] and row["excluded"] == {}
            grid.stage = "none"  # honest from now on
    expected = _expected(updates, list(updates), start)
    for name, value in from_arrays(arrays).items():
        np.testing.assert_allclose(value, expected[name], atol=_bound(SecureSettings(max_weight=1000.0), updates,
                                                                      list(updates)), rtol=0)  # fmt: skip
    row = round_row(2, {}, strategy.rounds[2], 1.0)
    assert "refused" not in row
    levels = levels_for(len(updates))
    weight = sum(round(c / 1000.0 * levels) for _, c in updates.values())
    assert row["secure_shift_bound"] == pytest.approx(2 * len(updates) * 4.0 * levels / weight)  # the report states it
