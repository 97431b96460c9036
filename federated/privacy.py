"""How much privacy a run of Flower's fixed-clipping Gaussian mechanism spends: an epsilon for a delta.

Each round adds Gaussian noise of std ``noise_multiplier * clip`` to the sum of updates clipped to
norm ``clip`` (Flower's wrappers add ``noise_multiplier * clip / n`` to the average of ``n``), so a
round is the Gaussian mechanism with noise multiplier ``z`` for adding or removing one client.
Its Renyi DP of order ``a`` is ``a / (2 z^2)``; ``rounds`` of it compose to ``rounds * a / (2 z^2)``,
and RDP of order ``a`` gives ``(epsilon, delta)``-DP with ``epsilon = rdp + log(1 / delta) / (a - 1)``
(Mironov 2017). Minimized over ``a > 1`` in closed form:
``epsilon = rounds / (2 z^2) + sqrt(2 rounds log(1 / delta)) / z``.

An upper bound: it takes no credit for sampling only some clients per round (privacy
amplification by subsampling), so with ``fraction-train < 1`` the true figure is lower.
"""

from __future__ import annotations

import math

__all__ = ["gaussian_epsilon"]


def gaussian_epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    """The epsilon (for ``delta``) of ``rounds`` rounds of the Gaussian mechanism with ``noise_multiplier``."""
    if not noise_multiplier > 0 or rounds < 0 or not 0 < delta < 1:
        raise ValueError(f"need noise_multiplier > 0, rounds >= 0 and 0 < delta < 1, got {noise_multiplier}, "
                         f"{rounds}, {delta}")  # fmt: skip
    if rounds == 0:
        return 0.0
    spent = rounds / (2 * noise_multiplier**2)
    return spent + math.sqrt(2 * rounds * math.log(1 / delta)) / noise_multiplier
