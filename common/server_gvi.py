"""The server's GVI step (FedGVI eq. 7): ``q_s = argmin_{q in Q} E_q[l_s] + D_s(q || prior)``.

``l_s = sum_m l_m`` is the global loss approximation; the server keeps it as the Gaussian factor
``global_site = exp(-l_s)`` with natural parameters ``eta_s``, so up to a constant

    E_q[l_s] = -<eta_s, E_q[T(theta)]>,   E_q[T] = (mu, Sigma + mu mu^T)    (closed form, no Monte Carlo).

* ``D_s = KL``: the minimiser is ``prior * exp(-l_s)`` = ``prior * global_site`` (natural parameters add),
  :func:`common.factors.kl_server_step`.
* ``D_s = (1/w) KL``: multiplying the objective by ``w`` gives ``E_q[w l_s] + KL``, so the minimiser is
  ``prior * exp(-w l_s)`` = ``prior * global_site**w``.
* any other ``D_s`` (Alpha-Renyi, reverse KL, Fisher-Rao): the objective is minimised numerically over the
  family of the prior, in float64, through the unconstrained parameterisation of :mod:`common.variational`,
  starting from the KL solution (or from the prior if that is improper or outside the divergence's
  domain): optional Adam steps, then L-BFGS with a strong-Wolfe line search.  A divergence that becomes
  undefined at a visited point raises its typed error
  (:class:`~common.errors.DivergenceUndefinedError`), never a NaN.

Tolerance of the numerical path: L-BFGS runs until the largest absolute entry of the gradient of the
objective with respect to the unconstrained parameters (locations, raw scales / Cholesky entries) is below
``tolerance_grad`` (default ``1e-9``) or the objective changes by less than ``tolerance_change`` (default
``1e-13``) between iterations, for at most ``max_rounds`` restarts of ``max_iter`` iterations.
If the gradient is then still above ``fail_grad`` (default ``1e-5``) a :class:`ServerOptimisationError` is
raised (a :class:`~common.errors.PGVIError`: :class:`~common.factors.PGVIServerState` rejects the update
batch and keeps its state).  In float64 the objective's rounding (~1e-15 relative) limits the reachable
gradient to about ``1e-7``-``1e-8``, i.e. natural parameters accurate to about ``1e-7`` relative; the
tests check the optimiser against the closed forms to ``1e-6``.  ``ServerGVIStep.last_info`` records
the L-BFGS rounds, the final gradient and objective.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from common.divergences import Divergence, WeightedKL, make_divergence
from common.errors import DivergenceUndefinedError, ImproperDistributionError, NonFiniteError, PGVIError
from common.factors import ServerStep, kl_server_step
from common.families import FullCovarianceGaussian, GaussianFactor, MeanFieldGaussian
from common.variational import (
    DEFAULT_MIN_SCALE,
    FullCovarianceVariational,
    MeanFieldVariational,
    VariationalGaussian,
    variational_for,
)

METHODS = ("auto", "optimise")


class ServerOptimisationError(PGVIError):
    """The numerical server step did not reach first-order optimality within its budget."""


def expected_site_loss(q: VariationalGaussian, global_site: GaussianFactor) -> Tensor:
    """``E_q[l_s] = -<eta_s, E_q[T]>`` from ``q``'s moments (differentiable, no Monte Carlo)."""
    if isinstance(q, MeanFieldVariational):
        assert isinstance(global_site, MeanFieldGaussian)
        mean, var = q.mean_variance()
        total = None
        for n in q.names:
            e1, e2 = global_site.params[f"eta1/{n}"], global_site.params[f"eta2/{n}"]
            m = mean[n]
            part = (e1 * m).sum() + (e2 * (m * m + var[n])).sum()
            total = part if total is None else total + part
        assert total is not None
        return -total
    assert isinstance(q, FullCovarianceVariational) and isinstance(global_site, FullCovarianceGaussian)
    m, cov = q.mean_covariance()
    second = cov + torch.outer(m, m)
    return -((global_site.eta1 * m).sum() + (global_site.eta2 * second).sum())


