"""The client's GVI step (FedGVI eq. 4): ``q_m = argmin_{q in Q} E_q[sum_i L(y_i; theta, x_i)] + D(q || cavity)``.

:func:`local_gvi` minimises this objective over the family of the cavity (mean-field or full covariance,
through the unconstrained parameterisations of :mod:`common.variational`) with Adam: locations with ``lr``,
scales with ``lr_scale`` (a full covariance's off-diagonal Cholesky entries with ``lr_scale / sqrt(d)``,
:func:`_scale_groups`).  How ``E_q[sum_i L_i]`` is evaluated depends on the loss,
the model and the configuration, in this order of preference:

1. ``"closed_form"``: the loss is quadratic in the parameter vector for this model
   (``loss.quadratic(...)`` returns a :class:`~common.quadratic.QuadraticLoss`; NLL and score matching on the
   Gaussian location / linear regression models).  Then ``E_q[L] = QuadraticLoss.expectation(mean, cov)``
   exactly, over all the data at once (``batch_size`` is then irrelevant), with no Monte Carlo.
2. ``"quadrature"`` (``quadrature_points = K > 0``, only for at most :data:`MAX_QUADRATURE_DIM` scalar
   parameters): a tensor-product Gauss-Hermite rule with ``K`` nodes per dimension, applied through the
   reparameterisation ``theta = mean + L z``; deterministic and differentiable.
3. ``"mc_local_reparam"``: Monte Carlo with the local reparameterisation trick (Kingma et al. 2015) for models
   that provide ``output_local_reparam`` (every registered model: the BNN samples its pre-activations, logistic
   regression its logits, the Gaussian models their means, each point with its own noise), mean-field family;
   ``"mc_local_reparam_full"`` the same for the full-covariance family (``output_local_reparam_full``: logistic
   regression and the Gaussian models draw each point's outputs from their joint Gaussian under ``q``).
4. ``"mc_weights"``: Monte Carlo with ``n_samples`` reparameterised parameter samples.

Monte Carlo steps use minibatches of ``B`` of the ``n`` examples and the unbiased estimate

    (n / B) * sum_{i in batch} (1/S) sum_s L(y_i; theta_s, x_i)  +  D(q || cavity).

Losses with ``needs_reference`` (score matching, whose weights are centred at the cavity) get the model
output at the cavity mean (``S = 1``).

Early stopping: after every epoch the objective is evaluated at the current state (``objective_estimate =
"end_of_epoch"``, the default: exactly for the deterministic paths; for Monte Carlo over all the data in
fixed order with a fresh generator seeded from ``seed``, i.e. common random numbers, so that two states are
compared under the same noise and the value is a deterministic function of the state).  With
``"running"`` the epoch's value is the mean of its minibatch objectives (cheaper, as in the reference
code: no pass over the data besides training).  Each step measures its objective before its update, so that
value is credited to the state before the epoch's last step: with one step an epoch (full batch) exactly the
state it was measured at, the epoch's starting state (crediting it to the end-of-epoch state returned a state
one step past the best measured one).  The best state (with ``"end_of_epoch"`` the initial state included, as
epoch 0; with ``"running"`` and full batch too) is kept; the run stops when the objective
has not improved by more than ``min_delta`` for ``patience`` epochs, and the best state is restored.  For a
deterministic objective the best state is then polished with L-BFGS (strong Wolfe) when ``polish`` is set;
the polished state is kept only if its objective is lower.

For a mean-field cavity and a KL, weighted-KL, reverse-KL or Alpha-Renyi divergence, ``D(q || cavity)`` is
evaluated by :class:`MeanFieldMomentDivergence` (the same closed forms, from ``q``'s moments and the
cavity's precomputed mean and precision, checked against :mod:`common.divergences` in the tests), and the
scales are computed once per step for the loss and the divergence; any other divergence is called as the
generic ``divergence(q, cavity)`` object.  Adam is torch's fused CPU implementation.

With Alpha-Renyi for ``alpha > 1`` or ``alpha < 0`` the divergence is finite only on part of the family; a step
(Adam's, or the explicit step's) that leaves that domain, shrunk by a small margin, is cut short
(:mod:`common.domain_guard`): it used to end the client's update.

Every random draw (sampling and shuffling) comes from one ``torch.Generator`` seeded with ``seed``, so a
run is bit-for-bit reproducible.  A non-finite objective or parameter raises
:class:`~common.errors.NonFiniteError` at once, naming the epoch and step.
"""

from __future__ import annotations

import copy
import math
import numbers
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from common.errors import (DivergenceUndefinedError, ImproperDistributionError, NonFiniteError, PGVIError,
                           ShapeMismatchError)
from common.domain_guard import domain_guard
from common.explicit_step import OneHiddenLayerStep
from common.families import FullCovarianceGaussian, GaussianFactor, MeanFieldGaussian
from common import fused_meanfield
from common.adam import Adam
from common.fast_math import all_finite, log1p, log_ratio
from common.likelihoods import CategoricalOutput, check_class_labels
from common.quadratic import QuadraticLoss
from common.variational import (
    DEFAULT_MIN_SCALE,
    FullCovarianceVariational,
    MeanFieldVariational,
    VariationalGaussian,
    variational_for,
)

MAX_QUADRATURE_DIM = 3
"""Tensor-product quadrature grows as ``K^d``; beyond this many scalar parameters use Monte Carlo."""

INIT_CHOICES = ("posterior", "cavity")
OBJECTIVE_ESTIMATES = ("end_of_epoch", "running")
_EVAL_SEED_OFFSET = 0x5EED_0BEC  # the evaluation generator's seed is seed + this (independent of training draws)


