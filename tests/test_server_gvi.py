"""The server GVI step (FedGVI eq. 7) against its closed forms and first-order optimality.

* D_s = KL: the optimiser path (forced) equals the closed form ``prior * exp(-l_s)``.
* D_s = (1/w) KL: the optimiser path equals ``prior * exp(-w l_s)`` (Lemma B.1), and so does the closed form.
* D_s = Alpha-Renyi: the result satisfies first-order optimality (gradient of the objective ~ 0, computed
  here independently with the moment form of E_q[l_s] by quadrature-free autograd) and differs from KL.
* E_q[l_s] = -<eta_s, E_q T> is checked against Monte Carlo.
* Inside PGVIServerState, an update that makes the server problem undefined is rejected, never NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.divergences import make_divergence
from common.factors import PGVIServerState, UpdateRejected, kl_server_step
from common.families import FullCovarianceGaussian, MeanFieldGaussian
from common.server_gvi import ServerGVIStep, ServerOptimisationError, expected_site_loss, make_server_step, server_objective
from common.variational import variational_for

F64 = torch.float64


def _full_cov_problem(d: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=F64)
    site_precision = a @ a.T + 0.5 * torch.eye(d, dtype=F64)
    prior = FullCovarianceGaussian.from_mean_covariance(torch.zeros(d, dtype=F64), 2.0 * torch.eye(d, dtype=F64))
    site = FullCovarianceGaussian(torch.randn(d, generator=g, dtype=F64), -0.5 * site_precision)
    return prior, site


def _mean_field_problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (6, 4), "b": (4,)}
    prior = MeanFieldGaussian.isotropic(shapes, 0.0, 1.0)
    site = MeanFieldGaussian({k: torch.randn(s, generator=g, dtype=F64) for k, s in shapes.items()},
                             {k: -3.0 * torch.rand(s, generator=g, dtype=F64) - 0.1 for k, s in shapes.items()})
    return prior, site


def test_kl_auto_is_the_closed_form_function():
    assert make_server_step("kl") is kl_server_step


@pytest.mark.parametrize("family", ["full", "mean_field"])
def test_kl_optimiser_path_matches_closed_form(family):
    prior, site = _full_cov_problem() if family == "full" else _mean_field_problem()
    step = make_server_step("kl", method="optimise")
    assert isinstance(step, ServerGVIStep)
    q = step(prior, site)
    closed = kl_server_step(prior, site)
    assert q.max_abs_diff(closed) < 1e-6


@pytest.mark.parametrize("family", ["full", "mean_field"])
@pytest.mark.parametrize("w", [0.3, 2.0])
def test_weighted_kl_solution_is_tempered_product(family, w):
    prior, site = _full_cov_problem(seed=1) if family == "full" else _mean_field_problem(seed=1)
    expected = prior * site**w  # pi * exp(-w l_s)
    optimised = make_server_step("weighted_kl", method="optimise", w=w)(prior, site)
    assert optimised.max_abs_diff(expected) < 1e-6 * max(1.0, max(float(v.abs().max()) for v in expected.params.values()))
    assert make_server_step("weighted_kl", w=w)(prior, site).max_abs_diff(expected) < 1e-12


def test_expected_site_loss_matches_monte_carlo():
    prior, site = _full_cov_problem(seed=2)
    q = FullCovarianceGaussian.from_mean_covariance(torch.tensor([0.3, -0.2, 0.1], dtype=F64),
                                                    torch.tensor([[0.5, 0.1, 0.0], [0.1, 0.4, 0.05], [0.0, 0.05, 0.3]], dtype=F64))
    closed = float(expected_site_loss(variational_for(q), site))
    theta = q.rsample(200_000, generator=torch.Generator().manual_seed(0))["theta"]
    # l_s(theta) = -<eta_s, T(theta)> = -(eta1 . theta + theta^T eta2 theta)
    vals = -(theta @ site.eta1 + torch.einsum("ni,ij,nj->n", theta, site.eta2, theta))
    se = float(vals.std()) / math.sqrt(len(vals))
    assert abs(float(vals.mean()) - closed) < 5 * se


@pytest.mark.parametrize("family", ["full", "mean_field"])
@pytest.mark.parametrize("alpha", [0.5, 2.5])
def test_alpha_renyi_first_order_optimality_and_differs_from_kl(family, alpha):
    prior, site = _full_cov_problem(seed=3) if family == "full" else _mean_field_problem(seed=3)
    step = make_server_step("alpha_renyi", alpha=alpha)
    q = step(prior, site)
    assert q.is_proper()
    # first-order optimality at the returned point, re-parameterised from scratch
    div = make_divergence("alpha_renyi", alpha=alpha)
    v = variational_for(q)
    value = server_objective(div, prior, site, v)
    grads = torch.autograd.grad(value, list(v.parameters()), allow_unused=True)
    gmax = max(float(g.abs().max()) for g in grads if g is not None)
    assert gmax < 1e-5
    # a local minimum: small random perturbations do not lower the objective
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        base = float(value)
        for _ in range(5):
            for p in v.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            assert float(server_objective(div, prior, site, v)) > base - 1e-9
            v = variational_for(q)
    # and it is not the KL solution
    assert q.max_abs_diff(kl_server_step(prior, site)) > 1e-2


def test_alpha_renyi_is_the_kl_solution_in_the_limit():
    # alpha -> 1 gives KL: the AR server solution approaches prior * site
    prior, site = _full_cov_problem(seed=4)
    closed = kl_server_step(prior, site)
    d_far = make_server_step("alpha_renyi", alpha=1.5)(prior, site).max_abs_diff(closed)
    d_near = make_server_step("alpha_renyi", alpha=1.001)(prior, site).max_abs_diff(closed)
    assert d_near < 0.01 * d_far


def test_undefined_server_problem_is_rejected_not_nan():
    # a site with negative precision: for alpha in (0, 1) the server objective is unbounded below
    # (E_q[l_s] -> -inf as the variance grows, D_AR grows only logarithmically): a typed error, and the
    # server state keeps its previous posterior
    prior = MeanFieldGaussian.isotropic({"theta": (2,)}, 0.0, 1.0)
    step = make_server_step("alpha_renyi", alpha=0.5)
    state = PGVIServerState(prior=prior, server_step=step)
    before = state.posterior.clone()
    delta = MeanFieldGaussian({"theta": torch.zeros(2, dtype=F64)}, {"theta": torch.full((2,), 0.3, dtype=F64)})
    with pytest.raises(UpdateRejected):
        state.apply({"c0": delta})
    assert state.version == 0 and state.posterior.max_abs_diff(before) == 0.0
    with pytest.raises(ServerOptimisationError, match="unbounded"):
        step(prior, delta)


@pytest.mark.parametrize("kwargs", [{"method": "newton"}, {"max_iter": 0}, {"tolerance_grad": 0.0},
                                    {"fail_grad": 1e-12}, {"alpha": 1.0}, {"bogus": 1}])
def test_make_server_step_rejects_bad_options(kwargs):
    name = "alpha_renyi"
    kwargs = {"alpha": 2.0, **kwargs}
    with pytest.raises(ValueError):
        make_server_step(name, **kwargs)
