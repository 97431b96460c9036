"""Progress bars: tqdm on a terminal, nothing when output is piped or progress is off."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def progress_bar(total: int, disable: bool = False) -> Any:
    return tqdm(total=total, unit="batch", disable=disable or not sys.stderr.isatty(), leave=False, dynamic_ncols=True)


def say(line: str) -> None:
    """Print ``line`` to stdout now (above a bar on a terminal, flushed when piped): a step's result as it ends."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()
