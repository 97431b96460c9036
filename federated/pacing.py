"""How long a round waits for replies, and what the console shows while it waits.

A fixed ``round-timeout`` lives on a thin margin: MiniLM LoRA rounds with 6 clients took 64-106 s
on 2 cores against the old default of 120 s, and 128-167 s with one more job on the machine, so a
good run ended in exit 1 after many minutes. By default (``round-timeout`` 0) the wait follows the
work: the first exchange of each kind in a run (train, evaluate, each secure-aggregation stage; the
first train also loads every client's model) may take :data:`FIRST_WAIT` seconds, each later one
:data:`MARGIN` times the slowest complete exchange of its kind so far, never less than
:data:`MIN_WAIT`. A positive ``round-timeout`` is used as given.

:class:`PacedGrid` applies the wait to every exchange with the nodes (train, evaluate, and each
secure-aggregation stage) and prints how many replies have come in while a long one runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from flwr.app import Message

__all__ = ["RoundPace", "PacedGrid", "FIRST_WAIT", "MIN_WAIT", "MARGIN", "PROGRESS_EVERY"]

FIRST_WAIT = 900.0
"""Seconds the first exchange of a run may take when the wait follows the work."""
MIN_WAIT = 120.0
MARGIN = 4.0
PROGRESS_EVERY = 15.0
"""Seconds between progress lines of an exchange that is still waiting for replies."""


@dataclass
class RoundPace:
    """The wait for the next exchange of a kind: ``fixed`` seconds, or (``fixed`` 0) following the work."""

    fixed: float = 0.0
    slowest: dict[str, float] = field(default_factory=dict)
    """Kind -> the longest exchange of that kind so far in which every node replied."""

    def wait(self, kind: str) -> float:
        if self.fixed > 0:
            return self.fixed
        return max(MIN_WAIT, MARGIN * self.slowest[kind]) if kind in self.slowest else FIRST_WAIT

    def observe(self, kind: str, seconds: float) -> None:
        self.slowest[kind] = max(self.slowest.get(kind, 0.0), seconds)


class PacedGrid:
    """A Grid whose exchanges wait :meth:`RoundPace.wait` seconds (whatever timeout the caller passed),
    pull replies (every 0.1 s at first, every second once an exchange has taken 10 s) and print progress
    on long waits; everything else is the grid's."""

    def __init__(self, grid: Any, pace: RoundPace, *, offset: Callable[[], int] = lambda: 0,
                 say: Callable[[str], None] = print) -> None:  # fmt: skip
        self._grid, self.pace, self._offset, self._say = grid, pace, offset, say
        self.used = pace.wait("")
        """The wait the last exchange was given (what a missed reply is reported against)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        if not messages:
            return []
        kind = _kind(messages[0])
        self.used = wait = self.pace.wait(kind)
        found = _server_round(messages[0])
        what = f"round {found + self._offset()} {messages[0].metadata.message_type}" if found else "exchange"
        start = time.monotonic()
        pending = set(self._grid.push_messages(messages))
        total, replies = len(pending), []
        shown = start
        while pending:
            new = list(self._grid.pull_messages(pending))
            replies += new
            pending -= {m.metadata.reply_to_message_id for m in new}
            now = time.monotonic()
            if not pending or now - start >= wait:
                break
            if now - shown >= PROGRESS_EVERY:
                shown = now
                self._say(f"odt: {what}: {len(replies)} of {total} replies after {now - start:.0f} s "
                          f"(waiting up to {wait:.0f} s)")  # fmt: skip
            time.sleep(0.1 if now - start < 10 else 1.0)  # quick exchanges stay quick; long ones poll once a second
        if not pending:
            self.pace.observe(kind, time.monotonic() - start)
        return replies


def _server_round(message: Message) -> int | None:
    """The round a message belongs to (its config's ``server-round``, or a numeric group id), if it says."""
    for record in message.content.config_records.values():
        value = record.get("server-round")
        if isinstance(value, int):
            return value
    group = message.metadata.group_id
    return int(group) if group.isdigit() else None


def _kind(message: Message) -> str:
    """An exchange's kind: its message type and, for secure aggregation, the stage."""
    stages = [str(v) for r in message.content.config_records.values() for k, v in r.items() if k.endswith("stage")]
    return ":".join([message.metadata.message_type, *stages[:1]])
