"""Oracles for common.factors: cavity / damped Delta in natural parameters, the ledger invariant
posterior = prior * prod sites under random update sequences (checked against an independent numpy ledger),
atomic rejection of bad batches, and the log-opinion-pool identity of FedGVI Prop. 4.3."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from common.errors import ImproperDistributionError
from common.factors import (
    PGVIServerState,
    UpdateRejected,
    apply_deltas,
    cavity,
    check_damping,
    damped_delta,
    kl_server_step,
)
from common.families import FullCovarianceGaussian, GaussianFactor, MeanFieldGaussian
from tests.tensors import assert_close, gen

DT = torch.float64
SHAPES = {"w": (3, 2), "b": (4,)}


# ---------------------------------------------------------------------------------------------------
# builders
def random_mf(g: torch.Generator) -> MeanFieldGaussian:
    mean = {n: torch.randn(s, generator=g, dtype=DT) for n, s in SHAPES.items()}
    var = {n: 0.2 + 2.0 * torch.rand(s, generator=g, dtype=DT) for n, s in SHAPES.items()}
    return MeanFieldGaussian.from_mean_variance(mean, var)


def random_full(g: torch.Generator, d: int = 3) -> FullCovarianceGaussian:
    a = torch.randn(d, d, generator=g, dtype=DT)
    s = a @ a.T / d + 0.3 * torch.eye(d, dtype=DT)
    return FullCovarianceGaussian.from_mean_covariance(torch.randn(d, generator=g, dtype=DT), s)


def prior_of(family: str) -> GaussianFactor:
    if family == "mf":
        return MeanFieldGaussian.isotropic(SHAPES, mean=0.0, variance=2.0)
    return FullCovarianceGaussian.from_mean_covariance(torch.zeros(3, dtype=DT), 2.0 * torch.eye(3, dtype=DT))


def random_local(family: str, g: torch.Generator) -> GaussianFactor:
    return random_mf(g) if family == "mf" else random_full(g)


def snapshot(state: PGVIServerState) -> dict:
    return {
        "posterior": state.posterior.to_numpy(),
        "global_site": state.global_site.to_numpy(),
        "sites": {k: v.to_numpy() for k, v in state.sites.items()},
        "version": state.version,
    }


def assert_same_snapshot(a: dict, b: dict) -> None:
    assert a["version"] == b["version"]
    for key in ("posterior", "global_site"):
        assert a[key].keys() == b[key].keys()
        for k in a[key]:
            np.testing.assert_array_equal(a[key][k], b[key][k])
    assert a["sites"].keys() == b["sites"].keys()
    for cid in a["sites"]:
        for k in a["sites"][cid]:
            np.testing.assert_array_equal(a["sites"][cid][k], b["sites"][cid][k])


def one_d(precision: float, shift: float = 0.0) -> MeanFieldGaussian:
    """A 1-D mean-field factor with natural parameters (shift, -precision / 2)."""
    return MeanFieldGaussian({"x": torch.tensor([shift], dtype=DT)}, {"x": torch.tensor([-0.5 * precision], dtype=DT)})


# ===================================================================================================
# cavity and damped Delta
def test_cavity_is_quotient_and_raises_on_improper():
    g = gen(0)
    q, t = random_mf(g), random_mf(g) ** 0.1  # a weak site: q / t stays proper
    cav = cavity(q, t)
    for k in q.params:
        assert_close(cav.params[k], q.params[k] - t.params[k], rtol=0, atol=0)
    with pytest.raises(ImproperDistributionError) as ei:
        cavity(q, q * q)  # precision of q / q^2 = -precision(q) < 0
    assert ei.value.what == "cavity"
    with pytest.raises(ImproperDistributionError) as ei:
        cavity(q, q)  # zero precision: improper too
    assert ei.value.what == "cavity"
    # full covariance: a site with more precision than the posterior in one direction
    f = random_full(g)
    big = FullCovarianceGaussian(torch.zeros(3, dtype=DT), f.eta2 * 1.5)
    with pytest.raises(ImproperDistributionError, match="smallest eigenvalue"):
        cavity(f, big)


def test_cavity_refuses_an_improper_posterior_even_when_the_quotient_is_proper():
    """An improper q divided by a site of even lower precision is a proper cavity: it was accepted and the client
    computed its Delta against a q the server never holds (from a review)."""
    zero = {"theta": torch.zeros(2, dtype=DT)}
    q = MeanFieldGaussian(zero, {"theta": torch.tensor([-0.5, 0.5], dtype=DT)})  # precisions 1 and -1
    t = MeanFieldGaussian(zero, {"theta": torch.tensor([0.0, 1.25], dtype=DT)})  # q / t: precisions 1 and 1.5
    assert (q / t).improper_detail() is None
    with pytest.raises(ImproperDistributionError) as ei:
        cavity(q, t)
    assert ei.value.what == "posterior"


@pytest.mark.parametrize("rho", [1.0, 0.5, 1e-3, 1 / 7])
def test_damped_delta_is_scaled_natural_difference(rho):
    g = gen(1)
    q, qm = random_mf(g), random_mf(g)
    d = damped_delta(qm, q, rho)
    for k in q.params:
        assert_close(d.params[k], rho * (qm.params[k] - q.params[k]), rtol=1e-14, atol=1e-15)
    if rho == 1.0:  # undamped: the new posterior is the local posterior
        assert (q * d).max_abs_diff(qm) < 1e-12


@pytest.mark.parametrize("rho", [0.0, -0.1, 1.0 + 1e-9, 1.5, float("nan"), float("inf")])
def test_damped_delta_rejects_rho_outside_unit_interval(rho):
    g = gen(2)
    q, qm = random_mf(g), random_mf(g)
    with pytest.raises(ValueError, match="rho"):
        damped_delta(qm, q, rho)
    with pytest.raises(ValueError, match="rho"):
        check_damping(rho)


def test_damped_delta_rejects_improper_local_posterior():
    g = gen(3)
    q = random_mf(g)
    with pytest.raises(ImproperDistributionError) as ei:
        damped_delta(q.zeros_like(), q, 0.5)
    assert ei.value.what == "local posterior"


def test_apply_deltas_checks_result():
    g = gen(4)
    q = random_mf(g)
    d1, d2 = damped_delta(random_mf(g), q, 0.5), damped_delta(random_mf(g), q, 0.5)
    out = apply_deltas(q, [d1, d2])
    assert out.max_abs_diff(q * d1 * d2) < 1e-12
    with pytest.raises(ImproperDistributionError) as ei:
        apply_deltas(q, [q ** -2.0], what="server posterior")
    assert ei.value.what == "server posterior"


def test_server_state_rejects_improper_prior():
    with pytest.raises(ImproperDistributionError) as ei:
        PGVIServerState(prior=MeanFieldGaussian.uniform(SHAPES))
    assert ei.value.what == "prior"


def test_initial_state():
    prior = prior_of("mf")
    state = PGVIServerState(prior=prior)
    assert state.version == 0 and state.sites == {}
    assert state.global_site.max_abs_diff(prior.zeros_like()) == 0.0
    assert state.posterior.max_abs_diff(prior) == 0.0
    site = state.site("new")  # a client never heard from has the uniform site
    assert site.max_abs_diff(prior.zeros_like()) == 0.0


# ===================================================================================================
# the ledger invariant under random update sequences
@pytest.mark.parametrize("family", ["mf", "full"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_posterior_is_prior_times_sites_after_random_updates(family, seed):
    rng = random.Random(seed)
    g = gen(100 + seed)
    prior = prior_of(family)
    state = PGVIServerState(prior=prior)
    clients = [f"c{i}" for i in range(4)]
    # an independent ledger in numpy
    ref_sites = {c: {k: np.zeros_like(v) for k, v in prior.to_numpy().items()} for c in clients}
    n_apply = 0
    for _ in range(12):
        batch = rng.sample(clients, rng.randint(1, len(clients)))
        raw = [rng.uniform(0.05, 1.0) for _ in batch]
        total = sum(raw)
        rhos = [r / max(1.0, total) for r in raw]  # sum of rhos <= 1: a convex combination stays proper
        q = state.posterior
        deltas = {}
        for cid, rho in zip(batch, rhos):
            # a client step: q_m = cavity * (a proper 'likelihood' factor).  All sites then keep a PSD precision,
            # so every cavity and (with sum rho <= 1) every posterior stays proper.
            cav = cavity(q, state.site(cid))
            deltas[cid] = damped_delta(cav * random_local(family, g), q, rho)
        state.apply(deltas)
        n_apply += 1
        for cid, d in deltas.items():
            for k, v in d.to_numpy().items():
                ref_sites[cid][k] = ref_sites[cid][k] + v
        assert state.version == n_apply
        assert state.check_invariant() < 1e-10
        expected_post = {k: v + sum(ref_sites[c][k] for c in clients) for k, v in prior.to_numpy().items()}
        for k, v in state.posterior.to_numpy().items():
            np.testing.assert_allclose(v, expected_post[k], rtol=1e-10, atol=1e-10)
        assert state.posterior.max_abs_diff(prior * state.global_site) < 1e-12
        for cid in batch:
            for k, v in state.sites[cid].to_numpy().items():
                np.testing.assert_allclose(v, ref_sites[cid][k], rtol=1e-10, atol=1e-12)
        assert state.posterior.is_proper()


def test_check_invariant_detects_a_corrupted_ledger():
    g = gen(5)
    state = PGVIServerState(prior=prior_of("mf"))
    state.apply({"a": damped_delta(random_mf(g), state.posterior, 0.5)})
    assert state.check_invariant() < 1e-12
    state.sites["a"] = state.sites["a"] ** 1.01
    assert state.check_invariant() > 1e-6


def test_apply_uses_the_server_step():
    g = gen(6)

    def tempered(prior, global_site):
        return prior * global_site ** 0.5

    state = PGVIServerState(prior=prior_of("mf"), server_step=tempered)
    d = damped_delta(random_mf(g), state.posterior, 0.7)
    post = state.apply({"a": d})
    assert post.max_abs_diff(state.prior * d ** 0.5) < 1e-12
    assert state.posterior is post
    assert kl_server_step(state.prior, d).max_abs_diff(state.prior * d) == 0.0


# ===================================================================================================
# atomic rejection
def _state_with_history(family: str = "mf", seed: int = 7) -> tuple[PGVIServerState, torch.Generator]:
    g = gen(seed)
    state = PGVIServerState(prior=prior_of(family))
    for batch in (["a", "b"], ["b", "c"], ["a"]):
        q = state.posterior
        state.apply({cid: damped_delta(random_local(family, g), q, 1 / len(batch)) for cid in batch})
    return state, g


def _nan_delta(state: PGVIServerState, g: torch.Generator, family: str) -> GaussianFactor:
    d = damped_delta(random_local(family, g), state.posterior, 0.5)
    k = next(iter(d.params))
    bad = {kk: v.clone() for kk, v in d.params.items()}
    bad[k].reshape(-1)[0] = float("nan")
    return d._like(bad)


@pytest.mark.parametrize("family", ["mf", "full"])
@pytest.mark.parametrize("position", ["first", "last"])
def test_nan_delta_rejects_batch_and_leaves_state_unchanged(family, position):
    state, g = _state_with_history(family)
    before = snapshot(state)
    good = damped_delta(random_local(family, g), state.posterior, 0.3)
    bad = _nan_delta(state, g, family)
    batch = {"b": bad, "a": good} if position == "first" else {"a": good, "b": bad}
    with pytest.raises(UpdateRejected) as ei:
        state.apply(batch)
    assert ei.value.client_id == "b"
    assert "non-finite" in ei.value.reason
    assert "'b'" in str(ei.value)
    assert_same_snapshot(before, snapshot(state))
    # the state is still usable: the good Delta alone applies
    state.apply({"a": good})
    assert state.version == before["version"] + 1 and state.check_invariant() < 1e-10


@pytest.mark.parametrize("family", ["mf", "full"])
def test_improper_posterior_rejects_batch_and_leaves_state_unchanged(family):
    state, g = _state_with_history(family)
    before = snapshot(state)
    good = damped_delta(random_local(family, g), state.posterior, 0.3)
    # Delta_b removes twice the posterior's natural parameters: q * Delta_b = q^-1, improper
    destroy = state.posterior ** -2.0
    with pytest.raises(UpdateRejected) as ei:
        state.apply({"a": good, "b": destroy})
    assert "b" in ei.value.client_id.split(",")
    assert "improper" in ei.value.reason
    assert_same_snapshot(before, snapshot(state))


def test_wrong_layout_delta_rejects_batch():
    state, g = _state_with_history("mf")
    before = snapshot(state)
    other = MeanFieldGaussian.isotropic({"w": (2, 3), "b": (4,)})
    with pytest.raises(UpdateRejected) as ei:
        state.apply({"a": damped_delta(random_mf(g), state.posterior, 0.3), "c": other})
    assert ei.value.client_id == "c"
    assert_same_snapshot(before, snapshot(state))


def test_rejected_batch_from_new_client_does_not_touch_sites():
    state, g = _state_with_history("mf")
    before = snapshot(state)
    with pytest.raises(UpdateRejected):
        state.apply({"newcomer": state.posterior ** -2.0})  # finite, right layout, improper posterior
    assert_same_snapshot(before, snapshot(state))


def test_rejected_nan_batch_from_new_client_does_not_touch_sites():
    state, g = _state_with_history("mf")
    before = snapshot(state)
    with pytest.raises(UpdateRejected) as ei:
        state.apply({"newcomer": _nan_delta(state, g, "mf")})
    assert ei.value.client_id == "newcomer"
    assert_same_snapshot(before, snapshot(state))


# ===================================================================================================
# FedGVI Prop. 4.3: rho = 1/M from a common q gives the log opinion pool of the local posteriors
@pytest.mark.parametrize("family", ["mf", "full"])
@pytest.mark.parametrize("M", [1, 3, 5])
def test_log_opinion_pool(family, M):
    state, g = _state_with_history(family, seed=10 + M)
    q = state.posterior
    locals_ = {f"m{i}": random_local(family, g) for i in range(M)}
    state.apply({cid: damped_delta(qm, q, 1.0 / M) for cid, qm in locals_.items()})
    for k in q.params:
        pool = sum(qm.params[k] for qm in locals_.values()) / M
        assert_close(state.posterior.params[k], pool, rtol=1e-11, atol=1e-11)
    assert state.check_invariant() < 1e-10


def test_log_opinion_pool_density_is_normalised_geometric_mean():
    """The pool's density is prod_m q_m(x)^(1/M) normalised (1-D grid)."""
    state = PGVIServerState(prior=one_d(1.0))
    q = state.posterior
    locals_ = [MeanFieldGaussian.from_mean_variance({"x": torch.tensor([m], dtype=DT)}, {"x": torch.tensor([v], dtype=DT)})
               for m, v in ((-1.0, 0.5), (0.5, 2.0), (2.0, 1.0))]
    state.apply({f"m{i}": damped_delta(qm, q, 1 / 3) for i, qm in enumerate(locals_)})
    x = torch.linspace(-10, 10, 20_001, dtype=DT)
    xs = {"x": x[:, None]}
    geo = torch.exp(sum(qm.log_prob(xs) for qm in locals_) / 3)
    geo = geo / torch.trapezoid(geo, x)
    assert_close(torch.exp(state.posterior.log_prob(xs)), geo, rtol=1e-7, atol=1e-10)
    assert math.isclose(float(torch.trapezoid(geo, x)), 1.0)


