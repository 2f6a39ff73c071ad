"""fedpipe.study.stats against numbers worked out by hand (each hand computation is in the comment above
its assertion), so a wrong formula, a wrong degree of freedom or an off-by-one in a count fails here."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from fedpipe.study.stats import (
    Interval,
    Reached,
    band_over_seeds,
    mean_ci,
    min_two_sided_pvalue,
    rounds_to_target,
    wilcoxon_paired,
    worst_fraction_mean,
)

T_975_DF2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom (printed tables: 4.303)
T_975_DF1 = 12.706204736174707  # ... 1 degree of freedom (tables: 12.706)
T_95_DF2 = 2.919985580355516  # ... 95% quantile, 2 degrees of freedom (tables: 2.920)


def test_mean_ci_of_three_values_by_hand():
    # mean (0.90 + 0.92 + 0.94) / 3 = 0.92; squared deviations 0.0004 + 0 + 0.0004 = 0.0008, / (n - 1 = 2) = 0.0004,
    # std = 0.02; half-width t(0.975, 2) * 0.02 / sqrt(3) = 4.302653 * 0.0115470 = 0.0496828 -> [0.870317, 0.969683]
    ci = mean_ci([0.90, 0.92, 0.94])
    assert ci.n == 3
    assert ci.mean == pytest.approx(0.92, abs=1e-12)
    assert ci.std == pytest.approx(0.02, abs=1e-12)
    half = T_975_DF2 * 0.02 / math.sqrt(3)
    assert half == pytest.approx(0.0496828, abs=1e-7)
    assert ci.low == pytest.approx(0.92 - half, abs=1e-9) and ci.low == pytest.approx(0.870317, abs=1e-6)
    assert ci.high == pytest.approx(0.92 + half, abs=1e-9) and ci.high == pytest.approx(0.969683, abs=1e-6)


def test_mean_ci_uses_n_minus_one_degrees_of_freedom_and_the_confidence_level():
    # [0.8, 1.0]: mean 0.9, std sqrt(0.02 / 1) = 0.141421; half-width t(0.975, 1) * 0.141421 / sqrt(2) = 12.706205 * 0.1 = 1.2706205
    ci = mean_ci([0.8, 1.0])
    assert (ci.low, ci.high) == pytest.approx((0.9 - 1.2706205, 0.9 + 1.2706205), abs=1e-6)
    assert 0.1 * T_975_DF1 == pytest.approx(1.2706205, abs=1e-7)
    # 90% of [0.90, 0.92, 0.94]: t(0.95, 2) * 0.02 / sqrt(3) = 2.919986 * 0.0115470 = 0.0337171
    ninety = mean_ci([0.90, 0.92, 0.94], confidence=0.90)
    assert ninety.high - 0.92 == pytest.approx(T_95_DF2 * 0.02 / math.sqrt(3), abs=1e-9)
    assert ninety.high == pytest.approx(0.9537171, abs=1e-6)


def test_mean_ci_of_one_value_has_no_spread_and_of_none_is_an_error():
    one = mean_ci([0.7])
    assert one.mean == 0.7 and one.n == 1
    assert math.isnan(one.std) and math.isnan(one.low) and math.isnan(one.high)
    with pytest.raises(ValueError, match="at least one value"):
        mean_ci([])
    with pytest.raises(ValueError, match="finite"):
        mean_ci([0.5, float("nan")])
    with pytest.raises(ValueError, match="between 0 and 1"):
        mean_ci([0.5, 0.6], confidence=95)
    assert isinstance(one, Interval)


def exact_two_sided_p(differences: list[float]) -> float:
    """The exact Wilcoxon signed-rank p-value by enumeration of the 2^n sign assignments (no ties, no zeros):
    P(W+ as far from n(n+1)/4 as observed, or farther), independently of scipy."""
    ranks = {abs(d): r for r, d in enumerate(sorted(differences, key=abs), start=1)}
    observed = sum(ranks[abs(d)] for d in differences if d > 0)
    centre = len(differences) * (len(differences) + 1) / 4
    extreme = 0
    for signs in itertools.product((0, 1), repeat=len(differences)):
        w_plus = sum(r for r, s in zip(sorted(ranks.values()), signs) if s)
        extreme += abs(w_plus - centre) >= abs(observed - centre)
    return extreme / 2 ** len(differences)


def test_wilcoxon_matches_the_exact_p_worked_out_by_enumeration():
    # differences [1, 2, 3, -0.5, 4]: ranks by |d| are 0.5 -> 1, 1 -> 2, 2 -> 3, 3 -> 4, 4 -> 5; W- = 1, W+ = 14.
    # Of the 32 sign assignments, W+ <= 1 for {} and {1} (2 of them) and W+ >= 14 for their mirrors (2): p = 4/32 = 0.125.
    differences = [1, 2, 3, -0.5, 4]
    b = [0.5] * 5
    a = [x + d for x, d in zip(b, differences)]
    test = wilcoxon_paired(a, b)
    assert exact_two_sided_p(differences) == 0.125
    assert test.pvalue == pytest.approx(0.125, abs=1e-12)
    assert test.statistic == 1.0  # min(W+, W-)
    assert test.n == 5 and test.median_difference == 2.0 and test.reason == ""
    # differences [1, -2, 3, 4, 5, 6]: W- = 2; W+ <= 2 for {}, {1}, {2} (3 of 64), mirrored 3 more: p = 6/64 = 0.09375
    six = [1, -2, 3, 4, 5, 6]
    assert exact_two_sided_p(six) == 0.09375
    result = wilcoxon_paired(six, [0] * 6)
    assert result.pvalue == pytest.approx(0.09375, abs=1e-12) and result.statistic == 2.0
    assert wilcoxon_paired([0] * 6, six).pvalue == pytest.approx(0.09375, abs=1e-12)  # two-sided: symmetric


def test_wilcoxon_edge_cases_say_why():
    same = wilcoxon_paired([0.9, 0.8, 0.7], [0.9, 0.8, 0.7])
    assert same.pvalue == 1.0 and same.median_difference == 0.0 and "zero" in same.reason
    one = wilcoxon_paired([0.9], [0.8])
    assert math.isnan(one.pvalue) and one.n == 1 and "at least 2" in one.reason
    assert one.median_difference == pytest.approx(0.1)
    assert math.isnan(wilcoxon_paired([], []).pvalue)
    with pytest.raises(ValueError, match="same length"):
        wilcoxon_paired([0.1, 0.2], [0.1])


def test_the_p_value_floor_of_few_pairs():
    # 3 pairs, all the same sign: 2 of the 8 sign assignments are as extreme: 2/8 = 0.25
    assert min_two_sided_pvalue(3) == 0.25
    assert exact_two_sided_p([1, 2, 3]) == 0.25
    assert wilcoxon_paired([1, 2, 3], [0, 0, 0]).pvalue == pytest.approx(0.25)
    assert min_two_sided_pvalue(5) == 0.0625 and min_two_sided_pvalue(1) == 1.0 and min_two_sided_pvalue(0) == 1.0


TWENTY = [0.95, 0.91, 0.40, 0.88, 0.97, 0.60, 0.93, 0.99, 0.85, 0.90,
          0.92, 0.89, 0.96, 0.94, 0.98, 0.87, 0.86, 0.70, 0.95, 0.93]


def test_worst_ten_percent_of_twenty_clients():
    # ceil(0.1 * 20) = 2 lowest: 0.40 and 0.60 -> 0.50 (one would give 0.40, three (with 0.70) 0.5667)
    assert worst_fraction_mean(TWENTY) == pytest.approx(0.50, abs=1e-12)
    # 11 clients: ceil(1.1) = 2 lowest (rounding would take 1): the first eleven hold 0.40 and 0.60 -> 0.50
    assert worst_fraction_mean(TWENTY[:11]) == pytest.approx(0.50, abs=1e-12)
    # 5 clients: ceil(0.5) = 1, the lowest 0.40; a fraction of 0.5 of 20 takes the 10 lowest
    assert worst_fraction_mean(TWENTY[:5]) == pytest.approx(0.40, abs=1e-12)
    assert worst_fraction_mean(TWENTY, fraction=0.5) == pytest.approx(np.mean(sorted(TWENTY)[:10]), abs=1e-12)
    assert worst_fraction_mean([0.3]) == 0.3
    assert worst_fraction_mean([0.5, 0.3, 0.9], fraction=0.0) == 0.3  # at least one client
    with pytest.raises(ValueError, match="at least one"):
        worst_fraction_mean([])


def test_worst_ten_percent_agrees_with_the_promotion_gate():
    from fedpipe.models.gate import gate_metric

    rng = random.Random(7)
    for n in [*range(1, 121), 199, 200, 1000, 1001]:
        accuracies = [round(rng.random(), 3) for _ in range(n)]
        assert worst_fraction_mean(accuracies) == gate_metric("worst10_accuracy", accuracies, None), n


def hand_curve() -> list[dict]:
    rows = [
        {"round": 1, "personalized_accuracy": 0.50, "bytes_uploaded": 100, "bytes_downloaded": 200},
        {"round": 2, "personalized_accuracy": None, "bytes_uploaded": 100, "bytes_downloaded": 200},
        {"round": 3, "personalized_accuracy": 0.85, "bytes_uploaded": 100, "bytes_downloaded": 200},
        {"round": 4, "personalized_accuracy": 0.91, "bytes_uploaded": 50, "bytes_downloaded": 50},
        {"round": 5, "personalized_accuracy": 0.95, "bytes_uploaded": 50, "bytes_downloaded": 50},
    ]
    return [rows[i] for i in (3, 0, 4, 2, 1)]  # out of order: the function sorts by round


def test_rounds_to_target_on_a_hand_curve():
    curve = hand_curve()
    # target 0.9: rounds 1 (0.5), 2 (no accuracy), 3 (0.85) fall short; round 4 (0.91) reaches it.
    # bytes: 3 rounds * (100 + 200) + (50 + 50) = 1000, round 2's included although it has no accuracy
    assert rounds_to_target(curve, 0.9) == Reached(round=4, bytes=1000, accuracy=0.91)
    # target 0.85 is reached at round 3 (>=, not >): 3 * 300 = 900
    assert rounds_to_target(curve, 0.85) == Reached(round=3, bytes=900, accuracy=0.85)
    assert rounds_to_target(curve, 0.5) == Reached(round=1, bytes=300, accuracy=0.5)
    assert rounds_to_target(curve, 0.99) is None
    assert rounds_to_target([], 0.5) is None


def test_band_over_seeds_keeps_the_rounds_every_seed_has():
    a = [{"round": 1, "personalized_accuracy": 0.5}, {"round": 2, "personalized_accuracy": 0.6}, {"round": 3, "personalized_accuracy": 0.7}]
    b = [{"round": 1, "personalized_accuracy": 0.6}, {"round": 2, "personalized_accuracy": 0.7}, {"round": 3, "personalized_accuracy": 0.8}]
    c = [{"round": 1, "personalized_accuracy": 0.7}, {"round": 2, "personalized_accuracy": None}, {"round": 3, "personalized_accuracy": 0.9},
         {"round": 4, "personalized_accuracy": 0.95}]
    rounds, mean, low, high = band_over_seeds([a, b, c])
    # round 2 lacks c's value and round 4 exists in c only: rounds 1 and 3.
    # round 1: 0.5, 0.6, 0.7 -> mean 0.6, std 0.1, half t(0.975, 2) * 0.1 / sqrt(3) = 0.2484138; round 3: 0.7, 0.8, 0.9 -> 0.8
    assert rounds == [1, 3]
    assert mean == pytest.approx([0.6, 0.8], abs=1e-12)
    assert low == pytest.approx([0.6 - 0.2484138, 0.8 - 0.2484138], abs=1e-6)
    assert high == pytest.approx([0.6 + 0.2484138, 0.8 + 0.2484138], abs=1e-6)
    # two seeds: the band is min..max
    rounds, mean, low, high = band_over_seeds([a, b])
    assert rounds == [1, 2, 3] and mean == pytest.approx([0.55, 0.65, 0.75]) and low == [0.5, 0.6, 0.7] and high == [0.6, 0.7, 0.8]
    assert band_over_seeds([]) == ([], [], [], [])
