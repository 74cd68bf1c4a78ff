"""The domain of ``D(q || cavity)`` as a constraint of the local optimiser: a step that leaves it is cut short.

Alpha-Renyi with ``alpha > 1`` or ``alpha < 0`` is finite only where the combined precision
``alpha Lambda_q + (1 - alpha) Lambda_p`` is positive definite (:class:`~common.divergences.AlphaRenyi`), i.e.
with ``c = alpha / (alpha - 1)``

* ``alpha > 1``: ``Sigma_q < c Sigma_p`` (``q`` no wider than ``c`` times the cavity; ``c`` is 1.02 for alpha 50);
* ``alpha < 0``: ``Sigma_q > c Sigma_p`` (``0 < c < 1``: ``q`` no narrower than ``c`` times the cavity).

The divergence is ``+inf`` outside and grows without bound towards the boundary, so the local problem's
minimiser lies inside.  An Adam step does not know that: its size per coordinate is about the learning rate
whatever the gradient, and a step from near the boundary (a weight the data say nothing about sits at the cavity,
2 % from the boundary for alpha 50) lands outside.  The next step had no finite objective and the client's whole
update failed (``DivergenceUndefinedError``).

Every step therefore ends with :meth:`DomainGuard.cut`: where the step left the domain shrunk by the relative
margin :data:`DOMAIN_MARGIN` (in variance), the scale parameters are moved back to half-way between where the step
started and that bound:

* mean-field, per coordinate of the raw scale ``rho`` (``sigma = softplus(rho) + min_scale``, monotone): a
  coordinate past its bound goes to the midpoint of its pre-step value and the bound (to the bound itself if it
  started beyond it, which only a start inside the margin can);
* full covariance: ``q``'s Cholesky parameters go back along the step (halving it) until
  ``Sigma_q <= (1 - margin) c Sigma_p`` (``>=`` for ``alpha < 0``) holds by a Cholesky test, at most
  :data:`MAX_HALVINGS` times, else to where the step started.

The means and every coordinate the step kept inside are untouched.  Cutting the step short rather than placing the
state on the bound matters for Adam: at the bound the divergence's gradient is about ``1/margin`` times its usual
size, and one such gradient in Adam's second-moment estimate (decay 0.999) shrank every later step of that
coordinate for thousands of steps (placed on the bound, a 2-D location problem's variance stalled at 0.907 against
its minimiser's 0.994; cut half-way, Adam reaches the minimiser).  At the margin the
combined precision is still ``alpha * margin`` of ``q``'s precision times ``(alpha - 1) / alpha``, far from float32's
rounding.  :attr:`common.local_gvi.LocalGVIResult.domain_cuts` counts the steps that were cut.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from common.divergences import AlphaRenyi
from common.errors import DivergenceUndefinedError
from common.families import FullCovarianceGaussian, GaussianFactor, MeanFieldGaussian
from common.variational import FullCovarianceVariational, MeanFieldVariational, VariationalGaussian, inverse_softplus

#: Relative distance (in variance) from the domain's boundary that a cut step keeps.
DOMAIN_MARGIN = 1e-3
#: Halvings of a full-covariance step before it is undone.
MAX_HALVINGS = 30


def bounded_ratio(divergence: Any) -> float | None:
    """``c = alpha / (alpha - 1)`` for an Alpha-Renyi divergence with a bounded domain (``alpha > 1``: an upper
    bound ``c > 1`` on ``Sigma_q / Sigma_p``; ``alpha < 0``: a lower bound ``0 < c < 1``), else ``None``."""
    if not isinstance(divergence, AlphaRenyi):
        return None
    alpha = float(divergence.alpha)
    if 0.0 < alpha < 1.0:
        return None
    return alpha / (alpha - 1.0)


class DomainGuard:
    """:meth:`remember` before a step, :meth:`cut` after it (both in place on ``q``'s scale parameters)."""

    def __init__(self, q: VariationalGaussian) -> None:
        self._before = [p.detach().clone() for p in q.scale_parameters()]

    def remember(self, q: VariationalGaussian) -> None:
        """Keep the scale parameters as they are before a step."""
        with torch.no_grad():
            for kept, p in zip(self._before, q.scale_parameters()):
                kept.copy_(p)

    def cut(self, q: VariationalGaussian) -> int:  # pragma: no cover - abstract
        """Cut the step since :meth:`remember` back onto the shrunk domain; how many coordinates (mean-field) or
        halvings (full covariance, ``MAX_HALVINGS + 1`` for an undone step) that took, 0 if none."""
        raise NotImplementedError


class MeanFieldDomainGuard(DomainGuard):
    """Per coordinate: the raw scale ``rho`` bounded above by ``rho_max`` (``alpha > 1``) or below by ``rho_min``
    (``alpha < 0``)."""

    def __init__(self, cavity: MeanFieldGaussian, q: MeanFieldVariational, ratio: float) -> None:
        super().__init__(q)
        self.upper = ratio > 1.0
        factor = ratio * (1.0 - DOMAIN_MARGIN if self.upper else 1.0 + DOMAIN_MARGIN)
        variance = cavity.variance()
        self.bounds: list[Tensor] = []
        for name, raw in zip(q.names, q.raw_scales):
            bound_scale = (factor * variance[name].detach().to(torch.float64)).sqrt() - q.min_scale
            if self.upper:
                if not bool((bound_scale > 0).all()):
                    raise DivergenceUndefinedError(
                        f"Alpha-Renyi domain of '{name}': the cavity's variance is so small that no scale above the "
                        f"parameterisation floor min_scale={q.min_scale:.3g} is inside the domain")
                bound = inverse_softplus(bound_scale)
            else:  # a lower bound below the floor holds for every representable scale
                bound = torch.where(bound_scale > 0, inverse_softplus(bound_scale.clamp_min(1e-300)),
                                    torch.full_like(bound_scale, -torch.inf))
            self.bounds.append(bound.to(raw.dtype))

    def cut(self, q: VariationalGaussian) -> int:
        assert isinstance(q, MeanFieldVariational)
        moved = 0
        with torch.no_grad():
            for raw, before, bound in zip(q.raw_scales, self._before, self.bounds):
                outside = raw > bound if self.upper else raw < bound
                count = int(outside.sum())  # a read-only pass; the parameter is written only when needed
                if count:
                    started_inside = before < bound if self.upper else before > bound
                    target = torch.where(started_inside, 0.5 * (before + bound), bound)
                    raw.copy_(torch.where(outside, target, raw))  # copy_ moves the version counter (explicit_step)
                    moved += count
        return moved


class FullCovarianceDomainGuard(DomainGuard):
    """The step of ``q``'s Cholesky parameters halved until ``(1 - margin) c Sigma_p - Sigma_q`` (``alpha > 1``) or
    ``Sigma_q - (1 + margin) c Sigma_p`` (``alpha < 0``) has a Cholesky factorisation, in float64."""

    def __init__(self, cavity: FullCovarianceGaussian, q: FullCovarianceVariational, ratio: float) -> None:
        super().__init__(q)
        self.upper = ratio > 1.0
        self.bound = ratio * (1.0 - DOMAIN_MARGIN if self.upper else 1.0 + DOMAIN_MARGIN)
        cov_p = cavity.covariance().detach().to(torch.float64)
        self.cov_p = 0.5 * (cov_p + cov_p.T)

    def inside(self, q: FullCovarianceVariational) -> bool:
        chol = q.cholesky().detach().to(torch.float64)
        cov_q = chol @ chol.T
        gap = self.bound * self.cov_p - cov_q if self.upper else cov_q - self.bound * self.cov_p
        return int(torch.linalg.cholesky_ex(gap).info) == 0

    def cut(self, q: VariationalGaussian) -> int:
        assert isinstance(q, FullCovarianceVariational)
        with torch.no_grad():
            if self.inside(q):
                return 0
            after = [p.detach().clone() for p in q.scale_parameters()]
            for halvings in range(1, MAX_HALVINGS + 1):
                t = 0.5**halvings
                for p, b, a in zip(q.scale_parameters(), self._before, after):
                    p.copy_(b + t * (a - b))
                if self.inside(q):
                    return halvings
            for p, b in zip(q.scale_parameters(), self._before):
                p.copy_(b)
        return MAX_HALVINGS + 1


def domain_guard(divergence: Any, cavity: GaussianFactor, q: VariationalGaussian) -> DomainGuard | None:
    """The guard of ``divergence(. || cavity)``'s domain for ``q``'s parameterisation, or ``None`` where the
    divergence is finite for every proper ``q`` (KL, weighted KL, reverse KL, Fisher-Rao, Alpha-Renyi with
    ``0 < alpha < 1``) or is not one of the registry's."""
    ratio = bounded_ratio(divergence)
    if ratio is None:
        return None
    if isinstance(q, MeanFieldVariational) and isinstance(cavity, MeanFieldGaussian):
        return MeanFieldDomainGuard(cavity, q, ratio)
    if isinstance(q, FullCovarianceVariational) and isinstance(cavity, FullCovarianceGaussian):
        return FullCovarianceDomainGuard(cavity, q, ratio)
    return None


__all__ = [
    "DOMAIN_MARGIN",
    "MAX_HALVINGS",
    "DomainGuard",
    "FullCovarianceDomainGuard",
    "MeanFieldDomainGuard",
    "bounded_ratio",
    "domain_guard",
]
