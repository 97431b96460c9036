"""Secure aggregation (SecAgg+) for the SDK's Message-API apps: the server learns only the sum.

Flower ships SecAgg+ for its legacy path only (``SecAggPlusWorkflow`` with legacy strategies and
``fitres.*`` records). Here the same protocol runs under the app's own strategy, built on Flower's
primitives (key agreement, Shamir shares, Fernet, quantization, the mask generator, the client's
stage functions: :mod:`federated.flower_internals`), not on home-made cryptography:

- Server: :class:`SecureGrid` wraps the Grid the strategy trains through. The TRAIN messages of a
  round (one per sampled node) become the four SecAgg+ stages: setup (public keys), share keys
  (Shamir shares of each node's mask seed and key, encrypted node to node), collect masked vectors
  (each node trains, then uploads its quantized, weighted, masked update) and unmask (the
  survivors' shares remove the masks: a node that vanished after sharing keys is unmasked from
  its neighbours' shares). The strategy then receives ONE reply: the example-weighted average of
  the updates, as if one node had sent it. FedAvg of one reply is that reply; FedAvgM and FedAdam
  apply their server step to it; Flower's client-side DP wrapper adds its noise to it.
- Client: :func:`secure_mod` answers the stages and, in the collect stage, masks what the
  ClientApp's train handler returned (the update: trained minus global weights).

The server never holds a client's update in the clear: only masked vectors, which are uniform
modulo 2^32 until summed.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.serverapp import Grid

from .errors import RoundFailedError
from .flower_internals import SecAgg, aggregate_metricrecords
from .protocol import ARRAYS, CONFIG, METRICS, from_arrays, to_arrays

__all__ = ["SecureSettings", "SecureGrid", "secure_mod", "aggregate_masked", "group_size", "levels_for"]

log = logging.getLogger(__name__)

MOD_RANGE = 2**32
"""Masked vectors are summed modulo this (Flower's default modulus range)."""


@dataclass(frozen=True)
class SecureSettings:
    """The run config's SecAgg+ settings (``secagg-*``)."""

    shares: float = 0.0
    """Share of the sampled nodes each node shares keys with: 1.0 is all (SecAgg), less cuts SecAgg+'s
    ring of groups; 0 (default) is :func:`group_size`."""
    threshold: float = 0.5
    """Share of a node's group whose shares unmask it (at least 2): fewer survivors fail the round."""
    clipping_range: float = 4.0
    """Each element of a weighted update is clipped to +/- this before quantization."""
    quantization: int = 0
    """Levels over [-clipping_range, clipping_range] (0: as many as the 2^32 modulus leaves for the round's
    nodes, with a factor 2 to spare); the aggregate is exact to about nodes x 2 x range / levels / weights."""
    max_weight: float = 100_000.0
    """The largest example count a node may weigh its update with (the run's max-examples)."""


@dataclass
class SecureRoundLog:
    """What the server held in one secure round (tests read it: masked vectors only)."""

    sampled: list[int] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)  # node -> the stage it vanished in
    masked: dict[int, list[np.ndarray]] = field(default_factory=dict)  # node -> its masked vector
    bytes_up: dict[int, int] = field(default_factory=dict)  # node -> bytes it sent in all stages
    bytes_down: dict[int, int] = field(default_factory=dict)