# ==================================================================================================
@dataclass(frozen=True)
class LocalGVIConfig:
    """Settings of :func:`local_gvi`; every value is validated (``ValueError`` naming the field).

    Attributes:
        epochs: maximum number of passes over the local data (>= 1).
        batch_size: minibatch size ``B`` (>= 1); ``None`` = full batch.  A ``B`` larger than the data is
            the full batch.
        lr: Adam learning rate of the location parameters (> 0).
        lr_scale: Adam learning rate of the scale parameters (> 0); ``None`` = ``lr``.  A full covariance's
            off-diagonal Cholesky entries take ``lr_scale / sqrt(d)`` (:func:`_scale_groups`).
        n_samples: Monte Carlo samples ``S`` per step (>= 1).
        patience: epochs without an improvement larger than ``min_delta`` before stopping (>= 1);
            ``None`` = run all ``epochs``.
        min_delta: the improvement that resets the patience counter (>= 0, absolute).
        seed: seed of the generator used for sampling and shuffling.
        init: start from the given posterior (``"posterior"``) or from the cavity (``"cavity"``).
        local_reparam: use the local reparameterisation trick when the model supports it.
        closed_form: use the closed-form expectation when the loss is quadratic for the model.
        quadrature_points: ``K > 0`` selects Gauss-Hermite quadrature with ``K`` nodes per dimension
            (models with at most :data:`MAX_QUADRATURE_DIM` scalar parameters); 0 = off.
        objective_estimate: ``"end_of_epoch"`` or ``"running"`` (see the module docstring).
        eval_samples: Monte Carlo samples of the end-of-epoch evaluation (>= 1); ``None`` = ``n_samples``.
            The evaluation uses fixed noise, so the returned (best) state minimises a fixed-noise estimate
            of the objective.  With weight sampling (``mc_weights``: ``local_reparam`` off, or a model
            without a local path) every point sees the same few draws of ``theta``, and that estimate's minimiser can be far
            from the true one: at 10 samples, variances 0.25-3.5x the optimal ones in a 3-parameter linear
            regression (a review, 2026-11-27), returned states up to 0.49 nats above the optimum in a 2-parameter
            logistic regression.  The local-reparameterisation path draws each point's output on its own,
            and its errors average over the points (0.02 nats at worst on that logistic regression,
            ``tests/test_local_reparam_linear.py``).  Raise it when the local posterior must be precise.
        polish: after Adam, refine a deterministic objective (closed form, or full-batch quadrature) with L-BFGS.
        polish_max_iter: L-BFGS iterations of the polish (>= 1).
        polish_tolerance_grad: L-BFGS stops when the largest absolute gradient entry is below this (> 0).
        dtype: dtype of the optimisation; ``None`` = the cavity's.  The result is returned in the cavity's
            dtype (the natural parameters are computed in that dtype from the optimised location and scale).
        min_scale: floor of the scale parameterisation (see :mod:`common.variational`).
    """

    epochs: int = 100
    batch_size: int | None = None
    lr: float = 1e-2
    lr_scale: float | None = None
    n_samples: int = 10
    patience: int | None = 10
    min_delta: float = 0.0
    seed: int = 0
    init: str = "posterior"
    local_reparam: bool = True
    closed_form: bool = True
    quadrature_points: int = 0
    objective_estimate: str = "end_of_epoch"
    eval_samples: int | None = None
    polish: bool = True
    polish_max_iter: int = 500
    polish_tolerance_grad: float = 1e-11
    dtype: torch.dtype | None = None
    min_scale: float = DEFAULT_MIN_SCALE

    def __post_init__(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        def positive_finite(name: str, v: Any) -> None:
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"LocalGVIConfig.{name} must be a finite number > 0, got {v!r}")

        if not is_int(self.epochs) or self.epochs < 1:
            raise ValueError(f"LocalGVIConfig.epochs must be an integer >= 1, got {self.epochs!r}")
        if self.batch_size is not None and (not is_int(self.batch_size) or self.batch_size < 1):
            raise ValueError(f"LocalGVIConfig.batch_size must be None (full batch) or an integer >= 1, got {self.batch_size!r}")
        positive_finite("lr", self.lr)
        if self.lr_scale is not None:
            positive_finite("lr_scale", self.lr_scale)
        if not is_int(self.n_samples) or self.n_samples < 1:
            raise ValueError(f"LocalGVIConfig.n_samples must be an integer >= 1, got {self.n_samples!r}")
        if self.patience is not None and (not is_int(self.patience) or self.patience < 1):
            raise ValueError(f"LocalGVIConfig.patience must be None or an integer >= 1, got {self.patience!r}")
        if (isinstance(self.min_delta, bool) or not isinstance(self.min_delta, numbers.Real)
                or not math.isfinite(self.min_delta) or self.min_delta < 0):
            raise ValueError(f"LocalGVIConfig.min_delta must be a finite number >= 0, got {self.min_delta!r}")
        if not is_int(self.seed):
            raise ValueError(f"LocalGVIConfig.seed must be an integer, got {self.seed!r}")
        if not -(2**63) <= self.seed <= 2**64 - 1 - _EVAL_SEED_OFFSET:  # torch's seed range, evaluation offset added
            raise ValueError(f"LocalGVIConfig.seed must be in [-2**63, 2**64 - 1 - {_EVAL_SEED_OFFSET:#x}], "
                             f"got {self.seed}")
        if self.init not in INIT_CHOICES:
            raise ValueError(f"LocalGVIConfig.init must be one of {INIT_CHOICES}, got {self.init!r}")
        if not is_int(self.quadrature_points) or self.quadrature_points < 0 or self.quadrature_points > 100:
            raise ValueError(
                f"LocalGVIConfig.quadrature_points must be an integer in [0, 100] (0 = off), got {self.quadrature_points!r}"
            )
        if self.objective_estimate not in OBJECTIVE_ESTIMATES:
            raise ValueError(
                f"LocalGVIConfig.objective_estimate must be one of {OBJECTIVE_ESTIMATES}, got {self.objective_estimate!r}"
            )
        if self.eval_samples is not None and (not is_int(self.eval_samples) or self.eval_samples < 1):
            raise ValueError(f"LocalGVIConfig.eval_samples must be None or an integer >= 1, got {self.eval_samples!r}")
        if not is_int(self.polish_max_iter) or self.polish_max_iter < 1:
            raise ValueError(f"LocalGVIConfig.polish_max_iter must be an integer >= 1, got {self.polish_max_iter!r}")
        positive_finite("polish_tolerance_grad", self.polish_tolerance_grad)
        if self.dtype is not None and self.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"LocalGVIConfig.dtype must be None, torch.float32 or torch.float64, got {self.dtype!r}")
        if (isinstance(self.min_scale, bool) or not isinstance(self.min_scale, numbers.Real)
                or not math.isfinite(self.min_scale) or self.min_scale < 0):
            raise ValueError(f"LocalGVIConfig.min_scale must be a finite number >= 0, got {self.min_scale!r}")


