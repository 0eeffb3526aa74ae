"""Uncertainty of the eval numbers: bootstrap intervals over items and the paired sign test.

Items are the unit of resampling: a run's mean over ``n`` items is resampled ``n`` items
at a time, with replacement, ``resamples`` times from a fixed seed, and the 2.5 / 97.5
percentiles of the resampled means are the 95% interval. Paired comparisons count the
items one side won and the other lost (ties dropped) and test them with the exact
two-sided sign test; on 0/1 scores (accuracy) that is the exact McNemar test.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

import numpy as np

RESAMPLES = 1000
SEED = 0
# the per-item scores that get intervals (when the run has them)
CI_SCORES = (
    "accuracy",
    "factoid_strict",
    "factoid_lenient",
    "list_f1",
    "rouge_l",
    "needle_accuracy",
    "agreement",
    "kl",
    "nll_gap",
)


def bootstrap_ci(
    values: Sequence[float], *, resamples: int = RESAMPLES, seed: int = SEED, level: float = 0.95
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean of ``values`` (None for fewer than 2)."""
    data = np.asarray([float(v) for v in values], dtype=np.float64)
    if data.size < 2:
        return None
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, data.size, size=(resamples, data.size))
    means = data[picks].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return round(float(low), 6), round(float(high), 6)


def sign_test(won: int, lost: int) -> float | None:
    """Exact two-sided sign test p-value of ``won`` vs ``lost`` paired items (ties left
    out); None when no item differs. Equals ``scipy.stats.binomtest(won, won + lost).pvalue``."""
    n = won + lost
    if n == 0:
        return None
    k = min(won, lost)
    tail = sum(comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)  # not rounded: small p-values must stay distinguishable


def paired_counts(pairs: Sequence[tuple[float, float]]) -> tuple[int, int]:
    """``(items where the first is higher, items where the second is higher)``."""
    return sum(a > b for a, b in pairs), sum(a < b for a, b in pairs)
