"""Tests of common.metrics against hand-computed cases, limit cases and a Monte Carlo calibration check."""

from __future__ import annotations

import math

import numpy as np
import pytest

from common.metrics import (
    NLL_FLOOR,
    accuracy,
    binary_probs,
    brier_score,
    classification_metrics,
    classification_metrics_from_log_probs,
    expected_calibration_error,
    negative_log_likelihood,
    negative_log_likelihood_from_log_probs,
    reliability_bins,
)

# Six points, three classes.  Top-label confidence, prediction, correctness and 15-bin index
# (bin b = (b/15, (b+1)/15], index ceil(15 c) - 1):
#   1. [0.90, 0.05, 0.05] y=0: c=0.90, pred 0, correct; 15c=13.5 -> bin 13 (0.8667, 0.9333]
#   2. [0.92, 0.04, 0.04] y=1: c=0.92, pred 0, wrong;   15c=13.8 -> bin 13
#   3. [0.20, 0.45, 0.35] y=1: c=0.45, pred 1, correct; 15c=6.75 -> bin 6  (0.4, 0.4667]
#   4. [0.30, 0.28, 0.42] y=0: c=0.42, pred 2, wrong;   15c=6.3  -> bin 6
#   5. [0.70, 0.20, 0.10] y=0: c=0.70, pred 0, correct; 15c=10.5 -> bin 10 (0.6667, 0.7333]
#   6. [1.00, 0.00, 0.00] y=0: c=1.00, pred 0, correct; 15c=15   -> bin 14 (0.9333, 1]
HAND_P = np.array([
    [0.90, 0.05, 0.05],
    [0.92, 0.04, 0.04],
    [0.20, 0.45, 0.35],
    [0.30, 0.28, 0.42],
    [0.70, 0.20, 0.10],
    [1.00, 0.00, 0.00],
])
HAND_Y = np.array([0, 1, 1, 0, 0, 0])


def test_hand_case_accuracy_nll():
    assert accuracy(HAND_P, HAND_Y) == pytest.approx(4 / 6)  # points 1, 3, 5, 6
    # -log p(y): p(y) = 0.90, 0.04, 0.45, 0.30, 0.70, 1.00
    expected = -(math.log(0.90) + math.log(0.04) + math.log(0.45) + math.log(0.30) + math.log(0.70) + 0.0) / 6
    assert negative_log_likelihood(HAND_P, HAND_Y) == pytest.approx(expected, rel=1e-12)


def test_hand_case_ece_15_bins():
    # bin 13: points 1,2: acc 1/2, conf (0.90+0.92)/2 = 0.91 -> gap 0.41,  weight 2/6
    # bin  6: points 3,4: acc 1/2, conf (0.45+0.42)/2 = 0.435 -> gap 0.065, weight 2/6
    # bin 10: point 5:    acc 1,   conf 0.70                   -> gap 0.30,  weight 1/6
    # bin 14: point 6:    acc 1,   conf 1.00                   -> gap 0,     weight 1/6
    # ECE = (2*0.41 + 2*0.065 + 0.30 + 0) / 6 = 1.25 / 6
    assert expected_calibration_error(HAND_P, HAND_Y) == pytest.approx(1.25 / 6, abs=1e-12)
    bins = reliability_bins(HAND_P, HAND_Y)
    np.testing.assert_array_equal(np.flatnonzero(bins["count"]), [6, 10, 13, 14])
    np.testing.assert_array_equal(bins["count"][[6, 10, 13, 14]], [2, 1, 2, 1])
    np.testing.assert_allclose(bins["confidence"][[6, 10, 13, 14]], [0.435, 0.70, 0.91, 1.0])
    np.testing.assert_allclose(bins["accuracy"][[6, 10, 13, 14]], [0.5, 1.0, 0.5, 1.0])
    assert np.all(np.isnan(bins["accuracy"][bins["count"] == 0]))
    np.testing.assert_allclose(bins["upper"] - bins["lower"], 1 / 15)


