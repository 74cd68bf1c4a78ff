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
margin :data:`DOMAIN_MARGIN` (in variance), the scale is moved back to half-way between where the step started and
that bound, direction by direction:

* mean-field, per coordinate of the raw scale ``rho`` (``sigma = softplus(rho) + min_scale``, monotone): a
  coordinate past its bound goes to the midpoint of its pre-step value and the bound (to the bound itself if it
  started beyond it, which only a start inside the margin band can);
* full covariance, in the cavity-whitened coordinates (``W = L_p^{-1} Sigma_q L_p^{-T}``, ``Sigma_p = L_p L_p^T``,
  whose eigenvalues must stay below ``c``, above it for ``alpha < 0``): the eigenvalues of ``W`` past the bound
  ``(1 - margin) c`` are clipped to the midpoint of the bound and the pre-step state's largest eigenvalue (the bound
  if that one was beyond it), and ``q``'s Cholesky factor is recomputed (float64); the other eigen-directions and
  the mean are kept.  Halving the whole step instead stopped every direction when one was pinned at the bound.

Nothing else moves: the means, and every coordinate or eigen-direction the step kept inside.  Cutting the step short
rather than placing the state on the bound matters for Adam: near the bound the divergence's gradient is about
``1/distance`` times its usual size, and one such gradient in Adam's second-moment estimate (decay 0.999) shrank
every later step of that coordinate for thousands of steps (with the state placed on a 1e-3 bound, a 2-D location
problem's variance stalled at 0.907 against its minimiser's 0.994; cut half-way, Adam reaches the minimiser).  A
minimiser inside the margin band (data that pull hard against the bound) is missed by at most the margin, relative,
in variance.  At the margin the combined precision is ``|alpha| * margin`` times ``q``'s, far from float32's rounding.
:attr:`common.local_gvi.LocalGVIResult.domain_cuts` counts the steps that were cut.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from common.divergences import AlphaRenyi
from common.errors import DivergenceUndefinedError
from common.families import FullCovarianceGaussian, GaussianFactor, MeanFieldGaussian
from common.variational import FullCovarianceVariational, MeanFieldVariational, VariationalGaussian, inverse_softplus

