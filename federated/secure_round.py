"""The server's side of one SecAgg+ round: four stages, every reply checked before it is used.

:class:`federated.secure.SecureGrid` runs one :class:`SecureRound` per TRAIN round. Each stage's
replies pass :mod:`federated.secure_checks` first; a node whose reply breaks the protocol is named
and excluded, and the round goes on while enough nodes remain. The unmasked sum is applied only
if honest inputs could have produced it; otherwise the round is refused and nothing changes.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from cryptography.exceptions import UnsupportedAlgorithm
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from .errors import RoundFailedError
from .flower_internals import SecAgg, aggregate_metricrecords
from .protocol import ARRAYS, CONFIG, METRICS, from_arrays, to_arrays
from .secure_checks import (
    ACCUSERS,
    EPHEMERAL,
    MOD_RANGE,
    PROVE,
    REJECTED,
    SECRETS,
    RecoveryError,
    accusation_verdict,
    destinations_problem,
    group_size,
    key_pair_problem,
    key_problem,
    levels_for,
    quantization_problem,
    recover,
    reply_problem,
    share_problem,
    shift_bound,
    sum_problem,
    token_problem,
)

if TYPE_CHECKING:
    from .secure import SecureRoundLog, SecureSettings

__all__ = ["SecureRound"]

log = logging.getLogger(__name__)


class SecureRound:
    """One secure round: the four stages, each reply checked before it is used (a peer may be hostile)."""

    def __init__(self, grid: Grid, settings: SecureSettings, tasks: list[Message], timeout: float | None,
                 record: SecureRoundLog) -> None:  # fmt: skip
        self.grid, self.settings, self.tasks, self.timeout, self.record = grid, settings, tasks, timeout, record
        self.content = {t.metadata.dst_node_id: t.content for t in tasks}
        config = self.content[tasks[0].metadata.dst_node_id].config_records.get(CONFIG, {})
        self.group = str(config.get("server-round", tasks[0].metadata.group_id))  # the stages' group: the round
        nodes = list(self.content)
        count = len(nodes)
        if count < 2:
            raise RoundFailedError(f"secure aggregation needs at least 2 sampled nodes, got {count}: raise min-nodes.")
        shares = group_size(count) if not settings.shares else round(settings.shares * count)
        self.shares = count if shares <= 2 or shares >= count else shares + 1 - shares % 2  # odd, as Flower's
        self.threshold = max(2, round(settings.threshold * self.shares))
        order = nodes[:]
        random.Random(self.group).shuffle(order)  # the ring the groups are cut from
        half = self.shares // 2
        self.groups = {n: {order[(i + d) % count] for d in range(-half, half + 1)} for i, n in enumerate(order)}
        start = from_arrays(self.content[nodes[0]][ARRAYS])
        self.start, self.names = start, sorted(start)  # the order both sides flatten an update in
        self.shapes = [(1,), *(start[n].shape for n in self.names)]  # the weight factor, then the tensors
        self.levels = settings.quantization or levels_for(count)
        problem = quantization_problem(settings.clipping_range, self.levels, count, settings.max_weight)
        if problem:
            raise RoundFailedError(f"secure aggregation: {problem}")

    def exchange(self, stage: str, outgoing: dict[int, RecordDict],
                 check: Callable[[int, RecordDict], str | None] | None = None,
                 required: bool = True) -> dict[int, RecordDict]:  # fmt: skip
        """Send one stage's tasks; the sound replies by node. A node that does not answer is dropped;
        one whose reply the stage cannot use (``check(node, content)`` names why) is excluded. A
        ``required`` stage fails the round when fewer than the threshold answer usably."""
        sent = [Message(c, dst_node_id=n, message_type=MessageType.TRAIN, group_id=self.group)
                for n, c in outgoing.items()]  # fmt: skip
        record = self.record
        for node, task in outgoing.items():
            record.bytes_down[node] = record.bytes_down.get(node, 0) + _size(task)
        replies = {}
        for reply in self.grid.send_and_receive(sent, timeout=self.timeout):
            node = reply.metadata.src_node_id
            if node not in outgoing or node in replies or reply.has_error():
                continue
            record.bytes_up[node] = record.bytes_up.get(node, 0) + _size(reply.content)
            problem = reply_problem(stage, reply.content, self.shapes, self.settings.max_weight)
            problem = problem or (check(node, reply.content) if check else None)
            if problem is None:
                replies[node] = reply.content
            else:
                self.exclude(node, f"its {stage} reply broke the protocol: {problem}", stage)
        for node in outgoing:
            if node in replies or node in record.excluded or node in record.flagged:
                continue
            if stage == SecAgg.Stage.UNMASK:
                record.flagged[node] = "it left at the unmask stage (its update is in the sum)"
            else:
                record.dropped[node] = stage
        if required:
            self.enough(len(replies), stage)
        return replies

    def exclude(self, node: int, reason: str, stage: str = "") -> None:
        """Take ``node`` out of the round for ``reason``; at the unmask stage its update is already in
        the sum (only its shares are refused), so it is flagged instead."""
        if stage == SecAgg.Stage.UNMASK:
            log.warning("secure aggregation: node %s: %s (its update is in the sum)", node, reason)
            self.record.flagged.setdefault(node, f"{reason} (its update is in the sum)")
            return
        log.warning("secure aggregation: node %s is out of the round: %s", node, reason)
        self.record.excluded[node] = reason

    def enough(self, answered: int, stage: str) -> None:
        if answered < self.threshold:
            raise RoundFailedError(
                f"secure aggregation: {answered} of {len(self.content)} nodes answered the {stage} stage usably, "
                f"fewer than the {self.threshold} needed to unmask (secagg-threshold). "
                "Raise round-timeout or lower the threshold; the round log names each node that was left out."
            )

    def stage(self, name: str, **values: Any) -> RecordDict:
        return RecordDict({SecAgg.CONFIGS: ConfigRecord({SecAgg.Key.STAGE: name, **values})})

    def run(self) -> Message | None:
        setup = dict(sample_num=len(self.content), share_num=self.shares, threshold=self.threshold,
                     clipping_range=self.settings.clipping_range, target_range=self.levels,
                     mod_range=MOD_RANGE, max_weight=self.settings.max_weight)  # fmt: skip
        keys = self.exchange(SecAgg.Stage.SETUP, {n: self.stage(SecAgg.Stage.SETUP, **setup) for n in self.content},
                             lambda node, content: key_pair_problem(_configs(content)))  # fmt: skip
        public = self.unique_keys(keys)
        peers = {n: (self.groups[n] & set(public)) - {n} for n in public}

        def share_keys(node: int) -> RecordDict:
            record_ = self.stage(SecAgg.Stage.SHARE_KEYS)
            for other in sorted(peers[node] | {node}):
                record_[SecAgg.CONFIGS][str(other)] = public[other]
            return record_

        def sent_shares(node: int, content: RecordDict) -> str | None:
            configs = _configs(content)
            tokens = (token_problem(t) for t in configs[SecAgg.Key.CIPHERTEXT_LIST])
            keys = (key_problem(k) and f"a one-off key that is {key_problem(k)}" for k in configs[EPHEMERAL])
            return destinations_problem(configs[SecAgg.Key.DESTINATION_LIST], peers[node]) or next(
                (p for p in (*tokens, *keys) if p), None)  # fmt: skip

        shared = self.exchange(SecAgg.Stage.SHARE_KEYS, {n: share_keys(n) for n in public}, sent_shares)
        sent = {src: dict(zip(_configs(reply)[SecAgg.Key.DESTINATION_LIST],
                              zip(_configs(reply)[SecAgg.Key.CIPHERTEXT_LIST], _configs(reply)[EPHEMERAL])))
                for src, reply in shared.items()}  # fmt: skip
        forward = {dst: {src: sent[src][dst] for src in shared if dst in sent[src]} for dst in shared}

        def collect(node: int) -> RecordDict:
            task = RecordDict({k: v for k, v in self.content[node].items()})
            task[SecAgg.CONFIGS] = ConfigRecord({SecAgg.Key.STAGE: SecAgg.Stage.COLLECT_MASKED_VECTORS,
                                                 SecAgg.Key.SOURCE_LIST: list(forward[node]),
                                                 SecAgg.Key.CIPHERTEXT_LIST: [c for c, _ in forward[node].values()],
                                                 EPHEMERAL: [k for _, k in forward[node].values()]})  # fmt: skip
            return task

        def rejections(node: int, content: RecordDict) -> str | None:
            rejected = _configs(content).get(REJECTED, [])
            if not isinstance(rejected, list) or not set(rejected) <= set(forward[node]):
                return f"{REJECTED!r} must list sources it was sent"
            return None

        masked = self.exchange(SecAgg.Stage.COLLECT_MASKED_VECTORS, {n: collect(n) for n in forward}, rejections)
        accepted = {n: set(forward[n]) - set(_configs(c).get(REJECTED, [])) for n, c in masked.items()}
        active = self.settle_accusations(set(masked), accepted, sent, public)
        dead = set(shared) - active
        active = self.unmaskable(active, accepted, dead)
        for node in sorted(active):
            self.record.masked[node] = [
                SecAgg.bytes_to_ndarray(b).astype(np.int64)
                for b in _configs(masked[node])[SecAgg.Key.MASKED_PARAMETERS]
            ]
        return self.unmask({n: masked[n] for n in active}, accepted, public, dead)

    def unique_keys(self, keys: dict[int, RecordDict]) -> dict[int, list[bytes]]:
        """Node -> (pk1, pk2) of the nodes whose keys are their own: a key that two nodes sent is
        someone's copy, and every honest peer would refuse the round's key list."""
        public = {n: [_configs(c)[SecAgg.Key.PUBLIC_KEY_1], _configs(c)[SecAgg.Key.PUBLIC_KEY_2]]
                  for n, c in keys.items()}  # fmt: skip
        owners: dict[bytes, list[int]] = {}
        for node, pair in public.items():
            for key in pair:
                owners.setdefault(key, []).append(node)
        for nodes in (n for n in owners.values() if len(n) > 1):  # who copied whom cannot be told
            for node in nodes:
                others = [n for n in nodes if n != node]
                self.exclude(node, f"its setup reply broke the protocol: node {others[0]} sent the same public key")
        public = {n: pair for n, pair in public.items() if n not in self.record.excluded}
        self.enough(len(public), SecAgg.Stage.SETUP)
        return public

    def settle_accusations(self, active: set[int], accepted: dict[int, set[int]],
                           sent: dict[int, dict[int, tuple[bytes, bytes]]], public: dict[int, list[bytes]]) -> set[int]:
        """The nodes left when every accusation is settled: a summed node that did not accept a summed
        peer's shares accuses it, and the peer reveals the one-off key of that ciphertext (the prove
        stage). The server opens it: the liar, or a peer that sent shares that do not open (or would
        not reveal the key), is excluded and named; the other stays. A pair's masks cancel only if both
        ends added them, so no accusation is left standing."""  # fmt: skip
        accusers: dict[int, list[int]] = {}
        for node in sorted(active):
            for peer in sorted((set(sent) & active) - accepted[node] - {node}):
                if node in sent[peer]:
                    accusers.setdefault(peer, []).append(node)
        if not accusers:
            return active

        def answers(node: int, content: RecordDict) -> str | None:
            count = len(_configs(content)[SECRETS])
            return None if count == len(accusers[node]) else f"{count} keys for {len(accusers[node])} accusers"

        tasks = {n: self.stage(PROVE, **{ACCUSERS: a}) for n, a in accusers.items()}
        proofs = self.exchange(PROVE, tasks, answers, required=False)
        faults: dict[int, list[str]] = {}
        for peer, nodes in sorted(accusers.items()):
            if peer in self.record.excluded:  # its prove reply broke the protocol
                active.discard(peer)
            elif peer not in proofs:
                faults.setdefault(peer, []).append(f"it did not reveal the keys of its shares to nodes {nodes}, "
                                                   "which said they could not decrypt them")  # fmt: skip
            else:
                for node, secret in zip(nodes, _configs(proofs[peer])[SECRETS]):
                    who, why = _verdict(peer, node, secret, sent[peer][node], public[node][1])
                    faults.setdefault(who, []).append(why)
        for node, reasons in sorted(faults.items()):
            self.record.dropped.pop(node, None)
            self.exclude(node, "; ".join(reasons))
            active.discard(node)
        self.enough(len(active), SecAgg.Stage.COLLECT_MASKED_VECTORS)
        return active

    def unmaskable(self, active: set[int], accepted: dict[int, set[int]], dead: set[int]) -> set[int]:
        """The summed nodes whose masks the others' shares can remove: each one's seed, and the key of
        each node that is not summed but whose shares they accepted, needs ``threshold`` holders."""
        while True:
            lost: dict[int, str] = {}
            for owner in sorted(active | dead):
                holders = {m for m in active if owner in accepted[m]} | ({owner} & active)
                if owner in active and len(holders) < self.threshold:
                    lost[owner] = f"only {len(holders)} summed nodes hold its shares, {self.threshold} needed"
                elif owner in dead and 0 < len(holders) < self.threshold:
                    why = f"it added masks with node {owner}, whose key only {len(holders)} summed nodes hold"
                    lost.update({m: f"{why} ({self.threshold} needed to remove the masks)" for m in holders})
            if not lost:
                self.enough(len(active), SecAgg.Stage.COLLECT_MASKED_VECTORS)
                return active
            for node, reason in lost.items():
                self.exclude(node, reason)
                active.discard(node)
                dead.add(node)

    def unmask(self, masked: dict[int, RecordDict], accepted: dict[int, set[int]], public: dict[int, list[bytes]],
               dead: set[int]) -> Message | None:  # fmt: skip
        """The unmask stage, the secrets rebuilt from the shares that fit, and the checked average."""
        active = set(masked)
        asked = {n: (sorted((accepted[n] | {n}) & active), sorted(accepted[n] & dead)) for n in active}

        def shares_asked(node: int, content: RecordDict) -> str | None:
            configs = _configs(content)
            if list(configs[SecAgg.Key.NODE_ID_LIST]) != asked[node][0] + asked[node][1]:
                return "it revealed shares of other nodes than those it was asked for"
            problems = (share_problem(s, self.shares) for s in configs[SecAgg.Key.SHARE_LIST])
            return next((p for p in problems if p), None)

        tasks = {n: self.stage(SecAgg.Stage.UNMASK, **{SecAgg.Key.ACTIVE_NODE_ID_LIST: asked[n][0],
                                                       SecAgg.Key.DEAD_NODE_ID_LIST: asked[n][1]})
                 for n in active}  # fmt: skip
        revealed = self.exchange(SecAgg.Stage.UNMASK, tasks, shares_asked)
        needed = active | {x for x in dead if any(x in accepted[n] for n in active)}  # others added no mask
        shares: dict[int, dict[int, bytes]] = {n: {} for n in needed}
        for holder, content in revealed.items():
            configs = _configs(content)
            for owner, share in zip(configs[SecAgg.Key.NODE_ID_LIST], configs[SecAgg.Key.SHARE_LIST]):
                shares[owner][holder] = share
        secrets = {}
        for owner, held in sorted(shares.items()):
            what = "mask seed" if owner in active else "secret key"
            valid = None if owner in active else _opens(public[owner][0])
            try:
                secrets[owner], bad = recover(held, self.threshold, valid)
            except RecoveryError as exc:
                return self.refuse(f"node {owner}'s {what} could not be rebuilt from {len(held)} shares ({exc})")
            for holder in sorted(bad):
                self.exclude(holder, f"its share of node {owner}'s {what} does not fit the other shares",
                             SecAgg.Stage.UNMASK)  # fmt: skip
        vectors = {n: self.record.masked[n] for n in active}
        keys = {n: secrets[n] for n in needed - active}
        vector = unmask_sum(vectors, {n: secrets[n] for n in active}, keys, accepted, public)
        counts = {n: int(c[METRICS]["num-examples"]) for n, c in masked.items()}
        factor = sum(round(count / self.settings.max_weight * self.levels) for count in counts.values())
        self.record.shift_bound = shift_bound(len(active), self.settings.clipping_range, self.levels, factor)
        problem = sum_problem(vector, len(active), self.levels, factor)
        if problem:
            return self.refuse(f"the unmasked sum of {len(active)} nodes is not one honest updates can make: {problem}")
        total, vector = SecAgg.factor_extract(vector)
        summed = SecAgg.dequantize(vector, self.settings.clipping_range, self.levels)
        offset = -(len(active) - 1) * self.settings.clipping_range
        deltas = [(v + offset) * (self.levels / total) for v in summed]
        weights = {name: self.start[name] + delta.astype(np.float32) for name, delta in zip(self.names, deltas)}
        if not all(np.isfinite(w).all() for w in weights.values()):
            return self.refuse("the average is not finite")
        return self.reply(weights, masked)

    def refuse(self, reason: str) -> None:
        log.warning("secure aggregation: the round's sum is refused: %s", reason)
        self.record.refused = reason
        return None

    def reply(self, weights: dict[str, np.ndarray], masked: dict[int, RecordDict]) -> Message:
        """The one reply the strategy sees: the average, with the nodes' clear metrics averaged alike."""
        summary = aggregate_metricrecords([masked[n] for n in sorted(masked)], "num-examples")
        summary["num-examples"] = sum(int(m[METRICS]["num-examples"]) for m in masked.values())
        summary["manifest-tag"] = next(iter(masked.values()))[METRICS].get("manifest-tag")
        summary.pop("client", None)
        reply = RecordDict({ARRAYS: to_arrays(weights), METRICS: MetricRecord(summary)})
        first = next(t for t in self.tasks if t.metadata.dst_node_id in masked)
        return Message(reply, reply_to=first)


