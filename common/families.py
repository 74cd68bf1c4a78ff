"""Gaussian exponential families in natural parameters.

Every object here is a Gaussian *factor* ``t(theta) = exp(<eta, T(theta)>)`` stored by its natural
parameters ``eta = (eta1, eta2)`` with sufficient statistics ``T(theta) = (theta, theta theta^T)``, so that

    eta1 = Lambda mu,     eta2 = -1/2 Lambda,     Lambda = Sigma^{-1}.

Factors multiply by adding natural parameters and divide by subtracting them, which is all PGVI's factor
algebra needs.  A factor may be improper (a PVI site often has a negative precision); the moments,
sampling, ``log_prob`` and ``entropy`` are defined only for proper factors and ``check_proper`` raises a
typed :class:`~common.errors.ImproperDistributionError` otherwise.  Nothing is ever clipped or repaired.

Two families:

* :class:`MeanFieldGaussian`: a diagonal Gaussian over an ordered dict of named tensors (e.g. all the
  weights and biases of a network).  Transport keys ``"eta1/<name>"`` and ``"eta2/<name>"``.
* :class:`FullCovarianceGaussian`: a full-covariance Gaussian over one vector ``theta`` of small
  dimension ``d``; ``d = 1`` is the univariate case.  Transport keys ``"eta1"`` and ``"eta2"``.

The log-normaliser ``A(eta)`` includes the ``d/2 log(2 pi)`` of the base measure, so that
``log_prob(theta) = <eta, T(theta)> - A(eta)`` and ``entropy = A(eta) - <eta, E[T]>``.  Both families evaluate
``log_prob`` and ``entropy`` in centred moment form instead (``-1/2 (theta - mu)^T Lambda (theta - mu) + 1/2
log|Lambda| - d/2 log(2 pi)`` and ``d/2 (1 + log(2 pi)) - 1/2 log|Lambda|``): the two terms of the identities
are ``O(mu^T Lambda mu)`` and cancel catastrophically in float32 (an entropy that drifted with the mean).

Proper means: finite natural parameters, a positive-definite precision, and no variance that overflows the
factor's dtype (a subnormal precision is positive but its variance overflows): checked exactly for the mean-field
family, and for the full-covariance family through the precision's Cholesky diagonal (``1 / L_ii^2`` finite, O(d);
:meth:`FullCovarianceGaussian.covariance` checks the inverse it forms).  The mean is not part of the
test: a proper factor's mean may still overflow (``eta1 = 1e30`` with precision ``1e-10`` in float32), which
the consumers that need it finite refuse with :class:`~common.errors.NonFiniteError`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from common.errors import ImproperDistributionError, NonFiniteError, ShapeMismatchError
from common.fast_math import all_finite

_LOG_2PI = math.log(2.0 * math.pi)
#: Relative tolerance of the symmetry of a full-covariance precision (rounding of symmetric products).
SYMMETRY_RTOL = 1e-8

F = TypeVar("F", bound="GaussianFactor")


class GaussianFactor(ABC):
    """A Gaussian factor in natural parameters, possibly improper.

    Subclasses fix how the flat dict of named tensors ``self.params`` is read (which keys hold ``eta1``
    and ``eta2``); the algebra (product, quotient, power, comparison, transport) is shared.
    """

    def __init__(self, params: Mapping[str, Tensor]) -> None:
        self.params: dict[str, Tensor] = dict(params)

    # ----------------------------------------------------------------------------------------------
    # construction
    @abstractmethod
    def _like(self: F, params: Mapping[str, Tensor]) -> F:
        """A factor of the same family and layout with other natural parameters."""

    def zeros_like(self: F) -> F:
        """The uniform factor (all natural parameters zero): the initial PVI site."""
        return self._like({k: torch.zeros_like(v) for k, v in self.params.items()})

    # ----------------------------------------------------------------------------------------------
    # algebra
    def _check_compatible(self, other: GaussianFactor) -> None:
        if type(self) is not type(other):
            raise ShapeMismatchError(f"cannot combine {type(self).__name__} with {type(other).__name__}")
        if self.params.keys() != other.params.keys():
            raise ShapeMismatchError(
                f"natural parameters differ in names: {sorted(self.params)} vs {sorted(other.params)}"
            )
        for k, v in self.params.items():
            if v.shape != other.params[k].shape:
                raise ShapeMismatchError(f"'{k}' has shape {tuple(v.shape)} vs {tuple(other.params[k].shape)}")

    def __mul__(self: F, other: F) -> F:
        """Product of factors: natural parameters add."""
        self._check_compatible(other)
        return self._like({k: v + other.params[k] for k, v in self.params.items()})

    def __truediv__(self: F, other: F) -> F:
        """Quotient of factors: natural parameters subtract."""
        self._check_compatible(other)
        return self._like({k: v - other.params[k] for k, v in self.params.items()})

    def __pow__(self: F, power: float) -> F:
        """``t ** rho``: natural parameters scale by ``rho`` (damping, tempering)."""
        return self._like({k: v * power for k, v in self.params.items()})

    def combine(self: F, other: F, a: float, b: float) -> F:
        """``self**a * other**b``, i.e. natural parameters ``a * eta_self + b * eta_other``."""
        self._check_compatible(other)
        return self._like({k: a * v + b * other.params[k] for k, v in self.params.items()})

    def allclose(self, other: GaussianFactor, rtol: float = 0.0, atol: float = 1e-8) -> bool:
        self._check_compatible(other)
        return all(torch.allclose(v, other.params[k], rtol=rtol, atol=atol) for k, v in self.params.items())

    def max_abs_diff(self, other: GaussianFactor) -> float:
        self._check_compatible(other)
        return max(float((v - other.params[k]).abs().max()) for k, v in self.params.items())

    # ----------------------------------------------------------------------------------------------
    # dtype / transport
    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.params.values())).dtype

    def to(self: F, dtype: torch.dtype) -> F:
        return self._like({k: v.to(dtype) for k, v in self.params.items()})

    def detach(self: F) -> F:
        return self._like({k: v.detach() for k, v in self.params.items()})

    def clone(self: F) -> F:
        return self._like({k: v.detach().clone() for k, v in self.params.items()})

    def numel(self) -> int:
        """Number of scalars in the natural parameters (the transport payload)."""
        return sum(v.numel() for v in self.params.values())

    def to_numpy(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy() for k, v in self.params.items()}

    def from_numpy(self: F, arrays: Mapping[str, np.ndarray]) -> F:
        """A factor of this layout from named arrays; names, shapes and finiteness are checked."""
        if set(arrays) != set(self.params):
            raise ShapeMismatchError(
                f"expected arrays {sorted(self.params)}, got {sorted(arrays)}"
            )
        out = {}
        for k, ref in self.params.items():
            a = np.asarray(arrays[k])
            if tuple(a.shape) != tuple(ref.shape):
                raise ShapeMismatchError(f"'{k}' has shape {tuple(a.shape)}, expected {tuple(ref.shape)}")
            if not np.issubdtype(a.dtype, np.floating):
                raise ShapeMismatchError(f"'{k}' has dtype {a.dtype}, expected a floating dtype")
            t = torch.as_tensor(np.array(a, copy=True), dtype=ref.dtype)
            out[k] = t
        factor = self._like(out)
        factor.check_finite(what="received natural parameters")
        detail = factor.structure_detail()
        if detail is not None:
            raise ShapeMismatchError(f"received natural parameters: {detail}")
        return factor

    def structure_detail(self) -> str | None:
        """``None`` if the natural parameters have the structure the family stores, else what is wrong (a
        full-covariance ``eta2`` must be symmetric).  Checked by :meth:`from_numpy`, since ``eta2`` enters
        every expectation only through its symmetric part while its antisymmetric part still rounds every
        sum it is added to (a peer's antisymmetric 1e12 erased the other sites' off-diagonal information)."""
        return None

    def check_finite(self: F, what: str = "factor") -> F:
        for k, v in self.params.items():
            if not all_finite(v):
                bad = int((~torch.isfinite(v)).sum())
                raise NonFiniteError(f"{what}: '{k}' has {bad} non-finite entries")
        return self

    # ----------------------------------------------------------------------------------------------
    # properness
    @abstractmethod
    def improper_detail(self) -> str | None:
        """``None`` if the factor is a proper distribution, else a description of what is wrong."""

    def is_proper(self) -> bool:
        return self.improper_detail() is None

    def check_proper(self: F, what: str = "distribution") -> F:
        """Return ``self`` if proper, else raise :class:`ImproperDistributionError` naming ``what``."""
        detail = self.improper_detail()
        if detail is not None:
            raise ImproperDistributionError(what, detail)
        return self

    # ----------------------------------------------------------------------------------------------
    # exponential-family quantities (proper factors only)
    @abstractmethod
    def log_normalizer(self) -> Tensor:
        """``A(eta) = log int exp(<eta, T(theta)>) dtheta`` (scalar tensor), differentiable."""

    @abstractmethod
    def mean_parameters(self) -> dict[str, Tensor]:
        """``E[T(theta)]`` laid out like ``self.params`` (the gradient of ``A``)."""

    def inner(self, stats: Mapping[str, Tensor]) -> Tensor:
        """``<eta, s>`` for sufficient statistics ``s`` laid out like ``self.params`` (no batch dims)."""
        return sum((v * stats[k]).sum() for k, v in self.params.items())  # type: ignore[return-value]

    def entropy(self) -> Tensor:
        """Generic ``A(eta) - <eta, E[T]>`` (cancels in float32); both families override it with a centred form."""
        self.check_proper("distribution in entropy()")
        return self.log_normalizer() - self.inner(self.mean_parameters())

    @abstractmethod
    def rsample(self, n: int, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """``n`` reparameterised samples: a dict of named tensors with a leading sample dimension."""

    @abstractmethod
    def log_prob(self, theta: Mapping[str, Tensor]) -> Tensor:
        """Log density of samples shaped like :meth:`rsample`'s output; returns shape ``(n,)``."""


