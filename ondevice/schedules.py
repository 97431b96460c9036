"""Learning-rate schedules as pure functions of the step (ORT's LinearLRScheduler swaps its counts)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["Schedule", "lr_at"]

KINDS = ("constant", "linear", "cosine")


def lr_at(step: int, *, kind: str, base: float, total: int, warmup: int = 0, min_lr: float = 0.0) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total``.

    ``linear`` and ``cosine`` ramp up linearly over ``warmup`` steps (step k gets
    ``base * (k + 1) / warmup``), then decay to ``min_lr`` at ``total`` linearly or along a
    half cosine; ``constant`` is ``base`` throughout.

    Examples
    --------
    >>> lr_at(0, kind="linear", base=1.0, total=10, warmup=2)
    0.5
    >>> lr_at(6, kind="linear", base=1.0, total=10, warmup=2)
    0.5
    """
    if kind == "constant":
        return base
    if kind not in KINDS:
        raise ConfigError(f"schedule must be one of {KINDS}, got {kind!r}.")
    if step < warmup:
        return base * (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    if kind == "linear":
        return min_lr + (base - min_lr) * (1.0 - progress)
    return min_lr + (base - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Schedule:
    """A schedule bound to its settings: ``schedule(step)`` gives the rate."""

    kind: str = "constant"
    base: float = 1e-3
    total: int = 1
    warmup: int = 0
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"schedule must be one of {KINDS}, got {self.kind!r}.")
        numbers = (self.base, self.min_lr, self.total, self.warmup)
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers):
            raise ConfigError(f"schedule settings must be finite numbers, got {numbers}.")
        if not (self.base > 0 and 0 <= self.min_lr < self.base) or self.warmup < 0 or self.total < 1:
            raise ConfigError(
                f"schedule needs base > 0, 0 <= min_lr < base, warmup >= 0 and total >= 1; got base={self.base}, "
                f"min_lr={self.min_lr}, warmup={self.warmup}, total={self.total}."
            )
        if self.kind != "constant" and self.warmup >= self.total:
            raise ConfigError(f"warm-up ({self.warmup} steps) must be shorter than the schedule ({self.total} steps).")

    def covers(self, steps: int) -> bool:
        """Whether ``steps`` optimizer steps stay on the curve (a constant rate never ends)."""
        return self.kind == "constant" or steps <= self.total

    def __call__(self, step: int) -> float:
        return lr_at(step, kind=self.kind, base=self.base, total=self.total, warmup=self.warmup, min_lr=self.min_lr)