@dataclass
class LocalGVIResult:
    """Outcome of :func:`local_gvi`.

    Attributes:
        posterior: the local posterior ``q_m`` (same family, layout and dtype as the cavity; proper).
        objective_trace: the objective after each epoch (see ``LocalGVIConfig.objective_estimate``).
        epochs_run: epochs actually run (early stopping may end before ``config.epochs``).
        best_epoch: the epoch whose state was returned (0 = the initial state), before any polish: the state
            after that many epochs; with ``"running"`` and several steps an epoch, the state before the last
            step of epoch ``best_epoch`` (see the module docstring).
        wall_time_s: wall-clock seconds of the whole call.
        n_examples: number of local examples ``n``.
        initial_objective: the objective at the initial state (NaN with ``objective_estimate="running"``,
            which makes no pass over the data besides training).
        final_objective: the objective at the returned state (equals ``min`` over the initial value and
            the trace unless the L-BFGS polish improved it; with ``"running"``, the best epoch's running
            mean).
        path: ``"closed_form"``, ``"quadrature"``, ``"mc_local_reparam"``, ``"mc_local_reparam_full"`` or
            ``"mc_weights"``.
        polished: whether an L-BFGS polish was run and kept.
        domain_cuts: steps that left the divergence's (shrunk) domain and were cut short (Alpha-Renyi with
            ``alpha > 1`` or ``< 0``: :mod:`common.domain_guard`).
        stopped_unrepresentable: empty, or why the epochs stopped early at a state the optimiser reached whose
            precision is not positive definite in the working dtype (a full-covariance ``q`` whose Cholesky
            factor is valid but so ill-conditioned, after too large a step, that ``L^-T L^-1`` rounds to an
            indefinite matrix); the best state before it was returned.
    """

    posterior: GaussianFactor
    objective_trace: list[float]
    epochs_run: int
    best_epoch: int
    wall_time_s: float
    n_examples: int
    initial_objective: float = float("nan")
    final_objective: float = float("nan")
    path: str = ""
    polished: bool = False
    domain_cuts: int = 0
    stopped_unrepresentable: str = ""


# ==================================================================================================
def _check_finite_input(t: Tensor | None, what: str) -> None:
    if t is None or not torch.is_floating_point(t) or t.numel() == 0:
        return
    lo, hi = torch.aminmax(t)  # one pass; NaN propagates, +-inf shows in the extremes
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
        bad = int((~torch.isfinite(t)).sum())
        raise NonFiniteError(f"local_gvi: {what} has {bad} non-finite entries")


def _check_labels(model: Any, y: Tensor | None) -> int | None:
    """For a classifier that states its class count (``model.is_classifier`` and an integer
    ``model.num_classes``): ``ValueError`` unless ``y`` holds class indices in ``[0, num_classes)``
    (:func:`~common.likelihoods.check_class_labels`, the message naming the model), and return the count.
    ``None`` for any other model, whose outputs then check their labels on every call.

    Run once on the client's whole label tensor before the first step; the loop then marks its categorical
    outputs ``labels_checked`` (:meth:`_Objective.loss_of`), so the per-call check (4-11 us, 6-12 % of the loss's
    forward and backward pass on a 32-row logistic-regression minibatch) is not repeated on every minibatch of
    labels that cannot change.
    """
    if y is None or not getattr(model, "is_classifier", False):
        return None
    c = getattr(model, "num_classes", None)
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
        return None
    name = getattr(model, "name", type(model).__name__)
    check_class_labels(y, int(c), f"local_gvi: labels y of the classifier {name!r} ({int(c)} classes)")
    return int(c)


def _layout(factor: GaussianFactor) -> dict[str, tuple[int, ...]]:
    """The parameter tensors a factor is over: ``{name: shape}`` (a full-covariance factor: one vector)."""
    if isinstance(factor, FullCovarianceGaussian):
        return {factor.name: (factor.dim,)}
    return dict(factor.shapes)


def _check_layouts(model: Any, cavity: GaussianFactor, init: GaussianFactor | None) -> None:
    """The cavity, ``init`` and the model are over the same named tensors of the same shapes, else a
    :class:`ShapeMismatchError` naming both layouts (without it a mismatch surfaced as a raw matmul error or a
    ``KeyError`` deep in the objective, depending on the path)."""
    cav = _layout(cavity)
    if init is not None:
        if type(init) is not type(cavity):
            raise TypeError(f"local_gvi: init is a {type(init).__name__}, the cavity a {type(cavity).__name__}")
        if _layout(init) != cav:
            raise ShapeMismatchError(f"local_gvi: init is over {_layout(init)}, the cavity over {cav}")
    shapes = getattr(model, "param_shapes", None)
    if shapes is not None and {k: tuple(v) for k, v in shapes.items()} != cav:
        raise ShapeMismatchError(f"local_gvi: the model {getattr(model, 'name', type(model).__name__)!r} has "
                                 f"parameters {dict(shapes)}, the cavity is over {cav}")


def _rows(t: Tensor, idx: Tensor | slice) -> Tensor:
    """``t[idx]`` along dimension 0 (``index_select`` for an index tensor: a quarter of ``t[idx]``'s time)."""
    return t[idx] if isinstance(idx, slice) else torch.index_select(t, 0, idx)


