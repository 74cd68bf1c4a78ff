"""Regression tests for the reviewed defects of common/divergences.py (float32 safety near alpha = 1 and 0,
overflow of the Fisher-Rao and mean-field Alpha-Renyi forms, hyperparameter validation)."""

from __future__ import annotations

import math

import mpmath as mpm
import pytest
import torch

from common.divergences import (
    KL,
    AlphaRenyi,
    FisherRao,
    ReverseKL,
    WeightedKL,
    alpha_renyi_full_covariance,
    alpha_renyi_mean_field_elementwise,
    alpha_renyi_via_log_normalizer,
    fisher_rao_univariate,
    make_divergence,
)
from common.errors import DivergenceUndefinedError
from common.families import FullCovarianceGaussian, MeanFieldGaussian
from common.local_gvi import MeanFieldMomentDivergence

F32, F64 = torch.float32, torch.float64
ALPHAS = [-0.5, 0.3, 0.999, 1 - 1e-6, 1 + 1e-7, 1.5, 2.5, 10.0]


def mf(m, v, dtype=F64):
    m, v = torch.as_tensor(m, dtype=dtype), torch.as_tensor(v, dtype=dtype)
    return MeanFieldGaussian.from_mean_variance({"w": m}, {"w": v})


def fc(m, s, dtype=F64):
    return FullCovarianceGaussian.from_mean_covariance(torch.as_tensor(m, dtype=dtype), torch.as_tensor(s, dtype=dtype))


def ar_ref(mq, sq, mp, sp, alpha) -> float:
    """The Sigma_alpha form at 50 digits (mpmath), for covariance matrices (lists of lists)."""
    with mpm.workdps(50):
        a = mpm.mpf(alpha)
        sq_, sp_ = mpm.matrix(sq), mpm.matrix(sp)
        dm = mpm.matrix([mpm.mpf(x) - mpm.mpf(y) for x, y in zip(mq, mp)])
        sa = a * sp_ + (1 - a) * sq_
        quad = (dm.T * mpm.inverse(sa) * dm)[0]
        return float(quad / 2 - mpm.log(mpm.det(sa) / (mpm.det(sq_) ** (1 - a) * mpm.det(sp_) ** a)) / (2 * a * (a - 1)))


def _d3_case():
    g = torch.Generator().manual_seed(7)
    a = torch.randn(3, 3, generator=g, dtype=F64)
    sq = a @ a.T / 3 + 0.3 * torch.eye(3, dtype=F64)
    b = torch.randn(3, 3, generator=g, dtype=F64)
    sp = 1.3 * sq + 0.2 * (b @ b.T / 3)  # Sigma_q < Sigma_p (alpha > 1 fine), Sigma_p < 3 Sigma_q (alpha = -0.5 fine)
    mq = torch.tensor([0.3, -0.5, 0.8], dtype=F64)
    mp = torch.tensor([0.1, 0.2, -0.4], dtype=F64)
    for alpha in ALPHAS:
        assert float(torch.linalg.eigvalsh(alpha * sp + (1 - alpha) * sq).min()) > 0
    return mq, sq, mp, sp


# ---------------------------------------------------------------------------------------------------
# finding 1: full-covariance Alpha-Renyi near alpha = 1
@pytest.mark.parametrize("alpha", [1 - 1e-6, 1 + 1e-7])
def test_full_covariance_alpha_renyi_near_one_float32_value_and_gradient(alpha):
    q64, p64 = fc([0.3], [[0.5]]), fc([-0.2], [[1.3]])
    ref = ar_ref([0.3], [[0.5]], [-0.2], [[1.3]], alpha)
    vals, grads = {}, {}
    for dt in (F32, F64):
        q, p = q64.to(dt), p64.to(dt)
        e2 = q.eta2.clone().requires_grad_()
        v = AlphaRenyi(alpha)(FullCovarianceGaussian(q.eta1, e2), p)
        (g,) = torch.autograd.grad(v, [e2])
        vals[dt], grads[dt] = float(v.detach()), float(g)
    assert vals[F32] == pytest.approx(ref, rel=1e-6)  # was 0.2163 / -0.618 for 0.2662
    assert vals[F64] == pytest.approx(ref, rel=1e-13)
    assert grads[F32] == pytest.approx(grads[F64], rel=1e-5)  # was -0.2188 / -1.0 for -0.1923
    # d = 1 full covariance agrees with mean-field
    assert vals[F32] == pytest.approx(float(AlphaRenyi(alpha)(mf([0.3], [0.5], F32), mf([-0.2], [1.3], F32))), rel=1e-6)


