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
  starting from the KL solution (or from the prior if that is improper, outside the divergence's domain or
  on its boundary to rounding, or the objective or its gradient is not finite there): optional Adam steps,
  then L-BFGS with a strong-Wolfe line search.  A divergence that becomes undefined at a visited point
  raises its typed error (:class:`~common.errors.DivergenceUndefinedError`), never a NaN.
* ``D_s`` = Fisher-Rao: the distance is a cone at ``q = prior`` (not differentiable there), so when the
  prior is the minimiser no gradient vanishes and L-BFGS cannot certify it.  The prior's subgradient
  optimality condition is tested first (:func:`fisher_rao_prior_dual_norm`); if it holds the prior is
  returned exactly, unless the optimiser started from the KL solution finds a lower objective (the
  objective is not convex; see :meth:`ServerGVIStep._prior_unless_beaten`).

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

from common.divergences import AlphaRenyi, Divergence, FisherRao, WeightedKL, make_divergence
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
    # <eta2, S> for a symmetric S sees only the symmetric part of eta2; an antisymmetric part contributes 0
    # exactly, not the rounding of a huge sum (a site's antisymmetric 1e12 made every later step fail)
    eta2 = global_site.eta2
    return -((global_site.eta1 * m).sum() + ((0.5 * eta2 + 0.5 * eta2.T) * second).sum())


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
        prior64, site64 = prior.to(torch.float64), _symmetric_part(global_site.to(torch.float64))
        if isinstance(self.divergence, FisherRao):
            dual = fisher_rao_prior_dual_norm(prior64, site64)
            if dual is not None and dual <= 1.0:
                return self._prior_unless_beaten(prior, prior64, site64, dual)
        q, _ = self._start(prior64, site64)
        self.last_info = self._minimise(prior64, site64, q, {"best": math.inf})
        with torch.no_grad():
            out = q.distribution().detach()
        return out.to(dtype).check_finite("server posterior").check_proper("server posterior")

    def _start(self, prior64: GaussianFactor, site64: GaussianFactor) -> tuple[VariationalGaussian, bool]:
        """The starting point of the optimiser and whether it is the prior.

        The KL solution ``prior * global_site``, unless that is improper, or the objective or its gradient there
        is undefined (outside the divergence's domain: Alpha-Renyi with alpha > 1 and a q much wider than the
        prior) or not finite, or (Alpha-Renyi with alpha > 1 or < 0) it lies on the boundary of the domain to
        rounding: a combined precision ``alpha Lambda_q + (1 - alpha) Lambda_p`` that is 0 but for rounding gives
        a finite objective whose gradient is ~1/rounding, from which L-BFGS cannot move.  Then the prior, where
        every divergence is 0 and every Alpha-Renyi combination is the prior's own precision.
        """
        start = prior64 * site64
        if start.is_proper():
            q = variational_for(start, min_scale=self.min_scale, dtype=torch.float64)
            if self._usable_start(q, prior64, site64):
                return q, False
        return variational_for(prior64, min_scale=self.min_scale, dtype=torch.float64), True

    def _usable_start(self, q: VariationalGaussian, prior64: GaussianFactor, site64: GaussianFactor) -> bool:
        try:
            value = server_objective(self.divergence, prior64, site64, q)
            grads = torch.autograd.grad(value, list(q.parameters()), allow_unused=True)
        except PGVIError:
            return False
        if not (bool(torch.isfinite(value)) and all(bool(torch.isfinite(g).all()) for g in grads if g is not None)):
            return False
        if isinstance(self.divergence, AlphaRenyi) and not 0.0 < self.divergence.alpha < 1.0:
            try:
                with torch.no_grad():
                    margin = alpha_renyi_margin(q.distribution(), prior64, self.divergence.alpha)
            except (PGVIError, RuntimeError, ValueError):  # a factorisation failing on extreme values
                return False
            if not margin > DOMAIN_MARGIN:
                return False
        return True

    def _prior_unless_beaten(self, prior: GaussianFactor, prior64: GaussianFactor, site64: GaussianFactor,
                             dual: float) -> GaussianFactor:
        """The Fisher-Rao step when the prior satisfies its first-order optimality condition (``dual <= 1``, see
        :func:`fisher_rao_prior_dual_norm`): the prior, exactly, unless the optimiser started from the KL solution
        finds a point with a lower objective.

        The condition makes the prior a local minimiser, not a global one: the objective is not convex (the
        distance grows only logarithmically while ``E_q[l_s]`` can fall linearly in the mean; with the prior
        N(0, 1) and a site (eta1, eta2) = (0.99, -0.01) the prior is a local minimum of objective 0.01 and
        N(46.6, 63.0) the global one, of objective -16.75).  So the optimiser still runs from the KL solution (if
        that is not the prior): a converged result with a lower objective wins; an unconverged run that saw a
        lower objective raises as before (the prior is then known not to be the minimiser); otherwise (the run
        was drawn to the prior's kink, where it cannot converge) the prior is returned.
        """
        stats = prior64.mean_parameters()
        prior_value = 0.0 - float(site64.inner(stats))  # E_prior[l_s]; D(prior || prior) = 0
        scale = float(sum((v * stats[k]).abs().sum() for k, v in site64.params.items()))
        tol = 1e-10 * (1.0 + scale)  # rounding of the objective, generously
        info: dict[str, Any] = {"path": "prior", "fisher_rao_dual_norm": dual, "objective": prior_value}
        if all(bool((v == 0).all()) for v in site64.params.values()):  # no site (the initial step): D alone
            self.last_info = info
            return prior.clone()
        q, at_prior = self._start(prior64, site64)
        if not at_prior:
            seen = {"best": math.inf}
            try:
                run = self._minimise(prior64, site64, q, seen)
            except ServerOptimisationError as err:
                if seen["best"] < prior_value - tol:
                    raise ServerOptimisationError(
                        f"{err}; the prior satisfies the first-order optimality condition of the Fisher-Rao step "
                        f"(dual norm {dual:.3g} <= 1) but is not its minimiser (objective {seen['best']:.6g} < "
                        f"{prior_value:.6g} was seen)"
                    ) from err
                info["explored"] = f"no better point: {err}"
            else:
                if run["objective"] < prior_value - tol:
                    self.last_info = {**run, "fisher_rao_dual_norm": dual, "prior_objective": prior_value}
                    with torch.no_grad():
                        out = q.distribution().detach()
                    return out.to(prior.dtype).check_finite("server posterior").check_proper("server posterior")
                info["explored"] = f"converged to objective {run['objective']:.6g}, not below the prior's"
        self.last_info = info
        return prior.clone()

    def _minimise(self, prior64: GaussianFactor, site64: GaussianFactor, q: VariationalGaussian,
                  seen: dict[str, float]) -> dict[str, Any]:
        """Optional Adam steps then L-BFGS on ``q`` in place; returns the run's info, raises
        :class:`ServerOptimisationError` if it does not converge.  ``seen["best"]`` is lowered to every finite
        objective value evaluated."""
        params = list(q.parameters())

        def objective() -> Tensor:
            return server_objective(self.divergence, prior64, site64, q)

        def record(value: Tensor) -> None:
            v = float(value.detach())
            if v < seen["best"]:
                seen["best"] = v

        if self.adam_steps:
            adam = torch.optim.Adam(params, lr=self.adam_lr)
            for _ in range(self.adam_steps):
                adam.zero_grad(set_to_none=True)
                value = objective()
                if not bool(torch.isfinite(value)):
                    raise ServerOptimisationError(f"non-finite server objective ({float(value)}) in Adam")
                record(value)
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
                raise ServerOptimisationError(f"non-finite server objective ({float(value.detach())}) in L-BFGS")
            record(value)
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
        info = {"path": "optimise", "lbfgs_rounds": rounds, "grad_max": grad_max,
                "objective": float(objective().detach())}
        self.last_info = info
        if not grad_max <= self.fail_grad:
            raise ServerOptimisationError(
                f"server GVI step ({self.divergence!r}) did not converge: max |gradient| {grad_max:.3g} > "
                f"{self.fail_grad:.3g} after {rounds} L-BFGS rounds of {self.max_iter} iterations"
            )
        return info