class SecureGrid:
    """A Grid whose TRAIN round runs SecAgg+ and answers with one reply, the aggregate; all else is the grid's."""

    def __init__(self, grid: Grid, settings: SecureSettings) -> None:
        self._grid, self.settings = grid, settings
        self.rounds: list[SecureRoundLog] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        if not messages or messages[0].metadata.message_type != MessageType.TRAIN:
            return self._grid.send_and_receive(messages, timeout=timeout)
        return [self._round(messages, timeout)]

    def _round(self, tasks: list[Message], timeout: float | None) -> Message:
        record = SecureRoundLog(sampled=[t.metadata.dst_node_id for t in tasks])
        self.rounds.append(record)
        content = {t.metadata.dst_node_id: t.content for t in tasks}
        config = content[tasks[0].metadata.dst_node_id].config_records.get(CONFIG, {})
        group = str(config.get("server-round", tasks[0].metadata.group_id))  # the stages' group: the round
        nodes = list(content)
        count = len(nodes)
        if count < 2:
            raise RoundFailedError(f"secure aggregation needs at least 2 sampled nodes, got {count}: raise min-nodes.")
        shares = group_size(count) if not self.settings.shares else round(self.settings.shares * count)
        shares = count if shares <= 2 or shares >= count else shares + 1 - shares % 2  # odd, as Flower's
        threshold = max(2, round(self.settings.threshold * shares))
        order = nodes[:]
        random.Random(group).shuffle(order)  # the ring the groups are cut from
        half = shares // 2
        groups = {n: {order[(i + d) % count] for d in range(-half, half + 1)} for i, n in enumerate(order)}
        start = from_arrays(content[nodes[0]][ARRAYS])
        names = sorted(start)  # the order both sides flatten an update in
        shapes = [(1,), *(start[n].shape for n in names)]  # the weight factor, then the tensors
        levels = self.settings.quantization or levels_for(count)
        if levels * count >= MOD_RANGE:
            raise RoundFailedError(
                f"secagg-quantization {levels} x {count} nodes overflows the 2^32 modulus: lower secagg-quantization."
            )

        def exchange(stage: str, outgoing: dict[int, RecordDict]) -> dict[int, RecordDict]:
            """Send one stage's tasks; the sound replies by node. A node that does not answer, or answers
            with something the stage does not expect (a hostile peer), is out of the round from here."""
            sent = [
                Message(c, dst_node_id=n, message_type=MessageType.TRAIN, group_id=group) for n, c in outgoing.items()
            ]
            for node, task in outgoing.items():
                record.bytes_down[node] = record.bytes_down.get(node, 0) + _size(task)
            replies = {}
            for reply in self._grid.send_and_receive(sent, timeout=timeout):
                node = reply.metadata.src_node_id
                if node not in outgoing or reply.has_error():
                    continue
                record.bytes_up[node] = record.bytes_up.get(node, 0) + _size(reply.content)
                problem = reply_problem(stage, reply.content, shapes)
                if problem is None:
                    replies[node] = reply.content
                else:
                    log.warning("secure aggregation: node %s left the round: %s", node, problem)
            for node in outgoing:
                if node not in replies:
                    record.dropped.setdefault(node, stage)
            if len(replies) < threshold:
                raise RoundFailedError(
                    f"secure aggregation: {len(replies)} of {count} nodes answered the {stage} stage, fewer than "
                    f"the {threshold} needed to unmask (secagg-threshold). Raise round-timeout or lower the threshold."
                )
            return replies

        def stage(name: str, **values: Any) -> RecordDict:
            return RecordDict({SecAgg.CONFIGS: ConfigRecord({SecAgg.Key.STAGE: name, **values})})

        setup = dict(sample_num=count, share_num=shares, threshold=threshold,
                     clipping_range=self.settings.clipping_range, target_range=levels,
                     mod_range=MOD_RANGE, max_weight=self.settings.max_weight)  # fmt: skip
        keys = exchange(SecAgg.Stage.SETUP, {n: stage(SecAgg.Stage.SETUP, **setup) for n in nodes})
        public = {
            n: [_configs(c)[SecAgg.Key.PUBLIC_KEY_1], _configs(c)[SecAgg.Key.PUBLIC_KEY_2]] for n, c in keys.items()
        }

        def share_keys(node: int) -> RecordDict:
            known = groups[node] & set(public)
            record_ = stage(SecAgg.Stage.SHARE_KEYS)
            for other in known:
                record_[SecAgg.CONFIGS][str(other)] = public[other]
            return record_

        shared = exchange(SecAgg.Stage.SHARE_KEYS, {n: share_keys(n) for n in public})
        forward: dict[int, tuple[list[int], list[bytes]]] = {n: ([], []) for n in shared}
        for src, reply in shared.items():
            sent_to = _configs(reply)
            for dst, ciphertext in zip(sent_to[SecAgg.Key.DESTINATION_LIST], sent_to[SecAgg.Key.CIPHERTEXT_LIST]):
                if dst in forward:
                    forward[dst][0].append(src)
                    forward[dst][1].append(ciphertext)

        def collect(node: int) -> RecordDict:
            task = RecordDict({k: v for k, v in content[node].items()})
            task[SecAgg.CONFIGS] = ConfigRecord({SecAgg.Key.STAGE: SecAgg.Stage.COLLECT_MASKED_VECTORS,
                                                 SecAgg.Key.SOURCE_LIST: forward[node][0],
                                                 SecAgg.Key.CIPHERTEXT_LIST: forward[node][1]})  # fmt: skip
            return task

        masked = exchange(SecAgg.Stage.COLLECT_MASKED_VECTORS, {n: collect(n) for n in forward})
        for node, reply in masked.items():
            record.masked[node] = [
                SecAgg.bytes_to_ndarray(b).astype(np.int64) for b in _configs(reply)[SecAgg.Key.MASKED_PARAMETERS]
            ]
        active = set(masked)
        dead = set(shared) - active  # shared keys, then vanished: their pairwise masks must be removed

        def unmask(node: int) -> RecordDict:
            lists = {SecAgg.Key.ACTIVE_NODE_ID_LIST: sorted(groups[node] & active),
                     SecAgg.Key.DEAD_NODE_ID_LIST: sorted(groups[node] & dead)}  # fmt: skip
            return stage(SecAgg.Stage.UNMASK, **lists)

        revealed = exchange(SecAgg.Stage.UNMASK, {n: unmask(n) for n in active})
        collected: dict[int, list[bytes]] = {n: [] for n in shared}  # only nodes that shared have shares
        for reply in revealed.values():
            for owner, share in zip(_configs(reply)[SecAgg.Key.NODE_ID_LIST], _configs(reply)[SecAgg.Key.SHARE_LIST]):
                if owner in collected:
                    collected[owner].append(share)
        deltas = aggregate_masked(
            record.masked, collected, active=active, groups=groups, public=public, threshold=threshold,
            clipping_range=self.settings.clipping_range, quantization=levels,
        )  # fmt: skip
        weights = {name: start[name] + delta.astype(np.float32) for name, delta in zip(names, deltas)}
        summary = aggregate_metricrecords([masked[n] for n in sorted(masked)], "num-examples")
        tag = next(iter(masked.values()))[METRICS].get("manifest-tag")
        summary["num-examples"] = sum(int(m[METRICS]["num-examples"]) for m in masked.values())
        summary["manifest-tag"] = tag
        summary.pop("client", None)
        reply = RecordDict({ARRAYS: to_arrays(weights), METRICS: MetricRecord(summary)})
        first = next(t for t in tasks if t.metadata.dst_node_id in active)
        return Message(reply, reply_to=first)