def test_hand_case_brier():
    # sum_c (p_c - onehot_c)^2 per point:
    #   1. 0.1^2 + 0.05^2 + 0.05^2            = 0.015
    #   2. 0.92^2 + 0.96^2 + 0.04^2           = 0.8464 + 0.9216 + 0.0016 = 1.7696
    #   3. 0.2^2 + 0.55^2 + 0.35^2            = 0.04 + 0.3025 + 0.1225   = 0.465
    #   4. 0.7^2 + 0.28^2 + 0.42^2            = 0.49 + 0.0784 + 0.1764   = 0.7448
    #   5. 0.3^2 + 0.2^2 + 0.1^2              = 0.14
    #   6. 0
    # mean = 3.1344 / 6 = 0.5224
    assert brier_score(HAND_P, HAND_Y) == pytest.approx(0.5224, abs=1e-12)


def test_bins_are_right_closed():
    # 4 bins (0, .25], (.25, .5], (.5, .75], (.75, 1]; confidences exactly on edges are exact in binary
    p = np.array([[0.5, 0.5], [0.75, 0.25], [0.25, 0.75], [1.0, 0.0]])
    bins = reliability_bins(p, np.array([0, 0, 1, 0]), num_bins=4)
    np.testing.assert_array_equal(bins["count"], [0, 1, 2, 1])  # 0.5 -> bin 1; 0.75, 0.75 -> bin 2; 1 -> bin 3


def test_perfect_predictor():
    y = np.array([2, 0, 1, 1, 2])
    p = np.eye(3)[y]
    m = classification_metrics(p, y)
    assert m == {"accuracy": 1.0, "nll": 0.0, "ece": 0.0, "brier": 0.0, "num_points": 5}


@pytest.mark.parametrize("c", [2, 4, 10])
def test_uniform_predictor(c):
    y = np.random.default_rng(c).integers(0, c, 1000)
    p = np.full((1000, c), 1.0 / c)
    acc = np.mean(y == 0)  # ties go to class 0
    m = classification_metrics(p, y)
    assert m["accuracy"] == pytest.approx(acc)
    assert m["nll"] == pytest.approx(math.log(c), rel=1e-12)
    assert m["brier"] == pytest.approx(1 - 1 / c, rel=1e-12)  # (1-1/c)^2 + (c-1)/c^2
    assert m["ece"] == pytest.approx(abs(acc - 1 / c), abs=1e-12)  # a single bin


def test_confidently_wrong_constant_predictor_ece_is_the_gap():
    # always 0.9 on class 1 of 2; the truth is class 1 with probability 0.6
    rng = np.random.default_rng(0)
    y = (rng.random(5000) < 0.6).astype(int)
    p = binary_probs(np.full(5000, 0.9))
    assert expected_calibration_error(p, y) == pytest.approx(abs(y.mean() - 0.9), abs=1e-12)


def test_calibrated_predictor_has_small_ece_and_expected_brier():
    """Monte Carlo: if y ~ Bernoulli(p1) then the predictive [1-p1, p1] is calibrated, its ECE is O(N^-1/2)
    and E[Brier] = E[2 p1 (1 - p1)]."""
    rng = np.random.default_rng(1)
    n = 200_000
    p1 = rng.random(n)
    y = (rng.random(n) < p1).astype(int)
    p = binary_probs(p1)
    assert expected_calibration_error(p, y) < 0.01
    # E[2 p (1-p)] for p ~ U(0,1) = 2 (1/2 - 1/3) = 1/3
    assert brier_score(p, y) == pytest.approx(1 / 3, abs=0.005)
    # the miscalibrated predictor p1^3 is detected
    q = p1**3
    assert expected_calibration_error(binary_probs(q), y) > 0.1


def test_nll_floor():
    p = np.array([[1.0, 0.0], [0.5, 0.5]])
    y = np.array([1, 0])
    assert negative_log_likelihood(p, y) == pytest.approx((-math.log(NLL_FLOOR) + math.log(2)) / 2)
    assert negative_log_likelihood(p, y, floor=1e-3) == pytest.approx((-math.log(1e-3) + math.log(2)) / 2)
    assert negative_log_likelihood(p, y, floor=0.0) == math.inf
    with pytest.raises(ValueError, match="floor"):
        negative_log_likelihood(p, y, floor=1.0)


