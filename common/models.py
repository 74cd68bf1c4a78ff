"""Likelihood models ``p(y | theta, x)`` evaluated at a batch of parameter samples.

A model maps named parameter tensors ``theta[name]`` of shape ``(S, *param_shapes[name])`` (a leading
sample dimension ``S``) and inputs ``x`` of shape ``(B, in_features)`` to a
:class:`~common.likelihoods.LikelihoodOutput` over ``(S, B)``, which the losses of :mod:`common.losses`
consume.  Every model but the BNN has one parameter vector named ``"theta"``, so both the mean-field and
the full-covariance Gaussian families apply.

* ``gaussian_location``: ``y ~ N(theta, sigma^2 I_dim)``; ``x`` is ignored.
* ``linear_regression``: ``y ~ N(x^T theta, sigma^2)`` (bias last in ``theta``).
* ``logistic_regression``: softmax regression; binary is the Bernoulli-logit model with logits ``[0, z]``.
* ``bnn``: a ReLU MLP with a mean-field Gaussian over all weights and biases, with an exact
  weight-sampling forward pass and the local-reparameterisation forward pass (Kingma et al. 2015).

The two Gaussian models are linear in ``theta``: the mean of point ``b`` is ``A_b theta`` with a design
matrix ``A_b`` of shape ``(D, d)``.  Their NLL and their weighted score-matching loss are therefore exact
quadratics in ``theta`` (:class:`~common.quadratic.QuadraticLoss`), which the conjugate client update uses
(FedGVI Prop. 4.9).
"""

from __future__ import annotations

import inspect
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from common import fused_head, fused_sampling
from common.families import GaussianFactor, MeanFieldGaussian
from common.likelihoods import CategoricalOutput, GaussianOutput, LikelihoodOutput
from common.losses import Loss
from common.quadratic import QuadraticLoss
from common.registry import Registry


def _positive_int(value: object, name: str, model: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{model}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _positive_float(value: object, name: str, model: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)) or value <= 0:
        raise ValueError(f"{model}: {name} must be a finite number > 0, got {value!r}")
    return float(value)


