"""uvicorn's HTTP/1.1 protocol with a deadline for a request's headers.

uvicorn times out an idle keep-alive connection, and the bridge's body guard a stalled body, but a
client that sends its headers a byte at a time (slowloris) held a connection for ever: nothing runs
until the headers end. :func:`header_deadline` closes a connection whose next request's headers
are not complete within the deadline; a request whose headers arrived is never cut.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["header_deadline"]


def header_deadline(seconds: float) -> type[H11Protocol]:
    """An H11Protocol class that closes connections whose request headers take over ``seconds``."""

    class HeaderDeadline(H11Protocol):
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._timer is not None:
                self._timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_later(seconds, self._overdue, self.cycle)

        def _overdue(self, armed: Any) -> None:
            waiting = self.cycle is None or self.cycle.response_complete  # no request's headers are in yet
            if self.cycle is armed and waiting and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
