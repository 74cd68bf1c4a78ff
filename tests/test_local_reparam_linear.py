"""Local reparameterisation for the linear models (logistic regression, linear regression, Gaussian location).

A review found that on the weight-sampling path the local optimiser's end-of-epoch evaluation (fixed noise,
``eval_samples`` = ``mc-samples`` = 10 draws of ``theta`` shared by every point) has a minimiser far from the true
one, and the best-state restore returned it: for a 37-point binary logistic regression the returned state was up
to 0.49 nats above the optimum (variances up to 1.6x the optimal ones) where Adam's last iterate was within noise.
Under a mean-field ``q`` these models' per-point outputs are Gaussian with known moments, so they are drawn point by
point (Kingma et al. 2015, as the BNN does): exact in expectation, and the fixed-noise errors average over points.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.divergences import make_divergence
from common.families import MeanFieldGaussian
from common.local_gvi import LocalGVIConfig, _Objective, _select_path, gvi_objective, local_gvi
from common.losses import make_loss
from common.models import make_model
from common.variational import MeanFieldVariational

F64 = torch.float64

# (model, kwargs, x columns, label kind)
CASES = {
    "logistic-binary": ("logistic_regression", {"in_features": 3}, 3, 2),
    "logistic-multiclass": ("logistic_regression", {"in_features": 3, "num_classes": 4}, 3, 4),
    "linear-regression": ("linear_regression", {"in_features": 3, "sigma": 0.7}, 3, None),
    "location-2d": ("gaussian_location", {"dim": 2, "sigma": 0.8}, 0, None),
}


def _data(case: str, n: int = 9, seed: int = 0):
    name, kw, cols, classes = CASES[case]
    g = torch.Generator().manual_seed(seed)
    model = make_model(name, **kw)
    x = torch.randn(n, cols, generator=g, dtype=F64)
    if classes is None:
        y = torch.randn(n, model.event_dim, generator=g, dtype=F64)
    else:
        y = torch.randint(0, classes, (n,), generator=g)
    (size,) = model.param_shapes["theta"]
    mean = 0.5 * torch.randn(size, generator=g, dtype=F64)
    var = 0.2 + torch.rand(size, generator=g, dtype=F64)
    return model, x, y, mean, var


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("loss_name", ["nll", "gce"])
def test_local_reparam_loss_equals_weight_sampling_in_expectation(case: str, loss_name: str) -> None:
    model, x, y, mean, var = _data(case)
    if loss_name == "gce" and not model.is_classifier:
        loss = make_loss("beta", beta=1.5)  # the Gaussian likelihood's robust loss
    else:
        loss = make_loss(loss_name, **({"delta": 0.6} if loss_name == "gce" else {}))
    s = 40_000
    g = torch.Generator().manual_seed(1)
    local = loss(model.output_local_reparam({"theta": mean}, {"theta": var}, x, s, g), y)  # (S, B)
    theta = {"theta": mean + var.sqrt() * torch.randn(s, mean.numel(), generator=g, dtype=F64)}
    weights = loss(model.output(theta, x), y)
    assert local.shape == weights.shape == (s, x.shape[0])
    for per_point in (False, True):  # each point's expectation, and the sum
        a = local if per_point else local.sum(1, keepdim=True)
        b = weights if per_point else weights.sum(1, keepdim=True)
        se = ((a.var(0) + b.var(0)) / s).sqrt()
        z = ((a.mean(0) - b.mean(0)) / se).abs()
        assert float(z.max()) < 4.5, (per_point, z)


@pytest.mark.parametrize("case", ["linear-regression", "location-2d"])
def test_local_reparam_nll_matches_the_closed_form_expectation(case: str) -> None:
    model, x, y, mean, var = _data(case)
    quad = model.nll_quadratic(x, y)
    exact = float(quad.expectation(mean, torch.diag(var)))
    s = 200_000
    out = model.output_local_reparam({"theta": mean}, {"theta": var}, x, s, torch.Generator().manual_seed(2))
    total = make_loss("nll")(out, y).sum(1)
    assert abs(float(total.mean()) - exact) < 4.5 * float(total.std()) / math.sqrt(s)


def test_local_reparam_is_differentiable_and_seeded() -> None:
    model, x, y, mean, var = _data("logistic-multiclass")
    m, v = mean.clone().requires_grad_(), var.clone().requires_grad_()
    out = model.output_local_reparam({"theta": m}, {"theta": v}, x, 5, torch.Generator().manual_seed(3))
    make_loss("nll")(out, y).sum().backward()
    assert m.grad is not None and v.grad is not None and bool(torch.isfinite(m.grad).all() & (v.grad != 0).any())
    again = model.output_local_reparam({"theta": mean}, {"theta": var}, x, 5, torch.Generator().manual_seed(3))
    assert torch.equal(out.logits.detach(), again.logits)
    with pytest.raises(ValueError, match=r"x must have shape \(B, 3\)"):
        model.output_local_reparam({"theta": mean}, {"theta": var}, x[:, :2], 5)


@pytest.mark.parametrize("local_reparam, path", [(True, "mc_local_reparam"), (False, "mc_weights")])
def test_mean_field_logistic_regression_takes_the_local_path(local_reparam: bool, path: str) -> None:
    model, x, y, mean, var = _data("logistic-binary")
    cavity = MeanFieldGaussian.from_mean_variance({"theta": mean}, {"theta": var})
    cfg = LocalGVIConfig(local_reparam=local_reparam)
    obj = _Objective(model, make_loss("nll"), make_divergence("kl"), cavity, x, y, cfg, F64)
    assert _select_path(obj, MeanFieldVariational(cavity), cfg) == path


def _gaps_to_the_optimum(cavity, seeds: int, path: str) -> list[float]:  # noqa: ANN001
    """The review's case (37 points, binary logistic regression, NLL + KL from the cavity): how far above the local
    optimum (quadrature, polished) the state each seed's default run returns lies, in the exact objective."""
    g = torch.Generator().manual_seed(5)
    n = 37
    x = torch.randn(n, 1, generator=g, dtype=F64)
    y = (torch.rand(n, generator=g) < torch.sigmoid(2 * x[:, 0])).long()
    model = make_model("logistic_regression", in_features=1)
    loss, div = make_loss("nll"), make_divergence("kl")
    quadrature = LocalGVIConfig(quadrature_points=20)
    optimum = local_gvi(model, loss, div, cavity, x, y, None,
                        LocalGVIConfig(init="cavity", quadrature_points=20, epochs=4000, lr=0.02, patience=None))
    best = gvi_objective(model, loss, div, cavity, x, y, optimum.posterior, quadrature)
    gaps = []
    for seed in range(seeds):
        r = local_gvi(model, loss, div, cavity, x, y, None, LocalGVIConfig(init="cavity", seed=seed, epochs=600))
        assert r.path == path
        gaps.append(gvi_objective(model, loss, div, cavity, x, y, r.posterior, quadrature) - best)
    return gaps