class LikelihoodModel(ABC):
    """``p(y | theta, x)`` for a batch of parameter samples."""

    name: str = "model"
    param_shapes: dict[str, tuple[int, ...]]
    #: whether :meth:`nll_quadratic` / :meth:`score_matching_quadratic` can return a quadratic: the local optimiser
    #: asks before it copies a client's data to float64 to form one (a BNN's 20,000 x 784 inputs were copied once
    #: per local update for nothing: +115 MiB peak RSS and 30,000 page faults in bench_core's one-epoch updates)
    has_quadratic_losses: bool = False

    @abstractmethod
    def output(self, theta: Mapping[str, Tensor], x: Tensor | None) -> LikelihoodOutput:
        """``theta[name]`` has a leading sample dim ``S``; returns ``(S, B, ...)`` outputs."""

    def nll_quadratic(self, x: Tensor | None, y: Tensor) -> QuadraticLoss | None:
        """``sum_b -log p(y_b | theta, x_b)`` as an exact quadratic in ``theta`` (Gaussian models), else None."""
        return None

    def score_matching_quadratic(
        self, x: Tensor | None, y: Tensor, w: Tensor, grad_w: Tensor
    ) -> QuadraticLoss | None:
        """The summed weighted score-matching loss as an exact quadratic (Gaussian models), else None."""
        return None

    @property
    def is_classifier(self) -> bool:
        return False

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes.values())

    def _check_theta(self, theta: Mapping[str, Tensor]) -> int:
        """Check names and shapes of a batch of samples; return the number of samples ``S``."""
        missing = [k for k in self.param_shapes if k not in theta]
        if missing:
            raise KeyError(f"{self.name}: parameters {missing} missing; expected {list(self.param_shapes)}")
        n = None
        for k, shape in self.param_shapes.items():
            t = theta[k]
            if tuple(t.shape[1:]) != tuple(shape) or t.dim() != len(shape) + 1:
                raise ValueError(
                    f"{self.name}: '{k}' must have shape (S, {', '.join(map(str, shape))}), got {tuple(t.shape)}"
                )
            if n is None:
                n = int(t.shape[0])
            elif int(t.shape[0]) != n:
                raise ValueError(f"{self.name}: parameters have different numbers of samples")
        assert n is not None
        return n

    def predictive_probs(
        self, q: GaussianFactor, x: Tensor, n_samples: int, generator: torch.Generator | None = None
    ) -> Tensor:
        """Classifiers: the posterior predictive ``E_q[softmax(logits(theta, x))]``, shape ``(B, C)``,
        estimated with ``n_samples`` samples of ``theta ~ q`` (drawn in chunks to bound memory)."""
        return self.predictive_log_probs(q, x, n_samples, generator=generator).exp().to(q.dtype)

    def predictive_log_probs(
        self, q: GaussianFactor, x: Tensor, n_samples: int, generator: torch.Generator | None = None
    ) -> Tensor:
        """``log E_q[softmax(...)]`` in float64, ``logsumexp_s log p_s - log S``: exact where the averaged
        probability underflows (the NLL of an over-confident predictive needs it).  Same draws as
        :meth:`predictive_probs`."""
        if not self.is_classifier:
            raise TypeError(f"{self.name} is not a classifier: predictive_probs is for classifiers")
        n_samples = _positive_int(n_samples, "n_samples", self.name)
        names = q.names if isinstance(q, MeanFieldGaussian) else [getattr(q, "name", "theta")]
        if set(names) != set(self.param_shapes):
            raise ValueError(f"{self.name}: q is over {names}, the model has parameters {list(self.param_shapes)}")
        b = int(x.shape[0])
        chunk = max(1, min(n_samples, (1 << 22) // max(1, b * self.num_params + b * 16)))
        total = None
        done = 0
        with torch.no_grad():
            while done < n_samples:
                s = min(chunk, n_samples - done)
                theta = q.rsample(s, generator=generator)
                out = self.output(theta, x)
                assert isinstance(out, CategoricalOutput)
                part = torch.logsumexp(out.log_probs.double(), 0)
                total = part if total is None else torch.logaddexp(total, part)
                done += s
        assert total is not None
        # a class certain under every draw has log p = 0; the chained logaddexp (one rounding per chunk) can put
        # it a few ulps above 0, which no log-probability may be (exp would exceed 1 and the metrics refuse it)
        return (total - math.log(n_samples)).clamp_(max=0.0)


MODELS: Registry[LikelihoodModel] = Registry("model")


def make_model(name: str, **kw: object) -> LikelihoodModel:
    """The model registered as ``name``.  ``KeyError`` for an unknown name, ``TypeError`` for an unknown
    keyword, ``ValueError`` for an invalid value."""
    factory = MODELS.get(name)
    params = inspect.signature(factory).parameters
    unknown = sorted(set(kw) - set(params))
    if unknown:
        raise TypeError(f"model '{name}' got unknown argument(s) {', '.join(unknown)}; it accepts: {', '.join(params)}")
    return factory(**kw)


# ==================================================================================================
class LinearGaussianModel(LikelihoodModel):
    """``y_b ~ N(A_b theta, sigma^2 I_D)`` with a known design matrix ``A_b`` of shape ``(D, d)``.

    Exact quadratics in ``theta`` (summed over the batch):

    * NLL: ``P = sum A^T A / sigma^2``, ``h = sum A^T y / sigma^2``,
      ``c = sum ||y||^2 / (2 sigma^2) + B D/2 log(2 pi sigma^2)`` (the sum of ``-log p``, no constant dropped).
    * weighted score matching (per point ``w^2 ||y - A theta||^2/sigma^4 - 4 w g.(y - A theta)/sigma^2
      - 2 D w^2/sigma^2`` with ``g = grad_y w``, see :class:`~common.losses.ScoreMatchingLoss`):
      ``P = sum 2 w^2 A^T A / sigma^4``, ``h = sum A^T (2 w^2 y / sigma^4 - 4 w g / sigma^2)``,
      ``c = sum (w^2 ||y||^2 / sigma^4 - 4 w g.y / sigma^2 - 2 D w^2 / sigma^2)``.
    """

    has_quadratic_losses = True

    sigma: float
    event_dim: int

    @abstractmethod
    def design(self, x: Tensor | None, n: int, dtype: torch.dtype) -> Tensor:
        """The design matrices ``A_b``, shape ``(n, D, d)``."""

    def output_local_reparam(self, mean: Mapping[str, Tensor], variance: Mapping[str, Tensor], x: Tensor | None,
                             n_samples: int, generator: torch.Generator | None = None) -> GaussianOutput:
        """Local reparameterisation (Kingma, Salimans & Welling 2015) under a mean-field ``q`` (``mean``,
        ``variance`` of ``theta``): the likelihood's means ``(S, B, D)`` drawn point by point from their
        marginals, ``A_b m + sqrt(A_b^2 v) eps`` with independent ``eps ~ N(0, I)`` per sample, point and
        coordinate.  Exact for these models: a row of ``A_b`` reads coordinates of ``theta`` no other row of it
        reads (the location model's identity, linear regression's single row), so a point's coordinates are
        independent under ``q``; each point's expected loss is the same as with sampled ``theta``.  Points get
        independent draws, so a fixed-noise estimate of the summed loss errs by far less than one in which every
        point sees the same few ``theta`` (:class:`common.local_gvi.LocalGVIConfig`, ``eval_samples``)."""
        s = _positive_int(n_samples, "n_samples", self.name)
        m, v = mean["theta"], variance["theta"]
        a = self.design(x, self._points(x), m.dtype)  # (B, D, d)
        return GaussianOutput(_draw(a @ m, (a * a) @ v, s, generator), self.sigma)

    def output_local_reparam_full(self, loc: Tensor, scale_tril: Tensor, x: Tensor | None, n_samples: int,
                                  generator: torch.Generator | None = None) -> GaussianOutput:
        """:meth:`output_local_reparam` under a full-covariance ``q = N(loc, L L^T)``: each point's mean
        ``A_b theta`` drawn on its own, ``A_b loc + (A_b L) eps`` with ``eps ~ N(0, I_d)`` per sample and point
        (exact for any design: the point's joint Gaussian; ``S B D d`` operations)."""
        s = _positive_int(n_samples, "n_samples", self.name)
        a = self.design(x, self._points(x), loc.dtype)  # (B, D, d)
        eps = torch.randn((s, a.shape[0], a.shape[2]), generator=generator, dtype=loc.dtype, device=loc.device)
        return GaussianOutput(a @ loc + torch.einsum("bkd,sbd->sbk", a @ scale_tril, eps), self.sigma)

    def _points(self, x: Tensor | None) -> int:
        """The number of points of a local-reparameterisation draw (one draw per row of ``x``)."""
        if x is None:
            raise ValueError(f"{self.name}: the local reparameterisation needs x (one row per point)")
        return int(x.shape[0])

    def _targets(self, y: Tensor) -> Tensor:
        if y.dim() == 1 and self.event_dim == 1:
            y = y.unsqueeze(-1)
        if y.dim() != 2 or y.shape[1] != self.event_dim:
            raise ValueError(f"{self.name}: y must have shape (B, {self.event_dim}), got {tuple(y.shape)}")
        return y

    def nll_quadratic(self, x: Tensor | None, y: Tensor) -> QuadraticLoss:
        y = self._targets(y)
        n, d_out = y.shape
        a = self.design(x, n, y.dtype)
        s2 = self.sigma**2
        precision = torch.einsum("bik,bil->kl", a, a) / s2
        shift = torch.einsum("bik,bi->k", a, y) / s2
        const = (y * y).sum() / (2 * s2) + 0.5 * n * d_out * math.log(2 * math.pi * s2)
        return QuadraticLoss(precision, shift, const, name="theta")

    def score_matching_quadratic(self, x: Tensor | None, y: Tensor, w: Tensor, grad_w: Tensor) -> QuadraticLoss:
        y = self._targets(y)
        n, d_out = y.shape
        if w.shape != (n,) or grad_w.shape != (n, d_out):
            raise ValueError(
                f"{self.name}: w must be ({n},) and grad_w ({n}, {d_out}); got {tuple(w.shape)}, {tuple(grad_w.shape)}"
            )
        a = self.design(x, n, y.dtype)
        s2 = self.sigma**2
        # (w / sigma^2)^2, not w^2 / sigma^4: sigma^4 leaves float32's range for sigma > 4.3e9 (and is subnormal
        # below 3e-10), which made the precision 0 (the cavity came back) where w / sigma^2 is an ordinary number
        u = w / s2
        u2 = u * u
        precision = torch.einsum("b,bik,bil->kl", 2.0 * u2, a, a)
        target = (2.0 * u2).unsqueeze(-1) * y - (4.0 * u).unsqueeze(-1) * grad_w  # (n, D)
        shift = torch.einsum("bik,bi->k", a, target)
        const = (
            (u2 * (y * y).sum(-1)).sum()
            - 4.0 * (u * (grad_w * y).sum(-1)).sum()
            - 2.0 * d_out * (w * u).sum()
        )
        return QuadraticLoss(precision, shift, const, name="theta")


@MODELS.register("gaussian_location")
class GaussianLocationModel(LinearGaussianModel):
    """``y ~ N(theta, sigma^2 I_dim)``; ``x`` is ignored (``None`` or a ``(B, 0)`` tensor); ``y`` is ``(B, dim)``.

    ``output`` returns means of shape ``(S, B, dim)`` when ``x`` is a tensor and ``(S, 1, dim)`` (which
    broadcasts against any batch) when ``x`` is ``None``.
    """

    name = "gaussian_location"

    def __init__(self, dim: int = 1, sigma: float = 1.0) -> None:
        self.dim = _positive_int(dim, "dim", self.name)
        self.sigma = _positive_float(sigma, "sigma", self.name)
        self.event_dim = self.dim
        self.param_shapes = {"theta": (self.dim,)}

    def output(self, theta: Mapping[str, Tensor], x: Tensor | None) -> GaussianOutput:
        s = self._check_theta(theta)
        t = theta["theta"]
        b = 1 if x is None else int(x.shape[0])
        return GaussianOutput(t.unsqueeze(1).expand(s, b, self.dim), self.sigma)

    def design(self, x: Tensor | None, n: int, dtype: torch.dtype) -> Tensor:
        return torch.eye(self.dim, dtype=dtype).expand(n, self.dim, self.dim)

    def output_local_reparam(self, mean: Mapping[str, Tensor], variance: Mapping[str, Tensor], x: Tensor | None,
                             n_samples: int, generator: torch.Generator | None = None) -> GaussianOutput:
        """:meth:`LinearGaussianModel.output_local_reparam` with the identity design: each point draws
        ``theta`` itself, ``m + sqrt(v) eps`` (``B D`` operations, no ``(B, D, D)`` design)."""
        s = _positive_int(n_samples, "n_samples", self.name)
        b = self._points(x)
        m, v = mean["theta"], variance["theta"]
        return GaussianOutput(_draw(m.expand(b, self.dim), v.expand(b, self.dim), s, generator), self.sigma)

    def output_local_reparam_full(self, loc: Tensor, scale_tril: Tensor, x: Tensor | None, n_samples: int,
                                  generator: torch.Generator | None = None) -> GaussianOutput:
        """:meth:`LinearGaussianModel.output_local_reparam_full` with the identity design: each point draws
        ``theta = loc + L eps`` itself (``S B D^2`` operations, no ``(B, D, D)`` design)."""
        s = _positive_int(n_samples, "n_samples", self.name)
        eps = torch.randn((s, self._points(x), self.dim), generator=generator, dtype=loc.dtype, device=loc.device)
        return GaussianOutput(loc + eps @ scale_tril.T, self.sigma)


def _draw(mu: Tensor, var: Tensor, n_samples: int, generator: torch.Generator | None) -> Tensor:
    """``mu + sqrt(var) eps``, ``(S, *mu.shape)``, with independent ``eps ~ N(0, 1)``; a variance of exactly 0 (a
    point whose features are all 0, without a bias) draws ``mu`` with a zero gradient, not ``sqrt``'s infinite
    derivative times 0 (NaN)."""
    eps = torch.randn((n_samples, *mu.shape), generator=generator, dtype=mu.dtype, device=mu.device)
    positive = var > 0
    return torch.addcmul(mu, torch.where(positive, var, torch.ones_like(var)).sqrt() * positive, eps)


def _with_bias(x: Tensor, bias: bool) -> Tensor:
    if not bias:
        return x
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], dim=1)


