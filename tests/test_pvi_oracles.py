"""PGVI / PVI against exact oracles on conjugate models, plus damping, the cavity ablation, robustness and
typed errors.

The oracles are computed here by hand from all the data at once, independently of the library's quadratic
forms:

* Bayes for the Gaussian location model ``y ~ N(theta, sigma^2 I)`` and linear regression
  ``y ~ N([x, 1]^T theta, sigma^2)``: ``Lambda = Lambda_0 + sum A^T A / sigma^2``,
  ``eta1 = eta1_0 + sum A^T y / sigma^2``.
* The SM-Bayes / GBI posterior of FedGVI Prop. 4.9 with constant score-matching weight ``beta_w`` and
  ``D = (1/w) KL``: ``Lambda = Lambda_0 + w sum 2 beta_w^2 A^T A / sigma^4``,
  ``eta1 = eta1_0 + w sum 2 beta_w^2 A^T y / sigma^4`` (the notes' per-point loss
  ``w^2 ||y - A theta||^2 / sigma^4 + const``).

A small in-process PVI loop (``common.factors``: cavity, damped_delta, PGVIServerState.apply) runs
synchronous (every client from the same posterior, Deltas applied together) and sequential (one client at
a time) schedules; the identity ``q = pi * prod_m t_m`` is checked after every server step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

from common.conjugate import ConjugacyError, conjugate_local_posterior, supports_conjugate
from common.divergences import fisher_rao_univariate, make_divergence
from common.errors import DivergenceUndefinedError, ImproperDistributionError
from common.factors import PGVIServerState, UpdateRejected, cavity, damped_delta
from common.families import FullCovarianceGaussian, GaussianFactor, MeanFieldGaussian
from common.local_gvi import LocalGVIConfig, local_gvi
from common.losses import make_loss
from common.models import make_model

F64 = torch.float64
TOL = 1e-6


# ==================================================================================================
# problems and hand-computed oracles
class Problem:
    def __init__(self, kind: str, M: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.sigma = 0.9
        sizes = [5 + (3 * m) % 7 for m in range(M)]  # unequal shards
        if kind == "location_1d":
            self.model = make_model("gaussian_location", dim=1, sigma=self.sigma)
            d = 1
        elif kind == "location_3d":
            self.model = make_model("gaussian_location", dim=3, sigma=self.sigma)
            d = 3
        else:
            self.model = make_model("linear_regression", in_features=2, sigma=self.sigma)
            d = 3
        self.shards = []
        self.designs = []  # A_b per point, (n, D, d)
        for n in sizes:
            if kind.startswith("location"):
                y = 0.7 + self.sigma * torch.randn(n, d, generator=g, dtype=F64)
                x = torch.zeros(n, 0, dtype=F64)
                a = torch.eye(d, dtype=F64).expand(n, d, d)
            else:
                x = torch.randn(n, 2, generator=g, dtype=F64)
                phi = torch.cat([x, torch.ones(n, 1, dtype=F64)], dim=1)
                y = (phi @ torch.tensor([0.5, -1.0, 0.3], dtype=F64) + self.sigma * torch.randn(n, generator=g, dtype=F64))
                y = y.unsqueeze(-1)
                a = phi.unsqueeze(1)
            self.shards.append((x, y))
            self.designs.append(a)
        cov = 0.3 * torch.ones(d, d, dtype=F64) + torch.diag(torch.linspace(1.0, 2.0, d, dtype=F64))
        self.prior = FullCovarianceGaussian.from_mean_covariance(torch.linspace(-0.2, 0.2, d, dtype=F64), cov)

    def site_oracle(self, m: int, scale: float) -> FullCovarianceGaussian:
        """exp(-scale * ||y - A theta||^2 / 2) for shard m: eta1 = scale sum A^T y, eta2 = -scale/2 sum A^T A."""
        a, (_, y) = self.designs[m], self.shards[m]
        p = torch.einsum("bik,bil->kl", a, a)
        h = torch.einsum("bik,bi->k", a, y)
        return FullCovarianceGaussian(scale * h, -0.5 * scale * p)

    def exact(self, scale: float) -> FullCovarianceGaussian:
        out = self.prior
        for m in range(len(self.shards)):
            out = out * self.site_oracle(m, scale)
        return out


def bayes_scale(sigma: float) -> float:
    return 1.0 / sigma**2


def sm_scale(sigma: float, beta_w: float, w: float) -> float:
    # w * 2 beta_w^2 / sigma^4 (per-point SM loss w_sm^2 ||y - A theta||^2 / sigma^4 = scale/2 ||.||^2)
    return w * 2.0 * beta_w**2 / sigma**4


def check_identity(state: PGVIServerState) -> None:
    """q = pi * prod t_m after every step, and l_s = sum_m l_m."""
    assert state.check_invariant() < 1e-9
    prod = state.prior
    for s in state.sites.values():
        prod = prod * s
    assert state.posterior.max_abs_diff(prod) < 1e-9


LocalStep = Callable[[GaussianFactor, torch.Tensor, torch.Tensor], GaussianFactor]


def run_pvi(prior: GaussianFactor, shards, local: LocalStep, schedule: str, rho: float, rounds: int,
            local_prior: str = "cavity", on_round=None) -> PGVIServerState:
    """In-process PVI.  ``local_prior`` selects what the client regularises towards (Thm 4.8 ablation)."""
    state = PGVIServerState(prior=prior)
    ids = [f"c{m}" for m in range(len(shards))]

    def client(cid: str, x, y, post: GaussianFactor) -> GaussianFactor:
        cav = cavity(post, state.site(cid))
        reg = {"cavity": cav, "posterior": post, "prior": prior}[local_prior]
        return damped_delta(local(reg, x, y), post, rho)

    for r in range(1, rounds + 1):
        if schedule == "synchronous":
            post = state.posterior
            state.apply({cid: client(cid, x, y, post) for cid, (x, y) in zip(ids, shards)})
            check_identity(state)
        else:
            for cid, (x, y) in zip(ids, shards):
                state.apply({cid: client(cid, x, y, state.posterior)})
                check_identity(state)
        if on_round is not None:
            on_round(r, state)
    return state


def conjugate_step(model, loss, div) -> LocalStep:
    return lambda reg, x, y: conjugate_local_posterior(model, loss, div, reg, x, y)


# ==================================================================================================
@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
@pytest.mark.parametrize("M", [1, 3, 10])
@pytest.mark.parametrize("kind", ["location_1d", "location_3d", "linear_regression"])
def test_pvi_nll_kl_reaches_exact_bayes(kind, M, schedule):
    pb = Problem(kind, M)
    exact = pb.exact(bayes_scale(pb.sigma))
    local = conjugate_step(pb.model, make_loss("nll"), make_divergence("kl"))
    posteriors = []
    state = run_pvi(pb.prior, pb.shards, local, schedule, rho=1.0, rounds=3,
                    on_round=lambda r, s: posteriors.append(s.posterior))
    for q in posteriors:  # exact after the first round and unchanged after
        assert q.max_abs_diff(exact) < TOL
    for m in range(M):  # each site is client m's likelihood
        assert state.sites[f"c{m}"].max_abs_diff(pb.site_oracle(m, bayes_scale(pb.sigma))) < TOL


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
@pytest.mark.parametrize("M", [1, 3, 10])
@pytest.mark.parametrize("kind", ["location_1d", "location_3d", "linear_regression"])
def test_pvi_score_matching_weighted_kl_reaches_sm_bayes(kind, M, schedule):
    pb = Problem(kind, M, seed=1)
    beta_w, w = 0.45, 0.6
    exact = pb.exact(sm_scale(pb.sigma, beta_w, w))
    local = conjugate_step(pb.model, make_loss("score_matching", weight="constant", beta_w=beta_w),
                           make_divergence("weighted_kl", w=w))
    posteriors = []
    run_pvi(pb.prior, pb.shards, local, schedule, rho=1.0, rounds=2,
            on_round=lambda r, s: posteriors.append(s.posterior))
    for q in posteriors:
        assert q.max_abs_diff(exact) < TOL
    # beta_w = sigma / sqrt(2) and w = 1 is exact Bayes (score matching == NLL for this model)
    assert math.isclose(sm_scale(pb.sigma, pb.sigma / math.sqrt(2), 1.0), bayes_scale(pb.sigma), rel_tol=1e-14)


@pytest.mark.parametrize("rho_kind", ["1/M", "0.3"])
@pytest.mark.parametrize("M", [3, 10])
def test_damped_synchronous_sites_follow_lemma_4_5(M, rho_kind):
    """After t synchronous rounds with damping rho each site is (1 - (1 - rho)^t) times its exact value."""
    pb = Problem("location_3d", M, seed=2)
    rho = 1.0 / M if rho_kind == "1/M" else 0.3
    s = bayes_scale(pb.sigma)
    local = conjugate_step(pb.model, make_loss("nll"), make_divergence("kl"))

    def check(t: int, state: PGVIServerState) -> None:
        factor = 1.0 - (1.0 - rho) ** t
        for m in range(M):
            assert state.sites[f"c{m}"].max_abs_diff(pb.site_oracle(m, s) ** factor) < TOL
        # and the server error decays geometrically at rate (1 - rho)
        err = pb.exact(s) / state.posterior
        ref = pb.exact(s) / pb.prior
        assert err.max_abs_diff(ref ** ((1.0 - rho) ** t)) < TOL

    run_pvi(pb.prior, pb.shards, local, "synchronous", rho=rho, rounds=6, on_round=check)


def test_cavity_is_necessary_thm_4_8():
    """rho = 1, M = 3: with the cavity the posterior is fixed after round 1; regularising to the current
    posterior double-counts the data; regularising to the prior makes round 2's posterior pi * prod L^(2-M),
    here improper, which the server rejects with a typed error."""
    M = 3
    pb = Problem("location_1d", M, seed=3)
    s = bayes_scale(pb.sigma)
    exact = pb.exact(s)
    lik = exact / pb.prior
    local = conjugate_step(pb.model, make_loss("nll"), make_divergence("kl"))

    state = run_pvi(pb.prior, pb.shards, local, "synchronous", 1.0, rounds=2, local_prior="cavity")
    assert state.posterior.max_abs_diff(exact) < TOL

    state = run_pvi(pb.prior, pb.shards, local, "synchronous", 1.0, rounds=2, local_prior="posterior")
    assert state.posterior.max_abs_diff(pb.prior * lik**2) < TOL  # overconfident

    with pytest.raises(UpdateRejected, match="improper"):
        run_pvi(pb.prior, pb.shards, local, "synchronous", 1.0, rounds=2, local_prior="prior")
    assert not (pb.prior * lik ** (2 - M)).is_proper()


# ==================================================================================================
# robustness: the empirical influence of one observation (FedGVI Fig. 4)
def _influence_setup():
    rng = np.random.default_rng(0)
    M, n_m = 7, 10
    data = [torch.tensor(rng.standard_t(4, size=(n_m, 1)), dtype=F64) for _ in range(M)]
    model = make_model("gaussian_location", dim=1, sigma=1.0)
    prior = FullCovarianceGaussian.from_mean_covariance(torch.zeros(1, dtype=F64), torch.eye(1, dtype=F64))
    return data, model, prior


def _fr(a: FullCovarianceGaussian, b: FullCovarianceGaussian) -> float:
    return float(fisher_rao_univariate(a.mean()[0], a.covariance()[0, 0].sqrt(), b.mean()[0], b.covariance()[0, 0].sqrt()))


def _server_posteriors(loss, zs, rounds: int):
    """Server posterior after ``rounds`` synchronous rounds (rho = 1) with one extra observation at client 0
    placed at each z.  Deterministic: conjugate for the NLL, Gauss-Hermite quadrature (20 nodes) + L-BFGS
    otherwise.  In round 1 the clients without the extra point do not depend on z (cached)."""
    data, model, prior = _influence_setup()
    kl = make_divergence("kl")
    cfg = LocalGVIConfig(init="cavity", epochs=2, lr=0.05, closed_form=False, quadrature_points=20)
    cache: dict = {}

    def local(cav, y, key):
        if key is not None and key in cache:
            return cache[key]
        if loss.name == "nll":
            q = conjugate_local_posterior(model, loss, kl, cav, None, y)
        else:
            q = local_gvi(model, loss, kl, cav, None, y, None, cfg).posterior
        if key is not None:
            cache[key] = q
        return q

    out = []
    for z in zs:
        shards = [torch.cat([data[0], torch.tensor([[z]], dtype=F64)]), *data[1:]]
        state = PGVIServerState(prior=prior)
        for r in range(rounds):
            post = state.posterior
            deltas = {}
            for m, y in enumerate(shards):
                cav = cavity(post, state.site(str(m)))
                key = ("round1", m) if (r == 0 and m > 0) else None
                deltas[str(m)] = damped_delta(local(cav, y, key), post, 1.0)
            state.apply(deltas)
            check_identity(state)
        out.append(state.posterior)
    return out


def test_influence_of_an_outlier_unbounded_for_nll_bounded_for_robust_losses():
    zs = [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]
    fr = {}
    for name, loss in [("nll", make_loss("nll")), ("beta", make_loss("beta", beta=1.5)),
                       ("gce", make_loss("gce", delta=0.3))]:
        posts = _server_posteriors(loss, zs, rounds=1)
        fr[name] = np.array([_fr(q, posts[0]) for q in posts[1:]])
    nll = fr["nll"]
    assert np.all(np.diff(nll) > 0) and nll[-1] > 1.0  # grows with z, roughly linearly
    assert nll[-1] > 5 * nll[0]
    for name in ("beta", "gce"):
        r = fr[name]
        assert r[-1] < 0.3 * nll[-1], (name, r)
        assert abs(r[-1] - r[3]) < 0.02 * nll[-1], (name, r)  # flat from z = 8 to z = 14
        assert r.max() < 0.3 * nll[-1]


def test_influence_bounded_after_a_second_round():
    # the second round's cavities carry the other clients' information; the bound persists
    loss = make_loss("beta", beta=1.5)
    base, far = _server_posteriors(loss, [0.0, 14.0], rounds=2)
    nll_base, nll_far = _server_posteriors(make_loss("nll"), [0.0, 14.0], rounds=2)
    assert _fr(far, base) < 0.3 * _fr(nll_far, nll_base)


# ==================================================================================================
# typed errors, never NaN and never a silent zero
def test_improper_cavity_is_a_typed_error():
    pb = Problem("location_1d", 1)
    post = pb.prior
    big_site = FullCovarianceGaussian(torch.zeros(1, dtype=F64), -0.5 * 10.0 * torch.eye(1, dtype=F64))
    with pytest.raises(ImproperDistributionError, match="cavity"):
        cavity(post, big_site)
    improper = post / big_site
    x, y = pb.shards[0]
    with pytest.raises(ImproperDistributionError, match="cavity"):
        conjugate_local_posterior(pb.model, make_loss("nll"), make_divergence("kl"), improper, x, y)
    with pytest.raises(ImproperDistributionError, match="cavity"):
        local_gvi(pb.model, make_loss("gce", delta=0.5), make_divergence("kl"), improper, x, y, post)


def test_improper_delta_is_rejected_and_state_unchanged():
    prior = MeanFieldGaussian.isotropic({"theta": (2,)}, 0.0, 1.0)
    state = PGVIServerState(prior=prior)
    good = MeanFieldGaussian({"theta": torch.tensor([0.1, 0.2], dtype=F64)}, {"theta": torch.tensor([-0.3, -0.1], dtype=F64)})
    state.apply({"a": good})
    before, version = state.posterior.clone(), state.version
    bad = MeanFieldGaussian({"theta": torch.zeros(2, dtype=F64)}, {"theta": torch.tensor([0.1, 5.0], dtype=F64)})
    with pytest.raises(UpdateRejected, match="improper"):
        state.apply({"b": bad})
    nan = MeanFieldGaussian({"theta": torch.tensor([float("nan"), 0.0], dtype=F64)}, {"theta": torch.zeros(2, dtype=F64)})
    with pytest.raises(UpdateRejected, match="non-finite"):
        state.apply({"b": nan})
    assert state.version == version and state.posterior.max_abs_diff(before) == 0.0
    assert "b" not in state.sites or state.sites["b"].max_abs_diff(prior.zeros_like()) == 0.0
    check_identity(state)


def test_alpha_renyi_improper_region_is_a_typed_error():
    pb = Problem("location_1d", 1)
    x, y = pb.shards[0]
    cav = pb.prior
    wide = FullCovarianceGaussian.from_mean_covariance(cav.mean(), 3.0 * cav.covariance())
    div = make_divergence("alpha_renyi", alpha=2.5)  # finite only for Sigma_q < 2.5/1.5 Sigma_p
    with pytest.raises(DivergenceUndefinedError):
        div(wide, cav)
    with pytest.raises(DivergenceUndefinedError):
        local_gvi(pb.model, make_loss("beta", beta=1.5), div, cav, x, y, wide,
                  LocalGVIConfig(closed_form=False, quadrature_points=4, epochs=2))


def test_conjugate_update_refuses_non_conjugate_combinations():
    pb = Problem("location_1d", 1)
    x, y = pb.shards[0]
    assert supports_conjugate(pb.model, make_loss("nll"), make_divergence("kl"))
    assert supports_conjugate(pb.model, make_loss("score_matching"), make_divergence("weighted_kl", w=2.0))
    for loss, div in [(make_loss("gce", delta=0.5), make_divergence("kl")),
                      (make_loss("nll"), make_divergence("alpha_renyi", alpha=2.0)),
                      (make_loss("beta", beta=1.5), make_divergence("weighted_kl", w=1.0))]:
        assert not supports_conjugate(pb.model, loss, div)
        with pytest.raises(ConjugacyError):
            conjugate_local_posterior(pb.model, loss, div, pb.prior, x, y)
    logistic = make_model("logistic_regression", in_features=2)
    assert not supports_conjugate(logistic, make_loss("nll"), make_divergence("kl"))
