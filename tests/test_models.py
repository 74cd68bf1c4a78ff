"""Oracles for common/models.py: closed forms, quadrature and Monte Carlo agreement of the BNN's two paths."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.families import FullCovarianceGaussian, MeanFieldGaussian
from common.likelihoods import CategoricalOutput, GaussianOutput
from common.losses import make_loss
from common.models import MODELS, BayesianMLP, make_model

DT = torch.float64


# ---------------------------------------------------------------------------------------------------
# registry and guards
def test_registry():
    assert set(MODELS.names()) == {"gaussian_location", "linear_regression", "logistic_regression", "bnn"}
    with pytest.raises(KeyError, match="known: bnn, gaussian_location"):
        make_model("resnet")
    with pytest.raises(TypeError, match="unknown argument"):
        make_model("gaussian_location", in_features=3)


@pytest.mark.parametrize(
    "name,kw,match",
    [
        ("gaussian_location", {"dim": 0}, "dim"),
        ("gaussian_location", {"sigma": 0.0}, "sigma"),
        ("gaussian_location", {"sigma": float("nan")}, "sigma"),
        ("linear_regression", {"in_features": 0}, "in_features"),
        ("linear_regression", {"in_features": 2, "sigma": -1.0}, "sigma"),
        ("logistic_regression", {"in_features": 2, "num_classes": 1}, "num_classes"),
        ("logistic_regression", {"in_features": 2.5}, "in_features"),
        ("bnn", {"in_features": 4, "hidden": [3, 0], "num_classes": 2}, "hidden"),
        ("bnn", {"in_features": 4, "hidden": "3", "num_classes": 2}, "hidden"),
        ("bnn", {"in_features": 4, "hidden": [3], "num_classes": 1}, "num_classes"),
    ],
)
def test_guards(name, kw, match):
    with pytest.raises(ValueError, match=match):
        make_model(name, **kw)


def test_theta_shape_checked():
    model = make_model("linear_regression", in_features=3)
    x = torch.randn(4, 3, dtype=DT)
    with pytest.raises(ValueError, match="shape"):
        model.output({"theta": torch.zeros(4, dtype=DT)}, x)  # no sample dim
    with pytest.raises(KeyError, match="missing"):
        model.output({"w": torch.zeros(1, 4, dtype=DT)}, x)
    with pytest.raises(ValueError, match="x must have shape"):
        model.output({"theta": torch.zeros(1, 4, dtype=DT)}, torch.randn(4, 2, dtype=DT))


# ---------------------------------------------------------------------------------------------------
# Gaussian models
def test_gaussian_location_output():
    model = make_model("gaussian_location", dim=3, sigma=0.5)
    assert model.param_shapes == {"theta": (3,)} and not model.is_classifier
    theta = torch.randn(4, 3, dtype=DT)
    y = torch.randn(6, 3, dtype=DT)
    for x in (None, torch.zeros(6, 0, dtype=DT)):
        out = model.output({"theta": theta}, x)
        assert isinstance(out, GaussianOutput) and out.sigma == 0.5
        lp = out.log_prob(y)
        assert lp.shape == (4, 6)
        expect = -0.5 * ((y[None] - theta[:, None]) ** 2).sum(-1) / 0.25 - 1.5 * math.log(2 * math.pi * 0.25)
        torch.testing.assert_close(lp, expect)


def test_linear_regression_output():
    model = make_model("linear_regression", in_features=2, sigma=0.3)
    assert model.param_shapes == {"theta": (3,)}
    theta = torch.randn(5, 3, dtype=DT)
    x = torch.randn(7, 2, dtype=DT)
    out = model.output({"theta": theta}, x)
    assert out.mean.shape == (5, 7, 1)
    expect = x @ theta[:, :2].T + theta[:, 2]  # (7, 5): bias last
    torch.testing.assert_close(out.mean[..., 0], expect.T)
    nobias = make_model("linear_regression", in_features=2, bias=False)
    assert nobias.param_shapes == {"theta": (2,)}
    torch.testing.assert_close(nobias.output({"theta": theta[:, :2]}, x).mean[..., 0], (x @ theta[:, :2].T).T)


@pytest.mark.parametrize(
    "name,kw", [("gaussian_location", {"dim": 1}), ("gaussian_location", {"dim": 3}),
                ("linear_regression", {"in_features": 4}), ("linear_regression", {"in_features": 1, "bias": False})]
)
def test_nll_quadratic_equals_sum_of_neg_log_prob(name, kw):
    g = torch.Generator().manual_seed(0)
    model = make_model(name, sigma=0.7, **kw)
    n = 9
    (d,) = model.param_shapes["theta"]
    x = None if name == "gaussian_location" else torch.randn(n, kw["in_features"], generator=g, dtype=DT)
    y = torch.randn(n, model.event_dim, generator=g, dtype=DT) * 2
    quad = model.nll_quadratic(x, y)
    thetas = 3 * torch.randn(6, d, generator=g, dtype=DT)
    direct = -model.output({"theta": thetas}, x).log_prob(y).sum(-1)
    # differences between thetas (the part that matters for inference) ...
    torch.testing.assert_close(quad.value(thetas) - quad.value(thetas[:1]), direct - direct[:1], rtol=1e-12, atol=1e-10)
    # ... and, since the constant is kept, the values themselves
    torch.testing.assert_close(quad.value(thetas), direct, rtol=1e-12, atol=1e-10)
    # the NLL loss routes to it
    torch.testing.assert_close(make_loss("nll").quadratic(model, x, y).shift, quad.shift)


def test_nll_quadratic_conjugate_posterior_location():
    """Conjugate Bayes (FedGVI section 2.3): 1/v = 1/v_c + n/sigma^2, mu = v (m_c/v_c + sum y / sigma^2)."""
    model = make_model("gaussian_location", dim=1, sigma=0.8)
    y = torch.tensor([[0.3], [1.2], [-0.4], [2.0]], dtype=DT)
    prior = FullCovarianceGaussian.from_mean_covariance(torch.tensor([0.5], dtype=DT), torch.tensor([[2.0]], dtype=DT))
    post = prior * model.nll_quadratic(None, y).as_factor(prior)
    v = 1 / (1 / 2.0 + 4 / 0.64)
    assert post.covariance().item() == pytest.approx(v, rel=1e-13)
    assert post.mean().item() == pytest.approx(v * (0.5 / 2.0 + float(y.sum()) / 0.64), rel=1e-13)


def test_score_matching_quadratic_shape_checks():
    model = make_model("linear_regression", in_features=2)
    x, y = torch.randn(3, 2, dtype=DT), torch.randn(3, 1, dtype=DT)
    with pytest.raises(ValueError, match="w must be"):
        model.score_matching_quadratic(x, y, torch.ones(2, dtype=DT), torch.zeros(3, 1, dtype=DT))
    with pytest.raises(ValueError, match="y must have shape"):
        model.nll_quadratic(x, torch.randn(3, 2, dtype=DT))
    # y of shape (B,) is accepted for one-dimensional outputs
    torch.testing.assert_close(model.nll_quadratic(x, y[:, 0]).shift, model.nll_quadratic(x, y).shift)


# ---------------------------------------------------------------------------------------------------
# logistic regression
def test_logistic_binary_is_sigmoid():
    model = make_model("logistic_regression", in_features=3)
    assert model.is_classifier and model.param_shapes == {"theta": (4,)}
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(5, 4, generator=g, dtype=DT)
    x = torch.randn(8, 3, generator=g, dtype=DT)
    out = model.output({"theta": theta}, x)
    assert isinstance(out, CategoricalOutput) and out.logits.shape == (5, 8, 2)
    z = theta[:, :3] @ x.T + theta[:, 3:]
    torch.testing.assert_close(out.log_probs[..., 1].exp(), torch.sigmoid(z))
    torch.testing.assert_close(out.log_prob(torch.ones(8)), torch.nn.functional.logsigmoid(z))


def test_logistic_multiclass():
    model = make_model("logistic_regression", in_features=3, num_classes=4)
    assert model.param_shapes == {"theta": (16,)}
    g = torch.Generator().manual_seed(2)
    theta = torch.randn(2, 16, generator=g, dtype=DT)
    x = torch.randn(5, 3, generator=g, dtype=DT)
    out = model.output({"theta": theta}, x)
    assert out.logits.shape == (2, 5, 4)
    w = theta.view(2, 4, 4)  # row-major (num_classes, in + 1), bias last
    expect = torch.einsum("sci,bi->sbc", w[..., :3], x) + w[..., 3].unsqueeze(1)
    torch.testing.assert_close(out.logits, expect)
    torch.testing.assert_close(out.log_probs.exp().sum(-1), torch.ones(2, 5, dtype=DT))


def test_logistic_predictive_probs_against_quadrature():
    """E_q[sigmoid(theta . phi)] with theta ~ N(m, S) is a 1-D Gaussian integral over z = theta . phi."""
    model = make_model("logistic_regression", in_features=2)
    m = torch.tensor([0.5, -1.0, 0.2], dtype=DT)
    a = torch.tensor([[0.8, 0.1, 0.0], [0.3, 0.6, 0.0], [0.1, -0.2, 0.5]], dtype=DT)
    q = FullCovarianceGaussian.from_mean_covariance(m, a @ a.T)
    x = torch.tensor([[1.0, 2.0], [-0.5, 0.3], [2.0, -1.0]], dtype=DT)
    n = 20000
    probs = model.predictive_probs(q, x, n, generator=torch.Generator().manual_seed(0))
    assert probs.shape == (3, 2)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, dtype=DT))
    phi = torch.cat([x, torch.ones(3, 1, dtype=DT)], 1)
    mu_z, sd_z = phi @ m, ((phi @ (a @ a.T)) * phi).sum(-1).sqrt()
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    exact = (weights[None] * (1 / (1 + np.exp(-(mu_z.numpy()[:, None] + sd_z.numpy()[:, None] * nodes[None]))))).sum(
        -1) / math.sqrt(2 * math.pi)
    # Monte Carlo error of a mean of n values in [0, 1]: at most 0.5/sqrt(n)
    assert np.abs(probs[:, 1].numpy() - exact).max() < 5 * 0.5 / math.sqrt(n)
    with pytest.raises(TypeError, match="not a classifier"):
        make_model("gaussian_location").predictive_probs(q, x, 3)


def test_logistic_predictive_probs_mean_field_multiclass():
    model = make_model("logistic_regression", in_features=3, num_classes=3)
    q = MeanFieldGaussian.isotropic(model.param_shapes, 0.0, 0.5)
    x = torch.randn(4, 3, dtype=DT)
    probs = model.predictive_probs(q, x, 7, generator=torch.Generator().manual_seed(0))
    assert probs.shape == (4, 3)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, dtype=DT))


# ---------------------------------------------------------------------------------------------------
# BNN
def _small_bnn(hidden=(4, 3)):
    model = make_model("bnn", in_features=5, hidden=list(hidden), num_classes=3)
    g = torch.Generator().manual_seed(0)
    mean = model.init_mean(generator=g, scale=1.5, dtype=DT)
    mean = {k: v + 0.2 * torch.randn(v.shape, generator=g, dtype=DT) for k, v in mean.items()}
    var = {k: 0.05 + 0.3 * torch.rand(v.shape, generator=g, dtype=DT) for k, v in mean.items()}
    x = torch.randn(6, 5, generator=g, dtype=DT)
    y = torch.randint(0, 3, (6,), generator=g)
    return model, mean, var, x, y


def test_bnn_layout():
    model = make_model("bnn", in_features=784, hidden=[200], num_classes=10)
    assert isinstance(model, BayesianMLP) and model.is_classifier
    assert model.param_shapes == {"layers.0.weight": (200, 784), "layers.0.bias": (200,),
                                  "layers.1.weight": (10, 200), "layers.1.bias": (10,)}
    assert model.num_params == 784 * 200 + 200 + 200 * 10 + 10
    assert list(make_model("bnn", in_features=3, hidden=[], num_classes=2).param_shapes) == [
        "layers.0.weight", "layers.0.bias"]


def test_bnn_exact_forward_matches_manual():
    model, mean, var, x, _ = _small_bnn()
    q = MeanFieldGaussian.from_mean_variance(mean, var)
    theta = q.rsample(3, generator=torch.Generator().manual_seed(1))
    logits = model.output(theta, x).logits
    assert logits.shape == (3, 6, 3)
    for s in range(3):
        h = x
        for i in range(3):
            h = h @ theta[f"layers.{i}.weight"][s].T + theta[f"layers.{i}.bias"][s]
            if i < 2:
                h = torch.relu(h)
        torch.testing.assert_close(logits[s], h)


def test_bnn_first_layer_moments_exact_and_mc():
    model, mean, var, x, _ = _small_bnn()
    mu, v = model.preactivation_moments(0, mean, var, x)
    w_m, b_m, w_v, b_v = (mean["layers.0.weight"], mean["layers.0.bias"], var["layers.0.weight"], var["layers.0.bias"])
    for b in range(6):
        for j in range(4):
            assert mu[b, j].item() == pytest.approx(sum(x[b, i].item() * w_m[j, i].item() for i in range(5))
                                                    + b_m[j].item(), rel=1e-12)
            assert v[b, j].item() == pytest.approx(sum(x[b, i].item() ** 2 * w_v[j, i].item() for i in range(5))
                                                   + b_v[j].item(), rel=1e-12)
    # against weight sampling: pre-activations x W^T + b with W ~ q
    n = 20000
    q = MeanFieldGaussian.from_mean_variance({k: mean[k] for k in ("layers.0.weight", "layers.0.bias")},
                                             {k: var[k] for k in ("layers.0.weight", "layers.0.bias")})
    th = q.rsample(n, generator=torch.Generator().manual_seed(2))
    pre = torch.einsum("bi,sji->sbj", x, th["layers.0.weight"]) + th["layers.0.bias"][:, None]
    z_mean = (pre.mean(0) - mu) / (v / n).sqrt()
    assert z_mean.abs().max() < 5
    # sample variance of a Gaussian has standard error var * sqrt(2/(n-1))
    z_var = (pre.var(0) - v) / (v * math.sqrt(2 / (n - 1)))
    assert z_var.abs().max() < 5


def test_bnn_single_layer_local_reparam_is_exact_gaussian():
    """With no hidden layer the local-reparameterised logits are N(mu, var) of the moments."""
    model, mean, var, x, _ = _small_bnn(hidden=())
    n = 20000
    logits = model.output_local_reparam(mean, var, x, n, generator=torch.Generator().manual_seed(3)).logits
    mu, v = model.preactivation_moments(0, mean, var, x)
    assert ((logits.mean(0) - mu) / (v / n).sqrt()).abs().max() < 5
    assert ((logits.var(0) - v) / (v * math.sqrt(2 / (n - 1)))).abs().max() < 5


def _two_path_samples(model, mean, var, x, n, seed):
    q = MeanFieldGaussian.from_mean_variance(mean, var)
    exact = model.output(q.rsample(n, generator=torch.Generator().manual_seed(seed)), x)
    local = model.output_local_reparam(mean, var, x, n, generator=torch.Generator().manual_seed(seed + 1))
    return exact, local


def test_bnn_local_reparam_agrees_with_weight_sampling_in_expectation():
    model, mean, var, x, y = _small_bnn()
    n = 20000
    exact, local = _two_path_samples(model, mean, var, x, n, seed=10)
    # E[softmax]: per (point, class), difference of two independent MC means within 5 standard errors
    pe, pl = exact.log_probs.exp(), local.log_probs.exp()
    se = (pe.var(0) / n + pl.var(0) / n).sqrt()
    z = (pe.mean(0) - pl.mean(0)) / se
    assert z.abs().max() < 5, z
    # E[sum_b NLL] and E[GCE]
    nll = make_loss("nll")
    for loss in (nll, make_loss("gce", delta=0.5)):
        le, ll = loss(exact, y).sum(-1), loss(local, y).sum(-1)
        z = (le.mean() - ll.mean()) / (le.var() / n + ll.var() / n).sqrt()
        assert abs(z) < 5
    # same per-point marginals, but the local path samples the points independently: the correlation of two
    # points' losses is ~0 there (within 5/sqrt(n)), while shared weights correlate them in the exact path
    corr_local = torch.corrcoef(nll(local, y).T)
    corr_exact = torch.corrcoef(nll(exact, y).T)
    off = ~torch.eye(6, dtype=torch.bool)
    assert corr_local[off].abs().max() < 5 / math.sqrt(n)
    assert corr_exact[off].abs().max() > 10 / math.sqrt(n)


def test_bnn_local_reparam_gradients_agree_with_weight_sampling():
    """grad_{mean, variance} E_q[sum_b NLL] by both paths (exact path: theta = m + sqrt(v) eps)."""
    model, mean, var, x, y = _small_bnn()
    nll = make_loss("nll")
    batches, per = 40, 500

    def grads(local: bool, seed: int):
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(batches):
            m = {k: t.clone().requires_grad_(True) for k, t in mean.items()}
            v = {k: t.clone().requires_grad_(True) for k, t in var.items()}
            if local:
                o = model.output_local_reparam(m, v, x, per, generator=g)
            else:
                th = {k: m[k] + v[k].sqrt() * torch.randn((per, *m[k].shape), generator=g, dtype=DT) for k in m}
                o = model.output(th, x)
            val = nll(o, y).mean(0).sum()
            gs = torch.autograd.grad(val, [*m.values(), *v.values()])
            out.append(torch.cat([t.reshape(-1) for t in gs]))
        return torch.stack(out)  # (batches, n_params * 2)

    ge, gl = grads(False, 0), grads(True, 1)
    diff = ge.mean(0) - gl.mean(0)
    se = (ge.var(0) / batches + gl.var(0) / batches).sqrt()
    z = diff / se.clamp_min(1e-12)
    assert z.abs().max() < 5.5, z.abs().max()  # 2 * 2 * 43 comparisons


def test_bnn_local_reparam_gradients_flow_and_determinism():
    model, mean, var, x, y = _small_bnn()
    m = {k: t.clone().requires_grad_(True) for k, t in mean.items()}
    v = {k: t.clone().requires_grad_(True) for k, t in var.items()}
    out = model.output_local_reparam(m, v, x, 4, generator=torch.Generator().manual_seed(7))
    assert out.logits.shape == (4, 6, 3)
    make_loss("nll")(out, y).mean(0).sum().backward()
    for t in [*m.values(), *v.values()]:
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0
    again = model.output_local_reparam(mean, var, x, 4, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(again.logits, out.logits.detach(), rtol=0, atol=0)
    other = model.output_local_reparam(mean, var, x, 4, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(other.logits, again.logits)


def test_bnn_float32_and_input_cast():
    model = make_model("bnn", in_features=784, hidden=[200], num_classes=10)
    g = torch.Generator().manual_seed(0)
    mean = model.init_mean(generator=g)
    var = {k: torch.full_like(t, 1e-3) for k, t in mean.items()}
    x = torch.rand(32, 784, dtype=DT)  # cast to the parameters' float32
    out = model.output_local_reparam(mean, var, x, 10, generator=g)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (10, 32, 10)
    assert torch.isfinite(out.logits).all()


def test_bnn_init_mean():
    model = make_model("bnn", in_features=400, hidden=[300], num_classes=10)
    a = model.init_mean(generator=torch.Generator().manual_seed(0), scale=2.0, dtype=DT)
    b = model.init_mean(generator=torch.Generator().manual_seed(0), scale=2.0, dtype=DT)
    assert all(torch.equal(a[k], b[k]) for k in a) and a.keys() == model.param_shapes.keys()
    for k, shape in model.param_shapes.items():
        assert tuple(a[k].shape) == shape
    assert (a["layers.0.bias"] == 0).all()
    # weights N(0, scale^2 / fan_in): sample std within 2 % (120k and 3k draws)
    assert a["layers.0.weight"].std().item() == pytest.approx(2.0 / math.sqrt(400), rel=0.02)
    assert a["layers.1.weight"].std().item() == pytest.approx(2.0 / math.sqrt(300), rel=0.05)
    with pytest.raises(ValueError, match="scale"):
        model.init_mean(scale=0.0)


def test_bnn_predictive_probs():
    model, mean, var, x, _ = _small_bnn()
    q = MeanFieldGaussian.from_mean_variance(mean, var)
    n = 20000
    probs = model.predictive_probs(q, x, n, generator=torch.Generator().manual_seed(4))
    assert probs.shape == (6, 3)
    torch.testing.assert_close(probs.sum(-1), torch.ones(6, dtype=DT))
    pe = model.output(q.rsample(n, generator=torch.Generator().manual_seed(5)), x).log_probs.exp()
    z = (probs - pe.mean(0)) / (2 * pe.var(0) / n).sqrt()  # both estimators have ~ the same per-point variance
    assert z.abs().max() < 5
    with pytest.raises(TypeError, match="MeanFieldGaussian"):
        model.predictive_probs(FullCovarianceGaussian.uniform(3), x, 3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float32: the fused kernels where they apply
def test_bnn_local_reparam_refuses_the_moments_of_another_network(dtype):
    """The local-reparameterisation passes take every size from the tensors: a posterior of a 3-7-3 network ran
    as that network in a 3-4-3 model (the exact path refused it).  Each pass now refuses it as that path does."""
    g = torch.Generator().manual_seed(0)
    model, other = BayesianMLP(3, [4], 3), BayesianMLP(3, [7], 3)
    var7 = {k: torch.full(sh, 0.01, dtype=dtype) for k, sh in other.param_shapes.items()}
    q7 = MeanFieldGaussian.from_mean_variance({k: v.to(dtype) for k, v in other.init_mean(g).items()}, var7)
    x, y = torch.randn(5, 3, dtype=dtype), torch.randint(0, 3, (5,))
    shape = r"'layers\.0\.weight' must have shape \(4, 3\), got \(7, 3\)"
    with pytest.raises(ValueError, match=shape):
        model.predictive_probs(q7, x, 10)
    with pytest.raises(ValueError, match=shape):
        model.output_local_reparam(q7.mean(), q7.variance(), x, 2)
    with pytest.raises(ValueError, match=shape):
        model.expected_loss_local_reparam(q7.mean(), q7.variance(), x, y, 2, make_loss("nll"))
    mean = dict(model.init_mean(g))
    del mean["layers.1.bias"]
    with pytest.raises(ValueError, match="the mean is over"):
        model.output_local_reparam(mean, {k: torch.full(sh, 0.01) for k, sh in model.param_shapes.items()}, x, 2)


def test_bnn_flops():
    model = make_model("bnn", in_features=784, hidden=[200], num_classes=10)
    assert model.flops_per_point(False) == 2 * (784 * 200 + 200 * 10)
    assert model.flops_per_point(False, n_samples=10) == 10 * 2 * (784 * 200 + 200 * 10)
    assert model.flops_per_point(True, n_samples=10) == 2 * 2 * (784 * 200 + 10 * 200 * 10)
    assert model.forward_flops(256, 10, True) == 256 * model.flops_per_point(True, n_samples=10)
    with pytest.raises(ValueError, match="n_samples"):
        model.flops_per_point(True)


@pytest.mark.parametrize("kind", ["bnn", "logistic"])
def test_predictive_log_probs_are_the_log_of_the_predictive_and_exact_where_it_underflows(kind):
    """``predictive_log_probs`` = log of ``predictive_probs`` (same draws), and stays exact for a predictive so
    confident that the averaged probability of a class is below float64's smallest number."""
    if kind == "bnn":
        model, mean, var, x, _ = _small_bnn()
        q = MeanFieldGaussian.from_mean_variance(mean, var)
        big = MeanFieldGaussian.from_mean_variance({k: 400.0 * v for k, v in mean.items()},
                                                   {k: 1e-6 * torch.ones_like(v) for k, v in var.items()})
    else:
        model = make_model("logistic_regression", in_features=2)
        q = FullCovarianceGaussian.from_mean_covariance(torch.tensor([0.5, -1.0, 0.2], dtype=DT),
                                                        0.3 * torch.eye(3, dtype=DT))
        big = FullCovarianceGaussian.from_mean_covariance(torch.tensor([900.0, -700.0, 0.0], dtype=DT),
                                                          1e-6 * torch.eye(3, dtype=DT))
        x = torch.tensor([[1.0, 2.0], [-0.5, 0.3], [2.0, -1.0]], dtype=DT)
    lp = model.predictive_log_probs(q, x, 50, generator=torch.Generator().manual_seed(1))
    p = model.predictive_probs(q, x, 50, generator=torch.Generator().manual_seed(1))
    assert lp.dtype == torch.float64
    torch.testing.assert_close(lp.exp(), p.double(), rtol=1e-6, atol=1e-12)
    # reference: logsumexp over the same S samples of the per-sample log-softmax, minus log S
    lp_big = model.predictive_log_probs(big, x, 7, generator=torch.Generator().manual_seed(2))
    assert torch.isfinite(lp_big).all() and lp_big.min() < -800  # exp() of it is 0 even in float64
    assert (model.predictive_probs(big, x, 7, generator=torch.Generator().manual_seed(2)) == 0).any()
    torch.testing.assert_close(torch.logsumexp(lp_big, -1), torch.zeros(len(x), dtype=torch.float64))


