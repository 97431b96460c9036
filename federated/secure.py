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

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
from cryptography.fernet import InvalidToken
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.serverapp import Grid

from .flower_internals import SecAgg
from .protocol import ARRAYS, METRICS, from_arrays
from .secure_checks import REJECTED, group_size, levels_for
from .secure_round import SecureRound

__all__ = ["SecureSettings", "SecureRoundLog", "SecureGrid", "secure_mod", "group_size", "levels_for"]


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
    """What the server held and decided in one secure round (tests read it: masked vectors only)."""

    sampled: list[int] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)  # node -> the stage it vanished in (not in the sum)
    excluded: dict[int, str] = field(default_factory=dict)  # node -> how it broke the protocol (not in the sum)
    flagged: dict[int, str] = field(default_factory=dict)  # node -> what went wrong after its update was summed
    refused: str | None = None  # why the unmasked sum was not applied (None: it was)
    masked: dict[int, list[np.ndarray]] = field(default_factory=dict)  # node -> its masked vector
    bytes_up: dict[int, int] = field(default_factory=dict)  # node -> bytes it sent in all stages
    bytes_down: dict[int, int] = field(default_factory=dict)


class SecureGrid:
    """A Grid whose TRAIN round runs SecAgg+ and answers with one reply, the aggregate (none when the
    sum is refused: see :attr:`SecureRoundLog.refused`); all else is the grid's."""

    def __init__(self, grid: Grid, settings: SecureSettings) -> None:
        self._grid, self.settings = grid, settings
        self.rounds: list[SecureRoundLog] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        if not messages or messages[0].metadata.message_type != MessageType.TRAIN:
            return self._grid.send_and_receive(messages, timeout=timeout)
        record = SecureRoundLog(sampled=[t.metadata.dst_node_id for t in messages])
        self.rounds.append(record)
        reply = SecureRound(self._grid, self.settings, messages, timeout, record).run()
        return [] if reply is None else [reply]


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
        rejected = _keep_usable_sources(state, configs)
        result = SecAgg.collect_masked_vectors(state, configs, count, SecAgg.ndarrays_to_parameters(update))
        result[REJECTED] = rejected
        masked = [SecAgg.bytes_to_ndarray(b) for b in result[SecAgg.Key.MASKED_PARAMETERS]]
        # Values modulo 2^32 fit 32 bits: half of Flower's int64 on the wire, as many bytes as float32 weights
        result[SecAgg.Key.MASKED_PARAMETERS] = [SecAgg.ndarray_to_bytes(m.astype(np.uint32)) for m in masked]
        del content[ARRAYS]  # the update leaves the node masked only
    else:
        result = SecAgg.unmask(state, configs)
    context.state.config_records[SecAgg.STATE] = ConfigRecord(state.to_dict())
    content[SecAgg.CONFIGS] = ConfigRecord(result, False)
    return Message(content, reply_to=msg)


def _keep_usable_sources(state: Any, configs: ConfigRecord) -> list[int]:
    """Drop from the collect stage's ``configs`` the ciphertexts this node cannot use (a source it has
    no key with or saw before, a token that does not decrypt, a plaintext naming another sender or
    receiver) and return their sources. Flower's client would raise on the first; a hostile peer
    could then stop every round. The server breaks up the pairs named here."""
    sources, ciphertexts, rejected = [], [], []
    for source, ciphertext in zip(configs[SecAgg.Key.SOURCE_LIST], configs[SecAgg.Key.CIPHERTEXT_LIST]):
        usable = source in state.ss2_dict and source not in sources
        if usable:
            try:
                plaintext = SecAgg.decrypt(state.ss2_dict[source], ciphertext)
                sender, receiver, _, _ = SecAgg.share_keys_plaintext_separate(plaintext)
                usable = sender == source and receiver == state.nid
            except (InvalidToken, ValueError, TypeError):
                usable = False
        if usable:
            sources.append(source)
            ciphertexts.append(ciphertext)
        else:
            rejected.append(source)
    configs[SecAgg.Key.SOURCE_LIST], configs[SecAgg.Key.CIPHERTEXT_LIST] = sources, ciphertexts
    return rejected
