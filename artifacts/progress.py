"""What `odt generate` is doing while it works: each stage (load, export, gradients, verify, planner candidates,
publish) as it starts and ends.

On a terminal the current stage stands on one tqdm line (stderr) whose clock runs, and each finished stage stays
above it with its time; piped, each stage is one line on stdout when it starts and one when it ends, flushed, so
a log shows where a long run is, as `odt train`'s epoch lines do (stderr keeps a failure's one error line).
Quiet unless a caller turns it on (:func:`reporting`: the CLI without ``--json``); the library's ``generate``
prints nothing by default.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

from tqdm import tqdm

__all__ = ["reporting", "stage", "note"]

SHOWN_DEPTH = 2
"""Stages nested deeper (the generate of each planner candidate) get no lines of their own."""


class _Reporter:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.terminal = sys.stderr.isatty()
        self.bar: tqdm | None = None
        self.depth = 0

    def begin(self, what: str) -> None:
        if not self.terminal:
            self._line(f"{what} ...")
            return
        if self.bar is None:
            self.bar = tqdm(total=None, bar_format="{desc} [{elapsed}]", leave=False, file=sys.stderr)
            threading.Thread(target=self._tick, args=(self.bar,), daemon=True).start()
        self.bar.set_description_str(f"{self.prefix}: {what}", refresh=True)

    def end(self, what: str, seconds: float, ok: bool) -> None:
        self._line(f"{what}: {seconds:.1f} s" if ok else f"{what}: failed after {seconds:.1f} s")

    def _line(self, text: str) -> None:
        if self.depth > SHOWN_DEPTH:  # a planner candidate's own stages: on the terminal's live line only
            return
        line = f"{self.prefix}: {'  ' * max(self.depth - 1, 0)}{text}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, flush=True)

    def _tick(self, bar: tqdm) -> None:  # the stage's clock runs between stages too
        while self.bar is bar:
            bar.refresh()
            time.sleep(1.0)

    def close(self) -> None:
        if self.bar is not None:
            bar, self.bar = self.bar, None
            bar.close()


_ACTIVE: ContextVar[_Reporter | None] = ContextVar("odt_generate_progress", default=None)


@contextmanager
def reporting(enabled: bool = True, prefix: str = "odt generate") -> Iterator[None]:
    """Within: :func:`stage` and :func:`note` report on stderr (``enabled`` False: silent, as outside)."""
    if not enabled:
        yield
        return
    reporter = _Reporter(prefix)
    token = _ACTIVE.set(reporter)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        reporter.close()


@contextmanager
def stage(what: str) -> Iterator[None]:
    """One stage of the work, reported as it starts and with its time when it ends (nested stages indent)."""
    reporter = _ACTIVE.get()
    if reporter is None:
        yield
        return
    reporter.depth += 1
    start, ok = time.monotonic(), False
    reporter.begin(what)
    try:
        yield
        ok = True
    finally:
        reporter.end(what, time.monotonic() - start, ok)
        reporter.depth -= 1


def note(text: str) -> None:
    """A result worth a line of its own while the work goes on (a planner candidate's measured peak)."""
    reporter = _ACTIVE.get()
    if reporter is not None:
        reporter._line(text)