def test_chunked_predictive_of_a_certain_class_never_exceeds_log_one():
    """Softmax regression on 600 points of 784 features draws one posterior sample per chunk, so the mixture is a
    chain of 200 logaddexps; with a class certain under every draw the chain's rounding used to leave log p at
    +4e-16..9e-16 and the server's metrics refused exp(log p) > 1 (every round's evaluation raised)."""
    from common.evaluation import evaluate_posterior
    from common.problem import Problem

    m = make_model("logistic_regression", in_features=784, num_classes=10)
    mean = torch.zeros(m.num_params, dtype=torch.float64)
    mean.view(10, 785)[3, 784] = 60.0  # class-3 bias: p(3 | x) = 1 - 1e-25 under every draw
    q = MeanFieldGaussian.from_mean_variance({"theta": mean}, {"theta": torch.full_like(mean, 1e-4)})
    x = np.random.default_rng(0).random((600, 784)) * 0.01
    lp = m.predictive_log_probs(q, torch.as_tensor(x), 200, generator=torch.Generator().manual_seed(0))
    assert float(lp.max()) <= 0.0
    prob = Problem(None, m, None, None, None, None, None, torch.float64)
    out = evaluate_posterior(prob, q, x, np.full(600, 3), 200, seed=0)
    assert out["accuracy"] == 1.0 and out["nll"] < 1e-20
