"""Regression tests for the reviewed defects in common/losses.py and common/likelihoods.py.

1. a hyperparameter that is not a normal number in the dtype of the computation (delta underflowing, beta or
   gamma overflowing in float32) is a ValueError naming it, not a NaN loss or gradient;
2. CategoricalOutput.log_prob checks the labels (count, dtype, range);
3. GaussianOutput.log_integral_power builds its tensor on the mean's device;
4. GaussianOutput refuses a NaN or infinite sigma;
5. weighted() validates its weight before the ``== 1`` shortcut, and an integer too large for a float is a
   ValueError naming the hyperparameter.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.likelihoods import CategoricalOutput, GaussianOutput
from common.losses import NegativeLogLikelihood, ScaledLoss, make_loss, weighted

F32, F64 = torch.float32, torch.float64


def _cat(dtype, requires_grad=False):
    logits = torch.tensor([[[0.0, 1.0, 2.0], [0.0, -200.0, -200.0]]], dtype=dtype)
    if requires_grad:
        logits.requires_grad_()
    return logits, torch.tensor([0, 0])


# ---------------------------------------------------------------------------------------------------
# 1. hyperparameters not representable in the dtype of the computation
@pytest.mark.parametrize("delta", [1e-40, 1e-46, 1e-300])
def test_gce_delta_underflowing_float32_is_value_error(delta):
    logits, y = _cat(F32)
    loss = make_loss("gce", delta=delta)  # valid as a Python float: the check is at call time, per dtype
    with pytest.raises(ValueError) as exc:
        loss(CategoricalOutput(logits), y)
    msg = str(exc.value)
    assert "delta" in msg and "float32" in msg and f"{delta:g}" in msg and "'nll'" in msg


def test_gce_small_delta_still_works_in_float64_and_float32():
    y = torch.tensor([0, 0])
    nll = make_loss("nll")(CategoricalOutput(_cat(F64)[0]), y)
    for delta in (1e-7, 1e-30, 1e-300):  # float64 keeps working far below float32's range
        logits, _ = _cat(F64, requires_grad=True)
        v = make_loss("gce", delta=delta)(CategoricalOutput(logits), y)
        v.sum().backward()
        assert torch.isfinite(logits.grad).all()
        torch.testing.assert_close(v, nll, rtol=1e-6, atol=1e-9)
    logits, _ = _cat(F32, requires_grad=True)  # the smallest normal float32 still works
    v = make_loss("gce", delta=torch.finfo(F32).tiny)(CategoricalOutput(logits), y)
    v.sum().backward()
    assert torch.isfinite(v).all() and torch.isfinite(logits.grad).all()


def test_gce_subnormal_delta_in_float64_is_value_error():
    logits, y = _cat(F64)
    with pytest.raises(ValueError, match=r"delta.*float64"):
        make_loss("gce", delta=1e-310)(CategoricalOutput(logits), y)


@pytest.mark.parametrize("name", ["beta", "gamma"])
@pytest.mark.parametrize("h", [1e39, 1e300])
def test_huge_beta_gamma_overflowing_float32_is_value_error(name, h):
    logits, y = _cat(F32)
    with pytest.raises(ValueError) as exc:
        make_loss(name, **{name: h})(CategoricalOutput(logits), y)
    msg = str(exc.value)
    assert name in msg and "float32" in msg and f"{h:g}" in msg


@pytest.mark.parametrize("name", ["beta", "gamma"])
def test_huge_beta_gamma_still_work_in_float64(name):
    logits, y = _cat(F64, requires_grad=True)
    v = make_loss(name, **{name: 1e300})(CategoricalOutput(logits), y)
    v.sum().backward()
    assert torch.isfinite(v).all() and torch.isfinite(logits.grad).all()
    m = torch.zeros(1, 1, 1, dtype=F32)
    with pytest.raises(ValueError, match=name):
        make_loss(name, **{name: 1e39})(GaussianOutput(m, 1.0), torch.zeros(1, 1, dtype=F32))


@pytest.mark.parametrize("name", ["beta", "gamma"])
def test_beta_gamma_near_one_underflowing_float16_is_value_error(name):
    # beta - 1 = 1e-5 is subnormal in float16 (smallest normal 6.1e-5)
    logits = torch.zeros(1, 2, 3, dtype=torch.float16)
    with pytest.raises(ValueError, match=rf"{name}.*float16"):
        make_loss(name, **{name: 1.0 + 1e-5})(CategoricalOutput(logits), torch.tensor([0, 1]))


# ---------------------------------------------------------------------------------------------------
# 2. CategoricalOutput.log_prob label checks
def _out():
    return CategoricalOutput(torch.randn(2, 5, 3, dtype=F64, generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("y", [torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 0, 1, 2]),
                               torch.zeros(0, dtype=torch.long)])
def test_categorical_label_count_mismatch_is_value_error(y):
    with pytest.raises(ValueError, match=r"label"):
        _out().log_prob(y)


@pytest.mark.parametrize("y", [torch.tensor([0.0, 0.99, 1.7, 2.0, 1.0], dtype=F64),
                               torch.tensor([0.0, float("nan"), 1.0, 2.0, 1.0]),
                               torch.tensor([0, 1, 2, 0, 1], dtype=torch.complex64)])
def test_categorical_non_integer_labels_are_value_error(y):
    with pytest.raises(ValueError, match=r"label"):
        _out().log_prob(y)


@pytest.mark.parametrize("bad", [[0, 1, 2, 3, 0], [0, 1, -1, 1, 0], [0, 1, 2**40, 1, 0]])
def test_categorical_out_of_range_labels_are_value_error(bad):
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        _out().log_prob(torch.tensor(bad))


def test_categorical_valid_labels_unchanged():
    out = _out()
    y = torch.tensor([0, 1, 2, 0, 1])
    ref = out.log_probs[:, torch.arange(5), y]
    assert torch.equal(out.log_prob(y), ref)
    assert torch.equal(out.log_prob(y.view(5, 1)), ref)  # (B, 1) labels
    assert torch.equal(out.log_prob(y.to(torch.int32)), ref)
    assert torch.equal(out.log_prob(y.to(F64)), ref)  # integer-valued float labels (e.g. binary 0./1.)
    empty = CategoricalOutput(torch.zeros(2, 0, 3))
    assert empty.log_prob(torch.zeros(0, dtype=torch.long)).shape == (2, 0)


# ---------------------------------------------------------------------------------------------------
# 3. device of log_integral_power
def test_gaussian_log_integral_power_on_mean_device():
    out = GaussianOutput(torch.zeros(2, 3, 1, device="meta"), 1.0)
    assert out.log_integral_power(1.5).device.type == "meta"
    v = make_loss("beta", beta=1.5)(out, torch.zeros(3, 1, device="meta"))
    assert v.device.type == "meta" and v.shape == (2, 3)


# ---------------------------------------------------------------------------------------------------
# 4. sigma NaN / inf
@pytest.mark.parametrize("sigma", [float("nan"), float("inf"), -float("inf"), 0.0, -1.0])
def test_gaussian_sigma_must_be_finite_positive(sigma):
    with pytest.raises(ValueError, match=r"sigma"):
        GaussianOutput(torch.zeros(1, 1, 1), sigma)


# ---------------------------------------------------------------------------------------------------
# 5. weighted() and huge integers
@pytest.mark.parametrize("w", [True, "1.0", "2.0", None, float("nan")])
def test_weighted_validates_weight_before_shortcut(w):
    with pytest.raises(ValueError, match=r"weight"):
        weighted(make_loss("nll"), w)


def test_weighted_valid_weights_unchanged():
    nll = make_loss("nll")
    assert weighted(nll, 1) is nll and weighted(nll, 1.0) is nll
    s = weighted(nll, 2)
    assert isinstance(s, ScaledLoss) and s.weight == 2.0 and isinstance(s.base, NegativeLogLikelihood)


@pytest.mark.parametrize("name,key", [("gce", "delta"), ("beta", "beta"), ("gamma", "gamma"),
                                      ("score_matching", "c")])
def test_huge_integer_hyperparameter_is_value_error(name, key):
    with pytest.raises(ValueError, match=key):
        make_loss(name, **{key: 10**400})
    with pytest.raises(ValueError, match="weight"):
        weighted(make_loss("nll"), 10**400)
    assert math.isfinite(make_loss("beta", beta=10**30).beta)


# ==================================================================================================
# review of 2026-11-28: a float32 Gaussian likelihood at a small sigma the config accepts


@pytest.mark.parametrize("loss", [make_loss("gce", delta=1.0), make_loss("gce", delta=0.5),
                                  make_loss("beta", beta=1.5), make_loss("gamma", gamma=1.5), NegativeLogLikelihood()])
@pytest.mark.parametrize("sigma", [1e-14, 1e-18])
@pytest.mark.parametrize("resid", [0.0, 0.3])
def test_float32_gaussian_loss_gradients_are_finite_where_the_true_ones_are(loss, sigma, resid):
    # -0.5 r^2 / sigma^2 sent dL/d(r^2) = p^delta / (2 sigma^2) (8e38 for GCE(1) at sigma 1e-14) through the
    # backward pass: an inf gradient, or inf * 0 = NaN at a zero residual, where float64 gives a finite one
    grads = {}
    for dtype in (torch.float32, torch.float64):
        m = torch.zeros(1, 1, 1, dtype=dtype, requires_grad=True)
        y = torch.full((1, 1), resid * sigma, dtype=dtype)
        value = loss(GaussianOutput(m, sigma), y).sum()
        value.backward()
        grads[dtype] = float(m.grad)
    if math.isfinite(grads[torch.float64]) and abs(grads[torch.float64]) < torch.finfo(torch.float32).max / 2:
        assert math.isfinite(grads[torch.float32]), grads
        assert grads[torch.float32] == pytest.approx(grads[torch.float64], rel=1e-4, abs=1e-30)


@pytest.mark.parametrize(("dtype", "c"), [(torch.float32, 1e-23), (torch.float64, 1e-170), (torch.float32, 1e25)])
@pytest.mark.parametrize("weight", ["imq", "se"])
def test_score_matching_refuses_a_kernel_scale_whose_square_leaves_the_normal_floats(dtype, c, weight):
    """c = 1e-23 in float32 passed the c > 0 guard; c^2 underflowed to 0 and a point at the reference mean got the
    weight 0/0 = NaN (the loss and the conjugate update's shift NaN).  Refused now with the range common.config
    applies to sm-c before round 1."""
    from common.models import GaussianLocationModel

    model = GaussianLocationModel(dim=1, sigma=1.0)
    loss = make_loss("score_matching", weight=weight, c=c)
    y = torch.tensor([[0.5], [2.0]], dtype=dtype)
    ref = model.output({"theta": torch.tensor([[0.5]], dtype=dtype)}, y)  # y[0] is at the reference mean
    out = model.output({"theta": torch.tensor([[0.3]], dtype=dtype)}, y)
    with pytest.raises(ValueError, match=r"score_matching: kernel scale c=.* is not usable in torch\.float(32|64)"):
        loss(out, y, reference=ref)
    with pytest.raises(ValueError, match="kernel scale"):
        loss.quadratic(model, y, y, reference_theta={"theta": torch.tensor([0.5], dtype=dtype)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_score_matching_at_the_edge_of_the_kernel_scale_range_is_finite(dtype):
    from common.models import GaussianLocationModel

    tiny = torch.finfo(dtype).tiny
    model = GaussianLocationModel(dim=1, sigma=1.0)
    y = torch.tensor([[0.5], [2.0]], dtype=dtype)
    ref = model.output({"theta": torch.tensor([[0.5]], dtype=dtype)}, y)
    out = model.output({"theta": torch.tensor([[0.3]], dtype=dtype)}, y)
    for c in (tiny**0.5 * 1.01, tiny**-0.5 * 0.99, 1.0):
        assert torch.isfinite(make_loss("score_matching", weight="imq", c=c)(out, y, reference=ref)).all(), c