def test_the_returned_state_is_near_the_optimum_for_every_seed() -> None:
    # 10 seeds, default settings (lr 1e-2, 10 samples, patience 10, fixed-noise end-of-epoch evaluation); on the
    # weight-sampling path the returned states were 0.11 nats above the optimum on average, 0.49 at worst; drawn
    # point by point, 0.007 on average and 0.02 at worst
    cavity = MeanFieldGaussian.from_mean_variance({"theta": torch.zeros(2, dtype=F64)}, {"theta": torch.ones(2, dtype=F64)})
    gaps = _gaps_to_the_optimum(cavity, 10, "mc_local_reparam")
    assert min(gaps) > -1e-6 and max(gaps) < 0.05 and sum(gaps) / len(gaps) < 0.02, gaps


# ---------------------------------------------------------------------------------- full-covariance q
def _scale_tril(d: int, seed: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.tril(0.3 * torch.randn(d, d, generator=g, dtype=F64), -1) + torch.diag(0.4 + torch.rand(d, generator=g, dtype=F64))


@pytest.mark.parametrize("case", list(CASES))
def test_full_covariance_local_reparam_equals_weight_sampling_in_expectation(case: str) -> None:
    model, x, y, mean, _ = _data(case)
    scale = _scale_tril(mean.numel())
    loss = make_loss("gce", delta=0.6) if model.is_classifier else make_loss("beta", beta=1.5)
    s = 40_000
    g = torch.Generator().manual_seed(6)
    local = loss(model.output_local_reparam_full(mean, scale, x, s, g), y)  # (S, B)
    theta = {"theta": mean + torch.randn(s, mean.numel(), generator=g, dtype=F64) @ scale.T}
    weights = loss(model.output(theta, x), y)
    assert local.shape == weights.shape == (s, x.shape[0])
    for a, b in ((local, weights), (local.sum(1, keepdim=True), weights.sum(1, keepdim=True))):
        z = ((a.mean(0) - b.mean(0)) / ((a.var(0) + b.var(0)) / s).sqrt()).abs()
        assert float(z.max()) < 4.5, z


@pytest.mark.parametrize("case", ["logistic-multiclass", "location-2d"])
def test_full_covariance_local_draws_have_the_points_joint_covariance(case: str) -> None:
    # the classes' logits (the location's coordinates) of one point are correlated as q makes them: their sample
    # covariance is Phi_b L L^T Phi_b^T, which a per-coordinate (mean-field) draw would miss
    model, x, y, mean, _ = _data(case)
    scale = _scale_tril(mean.numel())
    s = 200_000
    out = model.output_local_reparam_full(mean, scale, x, s, torch.Generator().manual_seed(7))
    draws = out.logits[..., :] if model.is_classifier else out.mean  # (S, B, K)
    theta = mean + torch.randn(s, mean.numel(), generator=torch.Generator().manual_seed(8), dtype=F64) @ scale.T
    ref = model.output({"theta": theta}, x)
    ref_draws = ref.logits if model.is_classifier else ref.mean
    for b in range(2):
        c1 = torch.cov(draws[:, b, :].T)
        c2 = torch.cov(ref_draws[:, b, :].T)
        assert float((c1 - c2).abs().max()) < 0.05 * float(c2.abs().max()), (c1, c2)
        assert float(c2.abs().max()) > 0 and float((c2 - torch.diag(c2.diagonal())).abs().max()) > 0.02


def test_full_covariance_logistic_regression_takes_the_local_path_and_finds_the_optimum() -> None:
    from common.families import FullCovarianceGaussian

    cavity = FullCovarianceGaussian.from_mean_covariance(torch.zeros(2, dtype=F64), torch.eye(2, dtype=F64))
    gaps = _gaps_to_the_optimum(cavity, 6, "mc_local_reparam_full")
    # weight sampling (the old path) was 0.16 nats above the optimum on average over these seeds, 0.58 at worst;
    # drawn point by point 0.033 and 0.063 (seeds 0-9: 0.13 / 0.58 against 0.05 / 0.15)
    assert min(gaps) > -1e-6 and max(gaps) < 0.1 and sum(gaps) / len(gaps) < 0.05, gaps


@pytest.mark.parametrize("name, kw", [("logistic_regression", {"in_features": 2, "bias": False}),
                                      ("linear_regression", {"in_features": 2, "bias": False})])
def test_a_point_without_features_and_bias_has_zero_variance_and_finite_gradients(name: str, kw: dict) -> None:
    # a review: an all-zero row without a bias has output variance exactly 0, and sqrt's infinite derivative times
    # 0 made every gradient NaN (NonFiniteError after epoch 1 where weight sampling ran)
    model = make_model(name, **kw)
    x = torch.tensor([[0.0, 0.0], [1.0, -2.0]], dtype=F64)
    y = torch.tensor([1, 0]) if model.is_classifier else torch.tensor([[0.5], [-1.0]], dtype=F64)
    m = torch.tensor([0.3, -0.2], dtype=F64, requires_grad=True)
    v = torch.tensor([0.5, 0.7], dtype=F64, requires_grad=True)
    out = model.output_local_reparam({"theta": m}, {"theta": v}, x, 8, torch.Generator().manual_seed(0))
    draws = out.logits[..., 1] if model.is_classifier else out.mean[..., 0]
    assert bool((draws[:, 0] == 0).all()) and float(draws[:, 1].std()) > 0
    loss = make_loss("nll") if model.is_classifier else make_loss("beta", beta=1.5)
    loss(out, y).sum().backward()
    assert bool(torch.isfinite(m.grad).all() & torch.isfinite(v.grad).all())