def test_full_covariance_alpha_renyi_float64_near_one_no_cancellation():
    q, p = fc([0.3], [[0.5]]), fc([-0.2], [[1.3]])
    kl = float(KL()(q, p))
    for eps in (1e-12, -1e-12):
        # within O(eps) of KL(q || p); the former log-det form lost 2.6e-4 here
        assert float(AlphaRenyi(1 + eps)(q, p)) == pytest.approx(kl, rel=1e-10)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("dtype", [F32, F64])
def test_full_covariance_alpha_renyi_d3_matches_mpmath(alpha, dtype):
    mq, sq, mp, sp = _d3_case()
    ref = ar_ref(mq.tolist(), sq.tolist(), mp.tolist(), sp.tolist(), alpha)
    got = float(AlphaRenyi(alpha)(fc(mq, sq, dtype), fc(mp, sp, dtype)))
    assert got == pytest.approx(ref, rel=2e-5 if dtype == F32 else 1e-12)


@pytest.mark.parametrize("alpha", [-0.5, 0.3, 0.999, 1 - 1e-6, 1 + 1e-7, 2.5, 1e-6])
def test_full_covariance_alpha_renyi_gradient_matches_finite_differences(alpha):
    mq, sq, mp, sp = _d3_case()
    q, p = fc(mq, sq), fc(mp, sp)
    params = [q.eta1.clone().requires_grad_(), q.eta2.clone().requires_grad_(),
              p.eta1.clone().requires_grad_(), p.eta2.clone().requires_grad_()]

    def f(e1q, e2q, e1p, e2p):
        return alpha_renyi_full_covariance(FullCovarianceGaussian(e1q, e2q), FullCovarianceGaussian(e1p, e2p), alpha)

    grads = torch.autograd.grad(f(*params), params)
    h = 1e-6
    for k, (x, g) in enumerate(zip(params, grads)):
        base = [t.detach().clone() for t in params]
        for idx in [(0,), (2,)] if x.dim() == 1 else [(0, 0), (1, 2), (2, 1)]:
            plus = [t.clone() for t in base]
            minus = [t.clone() for t in base]
            if x.dim() == 1:
                plus[k][idx] += h
                minus[k][idx] -= h
                fd = (float(f(*plus)) - float(f(*minus))) / (2 * h)
                an = float(g[idx])
            else:  # perturb symmetrically (the precision is symmetrised)
                i, j = idx
                for t, s in ((plus[k], h), (minus[k], -h)):
                    t[i, j] += s
                    if i != j:
                        t[j, i] += s
                fd = (float(f(*plus)) - float(f(*minus))) / (2 * h)
                an = float(g[i, j] + (g[j, i] if i != j else 0.0))
            assert an == pytest.approx(fd, rel=1e-5, abs=1e-8)
    # float32 autograd agrees with float64 autograd
    p32 = [t.detach().to(F32).requires_grad_() for t in params]
    g32 = torch.autograd.grad(f(*p32), p32)
    for a, b in zip(g32, grads):
        assert torch.allclose(a.double(), b, rtol=2e-4, atol=2e-4 * float(b.abs().max()))


def test_full_covariance_alpha_renyi_equals_log_normalizer_form_float64():
    mq, sq, mp, sp = _d3_case()
    q, p = fc(mq, sq), fc(mp, sp)
    for alpha in (-0.5, 0.3, 0.5, 0.7, 2.5, 10.0):
        assert float(alpha_renyi_full_covariance(q, p, alpha)) == pytest.approx(
            float(alpha_renyi_via_log_normalizer(q, p, alpha)), rel=1e-11)


