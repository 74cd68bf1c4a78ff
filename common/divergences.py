"""Divergences ``D(q || p)`` between Gaussian factors, in closed form, selectable by name.

These are the prior regularisers of a GVI problem ``argmin_q E_q[L] + D(q || p)`` (FedGVI eqs. 4 and 7),
where ``p`` is the cavity (client) or the prior (server).  Every divergence is a scalar tensor that is
differentiable by autograd with respect to the natural parameters of both arguments.

Registered names (``make_divergence(name, **hyper)``):

* ``"kl"``            ``KL(q || p)``.
* ``"weighted_kl"``   ``(1/w) KL(q || p)``, ``w > 0`` (FedGVI eq. 9; equivalent to tempering the loss by ``w``).
* ``"reverse_kl"``    ``KL(p || q)``.
* ``"alpha_renyi"``   ``1/(alpha (alpha - 1)) log int q^alpha p^(1 - alpha)`` (FedGVI eq. 10, the normalisation
  of Knoblauch et al. 2022), ``alpha`` real, not 0 or 1.
* ``"fisher_rao"``    the Fisher-Rao distance between univariate Gaussians (Nielsen 2023), and its
  product-manifold extension to mean-field Gaussians.

Both arguments must be proper distributions of the same family and layout: an improper argument raises
:class:`~common.errors.ImproperDistributionError`, a family or shape mismatch
:class:`~common.errors.ShapeMismatchError`, and an Alpha-Renyi divergence without a finite value
:class:`~common.errors.DivergenceUndefinedError`.  No value is ever clipped, zeroed or replaced.

Exponential-family identities used (``A`` the log-normaliser, ``E_q[T]`` the mean parameters of ``q``):

    KL(q || p)        = A(eta_p) - A(eta_q) - <eta_p - eta_q, E_q[T]>
    D_AR^alpha(q || p) = [A(alpha eta_q + (1 - alpha) eta_p) - alpha A(eta_q) - (1 - alpha) A(eta_p)]
                         / (alpha (alpha - 1))

For mean-field Gaussians (which may have ~10^5 coordinates, in float32, inside a training loop) both are
evaluated per coordinate in an algebraically equivalent form in (mean, precision) that avoids cancelling
the large log-normalisers (see :func:`kl_mean_field_elementwise`, :func:`alpha_renyi_mean_field_elementwise`);
full-covariance Gaussians likewise use the moment forms :func:`kl_full_covariance` and
:func:`alpha_renyi_full_covariance` (Cholesky factors, an explicit mean difference), because the
log-normalisers ``1/2 mu^T Lambda mu`` reach ~10^6 at means ~10 and precisions ~10^4 while the divergence is
O(1): in float32 their difference was off by 3-50 %.  The tests check that these equal the log-normaliser
forms in float64.
"""

from __future__ import annotations

import inspect
import math
import numbers
import sys
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor

from common.errors import DivergenceUndefinedError, ImproperDistributionError, NonFiniteError
from common.families import FullCovarianceGaussian, GaussianFactor, MeanFieldGaussian
from common.fast_math import log_ratio
from common.registry import Registry

_SQRT2 = math.sqrt(2.0)
_FR_LOG_FORM = 1e4  # fisher_rao_univariate: beyond this x = (1+D)/(1-D) - 1, log1p(x) is taken in log form

__all__ = [
    "DIVERGENCES",
    "AlphaRenyi",
    "Divergence",
    "FisherRao",
    "KL",
    "ReverseKL",
    "WeightedKL",
    "alpha_renyi_full_covariance",
    "alpha_renyi_mean_field_elementwise",
    "alpha_renyi_via_log_normalizer",
    "fisher_rao_univariate",
    "kl_full_covariance",
    "kl_mean_field_elementwise",
    "kl_via_log_normalizer",
    "make_divergence",
]


# ==================================================================================================
# helpers
def _check_same_layout(q: GaussianFactor, p: GaussianFactor) -> None:
    """Same family, same names, same shapes; else :class:`ShapeMismatchError` (from the families)."""
    q._check_compatible(p)


def _check_real_hyper(name: str, value: object) -> float:
    """``value`` as a finite float, else ValueError naming the hyperparameter."""
    is_scalar_tensor = isinstance(value, Tensor) and value.numel() == 1
    if isinstance(value, bool) or not (isinstance(value, numbers.Real) or is_scalar_tensor):
        raise ValueError(f"hyperparameter {name} must be a real number, got {value!r}")
    v = float(value)  # type: ignore[arg-type]
    if not math.isfinite(v):
        raise ValueError(f"hyperparameter {name} must be finite, got {v}")
    return v


def _safe_sqrt(x: Tensor) -> Tensor:
    """``sqrt(x)`` for ``x >= 0`` whose gradient at ``x == 0`` is 0 instead of ``inf`` (no NaN downstream).

    Used where the argument vanishes only at a minimum of the distance (``q == p``), where 0 is a valid
    subgradient of the (cone-shaped) distance.  Only an exact 0 is special-cased: a NaN argument (an
    overflowed or improper factor) gives NaN, which the callers turn into a typed error, never into 0.
    """
    pos = x > 0
    safe = torch.where(pos, x, torch.ones_like(x))
    zero_or_nan = torch.where(x == 0, torch.zeros_like(x), torch.full_like(x, math.nan))
    return torch.where(pos, torch.sqrt(safe), zero_or_nan)


