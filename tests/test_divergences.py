"""Oracles for common.divergences: torch.distributions, quadrature, Monte Carlo, the Sigma_alpha closed form of
the FedGVI notes (§2.2), limits, a numerically minimised Fisher-Rao geodesic, and finite differences."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, optimize, stats
from torch.distributions import MultivariateNormal, Normal, kl_divergence

from common.divergences import (
    DIVERGENCES,
    KL,
    AlphaRenyi,
    Divergence,
    FisherRao,
    ReverseKL,
    WeightedKL,
    alpha_renyi_mean_field_elementwise,
    alpha_renyi_via_log_normalizer,
    fisher_rao_univariate,
    kl_via_log_normalizer,
    make_divergence,
)
from common.errors import DivergenceUndefinedError, ImproperDistributionError, ShapeMismatchError
from common.families import FullCovarianceGaussian, MeanFieldGaussian

DT = torch.float64
SHAPES = {"w": (3, 4), "b": (5,)}


# ---------------------------------------------------------------------------------------------------
# builders
def random_spd(d: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    a = torch.randn(d, d, generator=g, dtype=DT)
    return scale * (a @ a.T / d + 0.5 * torch.eye(d, dtype=DT))


def random_mf(g: torch.Generator, shapes=SHAPES, var_lo: float = 0.3, var_hi: float = 3.0):
    mean = {n: torch.randn(s, generator=g, dtype=DT) for n, s in shapes.items()}
    var = {n: var_lo + (var_hi - var_lo) * torch.rand(s, generator=g, dtype=DT) for n, s in shapes.items()}
    return MeanFieldGaussian.from_mean_variance(mean, var), mean, var


def random_full(d: int, g: torch.Generator, scale: float = 1.0):
    m = torch.randn(d, generator=g, dtype=DT)
    s = random_spd(d, g, scale)
    return FullCovarianceGaussian.from_mean_covariance(m, s), m, s


def uni(mu: float, var: float) -> FullCovarianceGaussian:
    return FullCovarianceGaussian.from_mean_covariance(torch.tensor([mu], dtype=DT), torch.tensor([[var]], dtype=DT))


def uni_mf(mu: float, var: float) -> MeanFieldGaussian:
    return MeanFieldGaussian.from_mean_variance({"x": torch.tensor([mu], dtype=DT)}, {"x": torch.tensor([var], dtype=DT)})


def ar_sigma_alpha_form(m1, S1, m2, S2, alpha: float) -> float:
    """FedGVI notes §2.2: Sigma_a = alpha S2 + (1-alpha) S1,
    D = 1/2 (m1-m2)^T Sigma_a^-1 (m1-m2) - log(|Sigma_a| / (|S1|^(1-alpha) |S2|^alpha)) / (2 alpha (alpha-1))."""
    Sa = alpha * S2 + (1 - alpha) * S1
    d = m1 - m2
    quad = 0.5 * float(d @ torch.linalg.solve(Sa, d))
    logratio = float(torch.logdet(Sa) - (1 - alpha) * torch.logdet(S1) - alpha * torch.logdet(S2))
    return quad - logratio / (2 * alpha * (alpha - 1))


def flat(mean: dict, var: dict):
    return torch.cat([mean[n].reshape(-1) for n in mean]), torch.cat([var[n].reshape(-1) for n in var])


# ---------------------------------------------------------------------------------------------------
# KL
@pytest.mark.parametrize("seed", range(5))
def test_kl_mean_field_matches_torch_normal(seed):
    g = torch.Generator().manual_seed(seed)
    q, mq, vq = random_mf(g)
    p, mp, vp = random_mf(g)
    ref = sum(kl_divergence(Normal(mq[n], vq[n].sqrt()), Normal(mp[n], vp[n].sqrt())).sum() for n in SHAPES)
    got = KL()(q, p)
    assert got.dim() == 0
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
    # the float32-safe per-coordinate form equals the generic log-normaliser form
    assert torch.allclose(kl_via_log_normalizer(q, p), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed", range(5))
def test_kl_full_covariance_matches_torch_mvn(seed):
    g = torch.Generator().manual_seed(100 + seed)
    q, mq, sq = random_full(3, g)
    p, mp, sp = random_full(3, g, scale=2.0)
    ref = kl_divergence(MultivariateNormal(mq, sq), MultivariateNormal(mp, sp))
    assert torch.allclose(KL()(q, p), ref, rtol=1e-10, atol=1e-12)
    assert torch.allclose(ReverseKL()(q, p), kl_divergence(MultivariateNormal(mp, sp), MultivariateNormal(mq, sq)),
                          rtol=1e-10, atol=1e-12)


def test_kl_zero_at_equality_and_positive_otherwise():
    g = torch.Generator().manual_seed(7)
    q, _, _ = random_mf(g)
    p, _, _ = random_mf(g)
    assert abs(float(KL()(q, q))) < 1e-14
    assert float(KL()(q, p)) > 0


@pytest.mark.parametrize("seed", range(3))
def test_weighted_and_reverse_kl(seed):
    g = torch.Generator().manual_seed(200 + seed)
    for q, p in [(random_mf(g)[0], random_mf(g)[0]), (random_full(3, g)[0], random_full(3, g)[0])]:
        kl = KL()(q, p)
        for w in (0.1, 1.0, 7.5):
            assert torch.allclose(make_divergence("weighted_kl", w=w)(q, p), kl / w, rtol=1e-14, atol=0)
        assert torch.allclose(make_divergence("reverse_kl")(q, p), KL()(p, q), rtol=1e-14, atol=0)
        assert not torch.allclose(make_divergence("reverse_kl")(q, p), kl)  # KL is not symmetric here


# ---------------------------------------------------------------------------------------------------
# Alpha-Renyi: quadrature, Monte Carlo, Sigma_alpha form, limits
UNI_PAIRS = [  # (mu_q, var_q, mu_p, var_p), var_q < 5/3 var_p so alpha = 2.5 is defined
    (0.0, 1.0, 0.0, 1.0),
    (0.3, 0.5, -1.0, 2.0),
    (2.0, 1.4, 0.5, 1.0),
    (-1.0, 0.05, 1.5, 0.8),
    (0.0, 3.0, 0.2, 2.5),
]


def quad_log_integral(mq, vq, mp, vp, alpha):
    """log int q^alpha p^(1-alpha) by adaptive quadrature in log space (shifted by the integrand's maximum)."""
    def logf(x):
        return alpha * stats.norm.logpdf(x, mq, math.sqrt(vq)) + (1 - alpha) * stats.norm.logpdf(x, mp, math.sqrt(vp))

    xs = optimize.minimize_scalar(lambda x: -logf(x), bracket=(min(mq, mp) - 1, max(mq, mp) + 1)).x
    peak = logf(xs)
    width = 60 * math.sqrt(max(vq, vp))
    val, err = integrate.quad(lambda x: math.exp(logf(x) - peak), xs - width, xs + width,
                              points=[xs], epsabs=0, epsrel=1e-13, limit=500)
    assert err < 1e-10 * val
    return peak + math.log(val)


@pytest.mark.parametrize("alpha", [0.3, 0.5, 1.5, 2.5, -0.5])
def test_alpha_renyi_matches_quadrature_1d(alpha):
    for mq, vq, mp, vp in UNI_PAIRS:
        if alpha < 0 and not (vp < (alpha - 1) / alpha * vq):
            continue
        ref = quad_log_integral(mq, vq, mp, vp, alpha) / (alpha * (alpha - 1))
        for q, p in [(uni(mq, vq), uni(mp, vp)), (uni_mf(mq, vq), uni_mf(mp, vp))]:
            got = float(AlphaRenyi(alpha)(q, p))
            assert got == pytest.approx(ref, rel=1e-8, abs=1e-10), (mq, vq, mp, vp, type(q).__name__)


def mc_alpha_renyi(log_q, log_p, alpha):
    """D_AR = log E_q[(q/p)^(alpha-1)] / (alpha (alpha-1)) from samples of log q, log p under q; delta-method s.e."""
    lw = (alpha - 1) * (log_q - log_p)
    shift = lw.max()
    w = torch.exp(lw - shift)
    n = w.numel()
    m = w.mean()
    est = (torch.log(m) + shift) / (alpha * (alpha - 1))
    se = w.std() / (math.sqrt(n) * m) / abs(alpha * (alpha - 1))
    return float(est), float(se)


@pytest.mark.parametrize("alpha", [0.5, 1.5, 2.5])
def test_alpha_renyi_matches_monte_carlo_d3(alpha):
    g = torch.Generator().manual_seed(11)
    n = 200_000
    # full covariance, d = 3: p wider than q so the MC weights (q/p)^(alpha-1) have finite variance
    q, mq, sq = random_full(3, g, scale=0.7)
    p, mp, sp = random_full(3, g, scale=1.5)
    assert torch.linalg.eigvalsh(2 * (alpha - 1) * torch.linalg.inv(sq)
                                 - (2 * alpha - 2) * torch.linalg.inv(sp) + torch.linalg.inv(sq)).min() > 0
    Q, P = MultivariateNormal(mq, sq), MultivariateNormal(mp, sp)
    x = Q.sample((n,))
    est, se = mc_alpha_renyi(Q.log_prob(x), P.log_prob(x), alpha)
    got = float(AlphaRenyi(alpha)(q, p))
    assert abs(got - est) < 5 * se, (got, est, se)
    assert se < 0.02 * abs(got)  # the check has power

    # mean-field over two named tensors of 3 coordinates in total
    shapes = {"a": (2,), "b": (1,)}
    qm, mqm, vqm = random_mf(g, shapes, 0.3, 0.8)
    pm, mpm, vpm = random_mf(g, shapes, 0.9, 2.0)
    muq, varq = flat(mqm, vqm)
    mup, varp = flat(mpm, vpm)
    Qm, Pm = Normal(muq, varq.sqrt()), Normal(mup, varp.sqrt())
    x = Qm.sample((n,))
    est, se = mc_alpha_renyi(Qm.log_prob(x).sum(-1), Pm.log_prob(x).sum(-1), alpha)
    got = float(AlphaRenyi(alpha)(qm, pm))
    assert abs(got - est) < 5 * se, (got, est, se)
    assert se < 0.02 * abs(got)


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.9, 1.5, 2.5, 5.0, -0.5])
def test_alpha_renyi_matches_sigma_alpha_form(alpha):
    g = torch.Generator().manual_seed(21)
    for _ in range(4):
        q, mq, sq = random_full(3, g, scale=0.8)
        p, mp, sp = random_full(3, g, scale=1.2)
        if not bool(torch.linalg.eigvalsh(alpha * sp + (1 - alpha) * sq).min() > 0):
            with pytest.raises(DivergenceUndefinedError):
                AlphaRenyi(alpha)(q, p)
            continue
        ref = ar_sigma_alpha_form(mq, sq, mp, sp, alpha)
        assert float(AlphaRenyi(alpha)(q, p)) == pytest.approx(ref, rel=1e-10, abs=1e-12)
    # mean-field: the same form with diagonal covariances
    qm, mqm, vqm = random_mf(g, SHAPES, 0.5, 1.0)
    pm, mpm, vpm = random_mf(g, SHAPES, 0.7, 1.5)
    muq, varq = flat(mqm, vqm)
    mup, varp = flat(mpm, vpm)
    ref = ar_sigma_alpha_form(muq, torch.diag(varq), mup, torch.diag(varp), alpha)
    assert float(AlphaRenyi(alpha)(qm, pm)) == pytest.approx(ref, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("alpha", [0.3, 0.5, 1.5, 2.5, -0.5])
def test_alpha_renyi_mean_field_form_equals_log_normalizer_form(alpha):
    g = torch.Generator().manual_seed(31)
    for _ in range(3):
        q, _, _ = random_mf(g, SHAPES, 0.6, 1.0)
        p, _, _ = random_mf(g, SHAPES, 0.7, 1.2)
        parts = alpha_renyi_mean_field_elementwise(q, p, alpha)
        # elementwise A-form
        mix = q.combine(p, alpha, 1 - alpha)
        aq, ap, am = q.log_normalizer_elementwise(), p.log_normalizer_elementwise(), mix.log_normalizer_elementwise()
        for n in SHAPES:
            ref = (am[n] - alpha * aq[n] - (1 - alpha) * ap[n]) / (alpha * (alpha - 1))
            assert torch.allclose(parts[n], ref, rtol=1e-9, atol=1e-12)
            assert bool((parts[n] >= 0).all())
        assert torch.allclose(AlphaRenyi(alpha)(q, p), alpha_renyi_via_log_normalizer(q, p, alpha), rtol=1e-10)


@pytest.mark.parametrize("eps", [1e-5, -1e-5])
def test_alpha_renyi_limits(eps):
    g = torch.Generator().manual_seed(41)
    cases = [(random_full(3, g)[0], random_full(3, g, 1.5)[0]), (random_mf(g)[0], random_mf(g, SHAPES, 1.0, 3.0)[0])]
    for q, p in cases:
        kl, rkl = float(KL()(q, p)), float(KL()(p, q))
        assert abs(kl - rkl) > 1e-2  # the two limits are distinguishable
        assert float(AlphaRenyi(1 + eps)(q, p)) == pytest.approx(kl, abs=1e-4, rel=1e-4)
        assert float(AlphaRenyi(eps)(q, p)) == pytest.approx(rkl, abs=1e-4, rel=1e-4)


@pytest.mark.parametrize("alpha", [0.5, 2.5, -0.5])
def test_alpha_renyi_mean_field_equals_full_covariance_with_same_diagonal(alpha):
    g = torch.Generator().manual_seed(51)
    shapes = {"a": (2,), "b": (1,)}
    qm, mq, vq = random_mf(g, shapes, 0.8, 1.0)
    pm, mp, vp = random_mf(g, shapes, 0.8, 1.0)
    muq, varq = flat(mq, vq)
    mup, varp = flat(mp, vp)
    qf = FullCovarianceGaussian.from_mean_covariance(muq, torch.diag(varq))
    pf = FullCovarianceGaussian.from_mean_covariance(mup, torch.diag(varp))
    for div in (AlphaRenyi(alpha), KL(), ReverseKL()):
        assert float(div(qm, pm)) == pytest.approx(float(div(qf, pf)), rel=1e-11, abs=1e-13)


# ---------------------------------------------------------------------------------------------------
# Alpha-Renyi: the region where it is undefined
@pytest.mark.parametrize("alpha", [0.1, 0.5, 0.9])
def test_alpha_renyi_always_defined_for_alpha_in_unit_interval(alpha):
    for q, p in [(uni(0.0, 1e4), uni(1.0, 1e-4)), (uni(0.0, 1e-4), uni(1.0, 1e4))]:
        v = float(AlphaRenyi(alpha)(q, p))
        assert math.isfinite(v) and v > 0


def test_alpha_renyi_much_wider_q_raises_both_families():
    with pytest.raises(DivergenceUndefinedError, match="alpha > 1"):
        AlphaRenyi(2.5)(uni(0.0, 10.0), uni(0.0, 1.0))
    g = torch.Generator().manual_seed(61)
    q, _, _ = random_full(3, g, scale=10.0)
    p, _, _ = random_full(3, g, scale=0.1)
    with pytest.raises(DivergenceUndefinedError, match="alpha > 1"):
        AlphaRenyi(2.5)(q, p)
    # mean-field: two of the 17 coordinates of q are too wide; the message counts them
    qm, mq, vq = random_mf(g, SHAPES, 0.5, 1.0)
    pm_mean = {n: torch.zeros(s, dtype=DT) for n, s in SHAPES.items()}
    pm_var = {n: torch.ones(s, dtype=DT) for n, s in SHAPES.items()}
    vq = {n: v.clone() for n, v in vq.items()}
    vq["w"][1, 2] = 10.0
    vq["b"][0] = 10.0
    qm = MeanFieldGaussian.from_mean_variance(mq, vq)
    pm = MeanFieldGaussian.from_mean_variance(pm_mean, pm_var)
    with pytest.raises(DivergenceUndefinedError, match=r"in 2 of 17 coordinates") as err:
        AlphaRenyi(2.5)(qm, pm)
    assert "'w': 1 of 12" in str(err.value) and "'b': 1 of 5" in str(err.value)
    # alpha < 0: the roles swap; p much wider than q raises
    with pytest.raises(DivergenceUndefinedError, match="alpha < 0"):
        AlphaRenyi(-0.5)(uni(0.0, 1.0), uni(0.0, 10.0))


@pytest.mark.parametrize("alpha", [1.5, 2.5, 5.0, -0.5, -3.0])
def test_alpha_renyi_boundary_is_combined_precision_zero_univariate(alpha):
    # combined precision alpha/vq + (1-alpha)/vp = 0  <=>  vq / vp = alpha / (alpha - 1)
    ratio = alpha / (alpha - 1)
    rel = 1e-6
    for make in (uni, uni_mf):
        if alpha > 1:  # q wider than p is the problem: vq = ratio * vp
            inside, outside = (make(0.3, ratio * (1 - rel)), make(0.0, 1.0)), (make(0.3, ratio * (1 + rel)), make(0.0, 1.0))
        else:  # alpha < 0: p wider than q is the problem: vp = vq / ratio
            inside, outside = (make(0.3, 1.0), make(0.0, (1 - rel) / ratio)), (make(0.3, 1.0), make(0.0, (1 + rel) / ratio))
        v = float(AlphaRenyi(alpha)(*inside))
        assert math.isfinite(v) and v > 0
        # the primary check on the combined precision fires (not only a rounding guard)
        match = "combined precision .* <= 0 in 1 of 1 coordinates" if make is uni_mf else "smallest eigenvalue -"
        with pytest.raises(DivergenceUndefinedError, match=match):
            AlphaRenyi(alpha)(*outside)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_alpha_renyi_boundary_is_combined_precision_zero_full_covariance(sign):
    alpha = 2.5
    g = torch.Generator().manual_seed(71)
    lam_p = random_spd(3, g)
    v, _ = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=DT))
    lam_a = v @ torch.diag(torch.tensor([sign * 1e-7, 1.0, 2.0], dtype=DT)) @ v.T
    lam_q = (lam_a + (alpha - 1) * lam_p) / alpha
    lam_q = 0.5 * (lam_q + lam_q.T)
    q = FullCovarianceGaussian.from_mean_precision(torch.randn(3, generator=g, dtype=DT), lam_q)
    p = FullCovarianceGaussian.from_mean_precision(torch.randn(3, generator=g, dtype=DT), lam_p)
    assert q.is_proper() and p.is_proper()
    if sign > 0:
        val = float(AlphaRenyi(alpha)(q, p))
        assert math.isfinite(val) and val > 0
    else:
        with pytest.raises(DivergenceUndefinedError, match="smallest eigenvalue"):
            AlphaRenyi(alpha)(q, p)