def unmask_sum(
    masked: dict[int, list[np.ndarray]],
    seeds: dict[int, bytes],
    keys: dict[int, bytes],
    accepted: dict[int, set[int]],
    public: dict[int, list[bytes]],
) -> list[np.ndarray]:
    """The quantized sum under ``masked`` (node -> masked vector): each node's own mask comes off
    with its ``seeds`` entry; a node that shared keys and is not summed (``keys``: its rebuilt
    secret key) had pairwise masks added by the summed nodes that ``accepted`` its shares, and those
    come off too."""
    nodes = sorted(masked)
    vector = masked[nodes[0]]
    for node in nodes[1:]:
        vector = SecAgg.parameters_addition(vector, masked[node])
    vector = SecAgg.parameters_mod(vector, MOD_RANGE)
    shapes = SecAgg.get_parameters_shape(vector)
    for seed in seeds.values():
        vector = SecAgg.parameters_subtraction(vector, SecAgg.pseudo_rand_gen(seed, MOD_RANGE, shapes))
    for absent, key in keys.items():
        for other in (n for n in nodes if absent in accepted[n]):
            shared = SecAgg.generate_shared_key(SecAgg.bytes_to_private_key(key),
                                                SecAgg.bytes_to_public_key(public[other][0]))  # fmt: skip
            combine = SecAgg.parameters_addition if absent > other else SecAgg.parameters_subtraction
            vector = combine(vector, SecAgg.pseudo_rand_gen(shared, MOD_RANGE, shapes))
    return SecAgg.parameters_mod(vector, MOD_RANGE)


def _verdict(peer: int, node: int, secret: bytes, sent: tuple[bytes, bytes], key: bytes) -> tuple[int, str]:
    """The node at fault when ``node`` accused ``peer``, and why: ``secret`` is the key ``peer`` revealed
    for its ciphertext and one-off public key ``sent``, ``key`` the accuser's encryption key."""
    problem = accusation_verdict(secret, sent[1], key, sent[0], peer, node)
    if problem is None:
        return node, f"it said it could not decrypt the shares of node {peer}, which open under the key {peer} revealed"
    return peer, f"node {node} could not decrypt its shares: {problem}"


def _opens(public_key: bytes) -> Callable[[bytes], bool]:
    """Whether a rebuilt secret key is the one behind ``public_key`` (a key share can be checked)."""

    def valid(secret: bytes) -> bool:
        try:
            key = SecAgg.bytes_to_private_key(secret)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            return False
        return SecAgg.public_key_to_bytes(key.public_key()) == public_key

    return valid


def _configs(content: RecordDict) -> ConfigRecord:
    return content.config_records[SecAgg.CONFIGS]


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