def server_objective(divergence: Divergence, prior: GaussianFactor, global_site: GaussianFactor,
                     q: VariationalGaussian) -> Tensor:
    """``E_q[l_s] + D_s(q || prior)`` (up to a constant), differentiable in ``q``'s parameters."""
    return expected_site_loss(q, global_site) + divergence(q.distribution(), prior)


class ServerGVIStep:
    """A :data:`~common.factors.ServerStep` for an arbitrary server divergence (see the module docstring)."""

    def __init__(
        self,
        divergence: Divergence,
        *,
        method: str = "auto",
        adam_steps: int = 0,
        adam_lr: float = 1e-2,
        max_iter: int = 500,
        max_rounds: int = 3,
        tolerance_grad: float = 1e-9,
        tolerance_change: float = 1e-13,
        fail_grad: float = 1e-5,
        min_scale: float = DEFAULT_MIN_SCALE,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"make_server_step: method must be one of {METHODS}, got {method!r}")
        for name, v, lo in (("adam_steps", adam_steps, 0), ("max_iter", max_iter, 1), ("max_rounds", max_rounds, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"make_server_step: {name} must be an integer >= {lo}, got {v!r}")
        for name, f in (("adam_lr", adam_lr), ("tolerance_grad", tolerance_grad), ("fail_grad", fail_grad)):
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0:
                raise ValueError(f"make_server_step: {name} must be a finite number > 0, got {f!r}")
        if fail_grad < tolerance_grad:
            raise ValueError(f"make_server_step: fail_grad ({fail_grad}) must be >= tolerance_grad ({tolerance_grad})")
        self.divergence = divergence
        self.method = method
        self.adam_steps, self.adam_lr = int(adam_steps), float(adam_lr)
        self.max_iter, self.max_rounds = int(max_iter), int(max_rounds)
        self.tolerance_grad, self.fail_grad = float(tolerance_grad), float(fail_grad)
        if isinstance(tolerance_change, bool) or not isinstance(tolerance_change, (int, float)) or not tolerance_change >= 0:
            raise ValueError(f"make_server_step: tolerance_change must be a number >= 0, got {tolerance_change!r}")
        self.tolerance_change = float(tolerance_change)
        self.n_evals = 0
        self.min_scale = float(min_scale)
        self.last_info: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"ServerGVIStep({self.divergence!r}, method={self.method!r})"

    @property
    def closed_form_power(self) -> float | None:
        """``w`` where this step is the closed form ``prior * global_site ** w`` (the weighted KL with
        ``method="auto"``), else ``None`` (solved by optimisation)."""
        if self.method == "auto" and isinstance(self.divergence, WeightedKL):
            return float(self.divergence.w)
        return None

    # ----------------------------------------------------------------------------------------------
    def __call__(self, prior: GaussianFactor, global_site: GaussianFactor) -> GaussianFactor:
        prior.check_proper("prior")
        global_site.check_finite("global site")
        w = self.closed_form_power
        if w is not None:
            self.last_info = {"path": "closed_form"}
            return prior * global_site ** w
        return self.optimise(prior, global_site)

    def optimise(self, prior: GaussianFactor, global_site: GaussianFactor) -> GaussianFactor:
        dtype = prior.dtype
        prior64, site64 = prior.to(torch.float64), global_site.to(torch.float64)
        start = prior64 * site64
        if not start.is_proper():
            start = prior64
        q = variational_for(start, min_scale=self.min_scale, dtype=torch.float64)
        params = list(q.parameters())

        def objective() -> Tensor:
            return server_objective(self.divergence, prior64, site64, q)

        try:
            with torch.no_grad():
                objective()
        except PGVIError:
            # the KL solution lies outside the divergence's domain (Alpha-Renyi with alpha > 1 and a q much
            # wider than the prior): start from the prior, where every divergence is 0
            q = variational_for(prior64, min_scale=self.min_scale, dtype=torch.float64)
            params = list(q.parameters())

        if self.adam_steps:
            adam = torch.optim.Adam(params, lr=self.adam_lr)
            for _ in range(self.adam_steps):
                adam.zero_grad(set_to_none=True)
                value = objective()
                if not bool(torch.isfinite(value)):
                    raise ServerOptimisationError(f"non-finite server objective ({float(value)}) in Adam")
                value.backward()
                adam.step()

        lbfgs = torch.optim.LBFGS(
            params, lr=1.0, max_iter=self.max_iter, history_size=50, tolerance_grad=self.tolerance_grad,
            tolerance_change=self.tolerance_change, line_search_fn="strong_wolfe",
        )

        def closure() -> Tensor:
            lbfgs.zero_grad(set_to_none=True)
            self.n_evals += 1
            value = objective()
            if not bool(torch.isfinite(value)):
                raise ServerOptimisationError(f"non-finite server objective ({float(value)}) in L-BFGS")
            value.backward()
            return value

        grad_max = float("inf")
        rounds = 0
        try:
            for rounds in range(1, self.max_rounds + 1):
                lbfgs.step(closure)
                grad_max = _grad_max(params, objective)
                if grad_max <= self.tolerance_grad:
                    break
        except DivergenceUndefinedError:
            raise
        except (ImproperDistributionError, NonFiniteError) as err:
            raise ServerOptimisationError(
                f"server GVI step ({self.divergence!r}) left the family of distributions ({err}); the server "
                "objective may be unbounded below (e.g. a global site with negative precision and a divergence "
                "that grows only logarithmically in the variance, such as Alpha-Renyi with alpha < 1)"
            ) from err
        self.last_info = {"path": "optimise", "lbfgs_rounds": rounds, "grad_max": grad_max,
                          "objective": float(objective().detach())}
        if not grad_max <= self.fail_grad:
            raise ServerOptimisationError(
                f"server GVI step ({self.divergence!r}) did not converge: max |gradient| {grad_max:.3g} > "
                f"{self.fail_grad:.3g} after {rounds} L-BFGS rounds of {self.max_iter} iterations"
            )
        with torch.no_grad():
            out = q.distribution().detach()
        return out.to(dtype).check_finite("server posterior").check_proper("server posterior")


def _grad_max(params: list[torch.nn.Parameter], objective: Any) -> float:
    for p in params:
        p.grad = None
    value = objective()
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return max(float(g.abs().max()) for g in grads if g is not None)


def make_server_step(divergence: str = "kl", *, method: str = "auto", **options: Any) -> ServerStep:
    """The server step (FedGVI eq. 7) for server divergence ``divergence``.

    ``method="auto"`` uses the closed forms for ``"kl"`` (:func:`~common.factors.kl_server_step`, returned
    as is) and ``"weighted_kl"`` and the numerical optimiser otherwise; ``method="optimise"`` forces the
    optimiser (used by the tests to check it against the closed forms).  Keyword arguments that are
    hyperparameters of the divergence (``alpha``, ``w``) go to :func:`~common.divergences.make_divergence`;
    ``adam_steps``, ``adam_lr``, ``max_iter``, ``max_rounds``, ``tolerance_grad``, ``fail_grad`` and
    ``min_scale`` configure the optimiser.
    """
    if method not in METHODS:
        raise ValueError(f"make_server_step: method must be one of {METHODS}, got {method!r}")
    optimiser_keys = {"adam_steps", "adam_lr", "max_iter", "max_rounds", "tolerance_grad", "tolerance_change",
                      "fail_grad", "min_scale"}
    opt = {k: v for k, v in options.items() if k in optimiser_keys}
    hyper = {k: v for k, v in options.items() if k not in optimiser_keys}
    div = make_divergence(divergence, **hyper)
    if divergence == "kl" and method == "auto":
        return kl_server_step
    return ServerGVIStep(div, method=method, **opt)
