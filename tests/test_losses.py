"""Oracles for common/losses.py: limit cases, closed forms, quadrature and autograd derivations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from common.families import FullCovarianceGaussian
from common.likelihoods import CategoricalOutput, GaussianOutput
from common.conjugate import conjugate_local_posterior
from common.divergences import make_divergence
from common.local_gvi import LocalGVIConfig, local_gvi
from common.losses import LOSSES, Loss, ScaledLoss, ScoreMatchingLoss, make_loss, weighted
from common.models import make_model

DT = torch.float64


def _categorical(seed: int = 0, s: int = 3, b: int = 5, c: int = 4, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(s, b, c, generator=g, dtype=DT)
    y = torch.randint(0, c, (b,), generator=g)
    return CategoricalOutput(logits), y


def _gaussian(seed: int = 0, s: int = 3, b: int = 5, d: int = 2, sigma: float = 0.7):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(s, b, d, generator=g, dtype=DT)
    y = torch.randn(b, d, generator=g, dtype=DT)
    return GaussianOutput(mean, sigma), y


def _entropy(out) -> torch.Tensor:
    """Entropy of p(. | theta_s, x_b), shape (S, B)."""
    if isinstance(out, CategoricalOutput):
        return -(out.log_probs.exp() * out.log_probs).sum(-1)
    d = out.event_dim
    return torch.full(out.mean.shape[:-1], 0.5 * d * math.log(2 * math.pi * math.e * out.sigma**2), dtype=DT)


OUTPUTS = [
    pytest.param(_categorical, id="categorical"),
    pytest.param(_gaussian, id="gaussian"),
]


def _categorical_moderate():
    return _categorical(scale=1.0)


def _gaussian_moderate():
    return _gaussian(sigma=1.0)


# limit checks at delta, beta - 1, gamma - 1 = 1e-6 with tolerance 1e-4 need -log p of moderate size (the
# first-order error is ~1e-6 (log p)^2 / 2); the first-order slope checks below use the wide OUTPUTS too
MODERATE = [
    pytest.param(_categorical_moderate, id="categorical"),
    pytest.param(_gaussian_moderate, id="gaussian"),
]


# ---------------------------------------------------------------------------------------------------
# registry and guards
def test_registry_names_and_unknown():
    assert set(LOSSES.names()) == {"nll", "gce", "beta", "gamma", "score_matching"}
    with pytest.raises(KeyError, match="known: beta, gamma, gce, nll, score_matching"):
        make_loss("huber")
    with pytest.raises(TypeError, match="unknown hyperparameter"):
        make_loss("gce", beta=2.0)
    with pytest.raises(TypeError, match="unknown hyperparameter"):
        make_loss("nll", delta=0.5)
    for name, hyper in [("nll", {}), ("gce", {"delta": 0.3}), ("beta", {"beta": 1.2}), ("gamma", {"gamma": 1.2}),
                        ("score_matching", {"weight": "se", "c": 2.0})]:
        loss = make_loss(name, **hyper)
        assert isinstance(loss, Loss) and loss.name == name
    assert make_loss("score_matching").needs_reference and not make_loss("nll").needs_reference


@pytest.mark.parametrize("delta", [0.0, -0.1, 1.0001, 2.0, float("nan"), float("inf")])
def test_gce_guard(delta):
    with pytest.raises(ValueError, match="delta"):
        make_loss("gce", delta=delta)


@pytest.mark.parametrize("beta", [1.0, 0.5, 0.0, -2.0, float("nan")])
def test_beta_guard(beta):
    with pytest.raises(ValueError, match="beta"):
        make_loss("beta", beta=beta)


@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.0, float("nan"), float("inf")])
def test_gamma_guard(gamma):
    with pytest.raises(ValueError, match="gamma"):
        make_loss("gamma", gamma=gamma)


def test_score_matching_guards():
    with pytest.raises(ValueError, match="weight"):
        make_loss("score_matching", weight="huber")
    for c in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="c"):
            make_loss("score_matching", c=c)
    for bw in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="beta_w"):
            make_loss("score_matching", beta_w=bw)
    with pytest.raises(ValueError, match="delta"):
        make_loss("gce", delta="0.5")  # strings are not silently converted


@pytest.mark.parametrize("make_out", OUTPUTS)
@pytest.mark.parametrize("name,hyper", [("nll", {}), ("gce", {"delta": 0.4}), ("beta", {"beta": 1.3}),
                                        ("gamma", {"gamma": 1.7})])
def test_shapes_and_finite(make_out, name, hyper):
    out, y = make_out()
    val = make_loss(name, **hyper)(out, y)
    assert val.shape == (3, 5) and torch.isfinite(val).all()


# ---------------------------------------------------------------------------------------------------
# NLL
def test_nll_closed_forms():
    out, y = _categorical()
    expect = -torch.log_softmax(out.logits, -1)[:, torch.arange(5), y]
    torch.testing.assert_close(make_loss("nll")(out, y), expect)
    out, y = _gaussian()
    m = out.mean.numpy()
    ref = -stats.norm.logpdf(y.numpy()[None], m, out.sigma).sum(-1)
    np.testing.assert_allclose(make_loss("nll")(out, y).numpy(), ref, rtol=1e-12)


# ---------------------------------------------------------------------------------------------------
# GCE
@pytest.mark.parametrize("make_out", MODERATE)
def test_gce_to_nll_as_delta_to_zero(make_out):
    out, y = make_out()
    nll = make_loss("nll")(out, y)
    assert nll.max() < 10
    gce = make_loss("gce", delta=1e-6)(out, y)
    torch.testing.assert_close(gce, nll, atol=1e-4, rtol=0)


@pytest.mark.parametrize("make_out", MODERATE + OUTPUTS)
def test_gce_first_order_in_delta(make_out):
    out, y = make_out()
    nll = make_loss("nll")(out, y)
    # first-order term: (1 - p^d)/d = -log p - d (log p)^2 / 2 + O(d^2)
    d = 1e-4
    gce = make_loss("gce", delta=d)(out, y)
    torch.testing.assert_close((gce - nll) / d, -0.5 * nll**2, atol=1e-3, rtol=1e-3)


def test_gce_delta_one_is_one_minus_p():
    out, y = _categorical()
    p = out.log_prob(y).exp()
    torch.testing.assert_close(make_loss("gce", delta=1.0)(out, y), 1.0 - p)


@pytest.mark.parametrize("delta", [1e-3, 0.1, 0.5, 1.0])
def test_gce_bounded(delta):
    # two classes with logit gaps from -1e5 to 1e5: p(y=0) sweeps from 1 to 0 (log p down to -1e5)
    gaps = torch.cat([torch.tensor([-1e5, -1e3, -40.0]), torch.linspace(-10, 10, 41, dtype=DT),
                      torch.tensor([40.0, 1e3, 1e5])]).to(DT)
    logits = torch.stack([torch.zeros_like(gaps), gaps], -1).unsqueeze(0)  # (1, B, 2)
    y = torch.zeros(gaps.shape[0], dtype=torch.long)
    val = make_loss("gce", delta=delta)(CategoricalOutput(logits), y)
    assert (val >= 0).all() and (val <= 1.0 / delta).all()
    assert val[0, 0].item() == 0.0  # p = 1
    assert val[0, -1].item() == pytest.approx(1.0 / delta, rel=1e-12)  # p = 0: the supremum 1/delta
    assert (torch.diff(val[0]) >= 0).all()  # monotone in -log p


# ---------------------------------------------------------------------------------------------------
# int p^beta closed form (GaussianOutput.log_integral_power) against quadrature
@pytest.mark.parametrize("power", [1.0, 1.3, 2.0, 3.5])
@pytest.mark.parametrize("sigma", [0.3, 1.0, 2.5])
def test_gaussian_integral_power_quadrature_1d(power, sigma):
    out = GaussianOutput(torch.tensor([[[0.7]]], dtype=DT), sigma)
    closed = out.log_integral_power(power).exp().item()
    quad, _ = integrate.quad(lambda z: stats.norm.pdf(z, 0.7, sigma) ** power, -np.inf, np.inf, epsabs=1e-13)
    assert closed == pytest.approx(quad, rel=1e-8)


@pytest.mark.parametrize("power", [1.5, 2.0])
def test_gaussian_integral_power_quadrature_2d(power):
    sigma = 0.8
    out = GaussianOutput(torch.tensor([[[0.2, -0.4]]], dtype=DT), sigma)
    closed = out.log_integral_power(power).exp().item()
    # trapezoid rule on a fine grid: spectrally accurate for a smooth, rapidly decaying integrand
    grid = np.linspace(-8, 8, 1601)
    za, zb = np.meshgrid(grid, grid, indexing="ij")
    pdf = stats.multivariate_normal([0.2, -0.4], sigma**2 * np.eye(2)).pdf(np.stack([za, zb], -1))
    quad = integrate.trapezoid(integrate.trapezoid(pdf**power, grid, axis=1), grid)
    assert closed == pytest.approx(quad, rel=1e-7)


# ---------------------------------------------------------------------------------------------------
# beta-loss
def test_beta_loss_direct_formula_gaussian_and_categorical():
    beta = 1.7
    out, y = _gaussian(d=1, sigma=1.3)
    m = out.mean.numpy()[..., 0]
    yy = y.numpy()[:, 0]
    integral, _ = integrate.quad(lambda z: stats.norm.pdf(z, 0.0, 1.3) ** beta, -np.inf, np.inf, epsabs=1e-13)
    ref = -stats.norm.pdf(yy[None], m, 1.3) ** (beta - 1) / (beta - 1) + integral / beta
    np.testing.assert_allclose(make_loss("beta", beta=beta)(out, y).numpy(), ref, rtol=1e-9)
    out, y = _categorical()
    p = out.log_probs.exp().numpy()
    py = np.take_along_axis(p, y.numpy()[None, :, None].repeat(3, 0), -1)[..., 0]
    ref = -py ** (beta - 1) / (beta - 1) + (p**beta).sum(-1) / beta
    np.testing.assert_allclose(make_loss("beta", beta=beta)(out, y).numpy(), ref, rtol=1e-12)


@pytest.mark.parametrize("make_out", MODERATE)
def test_beta_loss_limit_is_nll(make_out):
    out, y = make_out()
    nll = make_loss("nll")(out, y)
    assert nll.max() < 10
    beta = 1 + 1e-6
    c = beta - 1  # exactly the c the loss sees (1 + 1e-6 is not exact in binary)
    lb = make_loss("beta", beta=beta)(out, y)
    torch.testing.assert_close(lb + 1 / c - 1, nll, atol=1e-4, rtol=0)


@pytest.mark.parametrize("make_out", MODERATE + OUTPUTS)
def test_beta_loss_first_order_in_beta(make_out):
    out, y = make_out()
    nll = make_loss("nll")(out, y)
    # analytic first-order term: L_B + 1/c - 1 = -log p - c [ (log p)^2/2 + 1 + H(p) ] + O(c^2)
    beta = 1 + 1e-5
    c = beta - 1
    lb = make_loss("beta", beta=beta)(out, y)
    slope = (lb + 1 / c - 1 - nll) / c
    torch.testing.assert_close(slope, -(0.5 * nll**2 + 1 + _entropy(out)), atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------------------------------
# gamma-loss
def test_gamma_loss_direct_formula():
    gamma = 2.2
    out, y = _categorical()
    p = out.log_probs.exp().numpy()
    py = np.take_along_axis(p, y.numpy()[None, :, None].repeat(3, 0), -1)[..., 0]
    ref = -gamma / (gamma - 1) * py ** (gamma - 1) / ((p**gamma).sum(-1)) ** ((gamma - 1) / gamma)
    np.testing.assert_allclose(make_loss("gamma", gamma=gamma)(out, y).numpy(), ref, rtol=1e-12)
    out, y = _gaussian(d=1, sigma=0.6)
    m = out.mean.numpy()[..., 0]
    yy = y.numpy()[:, 0]
    integral, _ = integrate.quad(lambda z: stats.norm.pdf(z, 0.0, 0.6) ** gamma, -np.inf, np.inf, epsabs=1e-13)
    ref = -gamma / (gamma - 1) * stats.norm.pdf(yy[None], m, 0.6) ** (gamma - 1) / integral ** ((gamma - 1) / gamma)
    np.testing.assert_allclose(make_loss("gamma", gamma=gamma)(out, y).numpy(), ref, rtol=1e-9)


@pytest.mark.parametrize("make_out", MODERATE)
def test_gamma_loss_limit_is_nll(make_out):
    out, y = make_out()
    nll = make_loss("nll")(out, y)
    assert nll.max() < 10
    gamma = 1 + 1e-6
    c = gamma - 1
    lg = make_loss("gamma", gamma=gamma)(out, y)
    torch.testing.assert_close(lg + (1 + c) / c, nll, atol=1e-4, rtol=0)


@pytest.mark.parametrize("make_out", MODERATE + OUTPUTS)
def test_gamma_loss_first_order_in_gamma(make_out):
    out, y = make_out()
    nll = make_loss("nll")(out, y)
    # analytic first-order term: L_G + gamma/c = -log p - c [ (log p)^2/2 + H(p) - nll ] + O(c^2)
    gamma = 1 + 1e-5
    c = gamma - 1
    lg = make_loss("gamma", gamma=gamma)(out, y)
    slope = (lg + (1 + c) / c - nll) / c
    torch.testing.assert_close(slope, -(0.5 * nll**2 + _entropy(out) - nll), atol=2e-3, rtol=2e-3)


def test_quadratic_is_none_for_non_quadratic_losses():
    model = make_model("gaussian_location", dim=1)
    y = torch.randn(4, 1, dtype=DT)
    for name, hyper in [("gce", {"delta": 0.5}), ("beta", {"beta": 1.5}), ("gamma", {"gamma": 1.5})]:
        assert make_loss(name, **hyper).quadratic(model, None, y) is None
    logistic = make_model("logistic_regression", in_features=2)
    x = torch.randn(4, 2, dtype=DT)
    assert make_loss("nll").quadratic(logistic, x, torch.tensor([0, 1, 1, 0])) is None
    assert make_loss("score_matching", weight="constant").quadratic(logistic, x, torch.tensor([0, 1, 1, 0])) is None


# ---------------------------------------------------------------------------------------------------
# score matching
def _hyvarinen_autograd(loss: ScoreMatchingLoss, m: torch.Tensor, y: torch.Tensor, ref: torch.Tensor, sigma: float):
    """||w grad_y log p||^2 + 2 div_y(w^2 grad_y log p) for one point, straight from the definition with
    autograd (w is a function of y through the residual y - ref)."""
    d = y.shape[0]

    def field(yv):
        w, _ = loss.weights((yv - ref).unsqueeze(0), sigma)
        logp = GaussianOutput(m.view(1, 1, d), sigma).log_prob(yv.unsqueeze(0))[0, 0]
        score = torch.autograd.grad(logp, yv, create_graph=True)[0]
        return w[0], score

    yv = y.clone().requires_grad_(True)
    w, score = field(yv)
    vec = w * w * score
    div = sum(torch.autograd.grad(vec[j], yv, retain_graph=True, create_graph=False)[0][j] for j in range(d))
    return ((w * score) ** 2).sum() + 2 * div


@pytest.mark.parametrize("weight", ["constant", "imq", "se"])
@pytest.mark.parametrize("d", [1, 3])
def test_score_matching_pointwise_matches_definition(weight, d):
    g = torch.Generator().manual_seed(3)
    sigma = 0.8
    loss = make_loss("score_matching", weight=weight, c=1.3, beta_w=0.9)
    m = torch.randn(2, 4, d, generator=g, dtype=DT)
    y = 2 * torch.randn(4, d, generator=g, dtype=DT)
    ref = torch.randn(4, d, generator=g, dtype=DT)
    val = loss(GaussianOutput(m, sigma), y, GaussianOutput(ref.unsqueeze(0), sigma))
    for s in range(2):
        for b in range(4):
            expect = _hyvarinen_autograd(loss, m[s, b], y[b], ref[b], sigma)
            assert val[s, b].item() == pytest.approx(expect.item(), rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("weight", ["imq", "se"])
def test_score_matching_weight_gradient_autograd(weight):
    loss = make_loss("score_matching", weight=weight, c=0.7)
    r = torch.randn(6, 3, dtype=DT, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    w, grad = loss.weights(r, sigma=1.4)
    auto = torch.autograd.grad(w.sum(), r)[0]
    torch.testing.assert_close(grad, auto)
    # default beta_w = sigma / sqrt(2); weights in (0, beta_w]; IMQ and SE closed forms
    r2 = (r.detach() ** 2).sum(-1)
    bw = 1.4 / math.sqrt(2)
    expect = bw / torch.sqrt(1 + r2 / 0.49) if weight == "imq" else bw * torch.exp(-r2 / (2 * 0.49))
    torch.testing.assert_close(w.detach(), expect)


def _sm_problem(kind: str, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind == "location":
        model = make_model("gaussian_location", dim=d, sigma=0.6)
        x = None
        y = torch.randn(7, d, generator=g, dtype=DT) + 0.5
        y[0] += 6.0  # an outlier, so the weights vary
        ndim = d
    else:
        model = make_model("linear_regression", in_features=d, sigma=0.6)
        x = torch.randn(7, d, generator=g, dtype=DT)
        y = torch.randn(7, 1, generator=g, dtype=DT)
        y[1] -= 5.0
        ndim = d + 1
    ref = {"theta": torch.randn(ndim, generator=g, dtype=DT)}
    thetas = torch.randn(5, ndim, generator=g, dtype=DT) * 2
    return model, x, y, ref, thetas


@pytest.mark.parametrize("weight", ["constant", "imq", "se"])
@pytest.mark.parametrize("kind,d", [("location", 1), ("location", 3), ("regression", 1), ("regression", 4)])
def test_score_matching_quadratic_equals_pointwise_sum(weight, kind, d):
    model, x, y, ref, thetas = _sm_problem(kind, d)
    loss = make_loss("score_matching", weight=weight, c=1.5)
    quad = loss.quadratic(model, x, y, reference_theta=ref)
    reference = model.output({"theta": ref["theta"].unsqueeze(0)}, x)
    pointwise = loss(model.output({"theta": thetas}, x), y, reference).sum(-1)  # (S,)
    # no constant dropped: exact equality, not only up to a constant
    torch.testing.assert_close(quad.value(thetas), pointwise, rtol=1e-11, atol=1e-9)
    # the precision is symmetric PSD
    torch.testing.assert_close(quad.precision, quad.precision.T)
    assert torch.linalg.eigvalsh(quad.precision).min() > -1e-10


@pytest.mark.parametrize("kind,d", [("location", 1), ("location", 3), ("regression", 2)])
def test_score_matching_constant_weight_is_nll(kind, d):
    model, x, y, ref, thetas = _sm_problem(kind, d, seed=5)
    sm = make_loss("score_matching", weight="constant").quadratic(model, x, y, reference_theta=ref)
    nll = make_loss("nll").quadratic(model, x, y)
    torch.testing.assert_close(sm.precision, nll.precision, rtol=1e-14, atol=0)
    torch.testing.assert_close(sm.shift, nll.shift, rtol=1e-14, atol=1e-15)
    # per point SM = ||y-m||^2/(2 sigma^2) - D and NLL = ||y-m||^2/(2 sigma^2) + D/2 log(2 pi sigma^2)
    n, dd = y.shape
    diff = nll.value(thetas) - sm.value(thetas)
    torch.testing.assert_close(diff, torch.full_like(diff, n * dd * (1 + 0.5 * math.log(2 * math.pi * 0.36))))
    # and no reference is needed for the constant weight
    sm2 = make_loss("score_matching", weight="constant").quadratic(model, x, y)
    torch.testing.assert_close(sm2.shift, sm.shift)


@pytest.mark.parametrize("weight", ["imq", "se"])
def test_score_matching_conjugate_update_matches_paper_1d(weight):
    """FedGVI section 2.3 (Gaussian location, 1-D): 1/v = 1/v_c + 2/sigma^4 sum w^2,
    mu = v [m_c/v_c + 2/sigma^4 sum w^2 (x - 2 sigma^2 w'/w)]."""
    sigma, mc, vc = 0.9, 0.3, 2.0
    model, _, y, _, _ = _sm_problem("location", 1, seed=2)
    model = make_model("gaussian_location", dim=1, sigma=sigma)
    loss = make_loss("score_matching", weight=weight, c=1.1)
    quad = loss.quadratic(model, None, y, reference_theta={"theta": torch.tensor([mc], dtype=DT)})
    cavity = FullCovarianceGaussian.from_mean_covariance(torch.tensor([mc], dtype=DT), torch.tensor([[vc]], dtype=DT))
    post = cavity * quad.as_factor(cavity)
    w, wp = loss.weights(y - mc, sigma)
    wp = wp[:, 0]
    prec = 1 / vc + 2 / sigma**4 * (w**2).sum()
    mu = (mc / vc + 2 / sigma**4 * (w**2 * (y[:, 0] - 2 * sigma**2 * wp / w)).sum()) / prec
    assert post.precision().item() == pytest.approx(prec.item(), rel=1e-12)
    assert post.mean().item() == pytest.approx(mu.item(), rel=1e-12)


def test_score_matching_errors():
    loss = make_loss("score_matching", weight="imq")
    out, y = _categorical()
    with pytest.raises(TypeError, match="Gaussian"):
        loss(out, y)
    gout, gy = _gaussian()
    with pytest.raises(ValueError, match="reference"):
        loss(gout, gy)
    model = make_model("gaussian_location", dim=2)
    with pytest.raises(ValueError, match="reference"):
        loss.quadratic(model, None, gy)
    # the weights do not depend on theta: no gradient flows through the reference
    m = gout.mean.clone().requires_grad_(True)
    val = loss(GaussianOutput(m, 0.7), gy, GaussianOutput(m[:1], 0.7)).sum()
    (grad,) = torch.autograd.grad(val, m)
    e = gy.unsqueeze(0) - m.detach()
    w, gw = loss.weights(gy - m.detach()[0], 0.7)
    expect = -(2 * w**2 / 0.7**4).unsqueeze(-1) * e + (4 * w / 0.49).unsqueeze(-1) * gw
    torch.testing.assert_close(grad, expect)


# ---- ScaledLoss: the GBI learning rate w ----------------------------------------------------------

@pytest.mark.parametrize("name,hyper", [("nll", {}), ("gce", {"delta": 0.8}), ("beta", {"beta": 1.4})])
def test_scaled_loss_is_weight_times_base(name, hyper):
    out, y = _categorical(seed=3)
    base = make_loss(name, **hyper)
    scaled = weighted(base, 10.0)
    assert isinstance(scaled, ScaledLoss) and scaled.name == name
    torch.testing.assert_close(scaled(out, y), 10.0 * base(out, y), rtol=1e-14, atol=0)
    assert weighted(base, 1.0) is base
    # scaling twice composes into one weight
    twice = ScaledLoss(ScaledLoss(base, 2.0), 3.0)
    assert twice.weight == 6.0 and twice.base is base
    assert scaled.hyperparameters() == {**base.hyperparameters(), "loss_weight": 10.0}


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "2"])
def test_scaled_loss_guards(bad):
    with pytest.raises(ValueError, match="weight"):
        ScaledLoss(make_loss("nll"), bad)


