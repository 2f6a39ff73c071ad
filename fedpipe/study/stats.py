"""The statistics a study reports: confidence intervals over seeds, paired Wilcoxon tests, the worst clients'
accuracy and the time (rounds, bytes) to reach a target accuracy.

Pure functions of numbers (numpy and scipy only): the report calls them, the tests check them by hand.
With a handful of seeds the honest answer is often "we cannot tell": an interval of n=1 is undefined (nan),
and a Wilcoxon test over 3 seeds can never give p below 0.25 (`min_two_sided_pvalue`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from fedpipe.models import gate

ACCURACY = "personalized_accuracy"


@dataclass(frozen=True)
class Interval:
    """A mean over n values with its sample standard deviation (ddof=1) and Student-t confidence bounds."""

    mean: float
    std: float
    low: float
    high: float
    n: int


@dataclass(frozen=True)
class PairedTest:
    """A two-sided Wilcoxon signed-rank test of paired samples a and b (differences a - b)."""

    statistic: float
    pvalue: float
    n: int  # the pairs given (zero differences included; the test itself drops them)
    median_difference: float
    reason: str = ""  # why the p-value is what it is when no test was run ("" when scipy ran it)


@dataclass(frozen=True)
class Reached:
    """When a curve first reached the target: the round and the bytes (up + down) sent until then, that round included."""

    round: int
    bytes: int
    accuracy: float


def _finite(values: Sequence[float], what: str) -> np.ndarray:
    array = np.asarray(values, dtype=float).ravel()
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{what} holds a value that is not a finite number: {array.tolist()[:10]}")
    return array


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """The mean of `values` and its Student-t interval mean ± t((1 + c) / 2, n - 1) · std / √n.

    One value has no spread: std and the bounds are nan (not zero, which would claim certainty)."""
    if not 0 < confidence < 1:
        raise ValueError(f"the confidence level must lie between 0 and 1, not {confidence!r}")
    array = _finite(values, "the values of a confidence interval")
    n = array.size
    if n == 0:
        raise ValueError("a confidence interval needs at least one value, and none was given")
    mean = float(array.mean())
    if n == 1:
        return Interval(mean, math.nan, math.nan, math.nan, 1)
    std = float(array.std(ddof=1))
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1)) * std / math.sqrt(n)
    return Interval(mean, std, mean - half, mean + half, n)


def min_two_sided_pvalue(pairs: int) -> float:
    """The smallest two-sided p-value an exact Wilcoxon test of `pairs` non-zero differences can give:
    2 / 2^n (every sign the same). With 3 seeds it is 0.25, so "not significant" says little there."""
    return 1.0 if pairs < 1 else min(1.0, 2.0 / 2.0**pairs)


def wilcoxon_paired(a: Sequence[float], b: Sequence[float]) -> PairedTest:
    """The two-sided Wilcoxon signed-rank test of a against b, pair by pair (scipy's; zero differences dropped).

    All differences zero: nothing differs, p = 1.0 (scipy would warn or divide by zero). Fewer than two
    pairs: p is nan, with the reason."""
    x, y = _finite(a, "the first sample"), _finite(b, "the second sample")
    if x.size != y.size:
        raise ValueError(f"a paired test needs samples of the same length, not {x.size} and {y.size}")
    diff = x - y
    median = float(np.median(diff)) if diff.size else math.nan
    if diff.size < 2:
        return PairedTest(math.nan, math.nan, int(diff.size), median, f"{diff.size} pair(s): a paired test needs at least 2")
    if not np.any(diff):
        return PairedTest(0.0, 1.0, int(diff.size), median, "every difference is zero: nothing to tell apart")
    result = stats.wilcoxon(x, y, alternative="two-sided")
    return PairedTest(float(result.statistic), float(result.pvalue), int(diff.size), median)


def worst_fraction_mean(accuracies: Sequence[float], fraction: float = 0.1) -> float:
    """The mean of the lowest `fraction` of the accuracies, ceil(fraction · n) of them and at least one: the
    promotion gate's worst10_accuracy (`fedpipe.models.gate.worst_fraction_mean`), on checked numbers."""
    values = _finite(accuracies, "the client accuracies")
    if values.size == 0:
        raise ValueError("the worst clients' accuracy needs at least one client accuracy, and none was given")
    return gate.worst_fraction_mean(values.tolist(), fraction)


def rounds_to_target(curve: Sequence[dict], target: float) -> Reached | None:
    """The first round whose personalized accuracy is at least `target`, and the bytes up and down of every
    round until then (that one included; rounds without an accuracy count their bytes too). None: never.

    The curve's rows hold per-round values (not running totals), in any order."""
    sent = 0
    for row in sorted(curve, key=lambda r: int(r["round"])):
        sent += int(row.get("bytes_uploaded") or 0) + int(row.get("bytes_downloaded") or 0)
        accuracy = row.get(ACCURACY)
        if accuracy is not None and float(accuracy) >= target:
            return Reached(int(row["round"]), sent, float(accuracy))
    return None


def band_over_seeds(curves: Sequence[Sequence[dict]], key: str = ACCURACY) -> tuple[list[int], list[float], list[float], list[float]]:
    """Per round, over seeds (one curve a seed): (rounds, mean, low, high) of `key`, on the rounds where every
    curve has a value.

    The band is the 95% Student-t interval of the mean with 3 or more seeds; with 1 or 2 it is the min..max
    (with 2 seeds t = 12.7 makes the interval some nine standard deviations wide, which shows nothing, and
    one seed has no interval at all)."""
    per_curve = [{int(r["round"]): float(r[key]) for r in curve if r.get(key) is not None} for curve in curves]
    if not per_curve:
        return [], [], [], []
    rounds = sorted(set.intersection(*(set(c) for c in per_curve)))
    means, lows, highs = [], [], []
    for rnd in rounds:
        values = [c[rnd] for c in per_curve]
        if len(values) >= 3:
            interval = mean_ci(values)
            low, high = interval.low, interval.high
        else:
            low, high = min(values), max(values)
        means.append(float(np.mean(values)))
        lows.append(low)
        highs.append(high)
    return rounds, means, lows, highs