def test_metrics_accept_float32_and_torch_inputs():
    torch = pytest.importorskip("torch")
    p32 = HAND_P.astype(np.float32)
    assert brier_score(p32, HAND_Y) == pytest.approx(0.5224, abs=1e-6)
    m = classification_metrics(torch.tensor(HAND_P), torch.tensor(HAND_Y))
    assert m["ece"] == pytest.approx(1.25 / 6) and m["num_points"] == 6


def test_binary_probs():
    np.testing.assert_allclose(binary_probs(np.array([0.2, 1.0])), [[0.8, 0.2], [0.0, 1.0]])


def test_input_validation():
    y = np.array([0, 1])
    good = np.array([[0.5, 0.5], [0.2, 0.8]])
    with pytest.raises(ValueError, match="sum to 1"):
        accuracy(np.array([[0.5, 0.6], [0.2, 0.8]]), y)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        brier_score(np.array([[1.2, -0.2], [0.2, 0.8]]), y)
    with pytest.raises(ValueError, match="NaN"):
        expected_calibration_error(np.array([[np.nan, 0.5], [0.2, 0.8]]), y)
    with pytest.raises(ValueError, match="labels"):
        accuracy(good, np.array([0, 2]))
    with pytest.raises(ValueError, match="labels"):
        accuracy(good, np.array([0, 1, 1]))
    with pytest.raises(ValueError, match="integers"):
        accuracy(good, np.array([0.0, 0.5]))
    with pytest.raises(ValueError, match="empty"):
        accuracy(np.zeros((0, 3)), np.zeros(0, int))
    with pytest.raises(ValueError, match=r"\(N, C\)"):
        accuracy(np.array([0.5, 0.5]), y)
    with pytest.raises(ValueError, match="num_bins"):
        expected_calibration_error(good, y, num_bins=0)
    # integral float labels are accepted
    assert accuracy(good, np.array([0.0, 1.0])) == 1.0


def test_nll_from_log_probs_is_exact_where_probabilities_underflow():
    """A confidently wrong prediction: log p(y) = -60 counts as 60, where the floored NLL from the probabilities
    says 27.63 (the bug this replaced: FedGVI's reported NLL was 0.02-0.04 too low at 40 % noise)."""
    from common.metrics import negative_log_likelihood_from_log_probs

    lp = np.array([[-60.0, np.log1p(-np.exp(-60.0))], [np.log(0.8), np.log(0.2)]])
    y = np.array([0, 0])
    exact = (60.0 - np.log(0.8)) / 2
    assert negative_log_likelihood_from_log_probs(lp, y) == pytest.approx(exact, rel=1e-12)
    p = np.exp(lp)
    assert negative_log_likelihood(p, y) == pytest.approx((-math.log(NLL_FLOOR) - np.log(0.8)) / 2, rel=1e-12)
    m = classification_metrics(p, y, log_probs=lp)
    assert m["nll"] == pytest.approx(exact, rel=1e-12)
    from common.metrics import classification_metrics_from_log_probs

    assert classification_metrics_from_log_probs(lp, y) == m
    assert m["accuracy"] == 0.5 and m["brier"] == classification_metrics(p, y)["brier"]
    with pytest.raises(ValueError, match="not the log of probs"):
        classification_metrics(p, y, log_probs=lp[::-1])
    with pytest.raises(ValueError, match="sum to 1"):
        negative_log_likelihood_from_log_probs(lp - 1.0, y)


