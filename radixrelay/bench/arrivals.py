"""Request arrival times: a Poisson process (independent exponential gaps with mean 1 / rate)."""

from __future__ import annotations

import math

import numpy as np


def arrival_times(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds from the start at which each of ``n`` requests is sent: the first at 0, then
    exponential gaps of mean ``1 / rate``. ``rate = inf`` sends everything at 0."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    gaps = rng.exponential(1.0 / rate, size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