def _configs(content: RecordDict) -> ConfigRecord:
    return content.config_records[SecAgg.CONFIGS]


def reply_problem(stage: str, content: RecordDict, shapes: list[tuple[int, ...]]) -> str | None:
    """Why a node's reply to ``stage`` cannot be used (None when it can): the values the stage needs,
    of the types and sizes it needs. Replies come from peers the server does not trust."""
    configs = content.config_records.get(SecAgg.CONFIGS)
    if configs is None:
        return "no SecAgg+ record in its reply"
    needs = {
        SecAgg.Stage.SETUP: {SecAgg.Key.PUBLIC_KEY_1: bytes, SecAgg.Key.PUBLIC_KEY_2: bytes},
        SecAgg.Stage.SHARE_KEYS: {SecAgg.Key.DESTINATION_LIST: int, SecAgg.Key.CIPHERTEXT_LIST: bytes},
        SecAgg.Stage.COLLECT_MASKED_VECTORS: {SecAgg.Key.MASKED_PARAMETERS: bytes},
        SecAgg.Stage.UNMASK: {SecAgg.Key.NODE_ID_LIST: int, SecAgg.Key.SHARE_LIST: bytes},
    }[stage]
    for key, kind in needs.items():
        value = configs.get(key)
        items = value if isinstance(value, list) else [value]
        if value is None or not all(isinstance(v, kind) and not isinstance(v, bool) for v in items):
            return f"its {stage} reply lacks {key!r} ({kind.__name__} values)"
    lists = [configs[k] for k in needs if isinstance(configs[k], list)]
    if len({len(v) for v in lists}) > 1:
        return f"its {stage} reply pairs lists of different lengths"
    if stage == SecAgg.Stage.COLLECT_MASKED_VECTORS:
        metrics = content.metric_records.get(METRICS)
        count = None if metrics is None else metrics.get("num-examples")
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            return f"its example count is {count!r}"
        try:
            vector = [SecAgg.bytes_to_ndarray(b) for b in configs[SecAgg.Key.MASKED_PARAMETERS]]
        except ValueError as exc:
            return f"its masked vector is not arrays ({exc})"
        if [v.shape for v in vector] != shapes or any(v.dtype.kind not in "iu" for v in vector):
            return "its masked vector does not have the model's shapes (integers)"
    return None


def group_size(nodes: int) -> int:
    """SecAgg+'s group for a round of ``nodes``: everyone up to 20, then 2 x ceil(log2 nodes) + 1 (the
    SecAgg+ paper's logarithmic groups: a node's cost stops growing with the round)."""
    return nodes if nodes <= 20 else min(nodes, 2 * math.ceil(math.log2(nodes)) + 1)