def _log1p_over_x(x: Tensor) -> Tensor:
    """``log1p(x) / x`` (1 at ``x == 0``) for ``x > -1``, accurate and with a finite gradient for every ``x``,
    including ``x`` so small that ``x * x`` underflows (there ``log1p(x)/x`` would be 0/0 or its autograd
    derivative ``1/(x (1+x)) - log1p(x)/x^2`` inf - inf).  For ``|x| < eps^(1/4)`` the Taylor polynomial
    ``1 - x/2 + x^2/3 - x^3/4`` (truncation ``x^4/5 < eps``), elsewhere the quotient; each branch is fed a
    harmless argument where it is not taken (no ``0 * inf = NaN`` in the gradient).

    Used by the Alpha-Renyi forms to write ``log1p(w m) - w log1p(m) = w [m log1p(w m)/(w m) - log1p(m)]`` so
    that the factor ``w`` (``1 - alpha`` near ``alpha = 1``, ``alpha`` near ``alpha = 0``) cancels against the
    normalisation ``1/(alpha (alpha - 1))`` analytically instead of in rounding."""
    small = x.abs() < torch.finfo(x.dtype).eps ** 0.25
    xb = torch.where(small, torch.ones_like(x), x)
    xs = torch.where(small, x, torch.zeros_like(x))
    series = 1.0 + xs * (-0.5 + xs * (1.0 / 3.0 - 0.25 * xs))
    return torch.where(small, series, torch.log1p(xb) / xb)


def _check_finite_distance(value: Tensor, what: str) -> Tensor:
    """``value`` if every entry is finite, else :class:`NonFiniteError`.

    The Fisher-Rao distance between proper Gaussians is always finite; a NaN or infinity means that a
    moment overflowed (e.g. a float32 mean ``eta1 / lambda`` beyond the float range), and returning it, or
    a 0, would silently mislead the optimiser.
    """
    v = value.detach()
    if not bool(torch.isfinite(v).all()):
        n_nan = int(torch.isnan(v).sum())
        n_inf = int(torch.isinf(v).sum())
        raise NonFiniteError(
            f"{what}: the Fisher-Rao distance is not finite ({n_nan} NaN, {n_inf} infinite of {v.numel()}); "
            f"a moment (mean = eta1 / lambda, or a standard deviation) overflowed in {v.dtype}"
        )
    return value


def _mean_precision(q: MeanFieldGaussian) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    lam = {n: -2.0 * e2 for n, e2 in q.eta2.items()}
    mean = {n: e1 / lam[n] for n, e1 in q.eta1.items()}
    return mean, lam