def _gauss_hermite(k: int, dim: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Nodes ``(k**dim, dim)`` and weights ``(k**dim,)`` of the standard-normal tensor-product rule."""
    x, w = np.polynomial.hermite_e.hermegauss(k)  # weight exp(-x^2/2)
    w = w / math.sqrt(2.0 * math.pi)
    grids = np.meshgrid(*([x] * dim), indexing="ij")
    wgrids = np.meshgrid(*([w] * dim), indexing="ij")
    nodes = np.stack([g.reshape(-1) for g in grids], axis=-1)
    weights = np.prod(np.stack([g.reshape(-1) for g in wgrids], axis=-1), axis=-1)
    return torch.as_tensor(nodes, dtype=dtype), torch.as_tensor(weights, dtype=dtype)


def _factor_mean(factor: GaussianFactor) -> dict[str, Tensor]:
    if isinstance(factor, MeanFieldGaussian):
        return factor.mean()
    assert isinstance(factor, FullCovarianceGaussian)
    return {factor.name: factor.mean()}


class _Objective:
    """``E_q[sum_i L_i] + D(q || cavity)`` for one client: the pieces shared by training and evaluation."""

    def __init__(self, model: Any, loss: Any, divergence: Any, cavity: GaussianFactor, x: Tensor, y: Tensor,
                 config: LocalGVIConfig, dtype: torch.dtype) -> None:
        self.model, self.loss, self.divergence, self.config = model, loss, divergence, config
        self.dtype = dtype
        self.label_classes = _check_labels(model, y)  # before anything runs: bad labels fail here, once
        self.cavity = cavity.to(dtype) if cavity.dtype != dtype else cavity
        self.x = x.to(dtype) if torch.is_floating_point(x) else x
        self.y = y.to(dtype) if (y is not None and torch.is_floating_point(y)) else y
        self.n = int(self.x.shape[0])
        self.needs_reference = bool(getattr(loss, "needs_reference", False))
        self.reference_theta = {k: v.detach() for k, v in _factor_mean(self.cavity).items()}
        self.quadratic: QuadraticLoss | None = None
        self.quad: tuple[Tensor, Tensor] | None = None
        self.path = ""
        self.fast_divergence = (
            MeanFieldMomentDivergence.create(divergence, self.cavity)
            if isinstance(self.cavity, MeanFieldGaussian) else None
        )

    # pieces ----------------------------------------------------------------------------------------
    def loss_of(self, out: Any, yb: Tensor, ref: Any) -> Tensor:
        """``loss(out, yb, reference=ref)`` for ``yb`` rows of this objective's labels: a categorical output
        over the class count :func:`_check_labels` validated them for skips the per-call label check."""
        if self.label_classes is not None and isinstance(out, CategoricalOutput) \
                and out.num_classes == self.label_classes:
            out.labels_checked = True
        return self.loss(out, yb, reference=ref)

    def reference(self, xb: Tensor) -> Any:
        if not self.needs_reference:
            return None
        with torch.no_grad():
            return self.model.output({k: v.unsqueeze(0) for k, v in self.reference_theta.items()}, xb)

    def moments(self, q: VariationalGaussian) -> _Moments | None:
        """Mean-field means, scales and variances, computed once per step and shared by the loss and the
        divergence (``None`` for the full-covariance family).  On the local-reparameterisation path with a
        moment-form divergence and float32 CPU parameters, :mod:`common.fused_meanfield` computes the
        variances and the divergence together in one pass (no scales: that path does not use them)."""
        if not isinstance(q, MeanFieldVariational):
            return None
        fd = self.fast_divergence
        if fd is not None and self.path == "mc_local_reparam" and fused_meanfield.applies_to(q.locs[0]):
            means = q.means()
            vs, total, bad = fused_meanfield.variances_and_divergence(
                list(means.values()), list(q.raw_scales), [fd.mean_p[k] for k in means], [fd.lam_p[k] for k in means],
                fd.kind, fd.alpha, 0.5 * fd.weight, q.min_scale)
            for (name, loc), b in zip(means.items(), bad):
                if b:
                    raise DivergenceUndefinedError.alpha_renyi(fd.alpha, b, loc.numel(), name)
            return _Moments(means, None, dict(zip(means, vs)), total)
        means, scales = q.means(), q.scales()
        return _Moments(means, scales, {k: v * v for k, v in scales.items()})

    def divergence_term(self, q: VariationalGaussian, moments: _Moments | None = None) -> Tensor:
        if moments is not None and moments.divergence is not None:
            return moments.divergence
        if self.fast_divergence is not None:
            moments = moments or self.moments(q)
            assert moments is not None
            return self.fast_divergence(moments.means, moments.variances)
        return self.divergence(q.distribution(), self.cavity)

    def batch_expected_loss(self, q: VariationalGaussian, xb: Tensor, yb: Tensor,
                            generator: torch.Generator | None, n_samples: int | None = None,
                            moments: _Moments | None = None) -> Tensor:
        """``sum_{i in batch} E_q[L_i]`` estimated by the path's rule (quadrature or Monte Carlo).  ``xb``, ``yb``
        are rows of ``self.x``, ``self.y`` (whose labels were checked once, see :meth:`loss_of`)."""
        ref = self.reference(xb)
        if self.path == "quadrature":
            assert self.quad is not None
            nodes, weights = self.quad
            out = self.model.output(q.transform_standard(nodes), xb)
            per = self.loss_of(out, yb, ref)  # (K, B)
            return (weights.unsqueeze(-1) * per).sum()
        s = n_samples or self.config.n_samples
        if self.path == "mc_local_reparam":
            moments = moments or self.moments(q)
            assert moments is not None
            fused = getattr(self.model, "expected_loss_local_reparam", None)
            if fused is not None and ref is None:  # common/fused_head.py where it applies
                value = fused(moments.means, moments.variances, xb, yb, s, self.loss, generator)
                if value is not None:
                    return value
            out = self.model.output_local_reparam(moments.means, moments.variances, xb, s, generator)
        elif self.path == "mc_local_reparam_full":
            assert isinstance(q, FullCovarianceVariational)
            out = self.model.output_local_reparam_full(q.loc, q.cholesky(), xb, s, generator)
        elif moments is not None:
            assert moments.scales is not None  # the fused variances are used on the local-reparam path only
            theta = {}
            for k, m in moments.means.items():
                eps = torch.randn((s, *m.shape), dtype=m.dtype, generator=generator)
                theta[k] = torch.addcmul(m, moments.scales[k], eps)
            out = self.model.output(theta, xb)
        else:
            out = self.model.output(q.rsample(s, generator), xb)
        per = self.loss_of(out, yb, ref)  # (S, B)
        return per.sum() / per.shape[0]

    def full_expected_loss(self, q: VariationalGaussian, generator: torch.Generator | None,
                           n_samples: int | None = None) -> Tensor:
        """``sum_i E_q[L_i]`` over all the data (closed form, quadrature, or Monte Carlo in fixed batches)."""
        if self.path == "closed_form":
            assert self.quadratic is not None
            mean, cov = q.mean_covariance()
            return self.quadratic.expectation(mean, cov)
        bsz = self.n if (self.config.batch_size is None) else min(self.config.batch_size, self.n)
        total = None
        for start in range(0, self.n, bsz):
            sl = slice(start, start + bsz)
            part = self.batch_expected_loss(q, self.x[sl], self.y[sl], generator, n_samples)
            total = part if total is None else total + part
        assert total is not None
        return total

    @property
    def deterministic(self) -> bool:
        return self.path == "closed_form" or (
            self.path == "quadrature" and (self.config.batch_size is None or self.config.batch_size >= self.n)
        )

    def evaluate(self, q: VariationalGaussian) -> float:
        """The objective at ``q``'s current state, a deterministic function of the state."""
        gen = torch.Generator().manual_seed(int(self.config.seed) + _EVAL_SEED_OFFSET)
        with torch.no_grad():
            e = self.full_expected_loss(q, gen, self.config.eval_samples)
            d = self.divergence_term(q)
        return _finite_float(e, d, "evaluation")


@dataclass
class _Moments:
    means: dict[str, Tensor]
    scales: dict[str, Tensor] | None  # None where the fused path computed the variances directly
    variances: dict[str, Tensor]
    divergence: Tensor | None = None  # D(q || cavity), when computed together with the variances


MOMENT_FORM_MIN_ABS_ALPHA = 1e-2
"""Below this ``|alpha|`` :meth:`MeanFieldMomentDivergence.create` returns ``None`` for Alpha-Renyi.  The moment
form here (and the compiled kernels of :mod:`common.fused_meanfield` and :mod:`common.explicit_step`, which share
it) expands the divergence around ``q``; its O(alpha) log term then cancels O(1) terms, with a float32 relative
error ~eps/|alpha| (1 % at alpha = 1e-5, the log term lost entirely at 1e-7).  The generic object
(:func:`common.divergences.alpha_renyi_mean_field_elementwise`) expands around ``p`` there and stays accurate."""


class MeanFieldMomentDivergence:
    """``D(q || p)`` for a mean-field ``q`` given by its means and variances, for a fixed mean-field ``p``.

    The training loop's fast path: it evaluates the same closed forms as :mod:`common.divergences` (the
    per-coordinate, cancellation-free forms of :func:`~common.divergences.kl_mean_field_elementwise` and
    :func:`~common.divergences.alpha_renyi_mean_field_elementwise`) directly from ``q``'s moments and ``p``'s
    precomputed mean and precision, without building natural parameters and re-checking the constant ``p``
    at every step (``q`` is proper by construction of the parameterisation; ``p`` is checked once here).
    With ``r = lambda_p sigma_q^2``, ``u = r - 1`` and ``d = mu_q - mu_p``, per coordinate:

    * ``kl``, ``weighted_kl``: ``(1/w) * 1/2 [u - log1p(u) + lambda_p d^2]``;
    * ``reverse_kl``: ``KL(p || q) = 1/2 [v - log1p(v) + d^2 / sigma_q^2]`` with ``v = 1/r - 1``;
    * ``alpha_renyi``: ``1/2 d^2 lambda_p / (1 + a) - [log1p(a) - (1 - alpha) log1p(u)] / (2 alpha (alpha - 1))``
      with ``a = (1 - alpha) u``; undefined (:class:`~common.errors.DivergenceUndefinedError`) where
      ``1 + a = alpha + (1 - alpha) r <= 0``, i.e. where ``alpha lambda_q + (1 - alpha) lambda_p <= 0``.

    ``log1p(u)`` (and ``log1p(v)``) is the log of the ratio ``r`` (``1/r``): it is taken as ``log1p`` of the
    difference only where that is within 1/2 of 0 and as ``log`` of the ratio itself elsewhere
    (:func:`common.fast_math.log_ratio`),
    because in float32 ``r - 1`` rounds to ``-1`` for ``r < 3e-8`` (a variance 10^8 times narrower than the
    cavity's: the divergence was ``inf``) and loses digits well before.  For the same reason the Alpha-Renyi
    gradient's ``lambda_p / (1 + u)`` is written ``1 / v``.

    :meth:`create` returns ``None`` for any other divergence, and for Alpha-Renyi with ``|alpha| <``
    :data:`MOMENT_FORM_MIN_ABS_ALPHA` (the caller then uses the generic object).
    tests/test_local_gvi.py checks values, gradients and the undefined region against the divergence objects.
    """

    def __init__(self, kind: str, weight: float, alpha: float, p: MeanFieldGaussian) -> None:
        p.check_finite("cavity").check_proper("cavity")
        self.kind, self.weight, self.alpha = kind, weight, alpha
        self.names = list(p.names)
        self.mean_p = {k: v.detach() for k, v in p.mean().items()}
        self.lam_p = {k: v.detach() for k, v in p.precision().items()}

    @classmethod
    def create(cls, divergence: Any, p: MeanFieldGaussian) -> MeanFieldMomentDivergence | None:
        from common.divergences import KL, AlphaRenyi, ReverseKL, WeightedKL

        if type(divergence) is KL:
            return cls("kl", 1.0, 1.0, p)
        if type(divergence) is WeightedKL:
            return cls("kl", 1.0 / float(divergence.w), 1.0, p)
        if type(divergence) is ReverseKL:
            return cls("reverse_kl", 1.0, 0.0, p)
        if type(divergence) is AlphaRenyi:
            if abs(float(divergence.alpha)) < MOMENT_FORM_MIN_ABS_ALPHA:
                return None  # see MOMENT_FORM_MIN_ABS_ALPHA: the generic object is accurate there
            return cls("alpha_renyi", 1.0, float(divergence.alpha), p)
        return None

    def __call__(self, means: dict[str, Tensor], variances: dict[str, Tensor]) -> Tensor:
        total: Tensor | None = None
        for k in self.names:
            part = _MomentDivergenceFn.apply(means[k], variances[k], self.mean_p[k], self.lam_p[k], self.kind,
                                             self.alpha, 0.5 * self.weight, k)
            total = part if total is None else total + part
        assert total is not None
        return total


class _MomentDivergenceFn(torch.autograd.Function):
    """``c * sum_i f(mu_i, v_i)`` for one tensor with the analytic gradient (``c = weight / 2``).

    Fewer passes over the ~10^5 coordinates than autograd's chain of element-wise ops.  Derivatives, with
    ``d = mu - mu_p``, ``u = lambda_p v - 1``, ``a = (1 - alpha) u``:

    * kl:          f = u - log1p(u) + lambda_p d^2;     df/dmu = 2 lambda_p d;   df/dv = lambda_p - 1/v
    * reverse_kl:  f = w - log1p(w) + d^2 / v, w = 1/(lambda_p v) - 1;
                   df/dmu = 2 d / v;   df/dv = (1 - 1/(lambda_p v) - d^2/v) / v
    * alpha_renyi: f = lambda_p d^2 / (1 + a) - [log1p(a) - (1 - alpha) log1p(u)] / (alpha (alpha - 1));
                   df/dmu = 2 lambda_p d / (1 + a);
                   df/dv = -(1 - alpha) lambda_p^2 d^2 / (1 + a)^2 + (lambda_p / (1 + a) - 1/v) / alpha

    (``log1p(u)``, ``log1p(w)``: :func:`common.fast_math.log_ratio` of ``lambda_p v``, ``1 / (lambda_p v)``.)
    The Alpha-Renyi mean term and its derivatives go through ``lambda_p / (1 + a)`` (the
    ``lambda_q lambda_p / lambda_a`` that :func:`common.divergences.alpha_renyi_mean_field_elementwise` forms
    first), times ``d``, times ``d``: never ``lambda_p d^2``, which overflows float32 where the term is finite.
    """

    @staticmethod
    def forward(ctx, mean, var, mean_p, lam_p, kind, alpha, c, name):  # type: ignore[no-untyped-def,override]
        d = mean - mean_p
        if kind == "kl":
            r = torch.mul(lam_p, var)
            u = r - 1.0
            val = u.sub(log_ratio(r, u, log1p)).sum() + torch.dot((lam_p * d).reshape(-1), d.reshape(-1))
            ctx.save_for_backward(d, var, lam_p)
        elif kind == "reverse_kl":
            r = torch.mul(lam_p, var).reciprocal_()
            w = r - 1.0
            val = w.sub(log_ratio(r, w, log1p)).sum() + torch.dot((d / var).reshape(-1), d.reshape(-1))
            ctx.save_for_backward(d, var, lam_p)
        else:
            r = torch.mul(lam_p, var)
            u = r - 1.0
            # domain: 1 + a > 0 with a = (1 - alpha) u, i.e. u < 1/(alpha - 1) (alpha > 1) or u > -1/(1 - alpha)
            extreme = float(u.max()) if alpha > 1.0 else float(u.min())
            if not (1.0 + (1.0 - alpha) * extreme > 0.0):
                a_all = (1.0 - alpha) * u
                raise DivergenceUndefinedError.alpha_renyi(alpha, int((~(a_all > -1.0)).sum()), u.numel(), name)
            a = u * (1.0 - alpha)
            # the mean term's precision lambda_p / (1 + a) = lambda_q lambda_p / lambda_a, formed before d enters (as
            # common.divergences does): lambda_p d^2 first overflowed float32 at lambda_p ~1e20, d ~1e10 where the
            # term is ~1e20.  (lam_pa d) d overflows only where the term itself does (|d| <= 1: lam_pa |d| <= lam_pa)
            lam_pa = torch.reciprocal(a + 1.0).mul_(lam_p)
            log_term = log1p(a).sub_(log_ratio(r, u, log1p), alpha=1.0 - alpha).sum() / (alpha * (alpha - 1.0))
            val = torch.dot((lam_pa * d).reshape(-1), d.reshape(-1)) - log_term
            ctx.save_for_backward(d, var, lam_pa)
        ctx.kind, ctx.alpha, ctx.c = kind, alpha, c
        return val * c

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def,override]
        g = grad * ctx.c
        kind, alpha = ctx.kind, ctx.alpha
        if kind == "kl":
            d, var, lam_p = ctx.saved_tensors
            g_mean = (lam_p * d).mul_(2.0 * g)
            g_var = torch.reciprocal(var).neg_().add_(lam_p).mul_(g)
        elif kind == "reverse_kl":
            d, var, lam_p = ctx.saved_tensors
            inv_v = torch.reciprocal(var)
            d_v = d * inv_v  # d / v before the second d (as the compiled kernel): d * d first overflows at |d| ~ 2e19
            g_mean = d_v.mul(2.0 * g)
            g_var = (1.0 - inv_v / lam_p - d_v * d).mul_(inv_v).mul_(g)
        else:
            d, var, lam_pa = ctx.saved_tensors
            t = lam_pa * d  # lambda_p d / (1 + a), without the overflow of lambda_p d
            g_mean = (2.0 * g) * t
            g_var = (t * t).mul_(-(1.0 - alpha))
            g_var.add_(lam_pa - torch.reciprocal(var), alpha=1.0 / alpha).mul_(g)
        return g_mean, g_var, None, None, None, None, None, None


