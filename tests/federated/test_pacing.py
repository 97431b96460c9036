"""How long a round waits: fixed, or following the work; progress while it waits.

Every federated run in these tests (simulations and deployments) goes through PacedGrid over Flower's
real grids. Here the replies' timing is scripted on a fake clock, which a real run cannot do exactly:
a grid whose nodes reply at given seconds."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from federated import pacing
from federated.pacing import FIRST_WAIT, MARGIN, MIN_WAIT, PacedGrid, RoundPace


def test_the_wait_is_fixed_or_follows_the_slowest_complete_exchange_of_its_kind():
    assert RoundPace(45.0).wait("train") == 45.0
    pace = RoundPace()
    assert pace.wait("train") == FIRST_WAIT  # the first exchange also loads every client's model
    pace.observe("train", 10.0)
    assert pace.wait("train") == MIN_WAIT  # 4 x 10 s is below the floor
    pace.observe("train", 90.0)
    pace.observe("train", 60.0)
    assert pace.wait("train") == MARGIN * 90.0
    assert pace.wait("evaluate") == FIRST_WAIT  # kinds are paced apart: a quick query says nothing of training


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _ScriptedGrid:
    """Replies to message i once the clock reaches ``at[i]`` seconds (None: never)."""

    def __init__(self, clock: _Clock, at: list[float | None]) -> None:
        self.clock, self.at, self.pushed = clock, at, {}

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        for index, message in enumerate(messages):
            self.pushed[f"m{index}"] = (self.at[index], message)
        return list(self.pushed)

    def pull_messages(self, ids):  # type: ignore[no-untyped-def]
        due = [i for i in ids if self.pushed[i][0] is not None and self.pushed[i][0] <= self.clock.now]
        replies = []
        for i in due:
            reply = Message(RecordDict(), reply_to=self.pushed[i][1])
            reply.metadata.__dict__["_reply_to_message_id"] = i
            replies.append(reply)
        return replies

    def get_node_ids(self):  # type: ignore[no-untyped-def]
        return [1, 2, 3]


def _round(number: int) -> list[Message]:
    content = RecordDict({"config": ConfigRecord({"server-round": number})})
    return [Message(content, dst_node_id=n, message_type=MessageType.TRAIN) for n in (1, 2, 3)]


@pytest.fixture
def clock(monkeypatch):  # type: ignore[no-untyped-def]
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # Flower stamps messages with it
    fake = _Clock()
    monkeypatch.setattr(pacing, "time", fake)
    return fake


def test_a_long_exchange_prints_progress_and_ends_at_its_wait(clock):
    lines: list[str] = []
    grid = PacedGrid(_ScriptedGrid(clock, [5.0, 20.0, None]), RoundPace(40.0), offset=lambda: 2, say=lines.append)
    replies = grid.send_and_receive(_round(1), timeout=999.0)  # the caller's timeout gives way to the pace
    assert len(replies) == 2 and 40.0 <= clock.now < 41.5
    assert lines == ["odt: round 3 train: 1 of 3 replies after 15 s (waiting up to 40 s)",
                     "odt: round 3 train: 2 of 3 replies after 30 s (waiting up to 40 s)"]  # fmt: skip
    assert grid.used == 40.0 and grid.pace.slowest == {}  # an exchange someone missed does not set the pace
    assert grid.get_node_ids() == [1, 2, 3]  # everything else is the grid's


def test_a_complete_exchange_sets_the_next_wait(clock):
    lines: list[str] = []
    grid = PacedGrid(_ScriptedGrid(clock, [3.0, 50.0, 50.0]), RoundPace(), say=lines.append)
    assert len(grid.send_and_receive(_round(1))) == 3
    assert grid.used == FIRST_WAIT and grid.pace.wait("train") == pytest.approx(MARGIN * 50.0, abs=MARGIN * 1.0)
    assert len(lines) == 3  # at 15, 30 and 45 s
