"""Losses that are quadratic in a parameter vector: ``L(theta) = 1/2 theta^T P theta - h^T theta + c``.

The NLL of the Gaussian location and linear-Gaussian models and the weighted score-matching loss of
those models (FedGVI Prop. 4.9) have this form.  Two things follow:

* the expectation under a Gaussian is closed form: ``E_q[L] = 1/2 (tr(P Sigma) + mu^T P mu) - h^T mu + c``;
* ``exp(-w L)`` is a Gaussian factor with ``eta1 = w h`` and ``eta2 = -w P / 2``, so the GVI problem
  ``E_q[L] + (1/w) KL(q : cavity)`` has the conjugate solution ``cavity * exp(-w L)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from common.families import FullCovarianceGaussian, GaussianFactor, MeanFieldGaussian


@dataclass
class QuadraticLoss:
    precision: Tensor  # P, (d, d), symmetric positive semi-definite for the losses here
    shift: Tensor  # h, (d,)
    constant: Tensor | float = 0.0
    name: str = "theta"

    def __post_init__(self) -> None:
        # P's symmetric part: the same quadratic form.  Sums of per-point products A^T W A leave rounding
        # asymmetries (float32: up to 2.5e-8 relative, above the precision check's 1e-8, so every float32
        # full-covariance score-matching posterior was refused as "not symmetric"); the factors built from P
        # (cavity * exp(-w L)) must be exactly symmetric
        p = self.precision
        if p.dim() == 2:
            self.precision = 0.5 * (p + p.T)

    def __add__(self, other: QuadraticLoss) -> QuadraticLoss:
        return QuadraticLoss(self.precision + other.precision, self.shift + other.shift,
                             self.constant + other.constant, self.name)

    def value(self, theta: Tensor) -> Tensor:
        """``L(theta)`` for ``theta`` of shape ``(..., d)``."""
        quad = 0.5 * torch.einsum("...i,ij,...j->...", theta, self.precision, theta)
        return quad - theta @ self.shift + self.constant

    def expectation(self, mean: Tensor, covariance: Tensor) -> Tensor:
        """``E_{N(mean, covariance)}[L]``; ``covariance`` may be ``(d, d)`` or the diagonal ``(d,)``.

        Evaluated in float64 whatever the inputs' dtype (the result is cast back, differentiably): its three large
        terms cancel to a small value, and in float32 their rounding swamped it (1,000 points at y ~ 1000, sigma 1:
        the true 1413.78 at every mean tried came out 1472-1536, not monotone in the mean, and the local optimiser's
        closed-form path stopped 7 posterior sds off with a variance 21x too wide)."""
        f64 = torch.float64
        p, h = self.precision.to(f64), self.shift.to(f64)
        m, cov = mean.to(f64), covariance.to(f64)
        c = self.constant.to(f64) if isinstance(self.constant, Tensor) else self.constant
        tr = (torch.diagonal(p) * cov).sum() if cov.dim() == 1 else (p * cov).sum()
        return (0.5 * (tr + m @ p @ m) - m @ h + c).to(mean.dtype)

    def as_factor(self, like: GaussianFactor, weight: float = 1.0) -> GaussianFactor:
        """The Gaussian factor ``exp(-weight * L)`` in the layout of ``like``.

        For a :class:`MeanFieldGaussian` the precision must be diagonal (exact conjugacy); otherwise a
        ``ValueError`` is raised rather than silently dropping the off-diagonal terms.
        """
        eta1 = weight * self.shift
        eta2 = -0.5 * weight * self.precision
        if isinstance(like, FullCovarianceGaussian):
            return FullCovarianceGaussian(eta1.to(like.dtype), eta2.to(like.dtype), name=like.name)
        if isinstance(like, MeanFieldGaussian):
            off = self.precision - torch.diag(torch.diagonal(self.precision))
            if off.abs().max() > 0:
                raise ValueError("a quadratic loss with off-diagonal precision is not conjugate to a mean-field Gaussian")
            if like.names != [self.name]:
                raise ValueError(f"mean-field layout {like.names} does not match parameter '{self.name}'")
            return MeanFieldGaussian({self.name: eta1.to(like.dtype)}, {self.name: torch.diagonal(eta2).to(like.dtype)})
        raise TypeError(f"unsupported family {type(like).__name__}")