def test_remove_site_divides_it_out_exactly():
    g = gen(11)
    state = PGVIServerState(prior=prior_of("mf"))
    like = state.prior
    sites = {}
    for cid in "abc":  # sites with positive precision: any of them can be removed
        sites[cid] = MeanFieldGaussian(
            {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in like.eta1.items()},
            {k: -torch.rand(v.shape, generator=g, dtype=v.dtype) for k, v in like.eta2.items()})
    state.apply({"a": sites["a"], "b": sites["b"]})
    state.apply({"c": sites["c"], "a": sites["a"]})
    version = state.version
    post = state.remove_site("a")
    assert post.max_abs_diff(state.prior * sites["b"] * sites["c"]) < 1e-10
    assert max(abs(v).max() for v in state.sites["a"].to_numpy().values()) == 0.0
    assert state.check_invariant() < 1e-10 and state.version == version + 1
    assert state.remove_site("never-seen") is state.posterior and state.version == version + 1


def test_remove_site_that_would_leave_an_improper_posterior_changes_nothing():
    state = PGVIServerState(prior=prior_of("mf"))
    # 'a' carries precision that 'b' (negative precision) relies on: without 'a' the posterior is improper
    a = state.prior.zeros_like()
    a = MeanFieldGaussian({k: torch.zeros_like(v) for k, v in a.eta1.items()},
                          {k: torch.full_like(v, -5.0) for k, v in a.eta2.items()})
    b = MeanFieldGaussian({k: torch.zeros_like(v) for k, v in a.eta1.items()},
                          {k: torch.full_like(v, 2.0) for k, v in a.eta2.items()})
    state.apply({"a": a, "b": b})
    before = (state.posterior, state.global_site, dict(state.sites), state.version)
    with pytest.raises(UpdateRejected, match="removing its site"):
        state.remove_site("a")
    assert (state.posterior, state.global_site, dict(state.sites), state.version) == before