# ==================================================================================================
class MeanFieldGaussian(GaussianFactor):
    """Diagonal Gaussian over an ordered dict of named tensors, in natural parameters."""

    def __init__(self, eta1: Mapping[str, Tensor], eta2: Mapping[str, Tensor]) -> None:
        if list(eta1) != list(eta2):
            raise ShapeMismatchError("eta1 and eta2 must name the same tensors in the same order")
        dtype = None
        for n in eta1:
            if eta1[n].shape != eta2[n].shape:
                raise ShapeMismatchError(f"'{n}': eta1 {tuple(eta1[n].shape)} vs eta2 {tuple(eta2[n].shape)}")
            if eta1[n].dtype != eta2[n].dtype:
                raise ShapeMismatchError(f"'{n}': eta1 has dtype {eta1[n].dtype}, eta2 {eta2[n].dtype}")
            if dtype is None:
                dtype = eta1[n].dtype
            elif eta1[n].dtype != dtype:
                raise ShapeMismatchError(f"'{n}' has dtype {eta1[n].dtype}, the tensors before it {dtype}: "
                                         "all natural parameters must share one dtype")
        self.names: list[str] = list(eta1)
        params = {f"eta1/{n}": eta1[n] for n in self.names}
        params.update({f"eta2/{n}": eta2[n] for n in self.names})
        super().__init__(params)

    def _like(self, params: Mapping[str, Tensor]) -> MeanFieldGaussian:
        return MeanFieldGaussian(
            {n: params[f"eta1/{n}"] for n in self.names}, {n: params[f"eta2/{n}"] for n in self.names}
        )

    # constructors ---------------------------------------------------------------------------------
    @classmethod
    def from_mean_variance(cls, mean: Mapping[str, Tensor], variance: Mapping[str, Tensor]) -> MeanFieldGaussian:
        return cls({n: mean[n] / variance[n] for n in mean}, {n: -0.5 / variance[n] for n in mean})

    @classmethod
    def isotropic(
        cls,
        shapes: Mapping[str, tuple[int, ...]],
        mean: float = 0.0,
        variance: float = 1.0,
        dtype: torch.dtype = torch.float64,
    ) -> MeanFieldGaussian:
        """``N(mean, variance I)`` over tensors of the given shapes (e.g. the prior ``N(0, I)``)."""
        m = {n: torch.full(s, float(mean), dtype=dtype) for n, s in shapes.items()}
        v = {n: torch.full(s, float(variance), dtype=dtype) for n, s in shapes.items()}
        return cls.from_mean_variance(m, v)

    @classmethod
    def uniform(cls, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype = torch.float64) -> MeanFieldGaussian:
        """The zero factor over tensors of the given shapes."""
        z = {n: torch.zeros(s, dtype=dtype) for n, s in shapes.items()}
        return cls(z, {n: t.clone() for n, t in z.items()})

    # accessors ------------------------------------------------------------------------------------
    @property
    def eta1(self) -> dict[str, Tensor]:
        return {n: self.params[f"eta1/{n}"] for n in self.names}

    @property
    def eta2(self) -> dict[str, Tensor]:
        return {n: self.params[f"eta2/{n}"] for n in self.names}

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(self.params[f"eta1/{n}"].shape) for n in self.names}

    def precision(self) -> dict[str, Tensor]:
        return {n: -2.0 * e2 for n, e2 in self.eta2.items()}

    def flat(self, per_name: Mapping[str, Tensor]) -> Tensor:
        """One tensor per name of this factor (e.g. its :meth:`mean` or :attr:`eta1`) as one flat vector, in the
        factor's order of names (the coordinates of the mean-field server steps)."""
        return torch.cat([per_name[n].reshape(-1) for n in self.names])

    def unflat(self, vector: Tensor) -> dict[str, Tensor]:
        """The inverse of :meth:`flat`: a flat vector split into this factor's names and shapes (views)."""
        shapes = self.shapes
        parts = torch.split(vector, [math.prod(shapes[n]) for n in self.names])
        return {n: part.view(shapes[n]) for n, part in zip(self.names, parts)}

    def from_flat_mean_variance(self, mean: Tensor, variance: Tensor) -> MeanFieldGaussian:
        """The mean-field Gaussian over this factor's names and shapes with the flat ``mean`` and ``variance``
        (the inverse of :meth:`flat` applied to :meth:`mean` and :meth:`variance`)."""
        return MeanFieldGaussian.from_mean_variance(self.unflat(mean), self.unflat(variance))

    def mean(self) -> dict[str, Tensor]:
        """Means ``eta1 / (-2 eta2)``; :class:`ImproperDistributionError` if the factor is improper."""
        self.check_proper("distribution in mean()")
        return self._mean_unchecked()

    def variance(self) -> dict[str, Tensor]:
        """Variances ``-1 / (2 eta2)``; :class:`ImproperDistributionError` if the factor is improper."""
        self.check_proper("distribution in variance()")
        return self._variance_unchecked()

    def _mean_unchecked(self) -> dict[str, Tensor]:
        return {n: self.params[f"eta1/{n}"] / (-2.0 * self.params[f"eta2/{n}"]) for n in self.names}

    def _variance_unchecked(self) -> dict[str, Tensor]:
        return {n: -0.5 / self.params[f"eta2/{n}"] for n in self.names}

    def improper_detail(self) -> str | None:
        """``None`` if every coordinate has finite natural parameters, a precision ``-2 eta2 > 0`` and a finite
        variance in the factor's dtype (a subnormal precision is positive but its variance overflows); see the
        module docstring for the mean.

        One reduction per tensor beyond the finiteness sums: ``max eta2``, which decides both tests (every
        precision is positive iff ``max eta2 < 0``, and the largest variance is ``-1 / (2 max eta2)``, since
        ``-1 / (2 eta2)`` increases with ``eta2 < 0``)."""
        problems = []
        for n in self.names:
            e1, e2 = self.params[f"eta1/{n}"].detach(), self.params[f"eta2/{n}"].detach()
            if not (all_finite(e1) and all_finite(e2) and all_finite(-2.0 * e2)):
                problems.append(f"'{n}' has non-finite natural parameters or precision")
                continue
            if e2.numel() == 0:
                continue
            top = e2.max()
            if bool(top >= 0):
                bad = e2 >= 0
                problems.append(
                    f"'{n}': {int(bad.sum())} of {e2.numel()} precisions <= 0 "
                    f"(smallest {float((-2.0 * e2).min()):.4g})"
                )
                continue
            largest_variance = float(-0.5 / top)  # evaluated in the factor's dtype, as variance() does
            if not math.isfinite(largest_variance):
                problems.append(
                    f"'{n}': variance overflows {e2.dtype} (smallest precision {float(-2.0 * top):.4g})"
                )
        return "; ".join(problems) if problems else None

    # exponential family ---------------------------------------------------------------------------
    def log_normalizer_elementwise(self) -> dict[str, Tensor]:
        """``A`` of each univariate coordinate (sums to :meth:`log_normalizer`); proper factors only."""
        self.check_proper("distribution in log_normalizer_elementwise()")
        return self._log_normalizer_elementwise_unchecked()

    def _log_normalizer_elementwise_unchecked(self) -> dict[str, Tensor]:
        out = {}
        for n in self.names:
            e1, e2 = self.params[f"eta1/{n}"], self.params[f"eta2/{n}"]
            out[n] = -e1 * e1 / (4.0 * e2) - 0.5 * torch.log(-2.0 * e2) + 0.5 * _LOG_2PI
        return out

    def log_normalizer(self) -> Tensor:
        self.check_proper("distribution in log_normalizer()")
        parts = self._log_normalizer_elementwise_unchecked().values()
        return sum(a.sum() for a in parts)  # type: ignore[return-value]

    def mean_parameters(self) -> dict[str, Tensor]:
        self.check_proper("distribution in mean_parameters()")
        m, v = self._mean_unchecked(), self._variance_unchecked()
        out = {f"eta1/{n}": m[n] for n in self.names}
        out.update({f"eta2/{n}": m[n] * m[n] + v[n] for n in self.names})
        return out

    def rsample(self, n: int, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        self.check_proper("distribution in rsample()")
        m, v = self._mean_unchecked(), self._variance_unchecked()
        out = {}
        for k in self.names:
            eps = torch.randn((n, *m[k].shape), dtype=m[k].dtype, generator=generator)
            out[k] = m[k] + v[k].sqrt() * eps
        return out

    def entropy(self) -> Tensor:
        """``sum_i 1/2 (1 + log(2 pi)) - 1/2 log(lambda_i)`` (independent of the means, as it must be)."""
        self.check_proper("distribution in entropy()")
        total = sum(torch.log(-2.0 * self.params[f"eta2/{n}"]).sum() for n in self.names)
        numel = sum(self.params[f"eta2/{n}"].numel() for n in self.names)
        return 0.5 * numel * (1.0 + _LOG_2PI) - 0.5 * total  # type: ignore[return-value]

    def log_prob(self, theta: Mapping[str, Tensor]) -> Tensor:
        """``sum_i -1/2 lambda_i (x_i - mu_i)^2 + 1/2 log(lambda_i) - 1/2 log(2 pi)`` per sample.

        ``theta[name]`` must have shape ``(n, *shape)`` (the same ``n`` for every name; a 0-d tensor's samples
        are ``(n,)``) and the factor's dtype; otherwise :class:`ShapeMismatchError` (no broadcasting)."""
        self.check_proper("distribution in log_prob()")
        n_samples = None
        for k in self.names:
            if k not in theta:
                raise ShapeMismatchError(f"samples have no '{k}'; the distribution is over {self.names}")
            x, shape = theta[k], tuple(self.params[f"eta1/{k}"].shape)
            if x.dim() != len(shape) + 1 or tuple(x.shape[1:]) != shape:
                raise ShapeMismatchError(
                    f"'{k}' has samples of shape {tuple(x.shape)}; expected (n, *{shape}) for its shape {shape}"
                )
            if n_samples is None:
                n_samples = int(x.shape[0])
            elif int(x.shape[0]) != n_samples:
                raise ShapeMismatchError(f"'{k}' has {int(x.shape[0])} samples, the names before it {n_samples}")
            if x.dtype != self.params[f"eta1/{k}"].dtype:
                raise ShapeMismatchError(f"'{k}' has samples of dtype {x.dtype}, the distribution {self.dtype}")
        total: Tensor | float = 0.0
        numel = 0
        for k in self.names:
            x, e1, e2 = theta[k], self.params[f"eta1/{k}"], self.params[f"eta2/{k}"]
            lam = -2.0 * e2
            r = x - e1 / lam
            quad = (lam * r * r).reshape(x.shape[0], e1.numel()).sum(1)
            total = total + (0.5 * torch.log(lam).sum() - 0.5 * quad)
            numel += e1.numel()
        return total - 0.5 * numel * _LOG_2PI  # type: ignore[return-value]


# ==================================================================================================
class FullCovarianceGaussian(GaussianFactor):
    """Full-covariance Gaussian over one vector ``theta`` in R^d, in natural parameters.

    ``eta2`` is stored as a symmetric ``(d, d)`` matrix.  ``name`` is the key under which samples are
    returned, so models can read ``theta[name]`` whichever family produced it.
    """

    def __init__(self, eta1: Tensor, eta2: Tensor, name: str = "theta") -> None:
        if eta1.dim() != 1 or eta2.shape != (eta1.shape[0], eta1.shape[0]):
            raise ShapeMismatchError(f"eta1 must be (d,) and eta2 (d, d); got {tuple(eta1.shape)}, {tuple(eta2.shape)}")
        if eta1.dtype != eta2.dtype:
            raise ShapeMismatchError(f"eta1 has dtype {eta1.dtype}, eta2 {eta2.dtype}: they must share one dtype")
        self.name = name
        super().__init__({"eta1": eta1, "eta2": eta2})

    def _like(self, params: Mapping[str, Tensor]) -> FullCovarianceGaussian:
        return FullCovarianceGaussian(params["eta1"], params["eta2"], name=self.name)

    @classmethod
    def from_mean_covariance(cls, mean: Tensor, covariance: Tensor, name: str = "theta") -> FullCovarianceGaussian:
        """The factor with precision ``Sigma^{-1}`` (symmetrised) and ``eta1 = Sigma^{-1} mean``.

        Like :meth:`MeanFieldGaussian.from_mean_variance` this does not validate the moments: an invertible but
        indefinite (or non-finite) ``covariance`` gives an improper factor, refused by :meth:`check_proper`.  A
        singular ``covariance`` has no precision at all and raises :class:`ImproperDistributionError`."""
        precision, info = torch.linalg.inv_ex(covariance)
        if int(info) != 0:
            raise ImproperDistributionError(
                "covariance in from_mean_covariance()", f"the covariance is singular (zero LU pivot {int(info)})"
            )
        precision = 0.5 * (precision + precision.T)
        return cls(precision @ mean, -0.5 * precision, name=name)

    @classmethod
    def from_mean_precision(cls, mean: Tensor, precision: Tensor, name: str = "theta") -> FullCovarianceGaussian:
        return cls(precision @ mean, -0.5 * precision, name=name)

    @classmethod
    def uniform(cls, d: int, dtype: torch.dtype = torch.float64, name: str = "theta") -> FullCovarianceGaussian:
        return cls(torch.zeros(d, dtype=dtype), torch.zeros(d, d, dtype=dtype), name=name)

    @property
    def dim(self) -> int:
        return int(self.params["eta1"].shape[0])

    @property
    def eta1(self) -> Tensor:
        return self.params["eta1"]

    @property
    def eta2(self) -> Tensor:
        return self.params["eta2"]

    def precision(self) -> Tensor:
        return -2.0 * self.params["eta2"]

    def _cholesky_precision(self, what: str = "distribution") -> Tensor:
        """Cholesky factor of the precision; raises if the factor is not a proper distribution (non-finite,
        asymmetric or not positive definite), so no moment is ever computed from an improper factor."""
        self.check_proper(what)
        lam = self.precision()
        chol, info = torch.linalg.cholesky_ex(0.5 * (lam + lam.T))
        if int(info) != 0:
            raise ImproperDistributionError(what, self.improper_detail() or "precision not PD")
        return chol

    def covariance(self) -> Tensor:
        """``Lambda^{-1}``; ImproperDistributionError if it overflows (:meth:`improper_detail` checks the precision's
        Cholesky diagonal only, O(d), since it runs on every divergence call; an ill-conditioned precision can
        still have an overflowing inverse, caught here where the inverse is formed)."""
        cov = torch.cholesky_inverse(self._cholesky_precision())
        if not all_finite(cov.detach()):
            raise ImproperDistributionError("covariance", f"covariance overflows {cov.dtype}")
        return cov

    def mean(self) -> Tensor:
        return torch.cholesky_solve(self.params["eta1"].unsqueeze(-1), self._cholesky_precision()).squeeze(-1)

    def structure_detail(self) -> str | None:
        """``None`` if ``eta2`` is symmetric to rounding, else a description of its asymmetry.

        The test is ``max |Lambda - Lambda^T| <= SYMMETRY_RTOL * max(1, max |Lambda|)`` on the precision
        ``Lambda = -2 eta2`` (that of :meth:`improper_detail`), evaluated on ``eta2`` without forming
        ``-2 eta2`` or ``eta2 - eta2^T``, which can overflow for a finite ``eta2`` (a peer's value): an
        overflowing asymmetry is infinite and refused, never compared as NaN."""
        e2 = self.params["eta2"].detach()
        if e2.numel() == 0:
            return None
        half = 0.5 * e2
        asym = 2.0 * float((half - half.T).abs().max())  # max |eta2 - eta2^T| (inf if it overflows)
        scale = float(e2.abs().max())
        if not asym <= SYMMETRY_RTOL * max(0.5, scale):  # NaN-safe; == the test on Lambda above
            return f"precision is not symmetric (max asymmetry {2.0 * asym:.3g})"
        return None

    def improper_detail(self) -> str | None:
        """``None`` if the factor is proper: finite natural parameters, a symmetric precision (see
        :meth:`structure_detail`) whose Cholesky factorisation succeeds, with ``1 / L_ii^2`` finite for its
        diagonal (a subnormal precision factorises but its covariance overflows; checked in O(d), as this runs on
        every divergence call: :meth:`covariance` checks the formed inverse itself).

        "Positive definite" means exactly that the Cholesky factorisation of the symmetrised precision
        succeeds in the factor's dtype; no eigenvalue margin is applied, so a precision that is indefinite
        within rounding of ``||Lambda||`` (smallest eigenvalue ``-O(eps ||Lambda||)``) may pass, and its
        moments are then those of the nearby positive-definite matrix that rounding factorised."""
        e1, e2 = self.params["eta1"].detach(), self.params["eta2"].detach()
        lam = -2.0 * e2
        if not (torch.isfinite(e1).all() and torch.isfinite(lam).all()):
            return "non-finite natural parameters or precision"
        detail = self.structure_detail()
        if detail is not None:
            return detail
        chol, info = torch.linalg.cholesky_ex(0.5 * (lam + lam.T))
        if int(info) != 0:
            try:
                smallest = f"{float(torch.linalg.eigvalsh(0.5 * (lam + lam.T)).min()):.4g}"
            except RuntimeError:  # eigvalsh can fail to converge on extreme inputs
                smallest = "unknown"
            return f"precision is not positive definite (smallest eigenvalue {smallest})"
        smallest = torch.diagonal(chol).min()
        if not math.isfinite(float(1.0 / (smallest * smallest))):
            return (f"covariance overflows {e1.dtype} "
                    f"(smallest Cholesky diagonal of the precision {float(smallest):.4g})")
        return None

    def log_normalizer(self) -> Tensor:
        chol = self._cholesky_precision()
        e1 = self.params["eta1"]
        z = torch.linalg.solve_triangular(chol, e1.unsqueeze(-1), upper=False).squeeze(-1)
        logdet = 2.0 * torch.log(torch.diagonal(chol)).sum()
        return 0.5 * (z * z).sum() - 0.5 * logdet + 0.5 * self.dim * _LOG_2PI

    def mean_parameters(self) -> dict[str, Tensor]:
        m, s = self.mean(), self.covariance()
        return {"eta1": m, "eta2": s + torch.outer(m, m)}

    def rsample(self, n: int, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        # theta = mu + L^{-T} z with Lambda = L L^T has covariance Lambda^{-1}
        chol = self._cholesky_precision()
        m = self.mean()
        z = torch.randn((n, self.dim), dtype=m.dtype, generator=generator)
        x = torch.linalg.solve_triangular(chol.T, z.T, upper=True).T
        return {self.name: m + x}

    def entropy(self) -> Tensor:
        """``d/2 (1 + log(2 pi)) - sum_i log L_ii`` with ``Lambda = L L^T`` (independent of the mean)."""
        chol = self._cholesky_precision("distribution in entropy()")
        return 0.5 * self.dim * (1.0 + _LOG_2PI) - torch.log(torch.diagonal(chol)).sum()

    def log_prob(self, theta: Mapping[str, Tensor]) -> Tensor:
        """``-1/2 ||L^T (x - mu)||^2 + sum_i log L_ii - d/2 log(2 pi)`` per sample, ``Lambda = L L^T``.

        ``theta[name]`` must have shape ``(n, d)`` and the factor's dtype; otherwise :class:`ShapeMismatchError`."""
        if self.name not in theta:
            raise ShapeMismatchError(f"samples have no '{self.name}'; got {sorted(theta)}")
        x = theta[self.name]
        if x.dim() != 2 or int(x.shape[1]) != self.dim:
            raise ShapeMismatchError(f"'{self.name}' has samples of shape {tuple(x.shape)}; expected (n, {self.dim})")
        if x.dtype != self.dtype:
            raise ShapeMismatchError(f"'{self.name}' has samples of dtype {x.dtype}, the distribution {self.dtype}")
        chol = self._cholesky_precision("distribution in log_prob()")
        mu = torch.cholesky_solve(self.params["eta1"].unsqueeze(-1), chol).squeeze(-1)
        z = (x - mu) @ chol  # row k is (L^T (x_k - mu))^T
        return -0.5 * (z * z).sum(-1) + torch.log(torch.diagonal(chol)).sum() - 0.5 * self.dim * _LOG_2PI