# ---------------------------------------------------------------------------------------------------
# float32 accuracy of the mean-field forms (the BNN case: many coordinates, q close to p)
def test_mean_field_float32_accuracy_when_q_is_close_to_p():
    g = torch.Generator().manual_seed(81)
    n = 20_000
    mq = 0.1 * torch.randn(n, generator=g, dtype=DT)
    vq = torch.exp(torch.empty(n, dtype=DT).uniform_(math.log(1e-6), math.log(1e-1), generator=g))
    mp = mq + 1e-3 * vq.sqrt() * torch.randn(n, generator=g, dtype=DT)
    vp = vq * torch.exp(1e-3 * torch.randn(n, generator=g, dtype=DT))
    q32 = MeanFieldGaussian.from_mean_variance({"w": mq.float()}, {"w": vq.float()})
    p32 = MeanFieldGaussian.from_mean_variance({"w": mp.float()}, {"w": vp.float()})
    q64, p64 = q32.to(DT), p32.to(DT)  # same rounded inputs: only the arithmetic differs
    for div in (KL(), ReverseKL(), AlphaRenyi(0.5), AlphaRenyi(2.5), FisherRao()):
        ref = float(div(q64, p64))
        got = div(q32, p32)
        assert got.dtype == torch.float32
        assert abs(float(got) - ref) < 1e-4 * ref, (div, float(got), ref)