# ---------------------------------------------------------------------------------------------------
# finding 2: alpha -> 0 keeps the log-det term (limit KL(p || q))
@pytest.mark.parametrize("dtype, alpha", [(F64, 1e-12), (F64, 1e-300), (F64, 5e-324), (F64, -1e-300),
                                          (F32, 1e-5), (F32, 1e-7), (F32, -1e-7), (F32, 1e-40)])
def test_alpha_renyi_near_zero_tends_to_reverse_kl(dtype, alpha):
    rkl = float(ReverseKL()(mf([0.3], [0.5]), mf([-0.2], [1.3])))  # 0.572244
    ref = ar_ref([0.3], [[0.5]], [-0.2], [[1.3]], alpha) if abs(alpha) > 1e-200 else rkl
    tol = 2e-6 if dtype == F32 else 1e-12
    v_mf = float(AlphaRenyi(alpha)(mf([0.3], [0.5], dtype), mf([-0.2], [1.3], dtype)))
    v_fc = float(AlphaRenyi(alpha)(fc([0.3], [[0.5]], dtype), fc([-0.2], [[1.3]], dtype)))
    assert v_mf == pytest.approx(ref, rel=tol)  # was 0.25 (mean term only) at 1e-300 / 1e-7
    assert v_fc == pytest.approx(ref, rel=tol)  # was -0.228 / 0.964


@pytest.mark.parametrize("alpha", [-0.5, 0.3, 1e-4, 1e-9])
def test_full_covariance_alpha_renyi_near_zero_d3(alpha):
    mq, sq, mp, sp = _d3_case()
    ref = ar_ref(mq.tolist(), sq.tolist(), mp.tolist(), sp.tolist(), alpha)
    assert float(AlphaRenyi(alpha)(fc(mq, sq, F32), fc(mp, sp, F32))) == pytest.approx(ref, rel=2e-5)
    assert float(AlphaRenyi(alpha)(fc(mq, sq), fc(mp, sp))) == pytest.approx(ref, rel=1e-12)


def test_mean_field_alpha_renyi_near_zero_gradient_float32_matches_float64():
    for alpha in (1e-7, 1e-3, 0.3):
        grads = {}
        for dt in (F32, F64):
            q, p = mf([0.3, -1.0], [0.5, 2.0], dt), mf([-0.2, 0.4], [1.3, 0.7], dt)
            e1, e2 = q.eta1["w"].clone().requires_grad_(), q.eta2["w"].clone().requires_grad_()
            q2 = MeanFieldGaussian({"w": e1}, {"w": e2})
            v = AlphaRenyi(alpha)(q2, p)
            grads[dt] = torch.cat(torch.autograd.grad(v, [e1, e2]))
        assert torch.allclose(grads[F32].double(), grads[F64], rtol=1e-5, atol=1e-6)


def test_moment_fast_path_is_not_used_for_tiny_alpha():
    p = mf([-0.2], [1.3], F32)
    for alpha in (1e-3, -1e-5, 1e-7):
        assert MeanFieldMomentDivergence.create(AlphaRenyi(alpha), p) is None  # generic (accurate) form
    for alpha in (0.4, -0.5, 0.5, 2.5):
        assert MeanFieldMomentDivergence.create(AlphaRenyi(alpha), p) is not None


# ---------------------------------------------------------------------------------------------------
# finding 3: Fisher-Rao overflow for far-apart Gaussians
def fr_ref(m1, s1, m2, s2) -> float:
    with mpm.workdps(50):
        m1, s1, m2, s2 = map(mpm.mpf, (m1, s1, m2, s2))
        return float(mpm.sqrt(2) * mpm.acosh(1 + ((m1 - m2) ** 2 / 2 + (s1 - s2) ** 2) / (2 * s1 * s2)))