def _scale_groups(q: VariationalGaussian, lr_scale: float) -> list[tuple[list[Tensor], float]]:
    """Adam's groups of the scale parameters.  Adam moves every entry by about its learning rate whatever its
    gradient's size, so the ``d (d - 1) / 2`` free off-diagonal entries of a full-covariance Cholesky factor ``L``
    take ``lr_scale / sqrt(d)``: a row of ``L`` (a coordinate's standard deviation, ``||L_i||``) then moves by at most
    about ``2 lr_scale`` per step, like a mean-field scale, instead of ``lr_scale sqrt(i)`` (a review: at d = 650,
    logistic regression on digits, the first step changed L by ~4.6 in Frobenius norm, no epoch from round 2 on
    improved on the start, and every update was zero)."""
    if isinstance(q, FullCovarianceVariational) and q.d > 1:
        return [([q.raw_diag], lr_scale), ([q.lower], lr_scale / math.sqrt(q.d))]
    return [(q.scale_parameters(), lr_scale)]


def _finite_float(expected: Tensor, div: Tensor, where: str) -> float:
    e, d = float(expected), float(div)
    if not math.isfinite(e) or not math.isfinite(d):
        raise NonFiniteError(
            f"local_gvi: non-finite objective at {where} (expected loss {e}, divergence {d}); "
            "check the data, the learning rates and the loss hyperparameters"
        )
    return e + d