# ---------------------------------------------------------------------------------------------------
# Fisher-Rao
def fr_arccosh(mu1, s1, mu2, s2):
    return math.sqrt(2) * math.acosh(1 + ((mu1 - mu2) ** 2 / 2 + (s1 - s2) ** 2) / (2 * s1 * s2))


def fr_nielsen(mu1, s1, mu2, s2):
    """The second published form (Nielsen; FedGVI notes S2.2): sqrt(2) log((1 + D) / (1 - D)) with
    D^2 = ((mu2 - mu1)^2 + 2 (s2 - s1)^2) / ((mu2 - mu1)^2 + 2 (s2 + s1)^2)."""
    d = math.sqrt(((mu2 - mu1) ** 2 + 2 * (s2 - s1) ** 2) / ((mu2 - mu1) ** 2 + 2 * (s2 + s1) ** 2))
    return math.sqrt(2) * math.log((1 + d) / (1 - d))


def test_fisher_rao_matches_nielsens_log_form():
    rng = np.random.default_rng(92)
    for _ in range(200):
        mu1, mu2 = rng.normal(0, 3, size=2)
        s1, s2 = np.exp(rng.normal(0, 1.5, size=2))
        t = lambda x: torch.tensor(float(x), dtype=DT)  # noqa: E731
        got = float(fisher_rao_univariate(t(mu1), t(s1), t(mu2), t(s2)))
        assert got == pytest.approx(fr_nielsen(mu1, s1, mu2, s2), rel=1e-11)
        assert got == pytest.approx(fr_arccosh(mu1, s1, mu2, s2), rel=1e-11)  # the two forms agree


