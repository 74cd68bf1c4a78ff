"""Closed-form client updates (FedGVI Prop. 4.9 and the conjugate PVI case).

For the Gaussian location and linear-Gaussian models the NLL and the weighted score-matching loss, summed
over the client's data, are exact quadratics ``L(theta) = 1/2 theta^T P theta - h^T theta + c``
(:class:`~common.quadratic.QuadraticLoss`).  With the divergence ``D = (1/w) KL`` (``w = 1``: KL) the
client objective is

    E_q[L] + (1/w) KL(q || cavity) = (1/w) KL(q || cavity * exp(-w L)) + const,

so over all Gaussians the minimiser is the Gaussian ``cavity * exp(-w L)``: natural parameters
``eta1 = eta1_cav + w h`` and ``eta2 = eta2_cav - w P / 2`` (FedGVI Prop. 4.9; for the NLL with ``w = 1``
this is exact Bayes).

Mean-field family: the minimiser over mean-field Gaussians of ``KL(q || N(m, Lambda^{-1}))`` is the
mean-field Gaussian with mean ``m`` and precisions ``diag(Lambda)`` (the classical mean-field solution for a
Gaussian target; setting the gradient of ``KL`` w.r.t. each ``(mu_i, sigma_i^2)`` to zero gives
``mu = m`` and ``1/sigma_i^2 = Lambda_ii``).  So for a mean-field cavity the client posterior is the exact
mean-field optimum: the target ``cavity * exp(-w L)`` is formed with full precision ``Lambda =
diag(Lambda_cav) + w P`` and then projected; if ``P`` is diagonal this is just the product of factors.

Anything else (another loss, model or divergence) raises :class:`ConjugacyError`; use
:func:`common.local_gvi.local_gvi` instead.
"""

from __future__ import annotations

from typing import Any

import torch

from common.divergences import KL, WeightedKL
from common.errors import ImproperDistributionError, PGVIError, ShapeMismatchError
from common.families import FullCovarianceGaussian, GaussianFactor, MeanFieldGaussian
from common.quadratic import QuadraticLoss

CONJUGATE_LOSSES = ("nll", "score_matching")
CONJUGATE_MODELS = ("gaussian_location", "linear_regression")


class ConjugacyError(PGVIError, ValueError):
    """The (model, loss, divergence) combination has no closed-form client update."""


def _divergence_weight(divergence: Any) -> float | None:
    """``w`` of ``D = (1/w) KL``, or ``None`` if ``divergence`` is not a (weighted) KL."""
    if isinstance(divergence, WeightedKL):
        return float(divergence.w)
    if isinstance(divergence, KL):
        return 1.0
    return None


def _why_not(model: Any, loss: Any, divergence: Any) -> str | None:
    reasons = []
    if getattr(model, "name", None) not in CONJUGATE_MODELS:
        reasons.append(f"model '{getattr(model, 'name', type(model).__name__)}' is not one of {CONJUGATE_MODELS}")
    if getattr(loss, "name", None) not in CONJUGATE_LOSSES:
        reasons.append(f"loss '{getattr(loss, 'name', type(loss).__name__)}' is not one of {CONJUGATE_LOSSES}")
    if _divergence_weight(divergence) is None:
        reasons.append(f"divergence {divergence!r} is not 'kl' or 'weighted_kl'")
    return "; ".join(reasons) if reasons else None


def supports_conjugate(model: Any, loss: Any, divergence: Any) -> bool:
    """Whether :func:`conjugate_local_posterior` applies (NLL or score matching on the Gaussian location or
    linear-regression model, with ``kl`` or ``weighted_kl``)."""
    return _why_not(model, loss, divergence) is None


