"""The epsilon a DP run reports: RDP of the Gaussian mechanism, composed over rounds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from federated.privacy import gaussian_epsilon


@pytest.mark.parametrize("z, rounds, delta", [(1.0, 1, 1e-5), (1.1, 20, 1e-5), (0.5, 100, 1e-6), (4.0, 3, 1e-3)])
def test_the_closed_form_is_the_minimum_over_renyi_orders(z, rounds, delta):
    """Against the definition: min over orders a > 1 of rounds * a / (2 z^2) + log(1/delta) / (a - 1)."""
    orders = 1 + np.logspace(-4, 4, 200_001)
    brute = np.min(rounds * orders / (2 * z**2) + math.log(1 / delta) / (orders - 1))
    assert gaussian_epsilon(z, rounds, delta) == pytest.approx(brute, rel=1e-6)


def test_more_noise_or_fewer_rounds_spend_less():
    assert gaussian_epsilon(2.0, 10, 1e-5) < gaussian_epsilon(1.0, 10, 1e-5)
    assert gaussian_epsilon(1.0, 5, 1e-5) < gaussian_epsilon(1.0, 10, 1e-5)
    assert gaussian_epsilon(1.0, 10, 1e-3) < gaussian_epsilon(1.0, 10, 1e-5)
    assert gaussian_epsilon(1.0, 0, 1e-5) == 0.0


@pytest.mark.parametrize("args", [(0.0, 1, 1e-5), (1.0, -1, 1e-5), (1.0, 1, 0.0), (1.0, 1, 1.0)])
def test_bad_arguments_are_refused(args):
    with pytest.raises(ValueError, match="need noise_multiplier > 0"):
        gaussian_epsilon(*args)