def test_fisher_rao_sigma_doubling():
    ref = math.sqrt(2) * math.log(2)
    assert float(FisherRao()(uni(0.0, 1.0), uni(0.0, 4.0))) == pytest.approx(ref, rel=1e-14)
    assert float(FisherRao()(uni_mf(0.0, 1.0), uni_mf(0.0, 4.0))) == pytest.approx(ref, rel=1e-14)
    assert float(fisher_rao_univariate(torch.tensor(0.0, dtype=DT), torch.tensor(1.0, dtype=DT),
                                       torch.tensor(0.0, dtype=DT), torch.tensor(2.0, dtype=DT))) == pytest.approx(ref, rel=1e-14)


def test_fisher_rao_matches_arccosh_form_and_is_symmetric():
    rng = np.random.default_rng(91)
    for _ in range(50):
        mu1, mu2 = rng.normal(0, 3, size=2)
        s1, s2 = np.exp(rng.normal(0, 1.5, size=2))
        ref = fr_arccosh(mu1, s1, mu2, s2)
        t = lambda x: torch.tensor(float(x), dtype=DT)  # noqa: E731
        assert float(fisher_rao_univariate(t(mu1), t(s1), t(mu2), t(s2))) == pytest.approx(ref, rel=1e-11)
        q, p = uni(mu1, s1**2), uni(mu2, s2**2)
        assert float(FisherRao()(q, p)) == pytest.approx(ref, rel=1e-11)
        assert float(FisherRao()(p, q)) == pytest.approx(float(FisherRao()(q, p)), rel=1e-13)
    # far apart and very close: still accurate
    assert float(fisher_rao_univariate(t(0), t(1e-6), t(1e3), t(1e2))) == pytest.approx(fr_arccosh(0, 1e-6, 1e3, 1e2), rel=1e-12)
    close = float(fisher_rao_univariate(t(0), t(1.0), t(1e-9), t(1.0)))
    assert close == pytest.approx(1e-9, rel=1e-6)  # FR ~ |dmu| / sigma for small mean shifts