def test_ece_of_a_union_comes_from_the_summed_bin_sums_not_the_mean_of_ecEs():
    """Two clients, hand-computed: A has 2 points at confidence 0.9, both right (gap 0.1 in bin 13); B has 2
    points at confidence 0.9, both wrong (gap 0.9).  Per client: ECE 0.1 and 0.9, mean 0.5.  Together: bin 13
    holds 4 points, accuracy 0.5, confidence 0.9: ECE 0.4."""
    from common.metrics import calibration_bin_sums, ece_from_bin_sums

    p = np.array([[0.9, 0.1], [0.9, 0.1]])
    ya, yb = np.array([0, 0]), np.array([1, 1])
    ea, eb = expected_calibration_error(p, ya), expected_calibration_error(p, yb)
    assert ea == pytest.approx(0.1) and eb == pytest.approx(0.9)
    sums = [a + b for a, b in zip(calibration_bin_sums(p, ya), calibration_bin_sums(p, yb))]
    assert ece_from_bin_sums(*sums) == pytest.approx(0.4)
    assert ece_from_bin_sums(*sums) == pytest.approx(expected_calibration_error(np.vstack([p, p]),
                                                                                np.concatenate([ya, yb])))
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(5), size=300)
    y = rng.integers(0, 5, 300)
    parts = [calibration_bin_sums(probs[i::3], y[i::3]) for i in range(3)]
    pooled = ece_from_bin_sums(*(sum(part[j] for part in parts) for j in range(3)))
    assert pooled == pytest.approx(expected_calibration_error(probs, y), abs=1e-12)
    with pytest.raises(ValueError, match="not all 0"):
        ece_from_bin_sums(np.zeros(15), np.zeros(15), np.zeros(15))
    with pytest.raises(ValueError, match="one length"):
        ece_from_bin_sums(np.ones(15), np.zeros(14), np.zeros(15))


def test_ece_from_bin_sums_refuses_impossible_bins():
    from common.metrics import ece_from_bin_sums

    with pytest.raises(ValueError, match="finite"):
        ece_from_bin_sums(np.array([2.0]), np.array([np.inf]), np.array([1.0]))
    with pytest.raises(ValueError, match="<= count"):
        ece_from_bin_sums(np.array([2.0]), np.array([5.0]), np.array([1.0]))
    with pytest.raises(ValueError, match="<= count"):
        ece_from_bin_sums(np.array([2.0]), np.array([1.0]), np.array([-1.0]))
    assert ece_from_bin_sums(np.array([2.0, 0.0]), np.array([1.8, 0.0]), np.array([1.0, 0.0])) == pytest.approx(0.4)


# ----------------------------------------------------------------------------------------------------------------
# log-probabilities a few ulps above 0 (a class certain under every posterior draw) and label checks of the
# log-probability NLL
def test_log_probs_rounded_above_zero_are_a_certain_class_not_an_error():
    lp = np.log(np.array([[1.0 - 1e-25, 1e-25 / 2, 1e-25 / 2], [0.2, 0.3, 0.5]]))
    lp[0, 0] = 8.9e-16  # what a chained logaddexp of 200 draws of log 1 gives
    m = classification_metrics_from_log_probs(lp, np.array([0, 2]))
    assert m["accuracy"] == 1.0
    assert m["nll"] == pytest.approx(-0.5 * math.log(0.5))  # point 0 contributes exactly 0
    assert 0.0 <= m["ece"] <= 1.0 and 0.0 <= m["brier"] <= 2.0
    assert negative_log_likelihood_from_log_probs(lp, np.array([0, 2])) == m["nll"]
    with pytest.raises(ValueError, match="<= 0"):  # more than rounding is still refused
        classification_metrics_from_log_probs(lp + np.array([[1e-3, 0, 0], [0, 0, 0]]), np.array([0, 2]))


@pytest.mark.parametrize("labels, match", [([-1, 1], r"\[0, 3\)"), ([0, 3], r"\[0, 3\)"), ([0.0, 1.9], "integers"),
                                           ([0], r"shape \(2,\)")])
def test_log_prob_nll_checks_the_labels_like_every_other_metric(labels, match):
    lp = np.log(np.full((2, 3), 1 / 3))
    with pytest.raises(ValueError, match=match):
        negative_log_likelihood_from_log_probs(lp, np.array(labels))