def conjugate_local_posterior(
    model: Any, loss: Any, divergence: Any, cavity: GaussianFactor, x: torch.Tensor | None, y: torch.Tensor
) -> GaussianFactor:
    """The exact minimiser of ``E_q[sum_i L_i] + D(q || cavity)`` over the cavity's family (see module doc).

    The score-matching weights are centred at the cavity mean (the loss's reference).  Raises
    :class:`ConjugacyError` for an unsupported combination,
    :class:`~common.errors.ShapeMismatchError` if the cavity's ``theta`` is not the model's vector ``theta``, and
    :class:`~common.errors.ImproperDistributionError` if the cavity (or, impossibly for these positive
    semi-definite losses, the result) is improper.
    """
    reason = _why_not(model, loss, divergence)
    if reason is not None:
        raise ConjugacyError(f"no closed-form client update: {reason}")
    w = _divergence_weight(divergence)
    assert w is not None
    cavity.check_finite("cavity")
    cavity.check_proper("cavity")
    if isinstance(cavity, MeanFieldGaussian):
        if cavity.names != ["theta"]:
            raise ConjugacyError(f"mean-field cavity over {cavity.names}; the model has one vector 'theta'")
        reference = {"theta": cavity.mean()["theta"]}
    elif isinstance(cavity, FullCovarianceGaussian):
        reference = {"theta": cavity.mean()}
    else:
        raise ConjugacyError(f"unsupported family {type(cavity).__name__}")
    cavity_shape = tuple(reference["theta"].shape)
    model_shape = getattr(model, "param_shapes", {}).get("theta")
    if len(cavity_shape) != 1 or (model_shape is not None and cavity_shape != tuple(model_shape)):
        raise ShapeMismatchError(
            f"cavity over 'theta' of shape {cavity_shape}; model '{model.name}' has 'theta' of shape "
            f"{None if model_shape is None else tuple(model_shape)}"
        )
    quad = loss.quadratic(model, x, y, reference)
    if quad is None:
        raise ConjugacyError(f"loss '{loss.name}' has no quadratic form for model '{model.name}'")
    quad = QuadraticLoss(quad.precision.to(cavity.dtype), quad.shift.to(cavity.dtype), quad.constant, quad.name)
    if isinstance(cavity, FullCovarianceGaussian):
        posterior = cavity * quad.as_factor(cavity, weight=w)
    else:
        posterior = _mean_field_projection(cavity, quad, w)
    return posterior.check_finite("local posterior").check_proper("local posterior")


def _mean_field_projection(cavity: MeanFieldGaussian, quad: QuadraticLoss, w: float) -> MeanFieldGaussian:
    """Mean-field optimum for the Gaussian target ``cavity * exp(-w L)`` (mean-field cavity); the cavity's
    ``theta`` must be a vector of the loss's dimension ``d`` (``P`` is ``(d, d)``, ``h`` is ``(d,)``), else
    :class:`~common.errors.ShapeMismatchError` (torch would broadcast a 1-vector)."""
    lam_cav = -2.0 * cavity.eta2["theta"]
    d = lam_cav.shape[0] if lam_cav.dim() == 1 else -1
    if d < 0 or tuple(quad.precision.shape) != (d, d) or tuple(quad.shift.shape) != (d,):
        raise ShapeMismatchError(
            f"mean-field cavity over 'theta' of shape {tuple(lam_cav.shape)}; the loss's quadratic has precision "
            f"{tuple(quad.precision.shape)} and shift {tuple(quad.shift.shape)}"
        )
    lam = torch.diag(lam_cav) + w * quad.precision
    lam = 0.5 * (lam + lam.T)
    h = cavity.eta1["theta"] + w * quad.shift
    chol, info = torch.linalg.cholesky_ex(lam)
    if int(info) != 0:
        raise ImproperDistributionError("conjugate target cavity * exp(-w L)", "precision is not positive definite")
    mean = torch.cholesky_solve(h.unsqueeze(-1), chol).squeeze(-1)
    diag = torch.diagonal(lam).clone()
    return MeanFieldGaussian({"theta": diag * mean}, {"theta": -0.5 * diag})