def _symmetric_part(site: GaussianFactor) -> GaussianFactor:
    """``site`` with a full-covariance ``eta2`` replaced by its symmetric part: the objective sees nothing else
    (:func:`expected_site_loss`), and so the KL starting point ``prior * site`` is the same either way."""
    if isinstance(site, FullCovarianceGaussian):
        e2 = site.eta2
        return FullCovarianceGaussian(site.eta1, 0.5 * e2 + 0.5 * e2.T, name=site.name)
    return site


def _grad_max(params: list[torch.nn.Parameter], objective: Any) -> float:
    for p in params:
        p.grad = None
    value = objective()
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return max(float(g.abs().max()) for g in grads if g is not None)


#: Relative margin of an Alpha-Renyi combined precision below which a start counts as on the domain's boundary.
DOMAIN_MARGIN = 1e-10


def alpha_renyi_margin(q: GaussianFactor, p: GaussianFactor, alpha: float) -> float:
    """How far ``q`` is inside the domain of ``D_AR^alpha(. || p)``, relative to rounding: the smallest eigenvalue
    of ``Lambda_a = alpha Lambda_q + (1 - alpha) Lambda_p`` in the metric of ``|alpha| Lambda_q + |1 - alpha|
    Lambda_p`` (per coordinate for mean-field: ``lambda_a / (|alpha| lambda_q + |1 - alpha| lambda_p)``).  In
    ``[-1, 1]``; ``<= 0`` outside the domain, ~1e-16 on its boundary to rounding.  ``q`` and ``p`` proper."""
    a, b = alpha, 1.0 - alpha
    if isinstance(q, MeanFieldGaussian):
        assert isinstance(p, MeanFieldGaussian)
        lq, lp = q.precision(), p.precision()
        return min(float(((a * lq[n] + b * lp[n]) / (abs(a) * lq[n] + abs(b) * lp[n])).min()) for n in q.names)
    assert isinstance(q, FullCovarianceGaussian) and isinstance(p, FullCovarianceGaussian)
    lq, lp = q.precision(), p.precision()
    lq, lp = 0.5 * (lq + lq.T), 0.5 * (lp + lp.T)
    chol = torch.linalg.cholesky(abs(a) * lq + abs(b) * lp)
    w = torch.linalg.solve_triangular(chol, a * lq + b * lp, upper=False)
    w = torch.linalg.solve_triangular(chol, w.T, upper=False)  # L^-1 Lambda_a L^-T (Lambda_a symmetric)
    return float(torch.linalg.eigvalsh(0.5 * (w + w.T)).min())