def _select_path(obj: _Objective, q: VariationalGaussian, config: LocalGVIConfig) -> str:
    # (a model that is not a LikelihoodModel is asked, as before the flag existed)
    if config.closed_form and hasattr(obj.loss, "quadratic") and getattr(obj.model, "has_quadratic_losses", True):
        # formed from the data in float64 and kept there (QuadraticLoss.expectation evaluates in float64 and returns
        # the mean's dtype): in float32 the sums of y and y^2 behind its shift and constant round at the scale of
        # the whole data set, which its terms then cancel down from
        f64 = torch.float64
        quad = obj.loss.quadratic(obj.model, None if obj.x is None else obj.x.to(f64), obj.y.to(f64),
                                  {k: v.to(f64) for k, v in obj.reference_theta.items()})
        if quad is not None:
            obj.quadratic = quad
            return "closed_form"
    if config.quadrature_points > 0:
        dim = q.flat_dim()
        if dim > MAX_QUADRATURE_DIM:
            raise ValueError(
                f"LocalGVIConfig.quadrature_points: quadrature needs at most {MAX_QUADRATURE_DIM} scalar "
                f"parameters, this model has {dim}; use quadrature_points=0 (Monte Carlo)"
            )
        obj.quad = _gauss_hermite(config.quadrature_points, dim, obj.dtype)
        return "quadrature"
    if config.local_reparam and isinstance(q, MeanFieldVariational) and hasattr(obj.model, "output_local_reparam"):
        return "mc_local_reparam"
    if config.local_reparam and isinstance(q, FullCovarianceVariational) \
            and hasattr(obj.model, "output_local_reparam_full"):
        return "mc_local_reparam_full"
    return "mc_weights"