@pytest.mark.parametrize("dtype, case", [
    (F32, (0.0, 1.0, 1e10, 1.0)), (F32, (0.0, 1.0, 1e19, 1.0)), (F32, (0.0, 1.0, 3e30, 2.0)),
    (F32, (0.0, 1e-20, 1.0, 1e-20)), (F32, (0.0, 1e-30, 0.0, 1e30)),
    (F64, (0.0, 1.0, 1e80, 1.0)), (F64, (0.0, 1.0, 1e160, 1.0)), (F64, (0.0, 1e-200, 1.0, 1e-200)),
])
def test_fisher_rao_far_apart_is_finite_and_accurate(dtype, case):
    v = fisher_rao_univariate(*(torch.tensor(x, dtype=dtype) for x in case))
    assert float(v) == pytest.approx(fr_ref(*case), rel=1e-6 if dtype == F32 else 1e-13)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_fisher_rao_far_apart_gradient(dtype):
    m2 = torch.tensor(1e10, dtype=dtype, requires_grad=True)
    s2 = torch.tensor(1.0, dtype=dtype, requires_grad=True)
    v = fisher_rao_univariate(torch.tensor(0.0, dtype=dtype), torch.tensor(1.0, dtype=dtype), m2, s2)
    gm, gs = torch.autograd.grad(v, [m2, s2])
    # FR ~ sqrt2 log(dm^2 / (2 s1 s2)) for dm >> s: dFR/ddm = 2 sqrt2 / dm, dFR/ds2 = -sqrt2 / s2
    assert float(gm) == pytest.approx(2 * math.sqrt(2) / 1e10, rel=1e-5)
    assert float(gs) == pytest.approx(-math.sqrt(2), rel=1e-5)


def test_fisher_rao_switch_to_log_form_is_continuous():
    # x = (1+D)/(1-D) - 1 crosses 1e4 near dm ~ 141 (s1 = s2 = 1): values and gradients on both sides
    for dm in (120.0, 140.0, 141.42, 141.43, 145.0, 300.0):
        m2 = torch.tensor(dm, dtype=F64, requires_grad=True)
        v = fisher_rao_univariate(torch.tensor(0.0, dtype=F64), torch.tensor(1.0, dtype=F64), m2,
                                  torch.tensor(1.0, dtype=F64))
        (g,) = torch.autograd.grad(v, [m2])
        assert float(v.detach()) == pytest.approx(fr_ref(0.0, 1.0, dm, 1.0), rel=1e-13)
        h = 1e-4
        fd = (fr_ref(0.0, 1.0, dm + h, 1.0) - fr_ref(0.0, 1.0, dm - h, 1.0)) / (2 * h)
        assert float(g) == pytest.approx(fd, rel=1e-7)


def test_fisher_rao_mean_field_far_apart():
    q, p = mf([0.0, 0.0], [1.0, 1.0], F32), mf([1e10, 0.5], [1.0, 1.0], F32)
    ref = math.hypot(fr_ref(0.0, 1.0, 1e10, 1.0), fr_ref(0.0, 1.0, 0.5, 1.0))
    assert float(FisherRao()(q, p)) == pytest.approx(ref, rel=1e-6)


# ---------------------------------------------------------------------------------------------------
# finding 4: mean-field Alpha-Renyi mean term overflow
@pytest.mark.parametrize("alpha", [0.5, 2.0, 0.3, -0.5])
def test_mean_field_alpha_renyi_tiny_variances_float32_finite(alpha):
    q, p = mf([1.0], [1e-20], F32), mf([0.0], [1e-20], F32)
    # equal variances: D = 1/2 d^2 / v = 5e19 for every alpha (the log term is 0)
    assert float(AlphaRenyi(alpha)(q, p)) == pytest.approx(5e19, rel=1e-6)
    assert float(alpha_renyi_mean_field_elementwise(q, p, alpha)["w"]) == pytest.approx(5e19, rel=1e-6)