def fisher_rao_prior_dual_norm(prior: GaussianFactor, global_site: GaussianFactor) -> float | None:
    """The dual norm, in the Fisher metric at the prior, of the gradient of ``E_q[l_s]`` at ``q = prior``; the prior
    solves the Fisher-Rao server step (to first order) iff it is ``<= 1``.  ``None`` for full covariance with
    ``d > 1`` (no Fisher-Rao distance there).

    Derivation.  ``FR(q, p)`` is the geodesic distance of the Fisher metric ``G``; near ``p`` it is the norm
    ``FR(p + delta, p) = ||delta||_G + O(|delta|^2)``, a cone with apex ``p`` whose subdifferential there is the
    dual unit ball ``{g : ||g||_* = sqrt(g^T G^-1 g) <= 1}``.  So ``p`` minimises ``E_q[l_s] + FR(q, p)``
    locally iff ``0`` is in ``grad E_q[l_s](p) + {||g||_* <= 1}``, i.e. ``||grad E_q[l_s](p)||_* <= 1`` (a strict
    local minimum when ``< 1``: the objective grows at least ``(1 - ||grad||_*) ||delta||``).  The dual norm
    is intrinsic, so any coordinates do; in ``(m, s)`` (mean, standard deviation) of a univariate Gaussian
    ``G = diag(1/s^2, 2/s^2)``, and ``E_q[l_s] = -(e1 m + e2 (m^2 + s^2))`` has gradient
    ``(-(e1 + 2 e2 m), -2 e2 s)``, so ``||grad||_*^2 = s^2 (e1 + 2 e2 m)^2 + (s^2 / 2) (2 e2 s)^2``.  The
    mean-field distance (:class:`~common.divergences.FisherRao`) is the product-manifold one,
    ``sqrt(sum_i FR_i^2)``, whose metric is block-diagonal: the squared dual norm is the sum over coordinates
    (one condition for all of them; a sum of per-coordinate distances would give one per coordinate).
    """
    if isinstance(prior, MeanFieldGaussian):
        assert isinstance(global_site, MeanFieldGaussian)
        mean, var = prior.mean(), prior.variance()
        total = 0.0
        for n in prior.names:
            e1, e2 = global_site.params[f"eta1/{n}"], global_site.params[f"eta2/{n}"]
            total += float((var[n] * (e1 + 2.0 * e2 * mean[n]) ** 2 + 2.0 * (e2 * var[n]) ** 2).sum())
        return math.sqrt(total)
    if isinstance(prior, FullCovarianceGaussian) and prior.dim == 1:
        assert isinstance(global_site, FullCovarianceGaussian)
        m, v = prior.mean()[0], prior.covariance()[0, 0]
        e1, e2 = global_site.eta1[0], global_site.eta2[0, 0]
        return math.sqrt(float(v * (e1 + 2.0 * e2 * m) ** 2 + 2.0 * (e2 * v) ** 2))
    return None


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
