"""Synthetic data-generating processes of the FedGVI/PGVI experiments, in float64, from seeded
``numpy.random.Generator`` streams (``np.random.default_rng(seed)``).

* :func:`clutter_1d`: the epsilon-contaminated Gaussian location problem (FedGVI S5.1, App. C.1).
* :func:`student_t_location`: the heavy-tailed data of the influence-function experiment (FedGVI S5.2).
* :func:`logistic_2d_with_outliers`: the misspecified 2-D logistic regression (FedGVI S5.3, App. C.2).
* :func:`conjugate_linear_regression`: a linear-Gaussian model with known noise, for closed-form tests.

The generators reproduce the *distributions* of the papers, not the reference code's random numbers (which
came from torch's generator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "ClutterData",
    "LinearRegressionData",
    "Logistic2DData",
    "clutter_1d",
    "conjugate_linear_regression",
    "logistic_2d_with_outliers",
    "student_t_location",
]


def _check_n(n: int, name: str = "n", minimum: int = 1) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {n!r}")
    return int(n)


def _check_positive(value: float, name: str) -> float:
    value = float(value)
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def _check_finite(value: float, name: str) -> float:
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


# --------------------------------------------------------------------------------------------------
# 1-D clutter problem


@dataclass(frozen=True, eq=False)
class ClutterData:
    """Draws from ``(1 - eps) N(theta + inlier_shift, inlier_std^2) + eps N(theta + outlier_shift, outlier_std^2)``.

    Attributes:
        x: float64 ``(n,)`` observations.
        theta: the true location parameter used.
        is_outlier: bool ``(n,)``, which mixture component each point came from.
        inlier_mean: ``theta + inlier_shift``, the location of the uncontaminated component (what a
            robust location estimate under the model ``x ~ N(., 1)`` targets).
        outlier_mean: ``theta + outlier_shift``.
        eps: the contamination probability.
    """

    x: np.ndarray
    theta: float
    is_outlier: np.ndarray
    inlier_mean: float
    outlier_mean: float
    eps: float


def clutter_1d(
    n: int = 100,
    eps: float = 0.25,
    seed: int = 0,
    theta: float | None = None,
    theta_prior_mean: float = 0.0,
    theta_prior_std: float = 0.5,
    inlier_shift: float = -2.0,
    inlier_std: float = 1.0,
    outlier_shift: float = 3.0,
    outlier_std: float = 0.5,
) -> ClutterData:
    """The FedGVI clutter problem (App. C.1).

    ``theta ~ N(theta_prior_mean, theta_prior_std^2)`` (the paper's ``N(0, 0.5^2)``) unless given; then
    each of the ``n`` points is, independently, an outlier with probability ``eps`` (a Huber mixture, so
    the number of outliers is Binomial(n, eps)) and
    ``x | inlier ~ N(theta - 2, 1)``, ``x | outlier ~ N(theta + 3, 0.5^2)`` with the default shifts.

    The OCR of App. C.1 is ambiguous between inlier mean ``theta - 2`` and ``-2``; ``inlier_shift`` is the
    ``theta - 2`` reading, and ``inlier_mean`` reports the resulting location either way.
    """
    n = _check_n(n)
    eps = float(eps)
    if not (0.0 <= eps < 1.0):
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    for value, name in ((inlier_std, "inlier_std"), (outlier_std, "outlier_std")):
        _check_positive(value, name)
    inlier_shift = _check_finite(inlier_shift, "inlier_shift")
    outlier_shift = _check_finite(outlier_shift, "outlier_shift")
    rng = np.random.default_rng(seed)
    if theta is None:
        theta = (_check_finite(theta_prior_mean, "theta_prior_mean")
                 + _check_positive(theta_prior_std, "theta_prior_std") * rng.standard_normal())
    theta = _check_finite(theta, "theta")
    is_outlier = rng.random(n) < eps
    z = rng.standard_normal(n)
    x = np.where(is_outlier, theta + outlier_shift + outlier_std * z, theta + inlier_shift + inlier_std * z)
    return ClutterData(
        x=x.astype(np.float64),
        theta=theta,
        is_outlier=is_outlier,
        inlier_mean=theta + float(inlier_shift),
        outlier_mean=theta + float(outlier_shift),
        eps=eps,
    )


# --------------------------------------------------------------------------------------------------
# Student-t location


def student_t_location(n: int, df: float = 4.0, loc: float = 0.0, scale: float = 1.0, seed: int = 0) -> np.ndarray:
    """``n`` i.i.d. draws ``loc + scale * T_df`` (default: df 4, mean 0, scale 1, FedGVI S5.2), float64 ``(n,)``."""
    n = _check_n(n)
    df = _check_positive(df, "df")
    scale = _check_positive(scale, "scale")
    loc = _check_finite(loc, "loc")
    rng = np.random.default_rng(seed)
    return (loc + scale * rng.standard_t(df, size=n)).astype(np.float64)


# --------------------------------------------------------------------------------------------------
# 2-D logistic regression with outliers

_CLASS1_MEAN = np.array([3.0, 4.0])
_CLASS1_COV = np.array([[1.0, 0.35], [0.35, 0.75]])
_CLASS0_MEAN = np.array([0.0, 0.0])
_CLASS0_COV = np.array([[0.8, -0.4], [-0.4, 1.0]])
_OUTLIER_MEAN = np.array([1.0, 5.0])
_OUTLIER_COV = np.array([[0.15, 0.1], [0.1, 0.15]])


@dataclass(frozen=True, eq=False)
class Logistic2DData:
    """The FedGVI S5.3 data.

    Attributes:
        x_train: float64 ``(n + n_out, 2)``: the clean points followed by the outliers (no bias column).
        y_train: int64 ``(n + n_out,)`` in {0, 1}; the outliers are labelled 0.
        is_outlier: bool ``(n + n_out,)``.
        x_test: float64 ``(n, 2)``: the clean points (the paper evaluates on the clean data).
        y_test: int64 ``(n,)``.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    is_outlier: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def logistic_2d_with_outliers(
    n: int = 100,
    num_outliers: int | None = None,
    outlier_fraction: float = 0.05,
    seed: int = 0,
    balanced: bool = False,
) -> Logistic2DData:
    """FedGVI's misspecified 2-D logistic regression (App. C.2 and the reference code).

    ``n`` clean points from the mixture ``0.5 N([3,4], [[1,.35],[.35,.75]])`` (label 1) +
    ``0.5 N([0,0], [[.8,-.4],[-.4,1]])`` (label 0): the number in class 1 is Binomial(n, 1/2) as in the
    reference code, or exactly ``n // 2`` with ``balanced=True``.  Then ``num_outliers`` points from
    ``N([1,5], [[.15,.1],[.1,.15]])`` labelled 0, by default ``ceil(outlier_fraction n / (1 -
    outlier_fraction))`` (6 for n = 100: about 5% of the training set).  Class-1 points come first, then
    class 0, then the outliers.
    """
    n = _check_n(n, "n", 2)
    outlier_fraction = float(outlier_fraction)
    if not (0.0 <= outlier_fraction < 1.0):
        raise ValueError(f"outlier_fraction must be in [0, 1), got {outlier_fraction}")
    if num_outliers is None:
        # round first so that 0.05 * 100 / 0.95 = 5.263... is not pushed over an integer by float error
        num_outliers = math.ceil(round(outlier_fraction * n / (1.0 - outlier_fraction), 9))
    num_outliers = _check_n(num_outliers, "num_outliers", 0)
    rng = np.random.default_rng(seed)
    n1 = n // 2 if balanced else int(rng.binomial(n, 0.5))
    x1 = rng.multivariate_normal(_CLASS1_MEAN, _CLASS1_COV, size=n1)
    x0 = rng.multivariate_normal(_CLASS0_MEAN, _CLASS0_COV, size=n - n1)
    xo = rng.multivariate_normal(_OUTLIER_MEAN, _OUTLIER_COV, size=num_outliers)
    x_clean = np.concatenate([x1, x0]).astype(np.float64)
    y_clean = np.concatenate([np.ones(n1, np.int64), np.zeros(n - n1, np.int64)])
    return Logistic2DData(
        x_train=np.concatenate([x_clean, xo]).astype(np.float64),
        y_train=np.concatenate([y_clean, np.zeros(num_outliers, np.int64)]),
        is_outlier=np.concatenate([np.zeros(n, bool), np.ones(num_outliers, bool)]),
        x_test=x_clean.copy(),
        y_test=y_clean.copy(),
    )


# --------------------------------------------------------------------------------------------------
# conjugate linear regression


@dataclass(frozen=True, eq=False)
class LinearRegressionData:
    """``y = x theta + sigma * noise``.

    Attributes:
        x: float64 ``(n, d)`` design.
        y: float64 ``(n, 1)`` responses (the ``(N, 1)`` regression convention of :class:`Dataset`).
        theta: float64 ``(d,)`` true coefficients.
        sigma: the noise standard deviation.
    """

    x: np.ndarray
    y: np.ndarray
    theta: np.ndarray
    sigma: float


def conjugate_linear_regression(
    n: int = 100,
    dim: int = 3,
    sigma: float = 0.5,
    seed: int = 0,
    theta: np.ndarray | None = None,
    prior_std: float = 1.0,
    x_scale: float = 1.0,
) -> LinearRegressionData:
    """A linear-Gaussian model with known noise: ``x_ij ~ N(0, x_scale^2)`` i.i.d.,
    ``theta ~ N(0, prior_std^2 I)`` unless given, ``y = x theta + sigma eps`` with ``eps ~ N(0, 1)``.

    With the prior ``N(0, prior_std^2 I)`` the posterior is Gaussian with precision
    ``I / prior_std^2 + x^T x / sigma^2`` and mean ``precision^{-1} x^T y / sigma^2``.
    """
    n = _check_n(n)
    dim = _check_n(dim, "dim")
    sigma = _check_positive(sigma, "sigma")
    x_scale = _check_positive(x_scale, "x_scale")
    rng = np.random.default_rng(seed)
    if theta is None:
        theta = _check_positive(prior_std, "prior_std") * rng.standard_normal(dim)
    theta = np.asarray(theta, dtype=np.float64).reshape(-1)
    if theta.shape != (dim,):
        raise ValueError(f"theta must have shape ({dim},), got {theta.shape}")
    if not np.isfinite(theta).all():
        raise ValueError(f"theta must be finite, got {theta}")
    x = x_scale * rng.standard_normal((n, dim))
    y = x @ theta + sigma * rng.standard_normal(n)
    return LinearRegressionData(x=x, y=y.reshape(n, 1), theta=theta.copy(), sigma=sigma)
