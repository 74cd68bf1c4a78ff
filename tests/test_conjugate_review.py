"""Findings of the stop-30 review of the closed forms (score matching, the loss weight, the config's model/dataset
pairs). Each test failed on the code before its fix."""
from __future__ import annotations

import pytest
import torch

from common.config import ConfigError, parse_run_config
from common.conjugate import conjugate_local_posterior
from common.divergences import make_divergence
from common.families import MeanFieldGaussian
from common.losses import ScaledLoss, make_loss
from common.models import make_model


def _location_posterior(scale: float, loss_name: str, dtype: torch.dtype, **hyper) -> tuple[float, float]:
    """The conjugate posterior of a 1-D location problem whose data, noise scale and prior are in units of
    ``scale``, returned in those units (a change of units must not change it)."""
    g = torch.Generator().manual_seed(0)
    y = ((1.5 + torch.randn(20, 1, generator=g, dtype=torch.float64)) * scale).to(dtype)
    model = make_model("gaussian_location", dim=1, sigma=scale)
    cavity = MeanFieldGaussian.from_mean_variance({"theta": torch.zeros(1, dtype=dtype)},
                                                  {"theta": torch.full((1,), 4.0 * scale * scale, dtype=dtype)})
    post = conjugate_local_posterior(model, make_loss(loss_name, **hyper), make_divergence("kl"), cavity, None, y)
    return post.mean()["theta"].item() / scale, post.variance()["theta"].item() / scale**2


@pytest.mark.parametrize("scale", [1e-10, 1e10])
@pytest.mark.parametrize("hyper", [{"weight": "constant"}, {"weight": "imq", "c": 1.0}])
def test_float32_score_matching_posterior_does_not_depend_on_the_units(scale, hyper):
    """sigma^4 was formed as a Python float and cast to float32: inf for sigma > 4.3e9, so the precision became 0 and
    the constant-weight posterior was the cavity (mean 0, variance 4), without an error."""
    if "c" in hyper:
        hyper = {**hyper, "c": hyper["c"] * scale}
    m64, v64 = _location_posterior(scale, "score_matching", torch.float64, **hyper)
    m32, v32 = _location_posterior(scale, "score_matching", torch.float32, **hyper)
    assert m32 == pytest.approx(m64, rel=1e-5) and v32 == pytest.approx(v64, rel=1e-5)
    m1, v1 = _location_posterior(1.0, "score_matching", torch.float64, **{**hyper, **({"c": 1.0} if "c" in hyper else {})})
    assert m64 == pytest.approx(m1, rel=1e-9) and v64 == pytest.approx(v1, rel=1e-9)


def test_constant_weight_score_matching_in_float32_at_large_units_is_bayes():
    m_sm, v_sm = _location_posterior(1e10, "score_matching", torch.float32, weight="constant")
    m_nll, v_nll = _location_posterior(1e10, "nll", torch.float32)
    assert m_sm == pytest.approx(m_nll, rel=1e-5) and v_sm == pytest.approx(v_nll, rel=1e-5)


def test_linear_regression_on_the_location_dataset_is_a_config_error():
    """It passed validation and then failed in prepare with a raw 'in_features must be >= 1, got 0'."""
    with pytest.raises(ConfigError, match=r"dataset: model 'linear_regression' needs covariates"):
        parse_run_config({"model": "linear_regression", "dataset": "synthetic_gaussian_location"})


def test_nested_loss_weights_are_checked_after_multiplying():
    nll = make_loss("nll")
    with pytest.raises(ValueError, match="loss weight"):
        ScaledLoss(ScaledLoss(nll, 1e-200), 1e-200)  # 0.0: the loss would vanish
    with pytest.raises(ValueError, match="loss weight"):
        ScaledLoss(ScaledLoss(nll, 1e200), 1e200)  # inf
    assert ScaledLoss(ScaledLoss(nll, 2.0), 3.0).weight == 6.0


def test_scaled_score_matching_keeps_its_weight_kind_beside_the_loss_weight():
    sm = make_loss("score_matching", weight="se", c=2.0)
    hyper = ScaledLoss(sm, 3.0).hyperparameters()
    assert hyper["weight"] == "se" and hyper["loss_weight"] == 3.0 and hyper["c"] == 2.0


@pytest.mark.parametrize("shape", [(5,), (5, 1), (3, 1), (5, 2)])
def test_score_matching_quadratic_refuses_targets_of_the_wrong_shape_like_the_nll(shape):
    model = make_model("gaussian_location", dim=3, sigma=1.0)
    y = torch.zeros(shape, dtype=torch.float64)
    ref = {"theta": torch.zeros(3, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"y must have shape \(B, 3\)"):
        make_loss("nll").quadratic(model, None, y, ref)
    with pytest.raises(ValueError, match=r"y must have shape \(B, 3\)"):
        make_loss("score_matching", weight="imq", c=1.0).quadratic(model, None, y, ref)


@pytest.mark.parametrize("dtype, sigma, ok", [("float32", 1e19, False), ("float32", 1e-19, False),
                                              ("float32", 1e18, True), ("float64", 1e19, True),
                                              ("float64", 1e155, False)])
def test_likelihood_sigma_must_leave_sigma_squared_a_normal_float_of_the_dtype(dtype, sigma, ok):
    """1/sigma^2 is the data's precision: it was 0 in float32 for sigma > 1.8e19, and the posterior the prior."""
    raw = {"model": "gaussian_location", "dataset": "synthetic_gaussian_location", "dtype": dtype,
           "likelihood-sigma": sigma}
    if ok:
        assert parse_run_config(raw).likelihood_sigma == sigma
    else:
        with pytest.raises(ConfigError, match="likelihood-sigma: with dtype"):
            parse_run_config(raw)
    assert parse_run_config({"likelihood-sigma": 1e30}).likelihood_sigma == 1e30  # unused by a classifier


@pytest.mark.parametrize("scale", [1e10, 1e-12])
def test_float32_score_matching_loss_values_do_not_overflow_at_large_or_small_units(scale):
    """The per-point loss (the Monte Carlo path) still formed w^2 / sigma^4: NaN in float32 at sigma 1e10 and 1e-12,
    both accepted by the likelihood-sigma check; the closed form gave 3 (stop-30 diff review)."""
    from common.losses import ScoreMatchingLoss
    from common.models import GaussianLocationModel

    model = GaussianLocationModel(1, sigma=scale)
    y = torch.tensor([[3.0 * scale], [-1.0 * scale]], dtype=torch.float32)
    theta = {"theta": torch.zeros(1, 1, dtype=torch.float32)}
    loss = ScoreMatchingLoss(weight="constant")
    per_point = loss(model.output(theta, None), y).sum()
    closed = loss.quadratic(model, None, y).value(theta["theta"][0])
    assert torch.isfinite(per_point) and float(per_point) == pytest.approx(float(closed), rel=1e-5)
