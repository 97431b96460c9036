"""Package attributes that import their module on first use, so `import PACKAGE` (and `odt --help`) stay cheap."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Mapping, Sequence

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, table: Mapping[str, str], public: Sequence[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``table`` maps a name to the submodule defining it.

    Examples
    --------
    >>> __getattr__, __dir__ = lazy_exports(__name__, {"Trainer": ".trainer"}, __all__)  # doctest: +SKIP
    """

    def getattr_(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name], package), name)
        setattr(sys.modules[package], name, value)  # next time without this function
        return value

    def dir_() -> list[str]:
        return sorted(public)

    return getattr_, dir_
