"""Per-observation losses ``L(y; theta, x)`` of generalised Bayes / GVI (FedGVI section 2.1).

A loss takes the :class:`~common.likelihoods.LikelihoodOutput` of a model evaluated at ``S`` parameter
samples on ``B`` points and returns the per-sample, per-point loss of shape ``(S, B)``; the caller averages
over ``S`` (Monte Carlo) and sums over ``B``.  Notation: ``p = p(y | theta, x)`` (a probability for a
classifier, a density for a Gaussian model).

* ``nll``: ``-log p``.
* ``gce`` (generalised cross-entropy, Zhang & Sabuncu 2018; FedGVI eq. 8), ``delta in (0, 1]``:
  ``(1 - p^delta) / delta``, computed as ``-expm1(delta log p) / delta``, with the derivative
  ``-p^delta`` w.r.t. ``log p`` formed directly (:class:`_GCEOfLogProb`).  ``delta -> 0`` gives the NLL,
  ``delta = 1`` gives ``1 - p``; for a classifier it lies in ``[0, 1/delta]``.
* ``beta`` (density-power / beta-divergence loss, Basu et al. 1998, Knoblauch et al. 2022), ``beta > 1``:
  ``-p^(beta-1) / (beta-1) + int p(z)^beta dz / beta``.  As ``beta -> 1``,
  ``L_B + 1/(beta-1) - 1 -> -log p``.
* ``gamma`` (gamma-divergence loss, Fujisawa & Eguchi 2008, Hung et al. 2018, Knoblauch form),
  ``gamma > 1``: ``-gamma/(gamma-1) p^(gamma-1) / (int p(z)^gamma dz)^((gamma-1)/gamma)``.  As
  ``gamma -> 1``, ``L_G + gamma/(gamma-1) -> -log p`` (expand ``p^c = 1 + c log p + O(c^2)`` with
  ``c = gamma-1`` and note ``log int p^gamma = O(c)``, so the denominator is ``1 + O(c^2)``).
* ``score_matching``: the weighted Hyvarinen loss of Altamirano et al. (2023/2024), FedGVI App. B.6, for an
  isotropic Gaussian model ``N(y; m, sigma^2 I_D)`` only.  See :class:`ScoreMatchingLoss`.

:class:`ScaledLoss` multiplies any of them by a weight ``w > 0`` (the learning rate of generalised Bayes,
Bissiri et al. 2016): ``E_q[w L] + D`` has the same minimiser as ``E_q[L] + D / w``.

``Loss.quadratic`` returns the loss summed over a batch as an exact
:class:`~common.quadratic.QuadraticLoss` in ``theta`` when the model admits one (NLL and score matching for
the Gaussian location and linear-Gaussian models); this is what the conjugate client update uses.
"""

from __future__ import annotations

import inspect
import math
import numbers
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from common.likelihoods import GaussianOutput, LikelihoodOutput
from common.quadratic import QuadraticLoss
from common.registry import Registry

if TYPE_CHECKING:
    from common.models import LikelihoodModel


