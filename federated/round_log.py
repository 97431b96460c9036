"""What the server saw in each round, and why a round cannot go on."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

__all__ = ["RoundLog", "round_problem", "first_line", "slow_round"]


@dataclass
class RoundLog:
    """What the guard saw in one round: bytes moved and updates it excluded."""

    bytes_down: int = 0
    bytes_up: dict[int, int] = field(default_factory=dict)
    excluded: dict[int, str] = field(default_factory=dict)
    clipped: dict[int, str] = field(default_factory=dict)
    flagged: dict[int, str] = field(default_factory=dict)  # node -> a protocol fault after its update was summed
    refused: str | None = None  # why the round's (secure) sum was not applied
    shift_bound: float | None = None  # a secure round: the most one client could move an element of the average
    train_metrics: dict[str, Any] = field(default_factory=dict)  # the strategy's aggregate of client metrics
    eval_metrics: dict[str, Any] = field(default_factory=dict)
    dp_sampled: int | None = None  # clients the DP noise is calibrated to (this round's sample)
    dp_noise_std: float | None = None
    buffers: dict[int, tuple[int, dict[str, np.ndarray]]] = field(default_factory=dict)  # node -> running stats
    eval_by_client: dict[int, dict[str, float]] = field(default_factory=dict)  # partition id -> its eval metrics
    accepted: dict[int, tuple[int, dict[str, np.ndarray]]] = field(default_factory=dict)  # node -> (count, weights)
    partitions: dict[int, int] = field(default_factory=dict)  # node -> the partition id its train reply named
    tiers: dict[int, str] = field(default_factory=dict)  # node -> the name of the tier it trained (mixed tiers)
    sampled: list[int] = field(default_factory=list)  # the nodes asked to train this round

    def key(self, node: int) -> str:
        """How the report names a client: its partition id (as evaluation does), else its node id."""
        partition = self.partitions.get(node, -1)
        return str(partition) if partition >= 0 else f"node-{node}"


def round_problem(replies: int, kept: int, min_nodes: int, excluded: Mapping[int, str]) -> str | None:
    """Why a round cannot go on (None when it can): it needs ``min_nodes`` replies and one usable update."""
    first = next(iter(excluded.items()), None)
    cause = f" The first: node {first[0]}: {first_line(first[1])}" if first else ""
    if replies == 0:
        return "no client replied within round-timeout. Raise round-timeout or check that the nodes are running."
    if replies < min_nodes:
        return f"only {replies} of the {min_nodes} nodes it needs (min-nodes) replied within round-timeout.{cause}"
    if kept == 0:
        return f"every one of the {replies} clients failed or was excluded, so nothing was trained.{cause}"
    return None


def slow_round(server_round: int, seconds: float, timeout: float) -> str | None:
    """A warning when a round took more than half of a fixed round-timeout (a busier machine would drop clients);
    with the default round-timeout (0) each wait follows the work and nothing needs raising."""
    if timeout <= 0 or seconds <= timeout / 2:
        return None
    return (f"odt: warning: round {server_round} took {seconds:.0f} s, more than half of round-timeout "
            f"({timeout:g} s): on a busier machine clients would miss it. Raise --round-timeout.")  # fmt: skip


def first_line(reason: str, limit: int = 300) -> str:
    """The client's own error out of Flower's reason (which may hold a Ray or Python traceback)."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    told = [line.split("occurred. Message: ", 1)[1].rstrip("'>") for line in lines if "occurred. Message: " in line]
    raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b: ", line)]
    if told:
        line = told[0]
    elif raised:  # "ondevice.errors.DataError: ..." -> "DataError: ..."
        name, text = raised[-1].split(": ", 1)
        line = f"{name.rsplit('.', 1)[-1]}: {text}"
    else:
        line = lines[0] if lines else reason
    return line[:limit] + ("..." if len(line) > limit else "")