#: Relative distance (in variance) from the domain's boundary that a cut step keeps.
DOMAIN_MARGIN = 1e-4


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
        eigen-directions (full covariance) that moved, 0 if none."""
        raise NotImplementedError


class MeanFieldDomainGuard(DomainGuard):
    """Per coordinate: the raw scale ``rho`` bounded above by ``rho_max`` (``alpha > 1``) or below by ``rho_min``
    (``alpha < 0``)."""

    def __init__(self, cavity: MeanFieldGaussian, q: MeanFieldVariational, ratio: float,
                 step_bound: float | None = None) -> None:
        super().__init__(q)
        # the most a raw scale moves in one step (the optimiser's bound: common.adam.Adam.step_bound), and a lower
        # bound on the raw distance of every coordinate from its bound: while it exceeds the step bound, no step can
        # cross, and remember / cut skip their passes over the parameters (-inf: not known, check)
        self.step_bound = step_bound
        self.slack = -math.inf
        self._skipped = False
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

    def remember(self, q: VariationalGaussian) -> None:
        self._skipped = self.step_bound is not None and self.slack > self.step_bound
        if not self._skipped:
            super().remember(q)

    def _slack(self, q: MeanFieldVariational) -> float:
        """The smallest raw distance of a coordinate from its bound (negative: past it): one read-only pass."""
        return min(float((bound - raw).min() if self.upper else (raw - bound).min())
                   for raw, bound in zip(q.raw_scales, self.bounds))

    def cut(self, q: VariationalGaussian) -> int:
        assert isinstance(q, MeanFieldVariational)
        if self._skipped:
            assert self.step_bound is not None
            self.slack -= self.step_bound
            return 0
        moved = 0
        with torch.no_grad():
            self.slack = self._slack(q)
            if not self.slack < 0.0:
                return 0
            for raw, before, bound in zip(q.raw_scales, self._before, self.bounds):
                outside = raw > bound if self.upper else raw < bound
                count = int(outside.sum())
                if count:
                    started_inside = before < bound if self.upper else before > bound
                    target = torch.where(started_inside, 0.5 * (before + bound), bound)
                    raw.copy_(torch.where(outside, target, raw))  # copy_ moves the version counter (explicit_step)
                    moved += count
            self.slack = self._slack(q)
        return moved


class FullCovarianceDomainGuard(DomainGuard):
    """The eigenvalues of ``W = L_p^{-1} Sigma_q L_p^{-T}`` kept below ``(1 - margin) c`` (``alpha > 1``) or above
    ``(1 + margin) c`` (``alpha < 0``), in float64.  A state passes without an eigen-decomposition if a Cholesky
    factorisation shows it within half the margin of the bound (a state the cut placed on the bound passes)."""

    def __init__(self, cavity: FullCovarianceGaussian, q: FullCovarianceVariational, ratio: float) -> None:
        super().__init__(q)
        self.upper = ratio > 1.0
        sign = -1.0 if self.upper else 1.0
        self.bound = ratio * (1.0 + sign * DOMAIN_MARGIN)
        self.test = ratio * (1.0 + sign * 0.5 * DOMAIN_MARGIN)
        cov_p = cavity.covariance().detach().to(torch.float64)
        self.cov_p = 0.5 * (cov_p + cov_p.T)
        self.chol_p = torch.linalg.cholesky(self.cov_p)

    @staticmethod
    def _covariance(chol: Tensor) -> Tensor:
        chol = chol.detach().to(torch.float64)
        return chol @ chol.T

    def inside(self, q: FullCovarianceVariational) -> bool:
        """Whether ``q`` is within half the margin of the bound (a Cholesky test, no eigen-decomposition)."""
        cov_q = self._covariance(q.cholesky())
        gap = self.test * self.cov_p - cov_q if self.upper else cov_q - self.test * self.cov_p
        return int(torch.linalg.cholesky_ex(gap).info) == 0

    def _whitened(self, cov_q: Tensor) -> Tensor:
        half = torch.linalg.solve_triangular(self.chol_p, cov_q, upper=False)  # L_p^{-1} Sigma_q
        w = torch.linalg.solve_triangular(self.chol_p, half.T, upper=False)  # L_p^{-1} Sigma_q L_p^{-T}
        return 0.5 * (w + w.T)

    def cut(self, q: VariationalGaussian) -> int:
        assert isinstance(q, FullCovarianceVariational)
        with torch.no_grad():
            if self.inside(q):
                return 0
            e, v = torch.linalg.eigh(self._whitened(self._covariance(q.cholesky())))
            before = q.cholesky_of(*(p.to(torch.float64) for p in self._before))
            e_before = torch.linalg.eigvalsh(self._whitened(before @ before.T))
            if self.upper:
                target = 0.5 * (min(float(e_before[-1]), self.bound) + self.bound)
                clipped = e.clamp(max=target)
            else:
                target = 0.5 * (max(float(e_before[0]), self.bound) + self.bound)
                clipped = e.clamp(min=target)
            moved = int((clipped != e).sum())
            root = self.chol_p @ v * clipped.sqrt()  # Sigma' = root root^T
            new_chol = torch.linalg.cholesky(root @ root.T)
            new_diag = torch.diagonal(new_chol) - q.min_scale
            if not bool((new_diag > 0).all()):
                raise DivergenceUndefinedError("Alpha-Renyi domain: the cut covariance has a Cholesky diagonal below "
                                               f"the parameterisation floor min_scale={q.min_scale:.3g}")
            q.raw_diag.copy_(inverse_softplus(new_diag).to(q.raw_diag.dtype))
            q.lower.copy_(torch.tril(new_chol, diagonal=-1).to(q.lower.dtype))
        return max(moved, 1)


def domain_guard(divergence: Any, cavity: GaussianFactor, q: VariationalGaussian,
                 step_bound: float | None = None) -> DomainGuard | None:
    """The guard of ``divergence(. || cavity)``'s domain for ``q``'s parameterisation, or ``None`` where the
    divergence is finite for every proper ``q`` (KL, weighted KL, reverse KL, Fisher-Rao, Alpha-Renyi with
    ``0 < alpha < 1``) or is not one of the registry's.  ``step_bound``: the most one optimiser step can move a
    scale parameter (:meth:`common.adam.Adam.step_bound`); with it, the mean-field guard skips its work while every
    coordinate is further than that from its bound (the steps of a problem far from the boundary cost nothing)."""
    ratio = bounded_ratio(divergence)
    if ratio is None:
        return None
    if isinstance(q, MeanFieldVariational) and isinstance(cavity, MeanFieldGaussian):
        return MeanFieldDomainGuard(cavity, q, ratio, step_bound)
    if isinstance(q, FullCovarianceVariational) and isinstance(cavity, FullCovarianceGaussian):
        return FullCovarianceDomainGuard(cavity, q, ratio)
    return None


__all__ = [
    "DOMAIN_MARGIN",
    "DomainGuard",
    "FullCovarianceDomainGuard",
    "MeanFieldDomainGuard",
    "bounded_ratio",
    "domain_guard",
]