def _finite_float(value: object, name: str, loss: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{loss}: {name} must be a real number, got {value!r}")
    try:
        v = float(value)
    except OverflowError:  # e.g. 10**400: an int (or Fraction) beyond the float range
        raise ValueError(
            f"{loss}: {name} must be finite, got {type(value).__name__} too large for a float"
        ) from None
    if not math.isfinite(v):
        raise ValueError(f"{loss}: {name} must be finite, got {v}")
    return v


def _check_representable(loss: str, name: str, value: float, dtype: torch.dtype, *scalars: float) -> None:
    """``ValueError`` unless every Python ``scalar`` the loss multiplies or divides a tensor by is a normal
    number of ``dtype`` (``torch.finfo(dtype).tiny <= |s| <= max``).

    The scalars are cast to the tensor's dtype: one below the smallest normal becomes 0 or a subnormal (and
    its reciprocal, or the reciprocal in the backward pass, ``inf``), one above ``max`` becomes ``inf``; either
    way the loss or its gradient is NaN (``inf * 0``, ``0 / 0``).  A few Python comparisons per call.
    """
    if not dtype.is_floating_point:
        return
    fi = torch.finfo(dtype)
    for s in scalars:
        if not fi.tiny <= abs(s) <= fi.max:
            small = abs(s) < fi.tiny
            raise ValueError(
                f"{loss}: {name}={value:g} is not representable in {dtype}: the factor {s:.3g} it enters the "
                f"computation as would be {'0 or subnormal' if small else 'inf'} (normal range {fi.tiny:.3g} to "
                f"{fi.max:.3g}) and the loss or its gradient NaN; "
                + ("compute in float64 or " if dtype != torch.float64 else "") + "choose a "
                + ("larger delta (delta -> 0 is the NLL: use loss 'nll')" if loss == "gce"
                   else f"{name} further from 1 ({name} -> 1 is the NLL up to a constant: use loss 'nll')"
                   if small else f"smaller {name}")
            )


class Loss(ABC):
    """A per-observation loss ``L(y; theta, x)``."""

    name: ClassVar[str]
    needs_reference: ClassVar[bool] = False
    """True if the loss depends on a reference output (score matching: the model at the cavity mean)."""

    @abstractmethod
    def __call__(self, out: LikelihoodOutput, y: Tensor, reference: LikelihoodOutput | None = None) -> Tensor:
        """Per-sample, per-point loss, shape ``(S, B)``.  The caller averages over S and sums over B."""

    def quadratic(
        self,
        model: LikelihoodModel,
        x: Tensor | None,
        y: Tensor,
        reference_theta: dict[str, Tensor] | None = None,
    ) -> QuadraticLoss | None:
        """Sum over the batch of the loss as an exact quadratic in ``theta`` when the model admits it
        (Gaussian location / linear-Gaussian with NLL or score matching), else ``None``."""
        return None

    def hyperparameters(self) -> dict[str, object]:
        return {}

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({hp})"


LOSSES: Registry[Loss] = Registry("loss")


def make_loss(name: str, **hyper: object) -> Loss:
    """The loss registered as ``name`` with hyperparameters ``hyper``.

    Raises ``KeyError`` for an unknown name (listing the known ones), ``TypeError`` for a hyperparameter the
    loss does not take, ``ValueError`` for an out-of-range value.
    """
    factory = LOSSES.get(name)
    params = inspect.signature(factory).parameters
    unknown = sorted(set(hyper) - set(params))
    if unknown:
        raise TypeError(
            f"loss '{name}' got unknown hyperparameter(s) {', '.join(unknown)}; "
            f"it accepts: {', '.join(params) or 'none'}"
        )
    return factory(**hyper)


class ScaledLoss(Loss):
    """``w * L`` for a loss ``L`` and a weight ``w > 0``: the GBI learning rate (Bissiri et al. 2016).

    With the KL divergence, ``E_q[w L] + KL(q : p)`` and ``E_q[L] + (1/w) KL(q : p)`` have the same
    minimiser (FedGVI Lemma B.1), so ``w`` is also how the FedGVI reference BNN code behaves: it sums the GCE
    over its ``S = 10`` Monte Carlo samples instead of averaging, an implicit ``w = 10``.  The wrapper keeps
    the base loss's ``name`` and scales its quadratic form, so the closed-form and conjugate paths stay exact.
    """

    def __init__(self, base: Loss, weight: float) -> None:
        w = _finite_float(weight, "weight", base.name)
        if w <= 0:
            raise ValueError(f"{base.name}: loss weight must be > 0, got {w}")
        if isinstance(base, ScaledLoss):
            base, w = base.base, base.weight * w
            if not (math.isfinite(w) and w > 0):  # each factor was checked; their product can still be 0 or inf
                raise ValueError(f"{base.name}: loss weight must be a finite number > 0, got {w} "
                                 "(the product of the nested weights)")
        self.base, self.weight = base, w
        self.name = base.name  # type: ignore[misc]  # instance attribute shadows the ClassVar on purpose
        self.needs_reference = base.needs_reference  # type: ignore[misc]

    def hyperparameters(self) -> dict[str, object]:
        return {**self.base.hyperparameters(), "loss_weight": self.weight}  # score matching has its own "weight"

    def __call__(self, out: LikelihoodOutput, y: Tensor, reference: LikelihoodOutput | None = None) -> Tensor:
        return self.weight * self.base(out, y, reference=reference)

    def quadratic(self, model, x, y, reference_theta=None):  # type: ignore[no-untyped-def]
        quad = self.base.quadratic(model, x, y, reference_theta)
        if quad is None:
            return None
        return QuadraticLoss(self.weight * quad.precision, self.weight * quad.shift, self.weight * quad.constant,
                             quad.name)


def weighted(loss: Loss, weight: float) -> Loss:
    """``loss`` itself for ``weight == 1``, else :class:`ScaledLoss` ``(loss, weight)``."""
    w = _finite_float(weight, "weight", loss.name)  # before the shortcut: True or "1.0" is no weight
    return loss if w == 1.0 else ScaledLoss(loss, w)


# ==================================================================================================
@LOSSES.register("nll")
class NegativeLogLikelihood(Loss):
    """``L = -log p(y | theta, x)``: with the KL divergence this is (partitioned) Bayesian VI."""

    name = "nll"

    def __call__(self, out: LikelihoodOutput, y: Tensor, reference: LikelihoodOutput | None = None) -> Tensor:
        return -out.log_prob(y)

    def quadratic(self, model, x, y, reference_theta=None):  # type: ignore[no-untyped-def]
        return model.nll_quadratic(x, y)


class _GCEOfLogProb(torch.autograd.Function):
    """``-expm1(delta log p) / delta`` of a tensor ``log p`` (``delta`` a Python float), with the derivative
    ``dL/dlog p = -p^delta`` computed as ``-exp(delta log p)``.

    The value is the expm1 form, which keeps its digits for ``p^delta`` near 1 (small ``delta``).  Autograd's
    derivative of that form is not: it forms ``exp(x) = expm1(x) + 1`` from the rounded ``expm1(x)``, which
    is ``-1 + p^delta`` and has lost ``p^delta``'s digits when ``p^delta`` is small (the gradient was exactly
    0 below ``p^delta ~ 6e-8`` in float32, ``1e-16`` in float64, and off by up to 6 % at ``1e-7``: a
    misclassified point stopped contributing).  The backward here forms ``p^delta`` itself, as the fused head
    (:mod:`common.fused_head`) does, in the input's dtype (in float32 the rounding of ``delta log p`` puts a
    relative error of up to about ``|delta log p| * 6e-8`` into it).

    The backward is written in differentiable torch operations on the saved input, so a double backward
    (``create_graph=True``) gives the second derivative ``-delta p^delta``, and :meth:`jvp` gives forward-mode
    AD the same derivative.  ``torch.func`` transforms (``vmap``, ``grad``, ``hessian``) need the
    ``setup_context`` form of a Function, which costs about 40 us more a call on a 32-row minibatch (as much as
    the rest of the loss); nothing in the package applies them to a loss, so this is the classic form.
    """

    @staticmethod
    def forward(ctx, log_p: Tensor, delta: float) -> Tensor:  # type: ignore[no-untyped-def,override]
        ctx.save_for_backward(log_p)
        ctx.save_for_forward(log_p)
        ctx.delta = delta
        return -torch.expm1(delta * log_p) / delta

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[no-untyped-def,override]
        (log_p,) = ctx.saved_tensors
        return -grad * torch.exp(ctx.delta * log_p), None

    @staticmethod
    def jvp(ctx, log_p_tangent: Tensor, delta_tangent: None) -> Tensor:  # type: ignore[no-untyped-def,override]
        (log_p,) = ctx.saved_tensors
        return -log_p_tangent * torch.exp(ctx.delta * log_p)


@LOSSES.register("gce")
class GeneralisedCrossEntropy(Loss):
    """``L = (1 - p^delta) / delta`` for ``delta in (0, 1]`` (FedGVI eq. 8), computed stably as
    ``-expm1(delta log p) / delta`` so that small ``delta`` does not cancel catastrophically, with the
    gradient ``-p^delta`` w.r.t. ``log p`` formed directly so that it keeps its digits where ``p^delta`` is
    small (see :class:`_GCEOfLogProb`)."""

    name = "gce"

    def __init__(self, delta: float = 0.5) -> None:
        d = _finite_float(delta, "delta", "gce")
        if not (0.0 < d <= 1.0):
            raise ValueError(f"gce: delta must be in (0, 1], got {d} (delta -> 0 is the NLL: use loss 'nll')")
        self.delta = d

    def hyperparameters(self) -> dict[str, object]:
        return {"delta": self.delta}

    def __call__(self, out: LikelihoodOutput, y: Tensor, reference: LikelihoodOutput | None = None) -> Tensor:
        log_p = out.log_prob(y)
        _check_representable("gce", "delta", self.delta, log_p.dtype, self.delta)
        return _GCEOfLogProb.apply(log_p, self.delta)


@LOSSES.register("beta")
class BetaLoss(Loss):
    """Density-power loss, Knoblauch et al. (2022) parameterisation, ``beta > 1``:

    ``L_B = -p^(beta-1) / (beta-1) + (1/beta) int p(z)^beta dz``

    (a sum over classes for a classifier).  ``L_B + 1/(beta-1) - 1 -> -log p`` as ``beta -> 1``.
    """

    name = "beta"

    def __init__(self, beta: float = 1.5) -> None:
        b = _finite_float(beta, "beta", "beta")
        if not b > 1.0:
            raise ValueError(f"beta: the beta-loss needs beta > 1, got {b}")
        self.beta = b

    def hyperparameters(self) -> dict[str, object]:
        return {"beta": self.beta}

    def __call__(self, out: LikelihoodOutput, y: Tensor, reference: LikelihoodOutput | None = None) -> Tensor:
        b = self.beta
        log_p = out.log_prob(y)
        _check_representable("beta", "beta", b, log_p.dtype, b, b - 1.0)
        log_int = out.log_integral_power(b)
        return -torch.exp((b - 1.0) * log_p) / (b - 1.0) + torch.exp(log_int) / b


@LOSSES.register("gamma")
class GammaLoss(Loss):
    """Gamma-divergence loss, ``gamma > 1``:

    ``L_G = -gamma/(gamma-1) * p^(gamma-1) / (int p(z)^gamma dz)^((gamma-1)/gamma)``,

    computed in log space.  ``L_G + gamma/(gamma-1) -> -log p`` as ``gamma -> 1``.
    """

    name = "gamma"

    def __init__(self, gamma: float = 1.5) -> None:
        g = _finite_float(gamma, "gamma", "gamma")
        if not g > 1.0:
            raise ValueError(f"gamma: the gamma-loss needs gamma > 1, got {g}")
        self.gamma = g

    def hyperparameters(self) -> dict[str, object]:
        return {"gamma": self.gamma}

    def __call__(self, out: LikelihoodOutput, y: Tensor, reference: LikelihoodOutput | None = None) -> Tensor:
        g = self.gamma
        c = g - 1.0
        log_p = out.log_prob(y)
        _check_representable("gamma", "gamma", g, log_p.dtype, g, c, c / g, g / c)
        log_ratio = c * log_p - (c / g) * out.log_integral_power(g)
        return -(g / c) * torch.exp(log_ratio)


# ==================================================================================================
SM_WEIGHTS = ("constant", "imq", "se")


@LOSSES.register("score_matching")
class ScoreMatchingLoss(Loss):
    r"""Weighted Hyvarinen score-matching loss for ``N(y; m(theta, x), sigma^2 I_D)`` (FedGVI App. B.6).

    With a scalar weight ``w(y)`` (the weight matrix is ``w I_D``) and the score
    ``s = grad_y log p = -(y - m) / sigma^2``, the per-point loss is

    ``||w s||^2 + 2 div_y(w^2 s) = w^2 ||y - m||^2 / sigma^4 - 4 w (grad_y w) . (y - m) / sigma^2 - 2 D w^2 / sigma^2``

    using ``div_y(w^2 s) = 2 w (grad_y w) . s + w^2 div_y s`` and ``div_y s = -D / sigma^2``.  Nothing is
    dropped from this expression: the last term does not depend on ``theta`` but is kept, so
    ``Loss.quadratic`` equals the sum of ``__call__`` exactly.  (As for every Hyvarinen score, the
    data-only term ``E ||w grad log p_0||^2`` of the weighted Fisher divergence is absent.)

    The weight is a function of the residual ``r = y - m_ref`` to the *reference* mean ``m_ref`` (the model
    evaluated at the cavity mean, supplied by the caller), never of ``theta``; the reference is detached.

    * ``constant``: ``w = beta_w``
    * ``imq``: ``w = beta_w (1 + |r|^2/c^2)^(-1/2)``, ``grad_y w = -w r / (c^2 + |r|^2)``
    * ``se``:  ``w = beta_w exp(-|r|^2 / (2 c^2))``, ``grad_y w = -w r / c^2``

    ``beta_w`` defaults to ``sigma / sqrt(2)``; then the constant weight gives ``||y-m||^2/(2 sigma^2) - D``
    per point, i.e. the NLL up to a constant, so conjugate SM + KL is exact Bayes.
    """

    name = "score_matching"
    needs_reference = True

    def __init__(self, weight: str = "imq", c: float = 1.0, beta_w: float | None = None) -> None:
        if weight not in SM_WEIGHTS:
            raise ValueError(f"score_matching: weight must be one of {', '.join(SM_WEIGHTS)}, got {weight!r}")
        cc = _finite_float(c, "c", "score_matching")
        if not cc > 0.0:
            raise ValueError(f"score_matching: kernel scale c must be > 0, got {cc}")
        if beta_w is not None:
            bw = _finite_float(beta_w, "beta_w", "score_matching")
            if not bw > 0.0:
                raise ValueError(f"score_matching: beta_w must be > 0 (or None for sigma/sqrt(2)), got {bw}")
            beta_w = bw
        self.weight = weight
        self.c = cc
        self.beta_w = beta_w

    def hyperparameters(self) -> dict[str, object]:
        return {"weight": self.weight, "c": self.c, "beta_w": self.beta_w}

    def weights(self, residual: Tensor, sigma: float) -> tuple[Tensor, Tensor]:
        """``(w, grad_y w)`` at residuals ``r = y - m_ref`` of shape ``(..., D)``: shapes ``(...)`` and
        ``(..., D)``."""
        bw = self.beta_w if self.beta_w is not None else sigma / math.sqrt(2.0)
        r2 = (residual * residual).sum(-1)
        if self.weight == "constant":
            w = torch.full_like(r2, bw)
            return w, torch.zeros_like(residual)
        c2 = self.c * self.c
        if residual.dtype.is_floating_point:
            # the rule common.config applies to sm-c before round 1: c^2 and 1/c^2 normal floats of the dtype.  A
            # c^2 that underflows to 0 made the weight 0/0 = NaN at a zero residual (a point at the reference mean)
            tiny = torch.finfo(residual.dtype).tiny
            if not tiny**0.5 <= self.c <= tiny**-0.5:
                raise ValueError(f"score_matching: kernel scale c={self.c:g} is not usable in {residual.dtype}: c^2 "
                                 f"and its inverse must be normal floats, i.e. c within [{tiny**0.5:.4g}, "
                                 f"{tiny**-0.5:.4g}]" + ("; or compute in float64" if residual.dtype != torch.float64
                                                        else ""))
        if self.weight == "imq":
            w = bw * torch.rsqrt(1.0 + r2 / c2)
            grad = -(w / (c2 + r2)).unsqueeze(-1) * residual
        else:  # se
            w = bw * torch.exp(-0.5 * r2 / c2)
            grad = -(w / c2).unsqueeze(-1) * residual
        return w, grad

    def _check_output(self, out: LikelihoodOutput, what: str) -> GaussianOutput:
        if not isinstance(out, GaussianOutput):
            raise TypeError(
                f"score_matching needs a Gaussian likelihood ({what} is {type(out).__name__}); "
                "use it with the gaussian_location or linear_regression model"
            )
        return out

    def __call__(self, out: LikelihoodOutput, y: Tensor, reference: LikelihoodOutput | None = None) -> Tensor:
        out = self._check_output(out, "the output")
        sigma = out.sigma
        y = out.target(y)  # (B, D); (B,) only for D = 1; a mismatch is a ShapeMismatchError, not a broadcast
        if reference is None:
            if self.weight != "constant":
                raise ValueError("score_matching with a non-constant weight needs the reference output "
                                 "(the model at the cavity mean)")
            residual = torch.zeros_like(y)
        else:
            ref = self._check_output(reference, "the reference")
            ref_mean = ref.mean.detach()
            if ref_mean.dim() == 3:
                if ref_mean.shape[0] != 1:
                    raise ValueError(f"the reference output must have one sample, got {ref_mean.shape[0]}")
                ref_mean = ref_mean[0]
            residual = (y - ref_mean).expand_as(y)
        w, grad_w = self.weights(residual, sigma)  # (B,), (B, D)
        d = y.shape[-1]
        e = y.unsqueeze(0) - out.mean  # (S, B, D)
        u = w / (sigma * sigma)  # (w / sigma^2)^2, not w^2 / sigma^4 (out of float32's range): as models.py's quadratic
        quad = u * u * (e * e).sum(-1)
        cross = -4.0 * u * (grad_w * e).sum(-1)
        const = -2.0 * d * w * u
        return quad + cross + const

    def quadratic(self, model, x, y, reference_theta=None):  # type: ignore[no-untyped-def]
        sigma = getattr(model, "sigma", None)
        if sigma is None:
            return None  # not a Gaussian model
        y = model._targets(y)  # the shape check the NLL's quadratic makes, before the residual broadcasts
        if reference_theta is None:
            if self.weight != "constant":
                raise ValueError("score_matching with a non-constant weight needs reference_theta (the cavity mean)")
            residual = torch.zeros_like(y)
        else:
            ref_theta = {}
            for k, shape in model.param_shapes.items():
                t = reference_theta[k].detach()
                ref_theta[k] = t.unsqueeze(0) if tuple(t.shape) == tuple(shape) else t
            ref = self._check_output(model.output(ref_theta, x), "the reference")
            ref_mean = ref.mean
            if ref_mean.shape[0] != 1:
                raise ValueError(f"reference_theta must be one parameter value, got {ref_mean.shape[0]} samples")
            residual = (y - ref_mean[0]).expand_as(y)
        w, grad_w = self.weights(residual, float(sigma))
        return model.score_matching_quadratic(x, y, w, grad_w)
