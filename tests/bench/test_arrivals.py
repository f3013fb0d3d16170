"""Poisson arrivals: the generated gaps fit Exp(rate) (Kolmogorov-Smirnov), and the edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from radixrelay.bench.arrivals import arrival_times

# Asymptotic Kolmogorov-Smirnov critical value at alpha = 0.01: c(alpha) / sqrt(n).
KS_C_ALPHA_01 = 1.628


def ks_statistic(samples: np.ndarray, rate: float) -> float:
    """sup |F_empirical - F_Exp(rate)| over the samples."""
    x = np.sort(samples)
    n = len(x)
    cdf = 1.0 - np.exp(-rate * x)
    upper = np.arange(1, n + 1) / n - cdf
    lower = cdf - np.arange(0, n) / n
    return float(max(upper.max(), lower.max()))


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gaps_fit_exponential_at_rate(rate, seed):
    n = 4000
    times = arrival_times(n, rate, np.random.default_rng(seed))
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    gaps = np.diff(times)
    assert ks_statistic(gaps, rate) < KS_C_ALPHA_01 / math.sqrt(len(gaps))
    # mean gap 1/rate with standard error (1/rate)/sqrt(n): within 4 standard errors
    assert abs(gaps.mean() * rate - 1.0) < 4 / math.sqrt(len(gaps))


def test_ks_rejects_a_wrong_rate():
    gaps = np.diff(arrival_times(4000, 2.0, np.random.default_rng(0)))
    assert ks_statistic(gaps, 2.5) > KS_C_ALPHA_01 / math.sqrt(len(gaps))


def test_seeded_and_infinite_rate():
    a = arrival_times(50, 3.0, np.random.default_rng(7))
    b = arrival_times(50, 3.0, np.random.default_rng(7))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(arrival_times(5, math.inf, np.random.default_rng(0)), np.zeros(5))
    assert len(arrival_times(0, 1.0, np.random.default_rng(0))) == 0


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_invalid_rate(rate):
    with pytest.raises(ValueError, match="request rate"):
        arrival_times(3, rate, np.random.default_rng(0))
