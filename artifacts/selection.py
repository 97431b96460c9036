"""Which parameters train: a pure function from names and options to the trainable set."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Collection, Sequence

from .errors import SelectionError

__all__ = ["select_trainable", "matches"]


def matches(pattern: str, name: str) -> bool:
    """Glob match on a dotted name; a plain module path also matches everything under it."""
    if fnmatchcase(name, pattern):
        return True
    return not any(c in pattern for c in "*?[") and name.startswith(pattern + ".")


def _owner(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def select_trainable(
    names: Sequence[str],
    *,
    trainable: Sequence[str] = (),
    freeze: Sequence[str] = (),
    train_last: int | None = None,
    bias_only: bool = False,
    reachable: Collection[str] | None = None,
) -> list[str]:
    """Return the trainable subset of ``names`` (kept in their order).

    Everything trains by default; ``trainable`` globs restrict to their matches, ``train_last``
    keeps the parameters of the last N modules that own parameters (counting only modules with a
    parameter in ``reachable``, the ones the loss depends on, when given: a BERT pooler under mean
    pooling is not one of the "last 2"), ``bias_only`` keeps biases, and ``freeze`` globs remove
    their matches last.

    Examples
    --------
    >>> select_trainable(["enc.0.weight", "enc.0.bias", "head.weight"], trainable=["head"])
    ['head.weight']
    """
    for pattern in (*trainable, *freeze):
        if not any(matches(pattern, n) for n in names):
            sample = ", ".join(list(names)[:6]) + (", ..." if len(names) > 6 else "")
            raise SelectionError(f"pattern {pattern!r} matches no parameter. Parameters are: {sample}.")
    chosen = list(names)
    if trainable:
        chosen = [n for n in chosen if any(matches(p, n) for p in trainable)]
    if train_last is not None:
        if train_last < 1:
            raise SelectionError(f"--train-last must be at least 1, got {train_last}.")
        owners = list(dict.fromkeys(_owner(n) for n in names if reachable is None or n in reachable))
        last = set(owners[-train_last:])
        chosen = [n for n in chosen if _owner(n) in last]
    if bias_only:
        chosen = [n for n in chosen if n.rsplit(".", 1)[-1] == "bias"]
    chosen = [n for n in chosen if not any(matches(p, n) for p in freeze)]
    if not chosen:
        raise SelectionError(
            "no parameter is left to train with these options "
            f"(trainable={list(trainable)}, freeze={list(freeze)}, train_last={train_last}, "
            f"bias_only={bias_only}). Loosen the selection."
        )
    return chosen
