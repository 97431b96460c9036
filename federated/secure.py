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
- Client: :func:`secure_mod` (:mod:`federated.secure_client`) answers the stages and, in the collect
  stage, masks what the ClientApp's train handler returned (the update: trained minus global
  weights). Each ciphertext of shares goes under a one-off key, so that a node accused of sending
  shares that do not open can prove otherwise, for that ciphertext only (the prove stage).

The server never holds a client's update in the clear: only masked vectors, which are uniform
modulo 2^32 until summed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
from flwr.app import Message, MessageType
from flwr.serverapp import Grid

from .secure_checks import group_size, levels_for
from .secure_client import secure_mod
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
    shift_bound: float | None = None  # the most one client could move an element of the average (shift_bound)
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