def _full_moments(f: FullCovarianceGaussian, what: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(mean, symmetrised precision, lower Cholesky factor of it)`` of a proper full-covariance factor,
    differentiable; :class:`ImproperDistributionError` naming ``what`` if the factorisation fails.

    The mean is a Cholesky solve of ``Lambda mu = eta1`` (no explicit inverse).  The symmetrisation matches
    :meth:`FullCovarianceGaussian.log_normalizer`, so gradients w.r.t. ``eta2`` are split symmetrically as
    there.
    """
    lam = f.precision()
    lam = 0.5 * (lam + lam.T)
    chol, info = torch.linalg.cholesky_ex(lam)
    if int(info) != 0:
        raise ImproperDistributionError(what, f.detach().improper_detail() or "precision not positive definite")
    mean = torch.cholesky_solve(f.eta1.unsqueeze(-1), chol).squeeze(-1)
    return mean, lam, chol


# ==================================================================================================
# closed forms as plain functions
def kl_via_log_normalizer(q: GaussianFactor, p: GaussianFactor) -> Tensor:
    """``KL(q || p) = A(eta_p) - A(eta_q) - <eta_p - eta_q, E_q[T]>`` for any Gaussian family (generic form).

    Exact in float64 for moderate means and precisions; in float32 (or with large ``mu^T Lambda mu``) the large
    log-normalisers cancel, which is why :class:`KL` uses :func:`kl_mean_field_elementwise` for mean-field
    factors and :func:`kl_full_covariance` for full-covariance ones.  Kept as the generic reference form.
    """
    _check_same_layout(q, p)
    q.detach().check_proper("q in KL")
    p.detach().check_proper("p in KL")
    stats = q.mean_parameters()
    cross = sum(((p.params[k] - q.params[k]) * stats[k]).sum() for k in q.params)
    return p.log_normalizer() - q.log_normalizer() - cross


def kl_mean_field_elementwise(q: MeanFieldGaussian, p: MeanFieldGaussian) -> dict[str, Tensor]:
    """Per-coordinate ``KL(q_i || p_i)`` of two proper mean-field Gaussians (same layout), in the form

        KL_i = 1/2 [ (u - log(r)) + lambda_p (mu_q - mu_p)^2 ],   r = lambda_p / lambda_q,
                                                                  u = (lambda_p - lambda_q) / lambda_q = r - 1,

    which equals ``1/2 [tr(Lambda_p Sigma_q) - 1 - log(lambda_p / lambda_q) + lambda_p (mu_q - mu_p)^2]`` and
    is accurate in float32 (no cancellation of log-normalisers).  Each entry is >= 0.

    ``log(r)`` is evaluated as ``log1p(u)`` where ``|u| <= 1/2`` (accurate near ``r = 1``, where the value is
    O(u^2)) and as ``log(r)`` with ``r`` formed directly elsewhere: for ``r`` below ~6e-8 (float32) ``u``
    rounds to ``-1`` and ``log1p(u)`` would be ``-inf`` (an infinite KL for, e.g., ``v_q = 1e-8`` under a
    unit cavity, whose KL is 8.71), and already at ``r ~ 1e-6`` the rounding of ``1 + u`` costs percents.
    The branch not taken is fed a harmless argument so that its gradient is finite (``torch.where`` would
    otherwise propagate ``0 * inf = NaN``).
    """
    mq, lq = _mean_precision(q)
    mp, lp = _mean_precision(p)
    out = {}
    for n in q.names:
        u = (lp[n] - lq[n]) / lq[n]
        d = mq[n] - mp[n]
        out[n] = 0.5 * ((u - log_ratio(lp[n] / lq[n], u)) + lp[n] * d * d)
    return out


def kl_full_covariance(q: FullCovarianceGaussian, p: FullCovarianceGaussian) -> Tensor:
    """``KL(q || p)`` of two proper full-covariance Gaussians in moment form,

        KL = 1/2 [ tr(Lambda_p Sigma_q) - d + dmu^T Lambda_p dmu + logdet Lambda_q - logdet Lambda_p ],

    with ``dmu = mu_q - mu_p`` formed explicitly and, with ``Lambda = L L^T`` (Cholesky),
    ``tr(Lambda_p Sigma_q) = ||L_q^{-1} L_p||_F^2``, ``dmu^T Lambda_p dmu = ||L_p^T dmu||^2`` and
    ``logdet Lambda_p - logdet Lambda_q = 2 sum_i log(L_p,ii / L_q,ii)`` (no explicit inverse).

    Every term is O(the divergence) or O(d), unlike the log-normaliser form
    :func:`kl_via_log_normalizer`, whose ``1/2 mu^T Lambda mu`` terms (~10^6 at means ~10 and precisions
    ~10^4) cancel: in float32 that form was off by 3 % there and by ~50 % at precisions ~10^5, which misled
    best-state selection and the L-BFGS line search of a float32 full-covariance polish.  Equal to it in
    float64 (to rounding).  Differentiable by autograd in both arguments.
    """
    _check_same_layout(q, p)
    q.detach().check_proper("q in KL")
    p.detach().check_proper("p in KL")
    mu_q, _, chol_q = _full_moments(q, "q in KL")
    mu_p, _, chol_p = _full_moments(p, "p in KL")
    dmu = mu_q - mu_p
    w = torch.linalg.solve_triangular(chol_q, chol_p, upper=False)  # L_q^{-1} L_p
    trace = (w * w).sum()
    maha = (chol_p.T @ dmu).square().sum()
    logdet_ratio = 2.0 * torch.log(torch.diagonal(chol_p) / torch.diagonal(chol_q)).sum()
    return 0.5 * (trace - q.dim + maha - logdet_ratio)


def _check_alpha(alpha: object) -> float:
    """``alpha`` as a finite float other than 0 and 1, else ValueError (a NaN alpha must not reach the region
    checks, whose comparisons are all False for NaN and would report it as an undefined divergence)."""
    alpha = _check_real_hyper("alpha", alpha)
    if alpha in (0.0, 1.0):
        raise ValueError(f"alpha must not be 0 or 1 here, got {alpha}")
    return alpha


def _alpha_mixture(q: GaussianFactor, p: GaussianFactor, alpha: float) -> GaussianFactor:
    """``alpha eta_q + (1 - alpha) eta_p`` after the checks both Alpha-Renyi closed forms share: same layout,
    ``alpha not in {0, 1}``, ``q`` and ``p`` proper, and the mixture proper (else
    :class:`DivergenceUndefinedError`)."""
    _check_same_layout(q, p)
    alpha = _check_alpha(alpha)
    q.detach().check_proper("q in alpha_renyi")
    p.detach().check_proper("p in alpha_renyi")
    mix = q.combine(p, alpha, 1.0 - alpha)
    detail = mix.detach().improper_detail()
    if detail is not None:
        raise DivergenceUndefinedError(_undefined_message(alpha, detail))
    return mix


def alpha_renyi_via_log_normalizer(q: GaussianFactor, p: GaussianFactor, alpha: float) -> Tensor:
    """``[A(alpha eta_q + (1-alpha) eta_p) - alpha A(eta_q) - (1-alpha) A(eta_p)] / (alpha (alpha-1))``.

    The generic exponential-family form of the Alpha-Renyi divergence (Knoblauch et al. 2022, Cor. 35).
    Raises :class:`DivergenceUndefinedError` if the combined natural parameter is improper (see
    :class:`AlphaRenyi` for the region).  ``alpha`` is not validated here beyond ``alpha not in {0, 1}``.
    """
    alpha = _check_alpha(alpha)
    mix = _alpha_mixture(q, p, alpha)
    num = mix.log_normalizer() - alpha * q.log_normalizer() - (1.0 - alpha) * p.log_normalizer()
    return num / (alpha * (alpha - 1.0))


def alpha_renyi_full_covariance(q: FullCovarianceGaussian, p: FullCovarianceGaussian, alpha: float) -> Tensor:
    """Alpha-Renyi divergence of two proper full-covariance Gaussians in the (moment) Sigma_alpha form

        D = 1/2 dmu^T Sigma_a^{-1} dmu - log(|Sigma_a| / (|Sigma_q|^(1-alpha) |Sigma_p|^alpha)) / (2 alpha (alpha-1)),

    ``Sigma_a = alpha Sigma_p + (1-alpha) Sigma_q``, evaluated without inverses through the combined precision
    ``Lambda_a = alpha Lambda_q + (1-alpha) Lambda_p = L_a L_a^T``: ``Sigma_a = Sigma_q Lambda_a Sigma_p``, so
    ``Sigma_a^{-1} = Lambda_p Lambda_a^{-1} Lambda_q`` and ``dmu^T Sigma_a^{-1} dmu = <L_a^{-1} Lambda_p dmu,
    L_a^{-1} Lambda_q dmu>`` with ``dmu = mu_q - mu_p`` formed explicitly.

    The log-det term ``log|Lambda_a| - alpha log|Lambda_q| - (1-alpha) log|Lambda_p|`` is O(1 - alpha) near
    ``alpha = 1`` and O(alpha) near ``alpha = 0`` while the normalisation divides by ``alpha (alpha - 1)``, so it
    is expanded around the nearer end (the full-covariance analogue of
    :func:`alpha_renyi_mean_field_elementwise`).  For ``alpha >= 1/2``, with ``L_q`` the Cholesky factor of
    ``Lambda_q``, ``w = 1 - alpha`` and ``m_i`` the eigenvalues of the symmetric
    ``M = L_q^{-1} (Lambda_p - Lambda_q) L_q^{-T}`` (``Lambda_a = L_q (I + w M) L_q^T``,
    ``Lambda_p = L_q (I + M) L_q^T``):

        log-det term = sum_i [log1p(w m_i) - w log1p(m_i)] = w S,
        S = sum_i m_i log1p(w m_i)/(w m_i) - log(|Lambda_p| / |Lambda_q|),
        log-det term / (2 alpha (alpha - 1)) = -S / (2 alpha);

    for ``alpha < 1/2`` the same with the roles of ``q`` and ``p`` swapped (``w = alpha``, ``M`` from ``L_p`` and
    ``Lambda_q - Lambda_p``), giving ``S / (2 (alpha - 1))``.  The factor ``w`` thus cancels analytically: the
    value is accurate in float32 as ``alpha -> 1`` (where the former ``2 sum_i [alpha log(L_a,ii/L_q,ii) +
    (1-alpha) log(L_a,ii/L_p,ii)]`` cancelled: 0.216 instead of 0.2662 at ``alpha = 1 - 1e-6``) and as ``alpha ->
    0`` (where it lost the log-det term altogether), and tends to ``KL(q || p)`` and ``KL(p || q)`` there.  The
    log-determinant ratio comes from the Cholesky diagonals (as in :func:`kl_full_covariance`), the eigenvalues
    from ``torch.linalg.eigvalsh`` (its gradient is stable also for repeated eigenvalues).  This is accurate in
    float32 where the log-normaliser form :func:`alpha_renyi_via_log_normalizer` cancels ~10^6-sized terms (14 %
    off at means ~10 and precisions ~10^4 for alpha = 2.5), and equals it in float64 to rounding.

    Raises :class:`DivergenceUndefinedError` if ``Lambda_a`` is not positive definite (see :class:`AlphaRenyi`
    for the region), or if it is only to rounding (``1 + w m_i <= 0``).  ``alpha`` must be a finite real other
    than 0 and 1 (else ValueError); it is not otherwise validated.
    """
    alpha = _check_alpha(alpha)
    mix = _alpha_mixture(q, p, alpha)
    lam_a = mix.precision()
    chol_a, info = torch.linalg.cholesky_ex(0.5 * (lam_a + lam_a.T))
    if int(info) != 0:  # positive definite by improper_detail, but not to rounding here
        raise DivergenceUndefinedError(
            _undefined_message(alpha, "the combined precision is on the boundary of positive definiteness to rounding")
        )
    mu_q, lam_q, chol_q = _full_moments(q, "q in alpha_renyi")
    mu_p, lam_p, chol_p = _full_moments(p, "p in alpha_renyi")
    dmu = mu_q - mu_p
    zq = torch.linalg.solve_triangular(chol_a, (lam_q @ dmu).unsqueeze(-1), upper=False).squeeze(-1)
    zp = torch.linalg.solve_triangular(chol_a, (lam_p @ dmu).unsqueeze(-1), upper=False).squeeze(-1)
    quad = (zq * zp).sum()
    if alpha >= 0.5:  # expand around q: Lambda_a = Lambda_q + (1 - alpha) (Lambda_p - Lambda_q)
        w, chol_b, chol_o, diff = 1.0 - alpha, chol_q, chol_p, lam_p - lam_q
    else:  # expand around p: Lambda_a = Lambda_p + alpha (Lambda_q - Lambda_p)
        w, chol_b, chol_o, diff = alpha, chol_p, chol_q, lam_q - lam_p
    x = torch.linalg.solve_triangular(chol_b, diff, upper=False)  # L_b^{-1} (Lambda_o - Lambda_b)
    m = torch.linalg.solve_triangular(chol_b, x.T, upper=False)  # L_b^{-1} (Lambda_o - Lambda_b) L_b^{-T}
    eig = torch.linalg.eigvalsh(0.5 * (m + m.T))
    wm = w * eig
    if not bool((wm.detach() > -1.0).all()):
        raise DivergenceUndefinedError(
            _undefined_message(
                alpha, "the combined precision is on the boundary of positive definiteness to rounding "
                f"(smallest eigenvalue of the relative combined precision {float((1.0 + wm.detach()).min()):.4g})"
            )
        )
    logdet_ratio = 2.0 * torch.log(torch.diagonal(chol_o) / torch.diagonal(chol_b)).sum()  # log|L_o| - log|L_b|
    s_sum = (eig * _log1p_over_x(wm)).sum() - logdet_ratio
    log_part = -s_sum / (2.0 * alpha) if alpha >= 0.5 else s_sum / (2.0 * (alpha - 1.0))
    return 0.5 * quad - log_part


def alpha_renyi_mean_field_elementwise(
    q: MeanFieldGaussian, p: MeanFieldGaussian, alpha: float
) -> dict[str, Tensor]:
    """Per-coordinate Alpha-Renyi divergence of two proper mean-field Gaussians (same layout).

    With ``lambda_a = alpha lambda_q + (1-alpha) lambda_p`` (the combined precision), ``t = log(lambda_p /
    lambda_q) = log(sigma_q^2 / sigma_p^2)`` and ``d = mu_q - mu_p``:

        D_i = 1/2 d^2 lambda_q lambda_p / lambda_a
              - [log1p((1-alpha) expm1(t)) - (1-alpha) t] / (2 alpha (alpha-1)),

    which is the Sigma_alpha form ``1/2 d^2 / Sigma_a - log(Sigma_a / (Sigma_q^(1-alpha) Sigma_p^alpha)) /
    (2 alpha (alpha-1))`` with ``Sigma_a = alpha sigma_p^2 + (1-alpha) sigma_q^2 = lambda_a sigma_q^2
    sigma_p^2``, written so that the O(t^2) log term does not cancel O(1) quantities (float32-safe).  The mean
    term is evaluated as ``d^2 lambda_p (lambda_q / lambda_a)`` (``alpha >= 1/2``) or ``d^2 lambda_q (lambda_p /
    lambda_a)`` (``alpha < 1/2``), so that ``lambda_q lambda_p`` is never formed (it overflows float32 at
    precisions ~1e19 where the divergence is finite).

    The log term above is O(1 - alpha) near ``alpha = 1`` (where the factor ``1 - alpha`` of ``(1-alpha) t``
    cancels the normalisation), but near ``alpha = 0`` it is O(alpha) and lost in rounding (at ``alpha = 1e-7`` in
    float32, or ``1e-300`` in float64, only the mean term survived).  For ``alpha < 1/2`` it is therefore
    expanded around ``p`` instead, with ``s = expm1(-t) = lambda_q / lambda_p - 1``:

        [log1p(alpha s) + alpha t] / (2 alpha (alpha-1)) = [s log1p(alpha s)/(alpha s) + t] / (2 (alpha-1)),

    the factor ``alpha`` cancelled analytically (:func:`_log1p_over_x`), which tends to ``KL(p || q)`` as
    ``alpha -> 0`` for every representable ``alpha``.

    Raises :class:`DivergenceUndefinedError` if ``lambda_a <= 0`` in any coordinate, saying how many.
    ``alpha`` must be a finite real other than 0 and 1 (else ValueError).
    """
    _check_same_layout(q, p)
    alpha = _check_alpha(alpha)
    mq, lq = _mean_precision(q)
    mp, lp = _mean_precision(p)
    lam_a = {n: alpha * lq[n] + (1.0 - alpha) * lp[n] for n in q.names}
    problems = []
    n_bad = 0
    n_total = 0
    for n in q.names:
        bad = ~(lam_a[n] > 0)
        n_total += bad.numel()
        if bad.any():
            k = int(bad.sum())
            n_bad += k
            problems.append(
                f"'{n}': {k} of {bad.numel()} (smallest combined precision {float(lam_a[n].min()):.4g})"
            )
    if problems:
        raise DivergenceUndefinedError(
            _undefined_message(
                alpha,
                f"combined precision alpha*lambda_q + (1-alpha)*lambda_p <= 0 in {n_bad} of {n_total} "
                f"coordinates: " + "; ".join(problems),
            )
        )
    out = {}
    c = 1.0 - alpha
    near_q = alpha >= 0.5
    for n in q.names:
        t = torch.log(lp[n]) - torch.log(lq[n])
        # expand around q (alpha >= 1/2: arg = (1-alpha)(r - 1)) or around p (alpha < 1/2: arg = alpha(1/r - 1))
        rel = torch.expm1(t) if near_q else torch.expm1(-t)
        arg = (c if near_q else alpha) * rel
        if not bool((arg > -1.0).all()):  # lambda_a > 0 but rounding put the coordinate on the boundary
            k = int((~(arg > -1.0)).sum())
            raise DivergenceUndefinedError(
                _undefined_message(alpha, f"'{n}': {k} coordinates are on the boundary lambda_a = 0 to rounding")
            )
        d = mq[n] - mp[n]
        # d^2 lambda_q lambda_p / lambda_a with the ratio formed first (lambda_q lambda_p overflows float32 at
        # precisions ~1e19); for 0 < alpha < 1 the ratio taken is bounded by 1/alpha resp. 1/(1-alpha) <= 2
        if near_q:
            mean_term = 0.5 * d * d * (lp[n] * (lq[n] / lam_a[n]))
            log_term = (torch.log1p(arg) - c * t) / (2.0 * alpha * (alpha - 1.0))
        else:
            mean_term = 0.5 * d * d * (lq[n] * (lp[n] / lam_a[n]))
            # [log1p(alpha rel) + alpha t] / (2 alpha (alpha-1)) with the factor alpha cancelled analytically
            log_term = (rel * _log1p_over_x(arg) + t) / (2.0 * (alpha - 1.0))
        out[n] = mean_term - log_term
    return out


def _undefined_message(alpha: float, detail: str) -> str:
    if alpha > 1.0:
        region = (
            f"for alpha > 1 the divergence is finite only if alpha*Lambda_q + (1-alpha)*Lambda_p is positive "
            f"definite, i.e. Sigma_q < alpha/(alpha-1) * Sigma_p = {alpha / (alpha - 1.0):.4g} * Sigma_p "
            f"(q must not be that much wider than p)"
        )
    else:  # alpha < 0
        region = (
            f"for alpha < 0 the divergence is finite only if alpha*Lambda_q + (1-alpha)*Lambda_p is positive "
            f"definite, i.e. Sigma_p < (alpha-1)/alpha * Sigma_q = {(alpha - 1.0) / alpha:.4g} * Sigma_q "
            f"(p must not be that much wider than q)"
        )
    return f"Alpha-Renyi divergence with alpha={alpha:g} is infinite: {detail}; {region}"


def fisher_rao_univariate(mu1: Tensor, s1: Tensor, mu2: Tensor, s2: Tensor) -> Tensor:
    """Fisher-Rao distance between ``N(mu1, s1^2)`` and ``N(mu2, s2^2)`` (``s`` are standard deviations), elementwise.

    Nielsen (2023):  FR = sqrt2 log((1 + D) / (1 - D)),
                     D  = sqrt(((mu2-mu1)^2 + 2 (s2-s1)^2) / ((mu2-mu1)^2 + 2 (s2+s1)^2)).

    Evaluated as the algebraically equal ``sqrt2 log1p(x)``, ``x = (num + sqrt(num) sqrt(den)) / (4 s1 s2)`` with
    ``num`` and ``den`` the numerator and denominator of ``D^2`` (using ``den - num = 8 s1 s2``), which is accurate
    both for nearby and for far-apart Gaussians.  Where ``x > 1e4`` (or ``x`` itself would overflow: ``num * den
    ~ dmu^4`` overflowed float32 at a mean gap ~2e9 and float64 at ~1e77, ``4 s1 s2`` underflows for tiny
    deviations) it is taken in log form, ``log1p(x) = log x + log1p(1/x)`` with ``log x = log sqrt(num) +
    log(sqrt(num) + sqrt(den)) - log 4 - log s1 - log s2`` and the square roots as ``hypot`` (finite for every
    finite input: the distance grows only logarithmically).  The square root is a safe one: at ``q == p`` the value is 0 and
    the gradient is 0 (a subgradient of the cone-shaped distance), never NaN.  Broadcasts its arguments.
    A non-finite result (a NaN or infinite argument, or an overflow of ``dm2`` or ``s1 s2``) raises
    :class:`~common.errors.NonFiniteError` instead of being returned.
    """
    mu1, s1, mu2, s2 = (torch.as_tensor(x) for x in (mu1, s1, mu2, s2))
    if not (bool((s1 > 0).all()) and bool((s2 > 0).all())):
        raise ValueError("fisher_rao_univariate: standard deviations s1, s2 must be > 0")
    mu1, s1, mu2, s2 = torch.broadcast_tensors(mu1, s1, mu2, s2)
    # far apart (x > _FR_LOG_FORM, or x itself not representable): log1p(x) = log x + log1p(1/x); decided on
    # detached values
    with torch.no_grad():
        far = _fr_log_x(mu1, s1, mu2, s2) > math.log(_FR_LOG_FORM)
    if not bool(far.any()):  # the usual case: the closed form alone (no second branch to evaluate)
        return _check_finite_distance(_SQRT2 * _fr_log1p_x(mu1, s1, mu2, s2), "fisher_rao_univariate")
    one, zero = torch.ones_like(s1), torch.zeros_like(mu1)
    # near (the closed form, fed harmless values where far, so its gradient there is 0, not NaN)
    near_val = _fr_log1p_x(*(torch.where(far, r, v) for r, v in ((zero, mu1), (one, s1), (zero, mu2), (one, s2))))
    # far (fed a point at distance ~1 where near)
    log_x = _fr_log_x(*(torch.where(far, v, r) for r, v in ((zero, mu1), (one, s1), (one, mu2), (one, s2))))
    far_val = log_x + torch.log1p(torch.exp(-log_x))
    return _check_finite_distance(_SQRT2 * torch.where(far, far_val, near_val), "fisher_rao_univariate")


def _fr_log1p_x(mu1: Tensor, s1: Tensor, mu2: Tensor, s2: Tensor) -> Tensor:
    """:func:`fisher_rao_univariate`'s ``log1p(x)``, ``x = (num + sqrt(num) sqrt(den)) / (4 s1 s2)``, directly."""
    dm2 = (mu2 - mu1) ** 2
    num = dm2 + 2.0 * (s2 - s1) ** 2
    den = dm2 + 2.0 * (s2 + s1) ** 2
    return torch.log1p((num + _safe_sqrt(num) * torch.sqrt(den)) / (4.0 * s1 * s2))


def _fr_log_x(mu1: Tensor, s1: Tensor, mu2: Tensor, s2: Tensor) -> Tensor:
    """:func:`fisher_rao_univariate`'s ``log x = log a + log(a + b) - log 4 - log s1 - log s2`` with ``a = sqrt(num)``
    and ``b = sqrt(den)`` as ``hypot``: no overflow of ``dm^2`` or ``num * den``, no underflow of ``4 s1 s2``."""
    a = torch.hypot(mu2 - mu1, _SQRT2 * (s2 - s1))
    b = torch.hypot(mu2 - mu1, _SQRT2 * (s2 + s1))
    return torch.log(a) + torch.log(a + b) - math.log(4.0) - torch.log(s1) - torch.log(s2)


# ==================================================================================================
# the divergence objects
class Divergence(ABC):
    """``D(q || p)`` between two Gaussian factors of the same family and layout."""

    name: ClassVar[str]

    @abstractmethod
    def __call__(self, q: GaussianFactor, p: GaussianFactor) -> Tensor:
        """Scalar tensor ``D(q || p)``, differentiable w.r.t. ``q.params`` and ``p.params`` (autograd)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


DIVERGENCES: Registry[Divergence] = Registry("divergence")


@DIVERGENCES.register("kl")
class KL(Divergence):
    """``KL(q || p)``.

    Full covariance: the moment form :func:`kl_full_covariance`.  Mean-field: the sum of
    :func:`kl_mean_field_elementwise`.  Both equal the generic log-normaliser form
    :func:`kl_via_log_normalizer` in exact arithmetic and are accurate in float32.
    """

    name: ClassVar[str] = "kl"

    def __call__(self, q: GaussianFactor, p: GaussianFactor) -> Tensor:
        return _kl(q, p, "KL")


def _kl(q: GaussianFactor, p: GaussianFactor, label: str) -> Tensor:
    _check_same_layout(q, p)
    q.detach().check_proper(f"q in {label}")
    p.detach().check_proper(f"p in {label}")
    if isinstance(q, MeanFieldGaussian):
        assert isinstance(p, MeanFieldGaussian)
        return sum(v.sum() for v in kl_mean_field_elementwise(q, p).values())  # type: ignore[return-value]
    if isinstance(q, FullCovarianceGaussian):
        assert isinstance(p, FullCovarianceGaussian)
        return kl_full_covariance(q, p)
    return kl_via_log_normalizer(q, p)


@DIVERGENCES.register("weighted_kl")
class WeightedKL(Divergence):
    """``(1/w) KL(q || p)`` with ``w > 0`` (FedGVI eq. 9).  By Lemma B.1 this equals tempering the loss by ``w``."""

    name: ClassVar[str] = "weighted_kl"

    def __init__(self, w: float) -> None:
        w = _check_real_hyper("w", w)
        if w <= 0:
            raise ValueError(f"weighted_kl: hyperparameter w must be > 0, got {w}")
        if w < sys.float_info.min:  # subnormal: 1/w is infinite (or nearly), every divergence would be inf
            raise ValueError(
                f"weighted_kl: hyperparameter w must be at least the smallest normal float64 "
                f"{sys.float_info.min:.4g} (its reciprocal 1/w must be finite), got {w!r}"
            )
        self.w = w

    def __call__(self, q: GaussianFactor, p: GaussianFactor) -> Tensor:
        return _kl(q, p, "weighted_kl") / self.w

    def __repr__(self) -> str:
        return f"WeightedKL(w={self.w:g})"


@DIVERGENCES.register("reverse_kl")
class ReverseKL(Divergence):
    """``KL(p || q)`` (the Alpha-Renyi limit alpha -> 0)."""

    name: ClassVar[str] = "reverse_kl"

    def __call__(self, q: GaussianFactor, p: GaussianFactor) -> Tensor:
        _check_same_layout(q, p)
        q.detach().check_proper("q in reverse_kl")
        p.detach().check_proper("p in reverse_kl")
        return _kl(p, q, "reverse_kl")


@DIVERGENCES.register("alpha_renyi")
class AlphaRenyi(Divergence):
    """Alpha-Renyi divergence ``D_AR = 1/(alpha (alpha-1)) log int q^alpha p^(1-alpha)`` (Knoblauch et al. 2022).

    Closed form through the log-normaliser,
    ``[A(alpha eta_q + (1-alpha) eta_p) - alpha A(eta_q) - (1-alpha) A(eta_p)] / (alpha (alpha-1))``, evaluated
    in the equivalent float32-safe moment forms: per coordinate (mean, precision) for mean-field factors
    (:func:`alpha_renyi_mean_field_elementwise`), the Sigma_alpha form for full covariance
    (:func:`alpha_renyi_full_covariance`).  ``alpha -> 1`` gives ``KL(q || p)`` and
    ``alpha -> 0`` gives ``KL(p || q)``; use ``"kl"`` / ``"reverse_kl"`` for those values.  Both moment forms
    expand around the nearer limit (``q`` for ``alpha >= 1/2``, ``p`` below), so they are accurate, also in
    float32, for every representable ``alpha`` other than 0 and 1.

    Region where it is finite: ``alpha eta_q + (1-alpha) eta_p`` must be a proper natural parameter, i.e. the
    combined precision ``Lambda_a = alpha Lambda_q + (1-alpha) Lambda_p`` must be positive definite
    (equivalently ``Sigma_a = alpha Sigma_p + (1-alpha) Sigma_q`` positive definite).

    * ``0 < alpha < 1``: always (a convex combination of precisions).
    * ``alpha > 1``: only if ``Sigma_q < alpha/(alpha-1) Sigma_p`` (per coordinate for mean-field); a ``q``
      much wider than ``p`` makes ``int q^alpha p^(1-alpha)`` infinite.
    * ``alpha < 0``: only if ``Sigma_p < (alpha-1)/alpha Sigma_q`` (roles swapped).

    Outside the region :class:`~common.errors.DivergenceUndefinedError` is raised, naming the region and (for
    mean-field) how many coordinates fail; nothing is returned as NaN, inf or 0.
    """

    name: ClassVar[str] = "alpha_renyi"

    def __init__(self, alpha: float) -> None:
        alpha = _check_real_hyper("alpha", alpha)
        if alpha == 1.0:
            raise ValueError('alpha_renyi: alpha = 1 is the KL limit; use divergence "kl"')
        if alpha == 0.0:
            raise ValueError('alpha_renyi: alpha = 0 is the reverse-KL limit; use divergence "reverse_kl"')
        self.alpha = alpha

    def __call__(self, q: GaussianFactor, p: GaussianFactor) -> Tensor:
        _check_same_layout(q, p)
        q.detach().check_proper("q in alpha_renyi")
        p.detach().check_proper("p in alpha_renyi")
        if isinstance(q, MeanFieldGaussian):
            assert isinstance(p, MeanFieldGaussian)
            parts = alpha_renyi_mean_field_elementwise(q, p, self.alpha)
            return sum(v.sum() for v in parts.values())  # type: ignore[return-value]
        if isinstance(q, FullCovarianceGaussian):
            assert isinstance(p, FullCovarianceGaussian)
            return alpha_renyi_full_covariance(q, p, self.alpha)
        return alpha_renyi_via_log_normalizer(q, p, self.alpha)

    def __repr__(self) -> str:
        return f"AlphaRenyi(alpha={self.alpha:g})"


@DIVERGENCES.register("fisher_rao")
class FisherRao(Divergence):
    """Fisher-Rao distance (a metric, symmetric in ``q`` and ``p``; Nielsen 2023).

    * :class:`FullCovarianceGaussian` with ``d = 1``: the univariate distance :func:`fisher_rao_univariate`.
    * :class:`MeanFieldGaussian`: ``sqrt(sum_i FR_i^2)`` over all coordinates.  This is the exact Fisher-Rao
      distance of the mean-field family, because the Fisher information of a product family is
      block-diagonal (the product metric), and the geodesic distance on a Riemannian product manifold is
      the Euclidean combination of the factor distances.
    * Full covariance with ``d > 1`` has no closed form: :class:`NotImplementedError`.
    """

    name: ClassVar[str] = "fisher_rao"

    def __call__(self, q: GaussianFactor, p: GaussianFactor) -> Tensor:
        _check_same_layout(q, p)
        if isinstance(q, FullCovarianceGaussian) and q.dim != 1:
            raise NotImplementedError(
                f"fisher_rao: the Fisher-Rao distance has no closed form for full-covariance Gaussians with "
                f"d = {q.dim} > 1; use d = 1 or a MeanFieldGaussian"
            )
        q.detach().check_proper("q in fisher_rao")
        p.detach().check_proper("p in fisher_rao")
        if isinstance(q, FullCovarianceGaussian):
            assert isinstance(p, FullCovarianceGaussian)
            lq, lp = q.precision()[0, 0], p.precision()[0, 0]
            return fisher_rao_univariate(q.eta1[0] / lq, lq.rsqrt(), p.eta1[0] / lp, lp.rsqrt())
        if isinstance(q, MeanFieldGaussian):
            assert isinstance(p, MeanFieldGaussian)
            mq, lq_ = _mean_precision(q)
            mp, lp_ = _mean_precision(p)
            sq = sum(
                (fisher_rao_univariate(mq[n], lq_[n].rsqrt(), mp[n], lp_[n].rsqrt()) ** 2).sum() for n in q.names
            )
            return _check_finite_distance(_safe_sqrt(sq), "fisher_rao")  # type: ignore[arg-type]
        raise TypeError(f"fisher_rao: unsupported family {type(q).__name__}")


# ==================================================================================================
def make_divergence(name: str, **hyper: object) -> Divergence:
    """The divergence registered as ``name`` with hyperparameters ``hyper`` (e.g. ``alpha=2.5``, ``w=0.1``).

    Unknown ``name``: :class:`KeyError` listing the known names.  Missing, unknown or invalid
    hyperparameters: :class:`ValueError`.
    """
    factory = DIVERGENCES.get(name)
    params = [p for p in inspect.signature(factory).parameters.values()]
    accepted = [p.name for p in params]
    unknown = sorted(set(hyper) - set(accepted))
    missing = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in hyper]
    if unknown or missing:
        msg = f"divergence '{name}' takes hyperparameters {accepted or 'none'}"
        if unknown:
            msg += f"; unknown: {unknown}"
        if missing:
            msg += f"; missing: {missing}"
        raise ValueError(msg)
    return factory(**hyper)
