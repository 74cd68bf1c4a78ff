"""One PGVI client step (FedGVI Alg. 2), transport-free.

Given the server posterior and this client's site: form the cavity (eq. 3), solve the local GVI problem
(eq. 4) in closed form where it is conjugate, else with the torch optimiser, and return the damped
Delta (eq. 5) and the new site.  The Flower client (client/) is a thin wrapper around this.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from common.conjugate import conjugate_local_posterior, supports_conjugate
from common.errors import DivergenceUndefinedError
from common.factors import cavity, damped_delta
from common.families import FullCovarianceGaussian, GaussianFactor, MeanFieldGaussian
from common.local_gvi import local_gvi
from common.problem import Problem

_LOG = logging.getLogger(__name__)


@dataclass
class ClientStepResult:
    delta: GaussianFactor
    new_site: GaussianFactor
    local_posterior: GaussianFactor
    metrics: dict[str, float] = field(default_factory=dict)


def _initial_q(problem: Problem, posterior: GaussianFactor, cav: GaussianFactor, site: GaussianFactor) -> GaussianFactor:
    """Where the local optimiser starts.

    A BNN whose site is still uniform (its first visit) starts from a small-variance q around a seeded random mean
    shared by every client (``cfg.seed``), so that all clients break the hidden-unit symmetry the same way; otherwise
    the current posterior or the cavity, as configured.

    FedGVI's reference starts "at the current server q in later rounds"; a first visit after round 1 (a later client
    of a sequential round, a late joiner, a reset site) still starts from the random mean here, on purpose.  Starting
    it from the posterior was tried on 2026-11-27 (a review measured 115 local epochs instead of 300 in a digits
    sequential run, same final accuracy): in the non-IID Fashion-MNIST sequential run of docs/RESULTS.md section 2
    (10 clients, Dirichlet(0.3), 3 local epochs) it held the test accuracy at 0.35-0.36 (NLL about 10) for 8 rounds,
    against 0.60, 0.71, 0.71, 0.73 in rounds 1-4 with the random start: each client then only nudges the previous
    clients' posterior (lr 1e-3) instead of fitting its own shard.
    """
    site_is_uniform = all(bool((v == 0).all()) for v in site.params.values())
    if problem.cfg.model == "bnn" and site_is_uniform and isinstance(posterior, MeanFieldGaussian):
        gen = torch.Generator().manual_seed(problem.cfg.seed)
        mean = problem.model.init_mean(gen)  # type: ignore[attr-defined]
        var = {n: torch.full_like(m, 1e-3) for n, m in mean.items()}
        return MeanFieldGaussian.from_mean_variance(
            {n: m.to(problem.dtype) for n, m in mean.items()}, {n: v.to(problem.dtype) for n, v in var.items()}
        )
    return posterior if problem.local.init == "posterior" else cav


def _start_in_domain(problem: Problem, init: GaussianFactor, cav: GaussianFactor) -> bool:
    """Whether the local objective is finite at the start ``init``: ``D(init || cavity)`` is undefined for an
    Alpha-Renyi divergence with alpha > 1 where ``alpha eta_init + (1 - alpha) eta_cavity`` is not a proper
    natural parameter (a coordinate of the posterior's variance above ``alpha / (alpha - 1)`` times the cavity's,
    i.e. the client's site has precision below ``-(1 - 1/alpha)`` times the cavity's there)."""
    try:
        problem.divergence(init, cav)
    except DivergenceUndefinedError:
        return False
    return True


def _narrowed_start(problem: Problem, init: GaussianFactor, cav: GaussianFactor) -> GaussianFactor:
    """``init``'s mean with a spread the local divergence is defined at: per coordinate the smaller of ``init``'s
    and the cavity's variance (mean field), else the cavity's (co)variance.  With the cavity's precision
    ``Lambda_cav``, ``alpha Lambda_q + (1 - alpha) Lambda_cav`` is ``Lambda_cav`` itself, proper for every alpha; a
    narrower ``q`` stays proper for alpha > 1.  The mean is kept: a BNN's first visit keeps its seeded random mean
    (the cavity's, the prior's zeros, is the symmetric point that start exists to avoid), a later visit the
    posterior's."""
    if isinstance(init, MeanFieldGaussian) and isinstance(cav, MeanFieldGaussian):
        var_init, var_cav = init.variance(), cav.variance()
        narrower = MeanFieldGaussian.from_mean_variance(
            init.mean(), {k: torch.minimum(var_init[k], var_cav[k]) for k in var_init})
        if _start_in_domain(problem, narrower, cav):
            return narrower
        return MeanFieldGaussian.from_mean_variance(init.mean(), var_cav)
    assert isinstance(init, FullCovarianceGaussian) and isinstance(cav, FullCovarianceGaussian)
    eta2 = cav.params["eta2"]  # the cavity's precision exactly, not a round trip through its covariance
    return FullCovarianceGaussian(-2.0 * eta2 @ init.mean(), eta2, name=init.name)