def levels_for(nodes: int) -> int:
    """The most quantization levels whose sum over ``nodes`` stays under half the modulus (a power of two)."""
    return 2 ** ((MOD_RANGE // (2 * nodes)).bit_length() - 1)


def aggregate_masked(
    masked: dict[int, list[np.ndarray]],
    shares: dict[int, list[bytes]],
    *,
    active: set[int],
    groups: dict[int, set[int]],
    public: dict[int, list[bytes]],
    threshold: int,
    clipping_range: float,
    quantization: int,
) -> list[np.ndarray]:
    """The example-weighted average of the updates under ``masked`` (node -> masked vector): the
    survivors' mask seeds and the dropped nodes' keys are rebuilt from ``shares`` (node -> the
    shares its group revealed) and their masks removed, then the sum is dequantized."""
    vector = None
    for node in sorted(active):
        vector = masked[node] if vector is None else SecAgg.parameters_addition(vector, masked[node])
    assert vector is not None
    vector = SecAgg.parameters_mod(vector, MOD_RANGE)
    shapes = SecAgg.get_parameters_shape(vector)
    for node, revealed in shares.items():
        if len(revealed) < threshold:
            raise RoundFailedError(
                f"secure aggregation: node {node}'s mask needs {threshold} shares, {len(revealed)} came back: "
                "too many nodes dropped out to unmask the sum."
            )
        secret = SecAgg.combine_shares(revealed)
        if node in active:  # its own mask, from its seed
            vector = SecAgg.parameters_subtraction(vector, SecAgg.pseudo_rand_gen(secret, MOD_RANGE, shapes))
            continue
        for other in groups[node] - {node}:  # a vanished node: the pairwise masks its survivors added
            if other not in active:
                continue
            key = SecAgg.generate_shared_key(SecAgg.bytes_to_private_key(secret),
                                             SecAgg.bytes_to_public_key(public[other][0]))  # fmt: skip
            mask = SecAgg.pseudo_rand_gen(key, MOD_RANGE, shapes)
            combine = SecAgg.parameters_addition if node > other else SecAgg.parameters_subtraction
            vector = combine(vector, mask)
    vector = SecAgg.parameters_mod(vector, MOD_RANGE)
    total, vector = SecAgg.factor_extract(vector)
    summed = SecAgg.dequantize(vector, clipping_range, quantization)
    offset = -(len(active) - 1) * clipping_range
    return [(v + offset) * (quantization / total) for v in summed]


def secure_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """The client's side of SecAgg+: answers the stages with Flower's stage functions and masks the
    update the ClientApp's train handler returns. Other messages pass through."""
    if msg.metadata.message_type != MessageType.TRAIN or SecAgg.CONFIGS not in msg.content.config_records:
        return call_next(msg, context)
    state_record = context.state.config_records.get(SecAgg.STATE, ConfigRecord({}))
    state = SecAgg.State(**state_record)
    configs = msg.content.config_records[SecAgg.CONFIGS]
    SecAgg.check_stage(state.current_stage, configs)
    state.current_stage = str(configs.pop(SecAgg.Key.STAGE))
    SecAgg.check_configs(state.current_stage, configs)
    content = RecordDict()
    if state.current_stage == SecAgg.Stage.SETUP:
        state.nid = msg.metadata.dst_node_id
        result = SecAgg.setup(state, configs)
    elif state.current_stage == SecAgg.Stage.SHARE_KEYS:
        result = SecAgg.share_keys(state, configs)
    elif state.current_stage == SecAgg.Stage.COLLECT_MASKED_VECTORS:
        start = from_arrays(msg.content[ARRAYS])
        del msg.content[SecAgg.CONFIGS]  # the train task as the app's mods and handler know it (one ConfigRecord)
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        content = reply.content
        trained = from_arrays(content[ARRAYS])
        # float64: quantization shifts each value by clipping_range, where float32 would keep only ~7 digits
        update = [trained[name].astype(np.float64) - start[name] for name in sorted(trained)]
        count = int(content[METRICS]["num-examples"])
        result = SecAgg.collect_masked_vectors(state, configs, count, SecAgg.ndarrays_to_parameters(update))
        masked = [SecAgg.bytes_to_ndarray(b) for b in result[SecAgg.Key.MASKED_PARAMETERS]]
        # Values modulo 2^32 fit 32 bits: half of Flower's int64 on the wire, as many bytes as float32 weights
        result[SecAgg.Key.MASKED_PARAMETERS] = [SecAgg.ndarray_to_bytes(m.astype(np.uint32)) for m in masked]
        del content[ARRAYS]  # the update leaves the node masked only
    else:
        result = SecAgg.unmask(state, configs)
    context.state.config_records[SecAgg.STATE] = ConfigRecord(state.to_dict())
    content[SecAgg.CONFIGS] = ConfigRecord(result, False)
    return Message(content, reply_to=msg)


def _size(content: RecordDict) -> int:
    """Bytes of a message's arrays and config values (what travels, give or take the envelope)."""
    size = 0
    for record in content.array_records.values():
        size += sum(len(a.data) for a in record.values())
    for record in content.config_records.values():
        for value in record.values():
            items = value if isinstance(value, list) else [value]
            size += sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in items)
    return size
