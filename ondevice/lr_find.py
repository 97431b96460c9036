"""The learning-rate range test: a short run with a rate growing every step, and the rate it suggests.

Leslie Smith's test as fastai runs it: from the artifacts' (or a checkpoint's) weights, one
optimizer step per rate on a geometric ramp, the loss smoothed with an exponential average; the
run stops once the loss has blown up (4x its best). The suggestion is the rate where the smoothed
loss falls fastest, a point well before the minimum, where training still descends steadily.
The trainer is used up by the test: load a fresh one to train.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterator, Mapping

import numpy as np

from .data import batch_indices, check_data
from .errors import ConfigError, DataError

__all__ = ["find_lr", "suggest"]


def find_lr(
    trainer: Any,
    data: Mapping[str, np.ndarray],
    *,
    batch_size: int,
    start: float = 1e-6,
    end: float = 1.0,
    steps: int = 100,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the range test on ``trainer`` (an :class:`ondevice.Trainer`); returns the rates, the
    smoothed losses and the suggested rate (None when the loss never fell)."""
    if not (0 < start < end and math.isfinite(end)):
        raise ConfigError(f"the learning-rate range must satisfy 0 < start < end, got {start!r} to {end!r}.")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 5:
        raise ConfigError(f"the range test needs at least 5 steps, got {steps!r}.")
    checked = check_data(trainer.manifest, data)
    size = len(next(iter(checked.values())))
    if batch_size > size:
        raise DataError(f"batch size {batch_size} is larger than the dataset ({size} examples).")
    rates = np.geomspace(start, end, steps)
    losses: list[float] = []
    average, best = 0.0, math.inf
    for step, (rate, index) in enumerate(zip(rates, _batches(size, batch_size, seed))):
        trainer.set_lr(float(rate))
        loss = trainer.train_step({name: value[index] for name, value in checked.items()}).loss
        if not math.isfinite(loss):
            break
        average = 0.98 * average + 0.02 * loss
        smoothed = average / (1 - 0.98 ** (step + 1))  # bias-corrected, like Adam's moments
        losses.append(smoothed)
        best = min(best, smoothed)
        if smoothed > 4 * best:
            break
    tried = [float(r) for r in rates[: len(losses)]]
    return {"lr": tried, "loss": losses, "suggested_lr": suggest(tried, losses)}


def _batches(size: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
    """Shuffled batches, epoch after epoch, for as long as the ramp needs them."""
    for epoch in itertools.count():
        yield from batch_indices(size, batch_size, shuffle=True, seed=seed, epoch=epoch)


def suggest(rates: list[float], losses: list[float]) -> float | None:
    """The rate of the steepest fall of ``losses`` against log ``rates`` (before the minimum)."""
    if len(losses) < 5:
        return None
    lowest = int(np.argmin(losses))
    if lowest < 2:
        return None
    slopes = np.gradient(np.asarray(losses[: lowest + 1]), np.log(np.asarray(rates[: lowest + 1])))
    return float(rates[int(np.argmin(slopes))])
