"""Regression tests for reviewed defects of common.families, common.variational, common.conjugate and
common.factors (shape/dtype checks, float32 cancellation in log_prob/entropy, properness of factors whose
moments overflow, typed errors instead of raw torch errors)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.distributions import MultivariateNormal, Normal

from common.conjugate import conjugate_local_posterior
from common.divergences import make_divergence
from common.errors import ImproperDistributionError, ShapeMismatchError
from common.factors import PGVIServerState, UpdateRejected, damped_delta
from common.families import FullCovarianceGaussian, MeanFieldGaussian
from common.losses import make_loss
from common.models import make_model
from common.variational import variational_for
from tests.tensors import assert_close, gen

DT = torch.float64
LOG_2PI = math.log(2.0 * math.pi)


def _spd3() -> torch.Tensor:
    return torch.tensor([[1.0, 0.3, 0.1], [0.3, 2.0, 0.2], [0.1, 0.2, 0.5]], dtype=DT)


# ---------------------------------------------------------------------------------------------------
# 1. MeanFieldGaussian.log_prob: 0-d named tensors and sample shapes
def test_mf_log_prob_scalar_named_tensor_keeps_sample_dim():
    mw, vw = torch.tensor([0.3, -1.0], dtype=DT), torch.tensor([2.0, 0.5], dtype=DT)
    mb, vb = torch.tensor(0.5, dtype=DT), torch.tensor(0.25, dtype=DT)
    q = MeanFieldGaussian.from_mean_variance({"w": mw, "b": mb}, {"w": vw, "b": vb})
    th = q.rsample(4, generator=gen(0))
    assert th["b"].shape == (4,)
    ref = Normal(mw, vw.sqrt()).log_prob(th["w"]).sum(-1) + Normal(mb, vb.sqrt()).log_prob(th["b"])
    assert_close(q.log_prob(th), ref, rtol=1e-12, atol=1e-12)
    q1 = MeanFieldGaussian.from_mean_variance({"b": mb}, {"b": vb})
    th1 = q1.rsample(4, generator=gen(1))
    assert_close(q1.log_prob(th1), Normal(mb, vb.sqrt()).log_prob(th1["b"]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(5, 1, 3), (5, 3, 2), (5, 6), (5, 2, 3, 1), (2, 3)])
def test_mf_log_prob_rejects_wrong_sample_shape(shape):
    q = MeanFieldGaussian.isotropic({"a": (2, 3)})
    with pytest.raises(ShapeMismatchError, match=r"\(2, 3\)"):
        q.log_prob({"a": torch.zeros(shape, dtype=DT)})


# ---------------------------------------------------------------------------------------------------
# 2. centred log_prob / entropy (no cancellation of <eta, T> against A in float32)
@pytest.mark.parametrize("mu,var", [(10.0, 1e-6), (1e3, 1e-2), (1e4, 1e-4), (1.0, 1e-4)])
def test_mf_log_prob_and_entropy_float32_no_cancellation(mu, var):
    q = MeanFieldGaussian.from_mean_variance({"t": torch.tensor([mu], dtype=DT)},
                                             {"t": torch.tensor([var], dtype=DT)}).to(torch.float32)
    x = torch.tensor([[mu + 0.5 * var ** 0.5]], dtype=DT)
    exact = float(Normal(torch.tensor(mu, dtype=DT), torch.tensor(var, dtype=DT).sqrt()).log_prob(x).sum())
    got = float(q.log_prob({"t": x.float()})[0])
    # the attainable float32 error is that of rounding x and mu: lam * |x - mu| * ulp(mu) ~ 0.5 * ulp(mu) / sd
    tol = 1e-4 + 2.0 * float(np.spacing(np.float32(mu))) / var ** 0.5
    assert abs(got - exact) < tol, (got, exact)
    assert float(q.entropy()) == pytest.approx(0.5 * math.log(2 * math.pi * math.e * var), abs=1e-5)


def test_full_log_prob_and_entropy_float32_no_cancellation():
    m = torch.tensor([100.0, -50.0, 20.0], dtype=DT)
    s = _spd3() * 1e-3
    q32 = FullCovarianceGaussian.from_mean_covariance(m, s).to(torch.float32)
    x = (m + 0.01).unsqueeze(0)
    exact = MultivariateNormal(m, s)
    assert float(q32.log_prob({"theta": x.float()})[0]) == pytest.approx(float(exact.log_prob(x)[0]), abs=1e-3)
    assert float(q32.entropy()) == pytest.approx(float(exact.entropy()), abs=1e-4)


def test_entropy_does_not_depend_on_the_mean_float32():
    s = _spd3()
    ents = [float(FullCovarianceGaussian.from_mean_covariance(torch.full((3,), mu, dtype=DT), s).to(torch.float32)
                  .entropy()) for mu in (0.0, 1e2, 1e4)]
    assert max(ents) - min(ents) < 1e-5, ents
    ents = [float(MeanFieldGaussian.from_mean_variance({"a": torch.full((3,), mu, dtype=DT)}, {"a": torch.diagonal(s)})
                  .to(torch.float32).entropy()) for mu in (0.0, 1e2, 1e4)]
    assert max(ents) - min(ents) < 1e-5, ents


def test_centred_forms_match_float64_references():
    g = gen(3)
    mean = {"w": torch.randn(3, 2, generator=g, dtype=DT), "b": torch.randn(4, generator=g, dtype=DT)}
    var = {n: 0.2 + torch.rand(m.shape, generator=g, dtype=DT) for n, m in mean.items()}
    q = MeanFieldGaussian.from_mean_variance(mean, var)
    x = q.rsample(7, generator=g)
    ref = sum(Normal(mean[n], var[n].sqrt()).log_prob(x[n]).flatten(1).sum(1) for n in mean)
    assert_close(q.log_prob(x), ref, rtol=1e-12, atol=1e-12)
    ent = sum(Normal(mean[n], var[n].sqrt()).entropy().sum() for n in mean)
    assert_close(q.entropy(), ent, rtol=1e-13, atol=1e-13)
    m = torch.randn(3, generator=g, dtype=DT)
    f = FullCovarianceGaussian.from_mean_covariance(m, _spd3())
    xs = f.rsample(7, generator=g)["theta"]
    assert_close(f.log_prob({"theta": xs}), MultivariateNormal(m, _spd3()).log_prob(xs), rtol=1e-12, atol=1e-12)
    assert_close(f.entropy(), MultivariateNormal(m, _spd3()).entropy(), rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------------------------------------------
# 3. mean-field moments of an improper factor raise (like FullCovarianceGaussian.mean())
def _mf_negative_precision() -> MeanFieldGaussian:
    return MeanFieldGaussian({"t": torch.tensor([1.0, 1.0], dtype=DT)}, {"t": torch.tensor([0.5, -0.5], dtype=DT)})


@pytest.mark.parametrize("method", ["mean", "variance", "log_normalizer", "log_normalizer_elementwise",
                                    "mean_parameters"])
@pytest.mark.parametrize("make", [lambda: MeanFieldGaussian.uniform({"t": (2,)}), _mf_negative_precision],
                         ids=["uniform", "negative-precision"])
def test_mf_moments_of_improper_factor_raise(method, make):
    with pytest.raises(ImproperDistributionError):
        getattr(make(), method)()


def test_mf_moments_of_proper_factor_unchanged():
    m, v = torch.tensor([0.3, -2.0], dtype=DT), torch.tensor([0.5, 4.0], dtype=DT)
    q = MeanFieldGaussian.from_mean_variance({"t": m}, {"t": v})
    assert_close(q.mean()["t"], m, rtol=1e-15)
    assert_close(q.variance()["t"], v, rtol=1e-15)
    a = (m * m / (2 * v) + 0.5 * torch.log(v) + 0.5 * LOG_2PI).sum()
    assert_close(q.log_normalizer(), a, rtol=1e-14)
    assert_close(q.mean_parameters()["eta2/t"], m * m + v, rtol=1e-15)


# ---------------------------------------------------------------------------------------------------
# 4. properness requires finite moments
@pytest.mark.parametrize("dtype,e2", [(torch.float64, -1e-310), (torch.float32, -1e-39)])
def test_subnormal_precision_is_improper(dtype, e2):
    mf = MeanFieldGaussian({"t": torch.tensor([0.0], dtype=dtype)}, {"t": torch.tensor([e2], dtype=dtype)})
    assert not mf.is_proper()
    assert "variance" in mf.improper_detail()
    with pytest.raises(ImproperDistributionError):
        mf.rsample(2, generator=gen(0))
    full = FullCovarianceGaussian(torch.tensor([0.0], dtype=dtype), torch.tensor([[e2]], dtype=dtype))
    assert not full.is_proper()
    with pytest.raises(ImproperDistributionError):
        full.covariance()


def test_large_finite_moments_stay_proper():
    # extreme but representable moments are not refused by the variance test
    mf = MeanFieldGaussian({"t": torch.tensor([1e300, 1e-5], dtype=DT)},
                           {"t": torch.tensor([-0.5e300, -0.5e-10], dtype=DT)})
    assert mf.is_proper(), mf.improper_detail()
    assert_close(mf.mean()["t"], torch.tensor([1.0, 1e5], dtype=DT), rtol=1e-15)
    big = MeanFieldGaussian({"t": torch.tensor([1e-300], dtype=DT)}, {"t": torch.tensor([-1e-300], dtype=DT)})
    assert big.is_proper() and math.isfinite(float(big.variance()["t"][0]))


# ---------------------------------------------------------------------------------------------------
# 5. FullCovarianceVariational from an ill-conditioned (but proper) precision
def _illcond(cond: float) -> FullCovarianceGaussian:
    q, _ = torch.linalg.qr(torch.randn(4, 4, generator=gen(0), dtype=DT))
    ev = torch.logspace(-8, -8 + np.log10(cond), 4, dtype=DT)
    lam = q @ torch.diag(ev) @ q.T
    return FullCovarianceGaussian.from_mean_precision(torch.zeros(4, dtype=DT), 0.5 * (lam + lam.T))


@pytest.mark.parametrize("cond,tol", [(1e14, 1e-10), (1e16, 1e-10), (1e17, 1e-6)])
def test_full_variational_from_ill_conditioned_precision(cond, tol):
    f = _illcond(cond)
    assert f.is_proper()
    # at 1e17 the reversed-order factorisation fails: the QR fallback is exercised
    flipped_ok = int(torch.linalg.cholesky_ex(torch.flip(f.precision(), dims=(0, 1))).info) == 0
    assert flipped_ok == (cond < 1e17)
    v = variational_for(f)  # must not raise torch's LinAlgError
    c = v.cholesky().detach()
    assert torch.all(torch.diagonal(c) > 0) and torch.equal(c, torch.tril(c))
    # init -> distribution() round trip (it was off by 1e-3 relative at cond 1e14, 0.4 at 1e16)
    back = v.distribution().detach()
    assert back.max_abs_diff(f) < tol * float(f.precision().abs().max())


def test_full_variational_well_conditioned_matches_covariance_cholesky():
    g = gen(5)
    a = torch.randn(3, 3, generator=g, dtype=DT)
    s = a @ a.T / 3 + 0.5 * torch.eye(3, dtype=DT)
    f = FullCovarianceGaussian.from_mean_covariance(torch.randn(3, generator=g, dtype=DT), s)
    v = variational_for(f)
    assert_close(v.cholesky().detach(), torch.linalg.cholesky(f.covariance()), rtol=1e-12, atol=1e-14)
    assert v.distribution().detach().max_abs_diff(f) < 1e-12


# ---------------------------------------------------------------------------------------------------
# 6. conjugate update: mean-field cavity of the wrong dimension
@pytest.mark.parametrize("d", [1, 2, 4])
def test_conjugate_mean_field_cavity_dimension_mismatch(d):
    model = make_model("gaussian_location", dim=3, sigma=1.0)
    y = torch.zeros(4, 3, dtype=DT)
    cav = MeanFieldGaussian.isotropic({"theta": (d,)})
    with pytest.raises(ShapeMismatchError, match=rf"\({d},\).*\(3,\)|\(3,\).*\({d},\)"):
        conjugate_local_posterior(model, make_loss("nll"), make_divergence("kl"), cav, None, y)


# ---------------------------------------------------------------------------------------------------
# 7. dtypes and sample shapes
def test_constructors_reject_mixed_dtypes():
    with pytest.raises(ShapeMismatchError, match="dtype"):
        FullCovarianceGaussian(torch.zeros(2, dtype=torch.float32), -0.5 * torch.eye(2, dtype=DT))
    with pytest.raises(ShapeMismatchError, match="dtype"):
        MeanFieldGaussian({"t": torch.zeros(2, dtype=torch.float32)}, {"t": -0.5 * torch.ones(2, dtype=DT)})
    with pytest.raises(ShapeMismatchError, match="dtype"):
        MeanFieldGaussian({"a": torch.zeros(2, dtype=DT), "b": torch.zeros(1, dtype=torch.float32)},
                          {"a": -0.5 * torch.ones(2, dtype=DT), "b": -0.5 * torch.ones(1, dtype=torch.float32)})


@pytest.mark.parametrize("theta", [
    {"theta": torch.zeros(3, 2, dtype=torch.float32)},
    {"theta": torch.zeros(2, dtype=DT)},
    {"theta": torch.zeros(3, 5, dtype=DT)},
    {"x": torch.zeros(3, 2, dtype=DT)},
], ids=["float32", "unbatched", "wrong-d", "missing-key"])
def test_full_log_prob_rejects_bad_samples(theta):
    f = FullCovarianceGaussian.from_mean_precision(torch.tensor([0.1, -0.2], dtype=DT),
                                                   torch.tensor([[2.0, 0.3], [0.3, 1.0]], dtype=DT))
    with pytest.raises(ShapeMismatchError):
        f.log_prob(theta)


def test_mf_log_prob_rejects_wrong_dtype_or_missing_name():
    q = MeanFieldGaussian.isotropic({"a": (2, 3)})
    with pytest.raises(ShapeMismatchError, match="dtype"):
        q.log_prob({"a": torch.zeros(4, 2, 3, dtype=torch.float32)})
    with pytest.raises(ShapeMismatchError):
        q.log_prob({"b": torch.zeros(4, 2, 3, dtype=DT)})


# ---------------------------------------------------------------------------------------------------
# 8. from_mean_covariance with a singular covariance
def test_from_mean_covariance_singular_raises_typed_error():
    with pytest.raises(ImproperDistributionError, match="singular"):
        FullCovarianceGaussian.from_mean_covariance(torch.zeros(2, dtype=DT), torch.ones(2, 2, dtype=DT))


def test_from_mean_covariance_indefinite_or_nan_still_returns_improper_factor():
    f = FullCovarianceGaussian.from_mean_covariance(torch.zeros(2, dtype=DT),
                                                    torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=DT))
    assert not f.is_proper()
    nan = torch.tensor([[1.0, float("nan")], [float("nan"), 1.0]], dtype=DT)
    assert not FullCovarianceGaussian.from_mean_covariance(torch.zeros(2, dtype=DT), nan).is_proper()


# ---------------------------------------------------------------------------------------------------
# 9. PGVIServerState.apply refuses a Delta of another dtype
@pytest.mark.parametrize("state_dtype,delta_dtype", [(torch.float32, torch.float64), (torch.float64, torch.float32)])
def test_server_state_rejects_delta_of_other_dtype(state_dtype, delta_dtype):
    prior = FullCovarianceGaussian.from_mean_covariance(torch.zeros(2, dtype=DT), torch.eye(2, dtype=DT))
    prior = prior.to(state_dtype)
    st = PGVIServerState(prior)
    qm = FullCovarianceGaussian.from_mean_covariance(torch.tensor([1.0, -1.0], dtype=DT),
                                                     torch.tensor([[0.5, 0.1], [0.1, 0.4]], dtype=DT))
    delta = damped_delta(qm.to(state_dtype), st.posterior, 0.5).to(delta_dtype)
    before = st.posterior.clone()
    with pytest.raises(UpdateRejected, match="dtype") as info:
        st.apply({"a": delta})
    assert info.value.client_id == "a"
    assert st.version == 0 and st.posterior.dtype == state_dtype and st.posterior.max_abs_diff(before) == 0.0
    assert "a" not in st.sites
    st.apply({"a": delta.to(state_dtype)})  # the same Delta in the state's dtype is applied
    assert st.version == 1 and st.posterior.dtype == state_dtype
