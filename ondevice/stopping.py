"""Early stopping: end training when a validation metric stops improving, keeping the best epoch's weights.

The rule is Keras's ``EarlyStopping(patience, restore_best_weights=True)``: after each epoch's
validation, the monitored metric improves when it beats the best so far by more than ``min_delta``;
``patience`` epochs in a row without an improvement end the run, and the trainer goes back to the
weights of the best epoch (its trainable parameters and running statistics; the optimizer's moments,
the epoch count and the step count stay where the run stopped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["EarlyStopping", "improves"]

HIGHER_IS_BETTER = ("accuracy", "top3_accuracy")
"""Metrics a model maximizes; every other one (loss, perplexity) is minimized."""


@dataclass(frozen=True)
class EarlyStopping:
    """Stop after ``patience`` epochs without a better ``monitor`` (a ``val_`` metric of :meth:`Trainer.fit`'s
    history), better meaning by more than ``min_delta``; with ``restore_best`` the trainer ends with the best
    epoch's weights.

    The default monitor is the validation loss, as in Keras: on 56 validation commands of a 529-command
    intents set, accuracy sat at 0.9286 from epoch 4 to 9 while the loss kept falling until epoch 8, whose
    weights did better on unseen homes (0.944 against 0.934 for epoch 4's)."""

    patience: int = 3
    monitor: str = "val_loss"
    min_delta: float = 0.0
    restore_best: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.patience, int) or isinstance(self.patience, bool) or self.patience < 1:
            raise ConfigError(f"early stopping's patience must be an integer >= 1 (epochs), got {self.patience!r}.")
        if not (isinstance(self.min_delta, (int, float)) and math.isfinite(self.min_delta) and self.min_delta >= 0):
            raise ConfigError(f"early stopping's min_delta must be a finite number >= 0, got {self.min_delta!r}.")
        if not (isinstance(self.monitor, str) and self.monitor.startswith("val_")):
            raise ConfigError(
                f"early stopping monitors a validation metric such as 'val_loss' or 'val_accuracy', got "
                f"{self.monitor!r}."
            )


def improves(value: float, best: float | None, monitor: str, min_delta: float = 0.0) -> bool:
    """Whether ``value`` of ``monitor`` beats ``best`` (None: nothing yet) by more than ``min_delta``; a value that
    is not finite never does."""
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    if monitor.removeprefix("val_") in HIGHER_IS_BETTER:
        return value > best + min_delta
    return value < best - min_delta