@pytest.mark.parametrize("kind,d", [("location", 1), ("location", 3), ("regression", 2)])
def test_scaled_loss_tempering_equals_weighted_kl(kind, d):
    """FedGVI Lemma B.1: argmin E_q[w L] + KL(q : c) = argmin E_q[L] + (1/w) KL(q : c) = c * exp(-w L),
    checked for the conjugate update, for the optimiser's closed-form path and against the hand-made factor."""
    model, x, y, ref, _ = _sm_problem(kind, d, seed=4)
    ndim = ref["theta"].numel()
    g = torch.Generator().manual_seed(1)
    a = torch.randn(ndim, ndim, generator=g, dtype=DT)
    cavity = FullCovarianceGaussian.from_mean_covariance(torch.randn(ndim, generator=g, dtype=DT),
                                                         a @ a.T / ndim + 0.5 * torch.eye(ndim, dtype=DT))
    w = 3.5
    nll = make_loss("nll")
    by_loss = conjugate_local_posterior(model, weighted(nll, w), make_divergence("kl"), cavity, x, y)
    by_div = conjugate_local_posterior(model, nll, make_divergence("weighted_kl", w=w), cavity, x, y)
    by_hand = cavity * nll.quadratic(model, x, y).as_factor(cavity, weight=w)
    for other in (by_div, by_hand):
        torch.testing.assert_close(by_loss.mean(), other.mean(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(by_loss.covariance(), other.covariance(), rtol=1e-12, atol=1e-12)
    # the tempered posterior is sharper than the untempered one
    plain = conjugate_local_posterior(model, nll, make_divergence("kl"), cavity, x, y)
    assert torch.linalg.eigvalsh(by_loss.precision() - plain.precision()).min() > 0
    # the torch optimiser on the scaled loss reaches the same posterior (closed-form expectation + L-BFGS polish)
    res = local_gvi(model, weighted(nll, w), make_divergence("kl"), cavity, x, y, cavity,
                    LocalGVIConfig(epochs=300, lr=0.05, patience=None, seed=0))
    torch.testing.assert_close(res.posterior.mean(), by_loss.mean(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(res.posterior.covariance(), by_loss.covariance(), rtol=1e-6, atol=1e-6)