# ---------------------------------------------------------------------------------------------------
# finding 5: hyperparameter validation
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_plain_alpha_renyi_functions_reject_non_finite_alpha(bad):
    q, p = mf([0.3], [0.5]), mf([0.0], [1.0])
    qf, pf = fc([0.3], [[0.5]]), fc([0.0], [[1.0]])
    for fn, args in ((alpha_renyi_mean_field_elementwise, (q, p)), (alpha_renyi_full_covariance, (qf, pf)),
                     (alpha_renyi_via_log_normalizer, (q, p))):
        with pytest.raises(ValueError, match="alpha must be finite"):
            fn(*args, bad)
    for fn, args in ((alpha_renyi_mean_field_elementwise, (q, p)), (alpha_renyi_full_covariance, (qf, pf))):
        with pytest.raises(ValueError, match="must not be 0 or 1"):
            fn(*args, 1.0)


def test_weighted_kl_rejects_weight_with_infinite_reciprocal():
    for w in (1e-320, 5e-324, 2e-308):
        with pytest.raises(ValueError, match="smallest normal"):
            WeightedKL(w)
        with pytest.raises(ValueError, match="smallest normal"):
            make_divergence("weighted_kl", w=w)
    q, p = mf([0.3], [0.5]), mf([0.0], [1.0])
    w = 2.3e-308
    assert math.isfinite(float(WeightedKL(w)(q, p)))


def test_undefined_region_unchanged_near_boundary_full_covariance():
    # alpha = 2.5: finite iff Sigma_q < 5/3 Sigma_p; alpha = -0.5: iff Sigma_p < 3 Sigma_q
    for alpha, inside, outside in ((2.5, (fc([0.3], [[5 / 3 * (1 - 1e-6)]]), fc([0.0], [[1.0]])),
                                    (fc([0.3], [[5 / 3 * (1 + 1e-6)]]), fc([0.0], [[1.0]]))),
                                   (-0.5, (fc([0.3], [[1.0]]), fc([0.0], [[3 * (1 - 1e-6)]])),
                                    (fc([0.3], [[1.0]]), fc([0.0], [[3 * (1 + 1e-6)]])))):
        v = float(AlphaRenyi(alpha)(*inside))
        assert math.isfinite(v) and v > 0
        with pytest.raises(DivergenceUndefinedError):
            AlphaRenyi(alpha)(*outside)


# stop 30 (audit): the mean-field Alpha-Renyi guard at the rounding boundary had no test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("alpha", [1.5, 2.5, 3.0, -0.5, -2.0])
def test_mean_field_alpha_renyi_at_the_rounding_boundary_is_a_typed_error_never_nan_or_inf(dtype, alpha):
    """lambda_a = alpha lq + (1 - alpha) lp > 0 by a few ulps while the log argument (1 - alpha) expm1(log lp - log lq)
    has rounded to <= -1: without the guard the divergence came out NaN (float64) or inf (float32)."""
    from common.divergences import AlphaRenyi
    from common.errors import DivergenceUndefinedError
    from common.families import MeanFieldGaussian

    g = torch.Generator().manual_seed(0)
    lq = torch.exp(torch.empty(200_000, dtype=torch.float64).uniform_(-5, 5, generator=g)).to(dtype)
    lp = (alpha / (alpha - 1.0)) * lq
    lp = lp * (1 + torch.randint(-8, 9, lq.shape, generator=g).to(dtype) * torch.finfo(dtype).eps)
    lam_a = alpha * lq + (1.0 - alpha) * lp
    t = torch.log(lp) - torch.log(lq)
    arg = (1.0 - alpha) * torch.expm1(t) if alpha >= 0.5 else alpha * torch.expm1(-t)
    hits = ((lam_a > 0) & ~(arg > -1.0)).nonzero().flatten()
    assert len(hits) > 0  # the boundary is reachable
    for i in hits[:5].tolist():
        q = MeanFieldGaussian({"x": torch.zeros(1, dtype=dtype)}, {"x": -0.5 * lq[i:i + 1]})
        p = MeanFieldGaussian({"x": torch.zeros(1, dtype=dtype)}, {"x": -0.5 * lp[i:i + 1]})
        with pytest.raises(DivergenceUndefinedError):
            AlphaRenyi(alpha)(q, p)
