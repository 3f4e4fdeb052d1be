"""Non-negative least squares for the planner's fits (``calibrate``, ``attention``)."""

from __future__ import annotations

import numpy as np


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares by dropping the most negative column until none is (small
    problems only; the columns are scaled to unit norm first)."""
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    a = a / norms
    active = [j for j in range(a.shape[1]) if np.any(a[:, j])]
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (sol >= 0).all():
            x[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return x / norms
