"""Nodes in this process: a Grid that hands each message to its node's ClientApp function.

For measuring and testing a protocol's own cost without processes or a network (the deployment
tests run it over real SuperLinks and SuperNodes): each node keeps its Context between messages,
as a SuperNode does, and ``vanish`` (node -> SecAgg+ stage) makes a node stop answering from that
stage on, as a phone that loses its connection mid-round.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid

from .flower_internals import SecAgg, act_as_server_app

__all__ = ["LoopbackGrid"]

Handler = Callable[[Message, Context], Message]


class LoopbackGrid(Grid):
    def __init__(self, handlers: dict[int, Handler], vanish: dict[int, str] | None = None) -> None:
        act_as_server_app()
        self.handlers, self.vanish = handlers, vanish or {}
        self.contexts = {node: Context(1, node, {}, RecordDict(), {}) for node in handlers}
        self.gone: set[int] = set()
        self.seconds: dict[int, float] = {node: 0.0 for node in handlers}
        """Time each node spent answering (its share of a round's work)."""

    def get_node_ids(self) -> Iterable[int]:
        return list(self.handlers)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            configs = message.content.config_records.get(SecAgg.CONFIGS)
            if configs is not None and self.vanish.get(node) == configs.get(SecAgg.Key.STAGE):
                self.gone.add(node)
            if node in self.gone:
                continue
            start = time.perf_counter()
            replies.append(self.handlers[node](message, self.contexts[node]))
            self.seconds[node] += time.perf_counter() - start
        return replies

    create_message = run = set_run = push_messages = pull_messages = None  # type: ignore[assignment]
