"""Unconstrained torch parameterisations of the two Gaussian families, for gradient-based GVI.

A :class:`~common.families.GaussianFactor` stores natural parameters, which are constrained (the precision
must be positive definite).  The optimisers of the local and server GVI steps instead move unconstrained
parameters; the modules here map them to a proper Gaussian and back:

* :class:`MeanFieldVariational`: per named tensor a ``loc`` and a raw scale ``rho`` with
  ``scale = softplus(rho) + min_scale``, so ``variance = scale**2``.
* :class:`FullCovarianceVariational`: ``loc`` and a lower-triangular Cholesky factor ``L`` of the
  *covariance* (``Sigma = L L^T``); the strictly lower part of ``L`` is free, its diagonal is
  ``softplus(raw_diag) + min_scale``.

``min_scale`` (default ``1e-8``) is a floor that keeps every scale strictly positive when the softplus
underflows (``softplus(-100)`` is ``0`` in float32); it bounds each precision by ``min_scale**-2 = 1e16``.
The floor is part of the parameterisation, not a repair: a factor whose scale is at or below the floor
cannot be represented and is refused with a ``ValueError`` at construction.

Every module returns a differentiable :meth:`distribution` (natural parameters, in the family and layout
of the factor it was built from), :meth:`rsample` (reparameterised samples), and the moments needed by the
closed-form and local-reparameterisation paths.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from common.errors import ImproperDistributionError, NonFiniteError, ScaleFloorError
from common.families import FullCovarianceGaussian, GaussianFactor, MeanFieldGaussian
from common.fast_math import all_finite, softplus

DEFAULT_MIN_SCALE = 1e-8


def inverse_softplus(y: Tensor) -> Tensor:
    """``softplus^{-1}(y) = y + log(-expm1(-y))`` for ``y > 0`` (stable for small and large ``y``)."""
    if not bool((y > 0).all()):
        raise ValueError("inverse_softplus needs strictly positive input")
    return y + torch.log(-torch.expm1(-y))


def _check_min_scale(min_scale: float) -> float:
    if not (float(min_scale) >= 0.0) or not torch.isfinite(torch.tensor(float(min_scale))):
        raise ValueError(f"min_scale must be a finite number >= 0, got {min_scale}")
    return float(min_scale)


def _raw_from_scale(scale: Tensor, min_scale: float, what: str) -> Tensor:
    if not all_finite(scale):
        raise NonFiniteError(f"{what}: non-finite scale")
    if not bool((scale > min_scale).all()):
        smallest = float(scale.min())
        raise ScaleFloorError(
            f"{what}: scale {smallest:.3g} is not above the parameterisation floor min_scale={min_scale:.3g}"
        )
    return inverse_softplus(scale - min_scale)


def _covariance_cholesky(init: FullCovarianceGaussian) -> Tensor:
    """Lower-triangular ``C`` with positive diagonal and ``C C^T = Lambda^{-1}``, from a Cholesky factorisation of
    the *precision*: no explicit covariance, whose re-factorisation failed with a raw ``LinAlgError`` for a
    proper precision of condition number ~1e17 and lost digits well before (the init ->
    :meth:`FullCovarianceVariational.distribution` round trip was off by ~1e-3 relative at condition 1e14 and
    0.4 at 1e16; ~1e-15 this way).

    With ``J`` the order-reversing permutation and ``J Lambda J = M M^T`` (``M`` lower), ``Lambda = U U^T`` with
    ``U = J M J`` upper, so ``Sigma = U^{-T} U^{-1}`` and ``C = U^{-T} = J M^{-T} J`` is lower-triangular: the
    (unique) Cholesky factor of ``Sigma``, equal to ``cholesky(Sigma)`` to rounding.  If the reversed-order
    factorisation fails (a precision positive definite only to rounding), ``C = R^T`` from the QR factorisation
    ``L^{-1} = Q R`` of the inverse of the precision's own Cholesky factor ``L`` (``Sigma = L^{-T} L^{-1} = R^T R``),
    diagonal signs fixed.  Raises :class:`ImproperDistributionError` if the precision cannot be factorised at all
    and ``ValueError`` if ``C`` overflows."""
    lam = init.precision().detach()
    lam = 0.5 * (lam + lam.T)
    eye = torch.eye(init.dim, dtype=lam.dtype, device=lam.device)
    m, info = torch.linalg.cholesky_ex(torch.flip(lam, dims=(0, 1)))
    if int(info) == 0:
        minv = torch.linalg.solve_triangular(m, eye, upper=False)  # M^{-1}
        chol = torch.flip(minv.T, dims=(0, 1))
    else:
        low, info = torch.linalg.cholesky_ex(lam)
        if int(info) != 0:
            raise ImproperDistributionError("initial distribution",
                                            "the Cholesky factorisation of the precision failed")
        _, r = torch.linalg.qr(torch.linalg.solve_triangular(low, eye, upper=False))
        chol = (r * torch.sign(torch.diagonal(r)).unsqueeze(-1)).T
    if not all_finite(chol):
        raise ValueError("initial distribution: the Cholesky factor of its covariance overflows")
    return chol


class VariationalGaussian(nn.Module):
    """Common interface of the two parameterisations."""

    min_scale: float

    def loc_parameters(self) -> list[nn.Parameter]:  # pragma: no cover - abstract
        raise NotImplementedError

    def scale_parameters(self) -> list[nn.Parameter]:  # pragma: no cover - abstract
        raise NotImplementedError

    def distribution(self) -> GaussianFactor:  # pragma: no cover - abstract
        raise NotImplementedError

    def rsample(self, n: int, generator: torch.Generator | None = None) -> dict[str, Tensor]:  # pragma: no cover
        raise NotImplementedError

    def flat_dim(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def transform_standard(self, z: Tensor) -> dict[str, Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def mean_covariance(self) -> tuple[Tensor, Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    # shared helpers --------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def snapshot(self) -> dict[str, Tensor]:
        """A detached copy of the parameters (for early stopping)."""
        return {k: v.detach().clone() for k, v in self.state_dict().items()}

    def restore(self, snapshot: Mapping[str, Tensor]) -> None:
        with torch.no_grad():
            self.load_state_dict(dict(snapshot))


# ==================================================================================================
class MeanFieldVariational(VariationalGaussian):
    """Mean-field Gaussian over named tensors: ``theta[k] = loc[k] + scale[k] * eps``.

    Names are kept in a list (parameter names such as ``"fc1.weight"`` need not be valid module names);
    ``locs[i]`` and ``raw_scales[i]`` belong to ``names[i]``.
    """

    def __init__(
        self,
        init: MeanFieldGaussian,
        min_scale: float = DEFAULT_MIN_SCALE,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(init, MeanFieldGaussian):
            raise TypeError(f"MeanFieldVariational needs a MeanFieldGaussian, got {type(init).__name__}")
        init.check_proper("initial distribution")
        self.min_scale = _check_min_scale(min_scale)
        dtype = dtype or init.dtype
        self.names: list[str] = list(init.names)
        mean, var = init.mean(), init.variance()
        self.locs = nn.ParameterList()
        self.raw_scales = nn.ParameterList()
        for n in self.names:
            m = mean[n].detach().to(dtype)
            s = var[n].detach().sqrt().to(dtype)
            self.locs.append(nn.Parameter(m.clone()))
            self.raw_scales.append(nn.Parameter(_raw_from_scale(s, self.min_scale, f"initial scale of '{n}'")))

    def loc_parameters(self) -> list[nn.Parameter]:
        return list(self.locs)

    def scale_parameters(self) -> list[nn.Parameter]:
        return list(self.raw_scales)

    def scales(self) -> dict[str, Tensor]:
        return {n: softplus(r) + self.min_scale for n, r in zip(self.names, self.raw_scales)}

    def means(self) -> dict[str, Tensor]:
        return dict(zip(self.names, self.locs))

    def mean_variance(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Differentiable means and variances (the input of local reparameterisation)."""
        return self.means(), {n: s * s for n, s in self.scales().items()}

    def distribution(self) -> MeanFieldGaussian:
        mean, var = self.mean_variance()
        return MeanFieldGaussian.from_mean_variance(mean, var)

    def rsample(self, n: int, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        out = {}
        for name, loc, s in zip(self.names, self.locs, self.scales().values()):
            eps = torch.randn((n, *loc.shape), dtype=loc.dtype, generator=generator)
            out[name] = loc + s * eps
        return out

    def flat_dim(self) -> int:
        return sum(p.numel() for p in self.locs)

    def transform_standard(self, z: Tensor) -> dict[str, Tensor]:
        """Map standard-normal points ``z`` of shape ``(K, flat_dim)`` to parameter samples (quadrature)."""
        out, start = {}, 0
        for name, loc, s in zip(self.names, self.locs, self.scales().values()):
            k = loc.numel()
            eps = z[:, start:start + k].reshape(z.shape[0], *loc.shape).to(loc.dtype)
            out[name] = loc + s * eps
            start += k
        return out

    def mean_covariance(self) -> tuple[Tensor, Tensor]:
        """Mean vector and the *diagonal* of the covariance, for a single parameter vector."""
        if len(self.names) != 1 or self.locs[0].dim() != 1:
            raise ValueError("mean_covariance() needs a single parameter vector; this family has "
                             f"{[(n, tuple(p.shape)) for n, p in zip(self.names, self.locs)]}")
        s = self.scales()[self.names[0]]
        return self.locs[0], s * s


# ==================================================================================================
class FullCovarianceVariational(VariationalGaussian):
    """Full-covariance Gaussian over one vector: ``theta = loc + L eps`` with ``Sigma = L L^T``."""

    def __init__(
        self,
        init: FullCovarianceGaussian,
        min_scale: float = DEFAULT_MIN_SCALE,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(init, FullCovarianceGaussian):
            raise TypeError(f"FullCovarianceVariational needs a FullCovarianceGaussian, got {type(init).__name__}")
        init.check_proper("initial distribution")
        self.min_scale = _check_min_scale(min_scale)
        self.name = init.name
        dtype = dtype or init.dtype
        d = init.dim
        self.d = d
        chol = _covariance_cholesky(init).to(dtype)
        self.loc = nn.Parameter(init.mean().detach().to(dtype).clone())
        self.raw_diag = nn.Parameter(_raw_from_scale(torch.diagonal(chol).clone(), self.min_scale,
                                                     "initial Cholesky diagonal"))
        self.lower = nn.Parameter(torch.tril(chol, diagonal=-1).clone())
        self.register_buffer("_strict_lower_mask", torch.tril(torch.ones(d, d, dtype=torch.bool), diagonal=-1),
                             persistent=False)

    def loc_parameters(self) -> list[nn.Parameter]:
        return [self.loc]

    def scale_parameters(self) -> list[nn.Parameter]:
        return [self.raw_diag, self.lower]

    def cholesky(self) -> Tensor:
        """Lower-triangular ``L`` with positive diagonal, ``Sigma = L L^T``."""
        return self.cholesky_of(self.raw_diag, self.lower)

    def cholesky_of(self, raw_diag: Tensor, lower: Tensor) -> Tensor:
        """:meth:`cholesky` at other values of the scale parameters (e.g. a saved pre-step state), in their dtype."""
        diag = softplus(raw_diag) + self.min_scale
        return torch.where(self._strict_lower_mask, lower, torch.zeros_like(lower)) + torch.diag(diag)

    def mean_covariance(self) -> tuple[Tensor, Tensor]:
        chol = self.cholesky()
        return self.loc, chol @ chol.T

    def distribution(self) -> FullCovarianceGaussian:
        chol = self.cholesky()
        eye = torch.eye(self.d, dtype=chol.dtype)
        linv = torch.linalg.solve_triangular(chol, eye, upper=False)  # L^{-1}
        lam = linv.T @ linv  # Sigma^{-1}
        lam = 0.5 * (lam + lam.T)
        return FullCovarianceGaussian(lam @ self.loc, -0.5 * lam, name=self.name)

    def rsample(self, n: int, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        z = torch.randn((n, self.d), dtype=self.loc.dtype, generator=generator)
        return self.transform_standard(z)

    def flat_dim(self) -> int:
        return self.d

    def transform_standard(self, z: Tensor) -> dict[str, Tensor]:
        return {self.name: self.loc + z.to(self.loc.dtype) @ self.cholesky().T}


def variational_for(
    factor: GaussianFactor, min_scale: float = DEFAULT_MIN_SCALE, dtype: torch.dtype | None = None
) -> VariationalGaussian:
    """The parameterisation matching ``factor``'s family, initialised at ``factor``."""
    if isinstance(factor, MeanFieldGaussian):
        return MeanFieldVariational(factor, min_scale=min_scale, dtype=dtype)
    if isinstance(factor, FullCovarianceGaussian):
        return FullCovarianceVariational(factor, min_scale=min_scale, dtype=dtype)
    raise TypeError(f"no variational parameterisation for {type(factor).__name__}")
