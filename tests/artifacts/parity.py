"""Two ORT training sessions of the same artifacts (ORT's kernel against a rewrite) kept in step."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np


def gradients_close_then_step(reference: Any, candidate: Any, names: Iterable[str]) -> None:
    """After a train step of both sessions: each named gradient of ``candidate`` within rounding of
    ``reference``'s (relative 1e-5, absolute 1e-6 of the largest), then an optimizer step of both."""
    for name in names:
        expected = reference.get_gradient(name)
        tolerance = 1e-6 * np.abs(expected).max()
        np.testing.assert_allclose(candidate.get_gradient(name), expected, rtol=1e-5, atol=tolerance, err_msg=name)
    for session in (reference, candidate):
        session.optimizer_step()
        session.reset_grad()
