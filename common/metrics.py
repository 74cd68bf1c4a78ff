"""Classification metrics of a predictive distribution, from probabilities ``(N, C)`` and labels ``(N,)``.

Definitions (``p_n`` the predicted probability vector of point ``n``, ``y_n`` its label):

* accuracy: ``mean_n [argmax_c p_nc == y_n]`` (ties go to the lowest class index, as ``np.argmax``).
* NLL: ``mean_n -log p_{n y_n}``.  Given the predictive's log-probabilities (``log_probs``, e.g.
  ``logsumexp_s log p_s - log S`` of a Monte Carlo predictive) it is computed from them exactly, however small
  the probability.  From probabilities alone it is ``mean_n -log max(p_{n y_n}, floor)``: the floor (default
  ``1e-12``, at most ``27.63`` a point) keeps the mean finite where a probability underflowed to zero, and so
  *under*states the NLL of an over-confident predictive; pass ``log_probs`` wherever they exist.
* ECE (Guo et al., 2017, top-label): confidence ``c_n = max_c p_nc``; 15 equal-width bins
  ``B_b = (b/15, (b+1)/15]`` for ``b = 0..14`` (right-closed; a confidence of 0 would go to bin 0);
  ``ECE = sum_b |B_b|/N * |acc(B_b) - conf(B_b)|`` with ``acc`` the fraction correct and ``conf`` the mean
  confidence in the bin (empty bins contribute 0).
* Brier score: ``mean_n sum_c (p_nc - [y_n == c])^2``, in ``[0, 2]``.

Everything is numpy; torch tensors on the CPU are accepted (converted with ``np.asarray``).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "DEFAULT_NUM_BINS",
    "NLL_FLOOR",
    "accuracy",
    "bin_sum_key",
    "binary_probs",
    "brier_score",
    "calibration_bin_sums",
    "classification_metrics",
    "classification_metrics_from_log_probs",
    "ece_from_bin_sums",
    "expected_calibration_error",
    "negative_log_likelihood",
    "negative_log_likelihood_from_log_probs",
    "reliability_bins",
]

#: Smallest probability used inside the log of the NLL.
NLL_FLOOR = 1e-12
#: Number of equal-width confidence bins of the ECE.
DEFAULT_NUM_BINS = 15
#: Tolerance on the row sums of the probabilities (float32 softmax outputs sum to 1 within ~1e-6).
_ROW_SUM_ATOL = 1e-4


def _check_labels(y: np.ndarray, n: int, num_classes: int) -> np.ndarray:
    """``n`` integer labels in ``[0, num_classes)`` as int64 (integral floats and bools accepted), else ValueError."""
    labels = np.asarray(y)
    if labels.ndim != 1 or labels.shape[0] != n:
        raise ValueError(f"labels must have shape ({n},), got {labels.shape}")
    if labels.dtype == np.bool_:  # binary labels as False / True: classes 0 / 1, as Problem.tensors reads them
        labels = labels.astype(np.int64)
    if not np.issubdtype(labels.dtype, np.integer):
        if np.issubdtype(labels.dtype, np.floating) and np.all(labels == np.round(labels)):
            labels = labels.astype(np.int64)
        else:
            raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got min {labels.min()}, max {labels.max()}")
    return labels.astype(np.int64)


def _check(probs: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2 or p.shape[1] < 2:
        raise ValueError(f"probs must have shape (N, C) with C >= 2, got {p.shape}")
    if p.shape[0] == 0:
        raise ValueError("probs is empty: metrics of zero points are undefined")
    labels = _check_labels(y, p.shape[0], p.shape[1])
    if not np.all(np.isfinite(p)):
        raise ValueError("probs contains NaN or infinity")
    if p.min() < 0 or p.max() > 1:
        raise ValueError(f"probs must lie in [0, 1], got min {p.min()}, max {p.max()}")
    worst = float(np.max(np.abs(p.sum(axis=1) - 1.0)))
    if worst > _ROW_SUM_ATOL:
        raise ValueError(f"each row of probs must sum to 1 (largest deviation {worst:.3g})")
    return p, labels


def binary_probs(p1: np.ndarray) -> np.ndarray:
    """``P(y = 1)`` of shape ``(N,)`` -> the ``(N, 2)`` matrix ``[1 - p1, p1]`` the other metrics take."""
    p1 = np.asarray(p1, dtype=np.float64).reshape(-1)
    return np.stack([1.0 - p1, p1], axis=1)


def accuracy(probs: np.ndarray, y: np.ndarray) -> float:
    p, labels = _check(probs, y)
    return float(np.mean(np.argmax(p, axis=1) == labels))


def negative_log_likelihood(probs: np.ndarray, y: np.ndarray, floor: float = NLL_FLOOR) -> float:
    """Mean ``-log p(y_n)`` of the predictive, with ``p`` floored at ``floor`` (see the module doc)."""
    p, labels = _check(probs, y)
    floor = float(floor)
    if not (0.0 <= floor < 1.0):
        raise ValueError(f"floor must be in [0, 1), got {floor}")
    picked = p[np.arange(p.shape[0]), labels]
    with np.errstate(divide="ignore"):
        return float(np.mean(-np.log(np.maximum(picked, floor))))


def _check_log_probs(log_probs: np.ndarray) -> np.ndarray:
    """``(N, C)`` log-probabilities as float64, each ``<= 0``: values in ``(0, 1e-6]`` (rounding of a certain
    class's ``log 1``) are set to 0; NaN or anything larger is a ValueError."""
    lp = np.asarray(log_probs, dtype=np.float64)
    if lp.ndim != 2 or lp.shape[1] < 2 or lp.shape[0] == 0:
        raise ValueError(f"log_probs must have shape (N, C) with N >= 1 and C >= 2, got {lp.shape}")
    if np.any(np.isnan(lp)) or np.any(lp > 1e-6):
        raise ValueError("log_probs must be <= 0 and not NaN")
    return np.minimum(lp, 0.0)


def negative_log_likelihood_from_log_probs(log_probs: np.ndarray, y: np.ndarray) -> float:
    """Mean ``-log p(y_n)`` from the predictive's log-probabilities ``(N, C)`` (no floor)."""
    lp = _check_log_probs(log_probs)
    labels = _check_labels(y, lp.shape[0], lp.shape[1])
    worst = float(np.max(np.abs(np.logaddexp.reduce(lp, axis=1))))
    if worst > _ROW_SUM_ATOL:
        raise ValueError(f"each row of exp(log_probs) must sum to 1 (largest log-sum {worst:.3g})")
    return float(np.mean(-lp[np.arange(lp.shape[0]), labels]))


def _bin_sums(p: np.ndarray, labels: np.ndarray, num_bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    conf = p.max(axis=1)
    correct = (np.argmax(p, axis=1) == labels).astype(np.float64)
    # bin b holds (b/B, (b+1)/B] with the edges reliability_bins reports (np.arange(B + 1) / B); searching those
    # edges, not ceil(conf * B) - 1, keeps a confidence one ulp above an edge out of the bin below it
    edges = np.arange(num_bins + 1) / num_bins
    idx = np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, num_bins - 1)
    count = np.bincount(idx, minlength=num_bins).astype(np.float64)
    return count, np.bincount(idx, weights=conf, minlength=num_bins), np.bincount(idx, weights=correct,
                                                                                  minlength=num_bins)


def calibration_bin_sums(probs: np.ndarray, y: np.ndarray,
                         num_bins: int = DEFAULT_NUM_BINS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-bin ``(count, sum of confidences, number correct)``: additive over disjoint sets of points, so
    the ECE of a union of data sets (e.g. every client's test split) is :func:`ece_from_bin_sums` of the
    summed arrays, where the mean of the per-set ECEs is not the ECE of the union."""
    p, labels = _check(probs, y)
    if isinstance(num_bins, bool) or not isinstance(num_bins, (int, np.integer)) or num_bins < 1:
        raise ValueError(f"num_bins must be an int >= 1, got {num_bins!r}")
    return _bin_sums(p, labels, num_bins)


def bin_sum_key(b: int, what: str) -> str:
    """Metric name of bin ``b``'s ``what`` (``count``, ``conf`` or ``correct``) in a client's evaluate reply
    (:func:`common.evaluation.evaluate_posterior` with ``bin_sums``)."""
    return f"ece-bin-{b:02d}-{what}"


def ece_from_bin_sums(count: np.ndarray, sum_conf: np.ndarray, sum_correct: np.ndarray) -> float:
    """``sum_b |count_b sum|/N * |acc_b - conf_b|`` = ``sum_b |sum_correct_b - sum_conf_b| / N``."""
    count, sum_conf, sum_correct = (np.asarray(a, dtype=np.float64) for a in (count, sum_conf, sum_correct))
    if not (count.shape == sum_conf.shape == sum_correct.shape) or count.ndim != 1:
        raise ValueError("count, sum_conf and sum_correct must be 1-D arrays of one length")
    if not (np.all(np.isfinite(count)) and np.all(np.isfinite(sum_conf)) and np.all(np.isfinite(sum_correct))):
        raise ValueError("bin sums must be finite")
    if np.any(count < 0) or count.sum() <= 0:
        raise ValueError("bin counts must be >= 0 and not all 0")
    tol = 1e-9 * max(1.0, float(count.sum()))
    if np.any(sum_conf < 0) or np.any(sum_correct < 0) or np.any(sum_conf > count + tol) or np.any(
            sum_correct > count + tol):
        raise ValueError("each bin needs 0 <= sum_conf, sum_correct <= count")
    return float(np.sum(np.abs(sum_correct - sum_conf)) / count.sum())


def reliability_bins(probs: np.ndarray, y: np.ndarray, num_bins: int = DEFAULT_NUM_BINS) -> dict[str, np.ndarray]:
    """Per-bin counts, accuracy and mean confidence of the top label (the ingredients of the ECE).

    Returns a dict of arrays of length ``num_bins``: ``"lower"``, ``"upper"`` (the bin edges ``b/B`` and
    ``(b+1)/B``), ``"count"``, ``"accuracy"`` and ``"confidence"`` (NaN for empty bins).
    """
    p, labels = _check(probs, y)
    if isinstance(num_bins, bool) or not isinstance(num_bins, (int, np.integer)) or num_bins < 1:
        raise ValueError(f"num_bins must be an int >= 1, got {num_bins!r}")
    count, sum_conf, sum_correct = _bin_sums(p, labels, num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = np.where(count > 0, sum_correct / count, np.nan)
        mean_conf = np.where(count > 0, sum_conf / count, np.nan)
    edges = np.arange(num_bins + 1) / num_bins
    return {"lower": edges[:-1], "upper": edges[1:], "count": count.astype(np.int64), "accuracy": acc, "confidence": mean_conf}


def expected_calibration_error(probs: np.ndarray, y: np.ndarray, num_bins: int = DEFAULT_NUM_BINS) -> float:
    """Top-label ECE with ``num_bins`` equal-width bins (default 15; see the module doc)."""
    return ece_from_bin_sums(*calibration_bin_sums(probs, y, num_bins))


def brier_score(probs: np.ndarray, y: np.ndarray) -> float:
    """Mean over points of ``sum_c (p_c - onehot(y)_c)^2``."""
    p, labels = _check(probs, y)
    onehot = np.zeros_like(p)
    onehot[np.arange(p.shape[0]), labels] = 1.0
    return float(np.mean(np.sum((p - onehot) ** 2, axis=1)))


def classification_metrics(
    probs: np.ndarray,
    y: np.ndarray,
    num_bins: int = DEFAULT_NUM_BINS,
    nll_floor: float = NLL_FLOOR,
    log_probs: np.ndarray | None = None,
) -> dict[str, float | int]:
    """``{"accuracy", "nll", "ece", "brier", "num_points"}`` of the predictive ``probs`` on labels ``y``; the
    NLL comes from ``log_probs`` when given (exact), else from ``probs`` with ``nll_floor``."""
    p, labels = _check(probs, y)
    if log_probs is not None and np.max(np.abs(np.exp(np.asarray(log_probs, dtype=np.float64)) - p)) > _ROW_SUM_ATOL:
        raise ValueError("log_probs are not the log of probs")
    nll = (negative_log_likelihood_from_log_probs(log_probs, labels) if log_probs is not None
           else negative_log_likelihood(p, labels, floor=nll_floor))
    return {
        "accuracy": accuracy(p, labels),
        "nll": nll,
        "ece": expected_calibration_error(p, labels, num_bins),
        "brier": brier_score(p, labels),
        "num_points": int(p.shape[0]),
    }


def classification_metrics_from_log_probs(
    log_probs: np.ndarray, y: np.ndarray, num_bins: int = DEFAULT_NUM_BINS, bin_sums: bool = False
) -> dict[str, float | int]:
    """:func:`classification_metrics` of a predictive given by its log-probabilities ``(N, C)``: the NLL is
    exact, the other metrics use ``exp(log_probs)``.  With ``bin_sums`` also the ECE's per-bin sums
    (:func:`calibration_bin_sums`) under the keys :func:`bin_sum_key`, from the same probabilities."""
    lp = _check_log_probs(log_probs)
    p = np.exp(lp)
    out = classification_metrics(p, y, num_bins, log_probs=lp)
    if bin_sums:
        for what, arr in zip(("count", "conf", "correct"), calibration_bin_sums(p, y, num_bins)):
            out.update({bin_sum_key(b, what): float(v) for b, v in enumerate(arr)})
    return out