def _discrete_geodesic_length(start: np.ndarray, end: np.ndarray, k: int) -> float:
    """Length of the k-segment path minimising the discrete Fisher-metric energy between two points.

    Points are ``(mu_1..mu_d, log s_1..log s_d)``; the metric of the mean-field family is the sum over
    coordinates of ``(dmu^2 + 2 ds^2) / s^2`` (the univariate Fisher metric), discretised per segment as
    ``(dmu^2 + 2 ds^2) / (s_j s_{j+1})``.  Minimising the energy (not the length) gives a constant-speed path
    and a well-conditioned problem; the length converges to the geodesic distance at rate O(1/k^2).
    """
    d = start.shape[0] // 2
    t = np.linspace(0.0, 1.0, k + 1)[:, None]
    init = ((1 - t) * start + t * end)[1:-1]

    def full(x):
        return np.vstack([start[None], x.reshape(k - 1, 2 * d), end[None]])

    def segments(path):
        mu, s = path[:, :d], np.exp(path[:, d:])
        a, b, den = mu[1:] - mu[:-1], s[1:] - s[:-1], s[1:] * s[:-1]
        return a, b, den, s, (a * a + 2 * b * b) / den

    def energy(x):
        a, b, den, s, e = segments(full(x))
        gmu = np.zeros((k + 1, d))
        gls = np.zeros((k + 1, d))
        gmu[1:] += 2 * a / den
        gmu[:-1] -= 2 * a / den
        gls[1:] += 4 * b * s[1:] / den - e
        gls[:-1] += -4 * b * s[:-1] / den - e
        return k * e.sum(), k * np.hstack([gmu, gls])[1:-1].reshape(-1)

    res = optimize.minimize(energy, init.reshape(-1), jac=True, method="L-BFGS-B",
                            options={"maxiter": 10_000, "gtol": 1e-11, "ftol": 1e-15})
    return float(np.sqrt(segments(full(res.x))[-1].sum(-1)).sum())


