"""Every private part of Flower 1.41 the apps rely on, in one place (tests/test_pinned_internals.py
checks each against the pinned version, so an upgrade that moves one fails there, by name).

- Differential privacy: the noise of Flower's fixed-clipping wrappers is ``noise_multiplier *
  clipping_norm / num_sampled_clients``, set once at construction; :func:`calibrate_dp_noise`
  resets it to the nodes actually sampled in a round (through the wrappers' shared base class).
- Metric averaging: ``strategy_utils.aggregate_metricrecords``, Flower's example-weighted mean.
- Sampling: Flower's strategies sample nodes with the global ``random`` module, in the order the
  grid lists them; :func:`seeded_sampling` and :class:`OrderedGrid` make a seeded run's sample repeat.
- The client's clipping mod reads its norm under ``KEY_CLIPPING_NORM``.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.dp_fixed_clipping import DifferentialPrivacyFixedClippingBase
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

__all__ = ["KEY_CLIPPING_NORM", "aggregate_metricrecords", "calibrate_dp_noise", "seeded_sampling", "OrderedGrid"]


def calibrate_dp_noise(strategy: Strategy, sampled: int) -> float | None:
    """Calibrate a DP wrapper's noise to the ``sampled`` nodes of this round; returns its std (None
    when ``strategy`` adds no noise)."""
    if not isinstance(strategy, DifferentialPrivacyFixedClippingBase) or sampled < 1:
        return None
    strategy.num_sampled_clients = sampled
    return strategy.noise_multiplier * strategy.clipping_norm / sampled


@contextmanager
def seeded_sampling(seed: int | None, server_round: int, phase: str) -> Iterator[None]:
    """Seed the ``random`` module for one round and phase (and restore it after), so that a seeded
    run samples the same nodes each time; with no seed, nothing changes."""
    if seed is None:
        yield
        return
    state = random.getstate()
    random.seed(f"odt-{seed}-{server_round}-{phase}")
    try:
        yield
    finally:
        random.setstate(state)


class OrderedGrid:
    """A grid whose node ids come in a fixed order (by ``order``'s keys, then by id) instead of the
    order Flower registered them in, so that a seeded sample of them repeats; all else is the grid's."""

    def __init__(self, grid: Grid, order: Mapping[int, int]) -> None:
        self._grid, self._order = grid, order

    def get_node_ids(self) -> list[int]:
        unknown = max(self._order.values(), default=0) + 1
        return sorted(self._grid.get_node_ids(), key=lambda node: (self._order.get(node, unknown), node))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)