F32 = torch.float32


def _mf32(prec: list[float], mean: float = 0.5) -> MeanFieldGaussian:
    lam = torch.tensor(prec, dtype=F32)
    return MeanFieldGaussian({"w": lam * mean}, {"w": -0.5 * lam})


@pytest.mark.parametrize("family", ["mean_field", "full_covariance"])
def test_a_cavity_lost_to_the_posteriors_rounding_says_so(family):
    # float32: prior precision 1e-6 (variance 1e6) + one client's site 100 rounds to 100; q / t is then 0 or -0,
    # while the exact cavity (the prior) is proper: the error names the cause and the way out
    prior_prec, site_prec = 1e-6, 100.0
    if family == "mean_field":
        site = _mf32([site_prec, site_prec])
        q = _mf32([site_prec + prior_prec, site_prec + prior_prec])  # rounds to the site's precision
    else:
        eye = torch.eye(2, dtype=F32)
        site = FullCovarianceGaussian(torch.zeros(2, dtype=F32), -0.5 * site_prec * eye)
        q = FullCovarianceGaussian(torch.zeros(2, dtype=F32), -0.5 * (site_prec + prior_prec) * eye)
    with pytest.raises(ImproperDistributionError, match="within torch.float32's rounding .* run with dtype float64"):
        cavity(q, site)


@pytest.mark.parametrize("family", ["mean_field", "full_covariance"])
def test_a_genuinely_improper_cavity_does_not_blame_rounding(family):
    if family == "mean_field":
        q, site = _mf32([1.0, 1.0]), _mf32([5.0, 0.5])
    else:
        eye = torch.eye(2, dtype=F32)
        q = FullCovarianceGaussian(torch.zeros(2, dtype=F32), -0.5 * eye)
        site = FullCovarianceGaussian(torch.zeros(2, dtype=F32), -2.5 * eye)
    with pytest.raises(ImproperDistributionError) as info:
        cavity(q, site)
    assert "rounding" not in str(info.value), str(info.value)


def test_a_float64_cavity_lost_to_rounding_does_not_suggest_float64():
    f64 = torch.float64
    site = MeanFieldGaussian({"w": torch.zeros(2, dtype=f64)}, {"w": torch.full((2,), -0.5e17, dtype=f64)})
    with pytest.raises(ImproperDistributionError, match="float64's rounding .* less vague prior") as info:
        cavity(site, site)  # q's precision equals the site's: the prior's 1e-17 share was rounded away
    assert "run with dtype float64" not in str(info.value)