def geodesic_length_numeric(start: np.ndarray, end: np.ndarray) -> float:
    """Fisher-Rao geodesic distance by direct numerical minimisation, Richardson-extrapolated from k = 16, 32
    (measured accuracy ~1e-7 relative; the k = 32 value alone is ~2e-4 too long)."""
    l16 = _discrete_geodesic_length(start, end, 16)
    l32 = _discrete_geodesic_length(start, end, 32)
    return (4 * l32 - l16) / 3


def test_fisher_rao_univariate_matches_numerical_geodesic():
    for mu1, s1, mu2, s2 in [(0.0, 1.0, 3.0, 0.5), (-1.0, 0.3, 1.0, 2.0)]:
        num = geodesic_length_numeric(np.array([mu1, math.log(s1)]), np.array([mu2, math.log(s2)]))
        assert num == pytest.approx(fr_arccosh(mu1, s1, mu2, s2), rel=2e-6)


def test_fisher_rao_mean_field_is_the_product_manifold_distance():
    # (a) a numerically minimised geodesic in the 2-coordinate mean-field family equals sqrt(FR_1^2 + FR_2^2)
    mq, sq, mp, sp = [0.0, 1.0], [1.0, 0.5], [2.0, -1.0], [0.4, 1.5]
    qm = MeanFieldGaussian.from_mean_variance({"x": torch.tensor(mq, dtype=DT)}, {"x": torch.tensor(sq, dtype=DT) ** 2})
    pm = MeanFieldGaussian.from_mean_variance({"x": torch.tensor(mp, dtype=DT)}, {"x": torch.tensor(sp, dtype=DT) ** 2})
    got = float(FisherRao()(qm, pm))
    assert got == pytest.approx(math.hypot(fr_arccosh(mq[0], sq[0], mp[0], sp[0]), fr_arccosh(mq[1], sq[1], mp[1], sp[1])), rel=1e-12)
    num = geodesic_length_numeric(np.array(mq + list(np.log(sq))), np.array(mp + list(np.log(sp))))
    assert num == pytest.approx(got, rel=2e-6)
    # (b) differing in one coordinate only: the univariate distance of that coordinate
    g = torch.Generator().manual_seed(93)
    q, mean, var = random_mf(g)
    mean2 = {n: v.clone() for n, v in mean.items()}
    var2 = {n: v.clone() for n, v in var.items()}
    mean2["w"][2, 1] += 1.3
    var2["w"][2, 1] *= 3.0
    p = MeanFieldGaussian.from_mean_variance(mean2, var2)
    ref = fr_arccosh(float(mean["w"][2, 1]), math.sqrt(var["w"][2, 1]), float(mean2["w"][2, 1]), math.sqrt(var2["w"][2, 1]))
    assert float(FisherRao()(q, p)) == pytest.approx(ref, rel=1e-11)
    assert float(FisherRao()(p, q)) == pytest.approx(ref, rel=1e-11)