# ==================================================================================================
def local_gvi(
    model: Any,
    loss: Any,
    divergence: Any,
    cavity: GaussianFactor,
    x: Tensor | None,
    y: Tensor,
    init: GaussianFactor | None = None,
    config: LocalGVIConfig | None = None,
) -> LocalGVIResult:
    """Minimise ``E_q[sum_i loss(y_i; theta, x_i)] + divergence(q || cavity)`` over the cavity's family.

    Args:
        model: a likelihood model (``output(theta, x)``; optionally ``output_local_reparam``).
        loss: a loss (``loss(out, y, reference=None) -> (S, B)``; optionally ``quadratic`` and
            ``needs_reference``).
        divergence: ``divergence(q, p) -> scalar tensor``.
        cavity: the local prior ``q^{\\m}`` (must be proper).
        x, y: the client's data, ``n`` examples along dimension 0.
        init: the starting distribution when ``config.init == "posterior"`` (the current server posterior);
            ignored for ``"cavity"``.
        config: :class:`LocalGVIConfig` (defaults if ``None``).

    Raises:
        ImproperDistributionError: the cavity or ``init`` is improper, or the result is.
        NonFiniteError: non-finite data, objective or parameters.
        DivergenceUndefinedError: the divergence has no finite value at a visited state (Alpha-Renyi).
    """
    t0 = time.perf_counter()
    config = config or LocalGVIConfig()
    cavity.check_finite("cavity")
    cavity.check_proper("cavity")
    if config.init == "posterior":
        if init is None:
            raise ValueError('local_gvi: init="posterior" needs the initial distribution (argument init)')
        _check_layouts(model, cavity, init)
        init.check_proper("initial local posterior")
        start = init
    else:
        _check_layouts(model, cavity, None)
        start = cavity
    if x is None:  # models that ignore x (gaussian_location): a (n, 0) placeholder
        x = torch.zeros((int(y.shape[0]), 0), dtype=y.dtype if torch.is_floating_point(y) else cavity.dtype)
    if x.shape[0] == 0:
        raise ValueError("local_gvi: the client has no data (x is empty)")
    if y is not None and y.shape[0] != x.shape[0]:
        raise ValueError(f"local_gvi: x has {x.shape[0]} examples but y has {y.shape[0]}")
    _check_finite_input(x, "input x")
    _check_finite_input(y, "input y")

    dtype = config.dtype or cavity.dtype
    q = variational_for(start.to(dtype) if start.dtype != dtype else start, min_scale=config.min_scale, dtype=dtype)
    obj = _Objective(model, loss, divergence, cavity, x, y, config, dtype)
    obj.path = _select_path(obj, q, config)
    n = obj.n
    bsz = n if (config.batch_size is None or obj.path == "closed_form") else min(config.batch_size, n)

    lr_scale = config.lr if config.lr_scale is None else config.lr_scale
    # torch's fused Adam kernel, one call per group, without torch.optim's import of torch._dynamo (common/adam.py)
    optimiser = Adam([(q.loc_parameters(), config.lr), *_scale_groups(q, lr_scale)])
    gen = torch.Generator().manual_seed(int(config.seed))

    # the one-hidden-layer BNN's step without autograd where it applies (bit-identical: common/explicit_step.py)
    # Alpha-Renyi with alpha > 1 or < 0: a step that leaves the (shrunk) domain is cut short (common/domain_guard.py)
    guard = domain_guard(divergence, cavity, q, optimiser.step_bound(q.scale_parameters()))
    domain_cuts = 0
    explicit = (OneHiddenLayerStep.create(model, loss, q, obj.fast_divergence, obj.x, obj.y, config.n_samples,
                                          optimiser) if obj.path == "mc_local_reparam" else None)
    running_mode = config.objective_estimate == "running"
    # "running": no extra pass over the data.  An epoch's value is the mean of the objectives its steps measured,
    # each before its update, so the state it is credited to is the one before the epoch's last step (with one
    # step an epoch, exactly the state that value was measured at; the end-of-epoch state is only measured by
    # the next epoch).  The initial state is thus a candidate with one step an epoch.
    initial = float("nan") if running_mode else obj.evaluate(q)
    best_value, best_state, best_epoch = (math.inf if running_mode else initial), q.snapshot(), 0
    ref_value, wait = best_value, 0
    trace: list[float] = []
    epochs_run = 0
    stopped = ""
    try:
        for epoch in range(1, config.epochs + 1):
            epochs_run = epoch
            running: list[float] = []
            if obj.path == "closed_form" or bsz >= n:
                batches: list[Tensor | slice] = [slice(0, n)]
            else:
                perm = torch.randperm(n, generator=gen)
                batches = [perm[s:s + bsz] for s in range(0, n, bsz)]
            last_step = len(batches) - 1
            for step, idx in enumerate(batches):
                if running_mode and step == last_step:
                    measured_state = q.snapshot()
                if guard is not None:
                    guard.remember(q)
                if explicit is not None:  # the whole step, the optimiser's update included
                    explicit(idx, gen, lambda e, d: running.append(_finite_float(e, d, f"epoch {epoch}, step {step}")))
                else:
                    optimiser.zero_grad()
                    moments = obj.moments(q)
                    if obj.path == "closed_form":
                        expected = obj.full_expected_loss(q, None)
                    else:
                        xb, yb = _rows(obj.x, idx), _rows(obj.y, idx)
                        expected = obj.batch_expected_loss(q, xb, yb, gen, moments=moments) * (n / int(xb.shape[0]))
                    div = obj.divergence_term(q, moments)
                    value = _finite_float(expected.detach(), div.detach(), f"epoch {epoch}, step {step}")
                    running.append(value)
                    (expected + div).backward()
                    optimiser.step()
                if guard is not None and guard.cut(q):
                    domain_cuts += 1
            for p in q.parameters():
                if not all_finite(p):
                    raise NonFiniteError(f"local_gvi: non-finite variational parameters after epoch {epoch}")
            value = obj.evaluate(q) if config.objective_estimate == "end_of_epoch" else float(np.mean(running))
            trace.append(value)
            if value < best_value:
                best_value, best_state = value, (measured_state if running_mode else q.snapshot())
                best_epoch = epoch - 1 if (running_mode and last_step == 0) else epoch
            if value < ref_value - config.min_delta:
                ref_value, wait = value, 0
            else:
                wait += 1
                if config.patience is not None and wait >= config.patience:
                    break
    except ImproperDistributionError as err:
        # the cavity and the start were checked above: the state a step reached has a valid parameterisation (a
        # full-covariance Cholesky factor) whose precision rounds to an indefinite matrix (condition number ~1e17
        # after too large a step); it is no candidate, and the best state so far is returned, as for a bad epoch
        stopped = f"epoch {epochs_run}: {err}"
        if math.isinf(best_value) and running:  # "running", stopped in epoch 1: its first value is the start's
            best_value = running[0]
    q.restore(best_state)
    final_value = best_value

    polished = False
    if config.polish and obj.deterministic:
        polished_value = _polish(q, obj, config)
        if polished_value is not None and polished_value < final_value:
            final_value, polished = polished_value, True
        else:
            q.restore(best_state)

    posterior = _to_factor(q, cavity.dtype)
    posterior.check_finite("local posterior")
    posterior.check_proper("local posterior")
    return LocalGVIResult(
        posterior=posterior,
        objective_trace=trace,
        epochs_run=epochs_run,
        best_epoch=best_epoch,
        wall_time_s=time.perf_counter() - t0,
        n_examples=n,
        initial_objective=initial,
        final_objective=final_value,
        path=obj.path,
        polished=polished,
        domain_cuts=domain_cuts,
        stopped_unrepresentable=stopped,
    )