class _LinearFeatures:
    """The checked features ``[x, 1]`` (or ``x`` without a bias) of the models linear in ``theta``."""

    name: str
    in_features: int
    bias: bool

    def features(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        if x is None or x.dim() != 2 or x.shape[1] != self.in_features:
            shape = None if x is None else tuple(x.shape)
            raise ValueError(f"{self.name}: x must have shape (B, {self.in_features}), got {shape}")
        if dtype is not None:
            x = x.to(dtype)
        return _with_bias(x, self.bias)


@MODELS.register("linear_regression")
class LinearRegressionModel(_LinearFeatures, LinearGaussianModel):
    """``y ~ N(x^T theta, sigma^2)`` (with bias: ``[x, 1]^T theta``, bias last); ``y`` is ``(B, 1)``."""

    name = "linear_regression"

    def __init__(self, in_features: int, sigma: float = 1.0, bias: bool = True) -> None:
        self.in_features = _positive_int(in_features, "in_features", self.name)
        self.sigma = _positive_float(sigma, "sigma", self.name)
        self.bias = bool(bias)
        self.event_dim = 1
        self.param_shapes = {"theta": (self.in_features + int(self.bias),)}

    def output(self, theta: Mapping[str, Tensor], x: Tensor | None) -> GaussianOutput:
        self._check_theta(theta)
        t = theta["theta"]
        phi = self.features(x, t.dtype)  # type: ignore[arg-type]
        return GaussianOutput((t @ phi.T).unsqueeze(-1), self.sigma)

    def design(self, x: Tensor | None, n: int, dtype: torch.dtype) -> Tensor:
        phi = self.features(x, dtype)  # type: ignore[arg-type]
        if phi.shape[0] != n:
            raise ValueError(f"{self.name}: x has {phi.shape[0]} rows but y has {n}")
        return phi.unsqueeze(1)


@MODELS.register("logistic_regression")
class LogisticRegressionModel(_LinearFeatures, LikelihoodModel):
    """Softmax regression on ``[x, 1]`` (bias last).

    * ``num_classes = 2``: one logit ``z = theta . [x, 1]``, logits ``[0, z]`` so ``p(y=1) = sigmoid(z)``;
      ``theta`` has ``in_features + 1`` entries.
    * ``num_classes = C > 2``: ``theta`` has ``C (in_features + 1)`` entries, read row-major as a
      ``(C, in_features + 1)`` weight matrix.
    """

    name = "logistic_regression"

    def __init__(self, in_features: int, num_classes: int = 2, bias: bool = True) -> None:
        self.in_features = _positive_int(in_features, "in_features", self.name)
        self.num_classes = _positive_int(num_classes, "num_classes", self.name, minimum=2)
        self.bias = bool(bias)
        self.n_inputs = self.in_features + int(self.bias)
        size = self.n_inputs if self.num_classes == 2 else self.num_classes * self.n_inputs
        self.param_shapes = {"theta": (size,)}

    @property
    def is_classifier(self) -> bool:
        return True

    def logits(self, theta: Mapping[str, Tensor], x: Tensor) -> Tensor:
        s = self._check_theta(theta)
        t = theta["theta"]
        phi = self.features(x, t.dtype)
        if self.num_classes == 2:
            z = t @ phi.T  # (S, B)
            return torch.stack([torch.zeros_like(z), z], dim=-1)
        w = t.view(s, self.num_classes, self.n_inputs)
        return torch.einsum("sci,bi->sbc", w, phi)

    def output(self, theta: Mapping[str, Tensor], x: Tensor | None) -> CategoricalOutput:
        if x is None:
            raise ValueError(f"{self.name}: x is required")
        return CategoricalOutput(self.logits(theta, x))

    def output_local_reparam(self, mean: Mapping[str, Tensor], variance: Mapping[str, Tensor], x: Tensor,
                             n_samples: int, generator: torch.Generator | None = None) -> CategoricalOutput:
        """Local reparameterisation (Kingma, Salimans & Welling 2015) under a mean-field ``q`` (``mean``,
        ``variance`` of ``theta``): logits ``(S, B, 2)`` / ``(S, B, C)`` drawn point by point from their
        marginals, ``phi W_m^T + sqrt(phi^2 W_v^T) eps`` (``phi = [x, 1]``), independent ``eps ~ N(0, 1)`` per
        sample, point and class.  Exact: each class's logit reads its own row of weights, so a point's logits are
        independent Gaussians under ``q``, and each point's expected loss is the one with sampled ``theta``.
        Points get independent draws, so a fixed-noise estimate of the summed loss errs by far less than one in
        which every point sees the same few ``theta`` (:class:`common.local_gvi.LocalGVIConfig`,
        ``eval_samples``)."""
        s = _positive_int(n_samples, "n_samples", self.name)
        m, v = mean["theta"], variance["theta"]
        phi = self.features(x, m.dtype)
        rows = 1 if self.num_classes == 2 else self.num_classes
        w_m, w_v = m.view(rows, self.n_inputs), v.view(rows, self.n_inputs)
        return self._categorical(_draw(phi @ w_m.T, (phi * phi) @ w_v.T, s, generator))  # (S, B, rows)

    def output_local_reparam_full(self, loc: Tensor, scale_tril: Tensor, x: Tensor, n_samples: int,
                                  generator: torch.Generator | None = None) -> CategoricalOutput:
        """:meth:`output_local_reparam` under a full-covariance ``q = N(loc, L L^T)``: each point's logits
        ``Phi_b theta`` (``Phi_b`` the point's ``(rows, d)`` design, ``phi^T`` in its class's block) drawn on
        their own, ``Phi_b loc + (Phi_b L) eps`` with ``eps ~ N(0, I_d)`` per sample and point (exact: the
        point's joint Gaussian, classes correlated as ``q`` makes them; ``B d^2 + S B C d`` operations)."""
        s = _positive_int(n_samples, "n_samples", self.name)
        phi = self.features(x, loc.dtype)
        rows = 1 if self.num_classes == 2 else self.num_classes
        d = loc.numel()
        mu = phi @ loc.view(rows, self.n_inputs).T  # (B, rows)
        spread = torch.einsum("bi,cid->bcd", phi, scale_tril.view(rows, self.n_inputs, d))  # Phi_b L: (B, rows, d)
        eps = torch.randn((s, phi.shape[0], d), generator=generator, dtype=loc.dtype, device=loc.device)
        return self._categorical(mu + torch.einsum("bcd,sbd->sbc", spread, eps))

    def _categorical(self, z: Tensor) -> CategoricalOutput:
        """Logits ``(S, B, C)`` from the drawn ``(S, B, rows)`` (binary: ``[0, z]``)."""
        if self.num_classes == 2:
            return CategoricalOutput(torch.cat([torch.zeros_like(z), z], dim=-1))
        return CategoricalOutput(z)


# ==================================================================================================
@MODELS.register("bnn")
class BayesianMLP(LikelihoodModel):
    """ReLU MLP ``in_features -> hidden[0] -> ... -> num_classes`` with a mean-field Gaussian over every
    weight and bias.  Parameters ``"layers.{i}.weight"`` of shape ``(out, in)`` and ``"layers.{i}.bias"``
    of shape ``(out,)``.

    Two forward passes:

    * :meth:`output`: exact, with sampled weights ``theta[name]`` of shape ``(S, *shape)``
      (one weight draw per sample, shared by all points); batched over ``S`` with ``baddbmm``.
    * :meth:`output_local_reparam`: the local reparameterisation trick (Kingma, Salimans & Welling 2015):
      given the mean-field moments, each layer's pre-activation is drawn directly as
      ``N(h W_mu^T + b_mu, h^2 W_var^T + b_var)`` independently per (sample, point, unit).  For one data
      point this gives exactly the same distribution of the outputs as weight sampling (each unit of a layer
      uses its own independent weights, and a layer's weights are independent of the earlier layers'), so
      per-point expectations (predictive probabilities, the expected loss summed over points and its
      gradients) agree; only the correlation *between* points differs, which lowers the estimator's variance.
    """

    name = "bnn"

    def __init__(self, in_features: int, hidden: Sequence[int] = (), num_classes: int = 10,
                 fused_sampling: bool = True) -> None:
        if not isinstance(fused_sampling, bool):
            raise ValueError(f"{self.name}: fused_sampling must be true or false, got {fused_sampling!r}")
        #: sample hidden layers with :mod:`common.fused_sampling` where it applies (float32 CPU, kernels built)
        self.use_fused_sampling = fused_sampling
        self.in_features = _positive_int(in_features, "in_features", self.name)
        if isinstance(hidden, (str, bytes)) or not isinstance(hidden, Sequence):
            raise ValueError(f"{self.name}: hidden must be a list of positive integers, got {hidden!r}")
        self.hidden = [_positive_int(h, "hidden sizes", self.name) for h in hidden]
        self.num_classes = _positive_int(num_classes, "num_classes", self.name, minimum=2)
        self.sizes = [self.in_features, *self.hidden, self.num_classes]
        self.num_layers = len(self.sizes) - 1
        shapes: dict[str, tuple[int, ...]] = {}
        for i in range(self.num_layers):
            shapes[f"layers.{i}.weight"] = (self.sizes[i + 1], self.sizes[i])
            shapes[f"layers.{i}.bias"] = (self.sizes[i + 1],)
        self.param_shapes = shapes

    @property
    def is_classifier(self) -> bool:
        return True

    def _check_x(self, x: Tensor | None) -> Tensor:
        if x is None or x.dim() != 2 or x.shape[1] != self.in_features:
            shape = None if x is None else tuple(x.shape)
            raise ValueError(f"{self.name}: x must have shape (B, {self.in_features}), got {shape}")
        return x

    # ----------------------------------------------------------------------------------------------
    def init_mean(
        self, generator: torch.Generator | None = None, scale: float = 1.0, dtype: torch.dtype = torch.float32
    ) -> dict[str, Tensor]:
        """A random initial posterior mean: weights ``N(0, scale^2 / fan_in)``, biases 0.

        A zero-mean initialisation (e.g. starting from the ``N(0, I)`` prior's mean) is a saddle point of the
        expected loss: all hidden units of a layer are exchangeable, so the gradient w.r.t. their means is the
        same in expectation and they never separate.  Random means break the symmetry; ``scale = 1`` keeps
        the pre-activations of unit-variance inputs at unit scale (LeCun/Kaiming-style fan-in scaling).
        """
        scale = _positive_float(scale, "scale", self.name)
        out = {}
        for i in range(self.num_layers):
            fan_out, fan_in = self.sizes[i + 1], self.sizes[i]
            w = torch.randn((fan_out, fan_in), generator=generator, dtype=dtype) * (scale / math.sqrt(fan_in))
            out[f"layers.{i}.weight"] = w
            out[f"layers.{i}.bias"] = torch.zeros(fan_out, dtype=dtype)
        return out

    # ----------------------------------------------------------------------------------------------
    def output(self, theta: Mapping[str, Tensor], x: Tensor | None) -> CategoricalOutput:
        """Exact forward pass with sampled weights: logits ``(S, B, num_classes)``."""
        s = self._check_theta(theta)
        x = self._check_x(x)
        dtype = theta["layers.0.weight"].dtype
        h = x.to(dtype).unsqueeze(0).expand(s, *x.shape)  # (S, B, in), a view
        for i in range(self.num_layers):
            w = theta[f"layers.{i}.weight"]  # (S, out, in)
            b = theta[f"layers.{i}.bias"]  # (S, out)
            a = torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))  # (S, B, out)
            h = torch.relu(a) if i < self.num_layers - 1 else a
        return CategoricalOutput(h)

    @staticmethod
    def _moments(h: Tensor, w_mean: Tensor, b_mean: Tensor, w_var: Tensor, b_var: Tensor) -> tuple[Tensor, Tensor]:
        # h is 2-D (N, in): two GEMMs with the bias fused in
        mu = torch.addmm(b_mean, h, w_mean.t())
        var = torch.addmm(b_var, h * h, w_var.t())
        return mu, var

    def preactivation_moments(
        self, layer: int, mean: Mapping[str, Tensor], variance: Mapping[str, Tensor], h: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Mean and variance of layer ``layer``'s pre-activations ``h W^T + b`` given its input ``h``
        (shape ``(..., in)``) under the mean-field ``W ~ N(mean, variance)``:
        ``(h W_mu^T + b_mu, h^2 W_var^T + b_var)``."""
        k = f"layers.{layer}"
        lead = h.shape[:-1]
        h2 = h.reshape(-1, h.shape[-1])
        mu, var = self._moments(h2, mean[f"{k}.weight"], mean[f"{k}.bias"], variance[f"{k}.weight"],
                                variance[f"{k}.bias"])
        return mu.view(*lead, -1), var.view(*lead, -1)

    def output_local_reparam(
        self,
        mean: Mapping[str, Tensor],
        variance: Mapping[str, Tensor],
        x: Tensor,
        n_samples: int,
        generator: torch.Generator | None = None,
    ) -> CategoricalOutput:
        """Local-reparameterisation forward pass: logits ``(S, B, num_classes)`` with ``S = n_samples``.

        The first layer's moments are computed once on ``(B, in)`` (two GEMMs shared by all samples), and
        only its ``(S, B, out)`` pre-activations are sampled; later layers act on the flattened
        ``(S*B, h)`` activations.  Differentiable w.r.t. ``mean`` and ``variance``.  The noise of the hidden
        layers comes from :func:`common.fused_sampling.sample_relu_linear` (one fused pass for the draw, the
        ReLU and the square, then the next layer's GEMMs; its key is drawn from ``generator``) when
        ``fused_sampling`` is on and it applies
        (float32 on the CPU, kernels built), otherwise from ``torch.randn(..., generator=generator)`` (one
        draw of ``(S, B, out)`` per layer, in layer order); the output layer's always from ``torch.randn``.
        Either way the same generator state gives the same output.  Variances must be > 0 where the gradient is
        needed (``sqrt`` has an infinite derivative at 0).
        """
        s = _positive_int(n_samples, "n_samples", self.name)
        x = self._check_x(x)
        self._check_moments(mean, variance)
        b = x.shape[0]
        mu, var, draws = self._last_moments_local_reparam(mean, variance, x, s, generator)
        eps = torch.randn((draws, mu.shape[0], self.num_classes), generator=generator, dtype=mu.dtype,
                          device=mu.device)
        a = torch.addcmul(mu, var.sqrt(), eps)
        return CategoricalOutput(a.view(s, b, self.num_classes))

    def _layer(self, mean: Mapping[str, Tensor], variance: Mapping[str, Tensor], i: int
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        k = f"layers.{i}"
        return mean[f"{k}.weight"], mean[f"{k}.bias"], variance[f"{k}.weight"], variance[f"{k}.bias"]

    def _last_moments_local_reparam(
        self, mean: Mapping[str, Tensor], variance: Mapping[str, Tensor], x: Tensor, s: int,
        generator: torch.Generator | None, stop: int = 0,
    ) -> tuple[Tensor, Tensor, int]:
        """Pre-activation moments ``(mu, var, draws)`` of layer ``num_layers - 1 - stop`` by the local
        reparameterisation: layer 0's on the ``B`` rows of ``x`` with ``draws = s`` (shared by the samples),
        a later layer's on the ``s B`` rows of the previous layer's samples with ``draws = 1``."""
        w0 = mean["layers.0.weight"]
        if x.dtype != w0.dtype:
            x = x.to(w0.dtype)
        fused = self.use_fused_sampling and self.num_layers > 1 and fused_sampling.applies_to(w0)
        mu, var = self._moments(x, *self._layer(mean, variance, 0))
        draws = s
        for i in range(self.num_layers - 1 - stop):  # hidden layers: sample, ReLU, next layer's moments
            if fused:  # one pass for the draw, the ReLU and the square (common/fused_sampling.py)
                mu, var = fused_sampling.sample_relu_linear(mu, var.sqrt(), *self._layer(mean, variance, i + 1),
                                                            draws, generator)
            else:
                eps = torch.randn((draws, mu.shape[0], mu.shape[-1]), generator=generator, dtype=mu.dtype,
                                  device=mu.device)
                h = torch.relu_(torch.addcmul(mu, var.sqrt(), eps)).view(-1, mu.shape[-1])
                mu, var = self._moments(h, *self._layer(mean, variance, i + 1))
            draws = 1
        return mu, var, draws

    def expected_loss_local_reparam(
        self,
        mean: Mapping[str, Tensor],
        variance: Mapping[str, Tensor],
        x: Tensor,
        y: Tensor,
        n_samples: int,
        loss: Loss,
        generator: torch.Generator | None = None,
    ) -> Tensor | None:
        """``sum_i E_q[loss_i] `` over the batch, estimated with ``n_samples`` local-reparameterisation samples
        by :mod:`common.fused_head` (the last hidden layer, the output layer and the loss in one pass), or
        ``None`` where that kernel does not apply (fused sampling off, no hidden layer, a loss other than the
        NLL or GCE, more than ``fused_head.MAX_CLASSES`` classes, not float32 on the CPU, kernels not built):
        the caller then uses :meth:`output_local_reparam` and the loss.  Same distribution as that path; other
        draws."""
        self._check_moments(mean, variance)
        w0 = mean["layers.0.weight"]
        if not (self.use_fused_sampling and self.num_layers > 1 and self.num_classes <= fused_head.MAX_CLASSES
                and fused_head.loss_spec(loss) is not None and fused_head.applies_to(w0)):
            return None
        s = _positive_int(n_samples, "n_samples", self.name)
        x = self._check_x(x)
        mu, var, draws = self._last_moments_local_reparam(mean, variance, x, s, generator, stop=1)
        return fused_head.expected_loss(mu, var, *self._layer(mean, variance, self.num_layers - 1), y, s, draws,
                                        loss, generator)

    def _check_moments(self, mean: Mapping[str, Tensor], variance: Mapping[str, Tensor]) -> None:
        """Check that ``mean`` and ``variance`` (one tensor per parameter, no sample dimension) are over this
        network's parameters with its shapes.  The local-reparameterisation passes take every size from the
        tensors themselves, so a posterior of another network (3-7-3 for this 3-4-3) ran as that network."""
        for what, moments in (("mean", mean), ("variance", variance)):
            if set(moments) != set(self.param_shapes):
                raise ValueError(f"{self.name}: the {what} is over {sorted(moments)}, the model has parameters "
                                 f"{list(self.param_shapes)}")
            for k, shape in self.param_shapes.items():
                if tuple(moments[k].shape) != tuple(shape):
                    raise ValueError(f"{self.name}: the {what} of '{k}' must have shape {tuple(shape)}, got "
                                     f"{tuple(moments[k].shape)}")

    def predictive_probs(
        self, q: GaussianFactor, x: Tensor, n_samples: int, generator: torch.Generator | None = None
    ) -> Tensor:
        """``E_q[softmax(f_theta(x))]``, shape ``(B, C)``, by the local reparameterisation (exact per point,
        see the class docstring), in chunks of points to bound memory (each point's first-layer moments are
        computed once, whatever ``n_samples``)."""
        return self.predictive_log_probs(q, x, n_samples, generator=generator).exp().to(q.dtype)

    def predictive_log_probs(
        self, q: GaussianFactor, x: Tensor, n_samples: int, generator: torch.Generator | None = None
    ) -> Tensor:
        """``log`` of :meth:`predictive_probs`, in float64, as ``logsumexp_s log p_s - log S`` (exact where the
        averaged probability underflows); same draws."""
        if not isinstance(q, MeanFieldGaussian):
            raise TypeError(f"{self.name}: q must be a MeanFieldGaussian, got {type(q).__name__}")
        if set(q.names) != set(self.param_shapes):
            raise ValueError(f"{self.name}: q is over {q.names}, the model has parameters {list(self.param_shapes)}")
        n_samples = _positive_int(n_samples, "n_samples", self.name)
        q.check_proper("posterior in predictive_probs()")
        mean, var = q.mean(), q.variance()
        self._check_moments(mean, var)
        b = int(x.shape[0])
        widest = max(self.sizes[1:])
        chunk = max(1, min(b, (1 << 23) // (n_samples * widest)))  # points per chunk: S x chunk x widest floats
        parts = []
        with torch.no_grad():
            for start in range(0, b, chunk):
                out = self.output_local_reparam(mean, var, x[start:start + chunk], n_samples, generator=generator)
                # clamped as in LikelihoodModel.predictive_log_probs: rounding must not lift log p above 0
                parts.append((torch.logsumexp(out.log_probs.double(), 0) - math.log(n_samples)).clamp_(max=0.0))
        if not parts:
            return torch.zeros((0, self.num_classes), dtype=torch.float64)
        return torch.cat(parts)

    # ----------------------------------------------------------------------------------------------
    def forward_flops(self, batch_size: int, n_samples: int, local_reparam: bool) -> int:
        """Matmul FLOPs (2 x multiply-adds, biases and element-wise work not counted) of one forward pass on
        ``batch_size`` points with ``n_samples`` parameter samples.

        Exact path: ``S B sum_l in_l out_l`` multiply-adds.  Local reparameterisation: two GEMMs (mean and
        variance) per layer, the first layer's on ``B`` rows only (shared by the samples), later layers' on
        ``S B`` rows.
        """
        pairs = [self.sizes[i] * self.sizes[i + 1] for i in range(self.num_layers)]
        if not local_reparam:
            return 2 * n_samples * batch_size * sum(pairs)
        return 2 * 2 * batch_size * (pairs[0] + n_samples * sum(pairs[1:]))

    def flops_per_point(self, local_reparam: bool, n_samples: int | None = None) -> int:
        """Matmul FLOPs per data point of a forward pass drawing ``n_samples`` samples (see
        :meth:`forward_flops`); a batch costs ``batch_size * flops_per_point(...)``.

        For the exact path ``n_samples`` defaults to 1 (the cost is linear in it).  For the local
        reparameterisation it is required: the first layer is shared by all samples, so the per-sample cost
        is not a constant and multiplying a one-sample count by ``S`` would overstate the work.
        """
        if n_samples is None:
            if local_reparam:
                raise ValueError(
                    "flops_per_point(local_reparam=True) needs n_samples: the first layer's moments are "
                    "computed once for all samples"
                )
            n_samples = 1
        n_samples = _positive_int(n_samples, "n_samples", self.name)
        return self.forward_flops(1, n_samples, local_reparam)


__all__ = [
    "MODELS",
    "BayesianMLP",
    "GaussianLocationModel",
    "LikelihoodModel",
    "LinearGaussianModel",
    "LinearRegressionModel",
    "LogisticRegressionModel",
    "make_model",
]