def test_fisher_rao_zero_and_finite_gradient_at_equality():
    g = torch.Generator().manual_seed(95)
    _, mean, var = random_mf(g)
    for family in ("mf", "full"):
        if family == "mf":
            params = {n: (mean[n].clone().requires_grad_(), var[n].clone().requires_grad_()) for n in SHAPES}
            q = MeanFieldGaussian.from_mean_variance({n: m for n, (m, _) in params.items()}, {n: v for n, (_, v) in params.items()})
            p = MeanFieldGaussian.from_mean_variance(mean, var)
            leaves = [t for pair in params.values() for t in pair]
        else:
            m = torch.tensor([0.4], dtype=DT, requires_grad=True)
            v = torch.tensor([[1.7]], dtype=DT, requires_grad=True)
            q = FullCovarianceGaussian.from_mean_covariance(m, v)
            p = uni(0.4, 1.7)
            leaves = [m, v]
        val = FisherRao()(q, p)
        assert float(val.detach()) == 0.0
        grads = torch.autograd.grad(val, leaves)
        assert all(bool(torch.isfinite(gr).all()) for gr in grads)
    # and through the natural parameters directly
    q = uni(0.2, 0.8)
    e1, e2 = q.eta1.clone().requires_grad_(), q.eta2.clone().requires_grad_()
    val = FisherRao()(FullCovarianceGaussian(e1, e2), q)
    g1, g2 = torch.autograd.grad(val, [e1, e2])
    assert bool(torch.isfinite(g1).all() and torch.isfinite(g2).all())


def test_fisher_rao_full_covariance_d_gt_1_not_implemented():
    g = torch.Generator().manual_seed(97)
    with pytest.raises(NotImplementedError, match="d = 3"):
        FisherRao()(random_full(3, g)[0], random_full(3, g)[0])


# ---------------------------------------------------------------------------------------------------
# gradients against finite differences
ALL_DIVS = [KL(), WeightedKL(0.3), ReverseKL(), AlphaRenyi(0.5), AlphaRenyi(2.5), AlphaRenyi(-0.5), FisherRao()]


def _fd_check(build, x0: torch.Tensor, h: float = 1e-6):
    x = x0.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(build(x), [x])
    fd = torch.zeros_like(x0)
    flat_x = x0.reshape(-1)
    for i in range(flat_x.numel()):
        e = torch.zeros_like(flat_x)
        e[i] = h
        fd.reshape(-1)[i] = (build((flat_x + e).reshape(x0.shape)) - build((flat_x - e).reshape(x0.shape))) / (2 * h)
    assert torch.allclose(grad, fd, rtol=1e-6, atol=1e-8), (grad, fd)
    assert float(grad.abs().max()) > 1e-3  # not a vacuous comparison


@pytest.mark.parametrize("div", ALL_DIVS, ids=repr)
def test_gradient_wrt_mean_of_q_matches_finite_differences(div):
    # mean-field
    g = torch.Generator().manual_seed(101)
    shapes = {"a": (2, 2), "b": (3,)}
    _, mq, vq = random_mf(g, shapes, 0.6, 0.9)
    p, _, _ = random_mf(g, shapes, 0.8, 1.2)

    def build_mf(a):
        return div(MeanFieldGaussian.from_mean_variance({"a": a, "b": mq["b"]}, vq), p)

    _fd_check(build_mf, mq["a"])

    # full covariance (d = 1 for Fisher-Rao, d = 3 otherwise)
    d = 1 if isinstance(div, FisherRao) else 3
    q_scale, p_scale = (1.3, 0.7) if isinstance(div, AlphaRenyi) and div.alpha < 0 else (0.7, 1.3)
    _, m0, s0 = random_full(d, g, scale=q_scale)
    pf, _, _ = random_full(d, g, scale=p_scale)
    _fd_check(lambda m: div(FullCovarianceGaussian.from_mean_covariance(m, s0), pf), m0)