def gvi_objective(
    model: Any,
    loss: Any,
    divergence: Any,
    cavity: GaussianFactor,
    x: Tensor | None,
    y: Tensor,
    q: GaussianFactor,
    config: LocalGVIConfig | None = None,
) -> float:
    """The local GVI objective ``E_q[sum_i L_i] + D(q || cavity)`` at ``q``, evaluated exactly as
    :func:`local_gvi` evaluates it after each epoch (same path, same common random numbers for Monte Carlo)."""
    config = config or LocalGVIConfig()
    cavity.check_proper("cavity")
    q.check_proper("q")
    if int(y.shape[0]) == 0 or (x is not None and x.shape[0] == 0):
        raise ValueError("gvi_objective: no data (x and y are empty)")
    if x is None:
        x = torch.zeros((int(y.shape[0]), 0), dtype=y.dtype if torch.is_floating_point(y) else cavity.dtype)
    dtype = config.dtype or cavity.dtype
    qv = variational_for(q.to(dtype) if q.dtype != dtype else q, min_scale=config.min_scale, dtype=dtype)
    obj = _Objective(model, loss, divergence, cavity, x, y, config, dtype)
    obj.path = _select_path(obj, qv, config)
    return obj.evaluate(qv)


def _polish(q: VariationalGaussian, obj: _Objective, config: LocalGVIConfig) -> float | None:
    """L-BFGS on a deterministic objective from ``q``'s state; returns the new objective or ``None``."""
    lbfgs = torch.optim.LBFGS(
        list(q.parameters()), lr=1.0, max_iter=config.polish_max_iter, history_size=50,
        tolerance_grad=config.polish_tolerance_grad, tolerance_change=1e-16, line_search_fn="strong_wolfe",
    )

    outside: list[float] = []  # the objective at the start: a trial outside the domain is scored above it

    def closure() -> Tensor:
        lbfgs.zero_grad(set_to_none=True)
        try:
            value = obj.full_expected_loss(q, None) + obj.divergence_term(q)
        except DivergenceUndefinedError:
            # a line-search trial left the divergence's domain (Alpha-Renyi near its bound): scored as a finite value
            # above the start's with a zero gradient, so that the strong-Wolfe search brackets and shrinks the step
            # instead of abandoning the polish (which returned Adam's unfinished state: 9e-4 off the minimiser at
            # alpha -100 after 555 domain cuts)
            if not outside:
                raise
            for p in q.parameters():
                p.grad = torch.zeros_like(p)
            return torch.tensor(outside[0] + 1.0 + abs(outside[0]), dtype=torch.float64)
        if not bool(torch.isfinite(value)):
            raise NonFiniteError("non-finite objective in the L-BFGS polish")
        value.backward()
        if not outside:
            outside.append(float(value.detach()))
        return value

    try:
        lbfgs.step(closure)
        if not all(all_finite(p) for p in q.parameters()):
            return None
        return obj.evaluate(q)
    except (PGVIError, ImproperDistributionError):
        # a trial point of the line search left the domain (e.g. Alpha-Renyi undefined): keep Adam's state
        return None


def _to_factor(q: VariationalGaussian, dtype: torch.dtype) -> GaussianFactor:
    """Natural parameters computed in ``dtype`` from the optimised location and scale."""
    q_out = q if q.dtype == dtype else copy.deepcopy(q).to(dtype)
    with torch.no_grad():
        return q_out.distribution().detach()