def local_seed(seed: int, step: int, stream: int) -> int:
    """The local optimiser's seed for one client step: a separate stream for every (run seed, round, client).

    Clients of one round must not share their Monte Carlo draws and minibatch order (with one seed per round
    their estimation errors are correlated and do not average out in the server's sum of Deltas)."""
    mask = (1 << 64) - 1  # SeedSequence takes non-negative entropy
    return int(np.random.SeedSequence([seed & mask, step & mask, stream & mask]).generate_state(1)[0])


def client_step(
    problem: Problem,
    posterior: GaussianFactor,
    site: GaussianFactor,
    x: torch.Tensor,
    y: torch.Tensor,
    rho: float,
    step_seed: int = 0,
    stream: int = 0,
) -> ClientStepResult:
    """Cavity -> local GVI -> damped Delta.  Raises ImproperDistributionError on an improper cavity.

    The optimiser starts where :func:`_initial_q` says, unless the local divergence is undefined there (Alpha-Renyi
    with alpha > 1 and a start much wider than the cavity in some coordinate: a posterior over a site of negative
    precision, or a BNN's first-visit start of variance 1e-3 over a narrower cavity): then at its mean with the
    spread of :func:`_narrowed_start`, and the metrics say ``start-narrowed = 1`` (the step used to fail, and the
    client kept its old site until other clients moved the posterior).

    ``step_seed`` (the round) and ``stream`` (the client: its partition id) select the local optimiser's random
    stream, :func:`local_seed`."""
    t0 = time.perf_counter()
    if len(y) == 0:  # as local_gvi refuses it: the conjugate path returned a zero Delta for no data
        raise ValueError("client_step: the client has no data")
    cav = cavity(posterior, site)
    metrics: dict[str, float] = {"num-examples": float(len(y))}
    if problem.cfg.conjugate and supports_conjugate(problem.model, problem.loss, problem.divergence):
        q_m = conjugate_local_posterior(problem.model, problem.loss, problem.divergence, cav, x, y)
        metrics.update({"conjugate": 1.0, "epochs": 0.0})
    else:
        init = _initial_q(problem, posterior, cav, site)
        metrics["start-narrowed"] = 0.0
        if init is not cav and not _start_in_domain(problem, init, cav):
            # the local problem is the same and has a minimiser; only its start's spread changes, and the reply says so
            _LOG.warning("local start: D(q || cavity) is undefined at the configured start (%s); starting from its "
                         "mean with a spread the divergence is defined at", problem.cfg.divergence)
            init, metrics["start-narrowed"] = _narrowed_start(problem, init, cav), 1.0
        # the start point is always _initial_q's (init="posterior" makes local_gvi start at the given one): with
        # init=cavity local_gvi would start at the cavity, and a BNN's first visit lose its symmetry-breaking start
        local_cfg = replace(problem.local, seed=local_seed(problem.local.seed, step_seed, stream), init="posterior")
        res = local_gvi(problem.model, problem.loss, problem.divergence, cav, x, y, init, local_cfg)
        q_m = res.posterior
        if res.stopped_unrepresentable:
            _LOG.warning("local update stopped early at its best state: a step reached a q whose precision is not "
                         "positive definite in %s (lower lr / lr-scale): %s", problem.cfg.dtype,
                         res.stopped_unrepresentable)
        metrics.update(
            {
                "conjugate": 0.0,
                "epochs": float(res.epochs_run),
                # the returned state's (local_gvi's final_objective: the initial state and a kept polish count;
                # for the BNN's "running" estimate, the best epoch's running mean), not min(trace)
                "objective": float(res.final_objective),
                "best-epoch": float(res.best_epoch),
                "polished": float(res.polished),
                # steps that left the divergence's domain and were cut short (common/domain_guard.py)
                "domain-cuts": float(res.domain_cuts),
                "local-seconds": float(res.wall_time_s),
            }
        )
    delta = damped_delta(q_m, posterior, rho)
    metrics["seconds"] = time.perf_counter() - t0
    return ClientStepResult(delta=delta, new_site=site * delta, local_posterior=q_m, metrics=metrics)