@pytest.mark.parametrize("div", [KL(), AlphaRenyi(2.5), FisherRao()], ids=repr)
def test_gradient_wrt_mean_of_p_matches_finite_differences(div):
    g = torch.Generator().manual_seed(103)
    q, _, _ = random_mf(g, {"a": (4,)}, 0.6, 0.9)
    _, mp, vp = random_mf(g, {"a": (4,)}, 0.8, 1.2)
    _fd_check(lambda m: div(q, MeanFieldGaussian.from_mean_variance({"a": m}, vp)), mp["a"])


# ---------------------------------------------------------------------------------------------------
# argument checks
@pytest.mark.parametrize("div", ALL_DIVS, ids=repr)
def test_mixed_families_and_shapes_raise(div):
    g = torch.Generator().manual_seed(111)
    qm, _, _ = random_mf(g)
    other, _, _ = random_mf(g, {"w": (3, 4), "b": (6,)})
    renamed, _, _ = random_mf(g, {"w": (3, 4), "c": (5,)})
    with pytest.raises(ShapeMismatchError):
        div(qm, other)
    with pytest.raises(ShapeMismatchError):
        div(qm, renamed)
    with pytest.raises(ShapeMismatchError):
        div(qm, uni(0.0, 1.0))
    with pytest.raises(ShapeMismatchError):
        div(uni(0.0, 1.0), FullCovarianceGaussian.from_mean_covariance(torch.zeros(2, dtype=DT), torch.eye(2, dtype=DT)))


@pytest.mark.parametrize("div", ALL_DIVS, ids=repr)
def test_improper_arguments_raise(div):
    g = torch.Generator().manual_seed(113)
    q, _, _ = random_mf(g)
    bad = MeanFieldGaussian(q.eta1, {n: -e2 for n, e2 in q.eta2.items()})  # negative precisions
    with pytest.raises(ImproperDistributionError):
        div(q, bad)
    with pytest.raises(ImproperDistributionError):
        div(bad, q)
    bad1 = FullCovarianceGaussian(torch.tensor([0.0], dtype=DT), torch.tensor([[0.5]], dtype=DT))
    with pytest.raises(ImproperDistributionError):
        div(uni(0.0, 1.0), bad1)


# ---------------------------------------------------------------------------------------------------
# registry and hyperparameters
def test_registry_names_and_factory():
    assert DIVERGENCES.names() == ["alpha_renyi", "fisher_rao", "kl", "reverse_kl", "weighted_kl"]
    for name, hyper, cls in [("kl", {}, KL), ("weighted_kl", {"w": 2.0}, WeightedKL), ("reverse_kl", {}, ReverseKL),
                             ("alpha_renyi", {"alpha": 2.5}, AlphaRenyi), ("fisher_rao", {}, FisherRao)]:
        div = make_divergence(name, **hyper)
        assert isinstance(div, cls) and isinstance(div, Divergence)
        assert div.name == name
    assert make_divergence("alpha_renyi", alpha=2.5).alpha == 2.5
    assert make_divergence("weighted_kl", w=np.float32(0.5)).w == 0.5


def test_unknown_name_lists_known_names():
    with pytest.raises(KeyError) as err:
        make_divergence("hellinger")
    msg = str(err.value)
    assert "hellinger" in msg
    for n in ("kl", "weighted_kl", "reverse_kl", "alpha_renyi", "fisher_rao"):
        assert n in msg


@pytest.mark.parametrize(
    "name, hyper, match",
    [
        ("weighted_kl", {"w": 0.0}, "w"),
        ("weighted_kl", {"w": -1.0}, "w"),
        ("weighted_kl", {"w": float("nan")}, "w"),
        ("weighted_kl", {"w": float("inf")}, "w"),
        ("weighted_kl", {"w": "1"}, "w"),
        ("weighted_kl", {}, "missing.*w"),
        ("alpha_renyi", {"alpha": 1.0}, '"kl"'),
        ("alpha_renyi", {"alpha": 0.0}, '"reverse_kl"'),
        ("alpha_renyi", {"alpha": float("nan")}, "alpha"),
        ("alpha_renyi", {"alpha": float("-inf")}, "alpha"),
        ("alpha_renyi", {"alpha": True}, "alpha"),
        ("alpha_renyi", {}, "missing.*alpha"),
        ("alpha_renyi", {"alpha": 2.0, "beta": 1.0}, "unknown.*beta"),
        ("kl", {"w": 1.0}, "unknown.*w"),
        ("fisher_rao", {"alpha": 0.5}, "unknown.*alpha"),
    ],
)
def test_bad_hyperparameters_raise_value_error(name, hyper, match):
    with pytest.raises(ValueError, match=match):
        make_divergence(name, **hyper)
