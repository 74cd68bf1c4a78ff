"""Gradients of the losses and of the fused mean-field divergence where their naive forms lose digits or overflow.

1. GCE, ``L = -expm1(delta log p) / delta``: autograd differentiated the expm1 as ``grad * (expm1(x) + 1)``, i.e.
   rebuilt ``p^delta`` from the rounded ``-1 + p^delta``; the gradient of a point with a small ``p^delta`` lost its
   digits (exactly 0 below ``p^delta ~ 6e-8`` in float32, ``1e-16`` in float64).  The loss now differentiates as
   ``dL/dlog p = -p^delta`` formed directly (:class:`common.losses._GCEOfLogProb`), with the same values.
2. The compiled mean-field kernel's Alpha-Renyi mean term formed ``lambda_p d^2`` first, which overflows float32
   (``lambda_p ~ 1e20``, ``d ~ 1e10``) where the term ``lambda_p d^2 / (1 + a)`` is finite, and its gradient
   ``lambda_p d`` (``lambda_p ~ 1e30``); it now forms ``lambda_p / (1 + a)`` first, as the torch moment form
   (common/local_gvi.py) does.  The reverse KL's ``d^2 / v`` and its gradient formed ``d^2`` first (inf at
   ``d ~ 1e20``, ``v ~ 1e10``); they now form ``d / v`` first.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.likelihoods import CategoricalOutput, LikelihoodOutput
from common.losses import ScaledLoss, make_loss, weighted

F32, F64 = torch.float32, torch.float64
DELTAS = [1e-4, 0.1, 0.5, 1.0]


class _LogProbOutput(LikelihoodOutput):
    """A likelihood output whose ``log_prob`` is a given tensor: the loss as a function of ``log p`` alone."""

    def __init__(self, log_p: torch.Tensor) -> None:
        self.log_p = log_p

    def log_prob(self, y: torch.Tensor) -> torch.Tensor:
        return self.log_p

    def log_integral_power(self, power: float) -> torch.Tensor:  # pragma: no cover - not used by GCE
        raise NotImplementedError


def _log_p_grid(dtype: torch.dtype) -> torch.Tensor:
    """``log p`` from 0 down to -160 (``p`` from 1 to 3e-70), shape ``(2, 40)``, in ``dtype``."""
    g = torch.Generator().manual_seed(0)
    mags = torch.cat([torch.tensor([0.0, 1e-6, 0.1, 1.0, 10.0, 16.0, 20.0, 40.0, 80.0, 160.0], dtype=F64),
                      160.0 * torch.rand(70, generator=g, dtype=F64)])
    return (-mags).to(dtype).view(2, 40)


# ---------------------------------------------------------------------------------------------------
# 1. GCE
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("delta", DELTAS)
def test_gce_gradient_wrt_log_p_is_minus_p_delta(dtype: torch.dtype, delta: float) -> None:
    # the exact derivative at the given log p (float64 math on the dtype's value), to the dtype's rounding wherever
    # -p^delta is a normal number of the dtype: the expm1 form's autograd gave 0 below p^delta ~ eps
    log_p = _log_p_grid(dtype).requires_grad_()
    (grad,) = torch.autograd.grad(make_loss("gce", delta=delta)(_LogProbOutput(log_p), None).sum(), log_p)
    fi = torch.finfo(dtype)
    checked = 0
    for got, lp in zip(grad.reshape(-1).tolist(), log_p.detach().double().reshape(-1).tolist()):
        want = -math.exp(delta * lp)
        if abs(want) >= fi.tiny:
            # exp's rounding plus that of delta * log p in the dtype (relative |delta log p| eps / 2 in p^delta)
            assert abs(got - want) <= (2 + abs(delta * lp)) * fi.eps * abs(want), (delta, lp, got, want)
            checked += 1
        else:  # below the normal range: the rounded (subnormal or 0) value
            assert abs(got - want) <= fi.tiny * fi.eps, (delta, lp, got, want)
    assert checked >= 40


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("delta", [0.5, 1.0])
@pytest.mark.parametrize("t", [16.0, 20.0, 40.0, 80.0])
def test_gce_gradient_of_a_misclassified_point_through_the_logits(dtype: torch.dtype, delta: float, t: float) -> None:
    # two classes, label 0, logits [0, t]: dL/dz_0 = -p^delta (1 - p) with log p = -log1p(e^t).  The float32 log p
    # itself is off by up to ~|log p| 6e-8 (log_softmax's rounding), so 1e-5 relative there; the expm1 form gave 0
    # (t >= 20 in float32 at delta = 1, t >= 40 in float64) or 6 % off (t = 16, float32)
    z = torch.tensor([[[0.0, t]]], dtype=dtype, requires_grad=True)
    (gz,) = torch.autograd.grad(make_loss("gce", delta=delta)(CategoricalOutput(z), torch.tensor([0])).sum(), z)
    log_p = -math.log1p(math.exp(t))
    want = -math.exp(delta * log_p) * -math.expm1(log_p)
    tol = 1e-5 if dtype == F32 else 1e-12
    assert abs(float(gz[0, 0, 0]) - want) <= tol * abs(want), (float(gz[0, 0, 0]), want)
    assert abs(float(gz[0, 0, 1]) + want) <= tol * abs(want)


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("delta", DELTAS)
def test_gce_values_are_the_expm1_form_bit_for_bit(dtype: torch.dtype, delta: float) -> None:
    g = torch.Generator().manual_seed(int(delta * 1e4))
    for scale in (1.0, 10.0, 80.0):
        z = (scale * (2.0 * torch.rand(3, 200, 10, generator=g, dtype=F64) - 1.0)).to(dtype)
        y = torch.randint(0, 10, (200,), generator=g)
        log_p = CategoricalOutput(z).log_prob(y)
        expected = -torch.expm1(delta * log_p) / delta
        assert torch.equal(make_loss("gce", delta=delta)(CategoricalOutput(z), y), expected)
        assert torch.equal(weighted(make_loss("gce", delta=delta), 3.0)(CategoricalOutput(z), y), 3.0 * expected)
        with torch.no_grad():
            assert torch.equal(make_loss("gce", delta=delta)(CategoricalOutput(z), y), expected)


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_weighted_gce_gradient_is_the_weight_times_minus_p_delta(dtype: torch.dtype) -> None:
    log_p = _log_p_grid(dtype).requires_grad_()
    loss = weighted(make_loss("gce", delta=0.5), 3.0)
    assert isinstance(loss, ScaledLoss)
    (grad,) = torch.autograd.grad(loss(_LogProbOutput(log_p), None).sum(), log_p)
    want = -3.0 * torch.exp(0.5 * log_p.detach().double())
    normal = want.abs() >= torch.finfo(dtype).tiny
    assert bool(normal.sum() >= 40)
    # exp's rounding plus that of 0.5 * log p in the dtype (see test_gce_gradient_wrt_log_p_is_minus_p_delta)
    bound = (3.0 + 0.5 * log_p.detach().double().abs()) * torch.finfo(dtype).eps * want.abs()
    assert bool(((grad.double() - want).abs() <= bound)[normal].all())


def test_gce_second_derivatives_and_forward_mode() -> None:
    # nothing in the package differentiates a loss twice, but the custom backward keeps double backward and
    # forward-mode AD (torch.func transforms are not supported: see _GCEOfLogProb)
    delta = 0.5
    loss = make_loss("gce", delta=delta)

    def f(lp: torch.Tensor) -> torch.Tensor:
        return loss(_LogProbOutput(lp), None)

    log_p = (-5.0 * torch.rand(3, 4, generator=torch.Generator().manual_seed(2), dtype=F64)).requires_grad_()
    assert torch.autograd.gradcheck(f, (log_p,), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(f, (log_p,))
    (g,) = torch.autograd.grad(f(log_p).sum(), log_p, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), log_p)
    lp = log_p.detach()
    assert torch.allclose(g.detach(), -torch.exp(delta * lp), rtol=1e-15, atol=0.0)
    assert torch.allclose(h, -delta * torch.exp(delta * lp), rtol=1e-15, atol=0.0)


# ---------------------------------------------------------------------------------------------------
# 2. the compiled mean-field kernel's mean terms at large precisions and mean differences
def _kernel_available() -> bool:
    from common import fused_meanfield

    return fused_meanfield.available()


def _kernel_and_float64_reference(kind: str, alpha: float, lam_p: float, d: float,
                                  raw: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The kernel's ``(value, d/dloc, d/draw)`` for one coordinate (``c = 1/2``: the divergence itself) and the same
    from float64 autograd of common/divergences.py (``v = softplus(raw)^2``, cavity ``N(0, 1/lam_p)``)."""
    from common import fused_meanfield as fm
    from common.divergences import alpha_renyi_mean_field_elementwise, kl_mean_field_elementwise
    from common.families import MeanFieldGaussian

    loc, raw_t = torch.tensor([d], requires_grad=True), torch.tensor([raw], requires_grad=True)
    mp, lp = torch.zeros(1), torch.tensor([lam_p])
    _, value, bad = fm.variance_and_divergence(loc, raw_t, mp, lp, kind, alpha, 0.5, 0.0)
    assert bad == 0
    grads = torch.autograd.grad(value, (loc, raw_t))
    got = (float(value.detach()), float(grads[0]), float(grads[1]))

    loc64, raw64 = loc.detach().double().requires_grad_(), raw_t.detach().double().requires_grad_()
    q = MeanFieldGaussian.from_mean_variance({"w": loc64}, {"w": torch.nn.functional.softplus(raw64) ** 2})
    p = MeanFieldGaussian.from_mean_variance({"w": mp.double()}, {"w": 1.0 / lp.double()})
    if kind == "alpha_renyi":
        ref = alpha_renyi_mean_field_elementwise(q, p, alpha)["w"].sum()
    elif kind == "reverse_kl":
        ref = kl_mean_field_elementwise(p, q)["w"].sum()
    else:
        ref = kl_mean_field_elementwise(q, p)["w"].sum()
    ref_grads = torch.autograd.grad(ref, (loc64, raw64))
    return got, (float(ref), float(ref_grads[0]), float(ref_grads[1]))


@pytest.mark.skipif(not _kernel_available(), reason="mean-field kernels could not be built here")
@pytest.mark.parametrize("kind, alpha, lam_p, d", [
    ("alpha_renyi", 0.5, 1e20, 1e10),   # the term ~4e20; lambda_p d^2 = 1e40 overflowed the old value
    ("alpha_renyi", -1.0, 1e20, 1e10),
    ("alpha_renyi", 0.9, 1e20, 1e10),
    ("alpha_renyi", 0.5, 1e30, 1e10),   # lambda_p d = 1e40 overflowed the old gradient as well
    ("alpha_renyi", -1.0, 1e30, 1e10),
    ("reverse_kl", 0.0, 1.0, 1e20),     # v = 1e10: d^2 = 1e40 overflowed the old value and d/dv
])
@pytest.mark.parametrize("raw", [0.0, 3.0])
def test_meanfield_kernel_mean_terms_do_not_overflow_where_the_divergence_is_finite(
        kind: str, alpha: float, lam_p: float, d: float, raw: float) -> None:
    if kind == "reverse_kl":
        raw = 1e5 + raw  # sigma = softplus(raw) ~ 1e5, v ~ 1e10
    got, want = _kernel_and_float64_reference(kind, alpha, lam_p, d, raw)
    for name, g, w in zip(("value", "d/dloc", "d/draw"), got, want):
        assert math.isfinite(w), (name, w)
        assert math.isfinite(g) and abs(g - w) <= 2e-6 * abs(w), (name, g, w)


@pytest.mark.skipif(not _kernel_available(), reason="mean-field kernels could not be built here")
@pytest.mark.parametrize("alpha", [0.5, -1.0])
def test_meanfield_kernel_and_torch_moment_form_agree_at_large_precisions(alpha: float) -> None:
    # the kernel and common.local_gvi's moment form (already lam_pa-first) on lambda_p 1e20, d 1e10 and around
    from common import fused_meanfield as fm
    from common.divergences import make_divergence
    from common.families import MeanFieldGaussian
    from common.local_gvi import MeanFieldMomentDivergence

    loc = torch.tensor([1e10, 3e9, -1e10, 0.5], requires_grad=True)
    raw = torch.tensor([0.0, 3.0, -1.0, 0.2], requires_grad=True)
    mp = torch.zeros(4)
    lp = torch.tensor([1e20, 1e18, 1e20, 2.0])
    _, kernel, bad = fm.variance_and_divergence(loc, raw, mp, lp, "alpha_renyi", alpha, 0.5, 0.0)
    assert bad == 0
    k_grads = torch.autograd.grad(kernel, (loc, raw))
    fd = MeanFieldMomentDivergence.create(make_divergence("alpha_renyi", alpha=alpha),
                                          MeanFieldGaussian.from_mean_variance({"w": mp}, {"w": 1.0 / lp}))
    assert fd is not None
    torch_path = fd({"w": loc}, {"w": torch.nn.functional.softplus(raw) ** 2})
    t_grads = torch.autograd.grad(torch_path, (loc, raw))
    k, t = float(kernel.detach()), float(torch_path.detach())
    assert math.isfinite(k) and abs(k - t) <= 1e-6 * abs(t), (k, t)
    # both float32 gradients against the float64 moment form, not against each other: the last entry (ordinary
    # values) has d/draw = -3.7e-3 for alpha 0.5, a difference of O(1) terms, so each float32 path is only good to
    # ~1e-7 absolute there, and how the two round depends on the CPU's vector code (kernel -3.68189e-3 and torch
    # -3.68168e-3 against -3.68177e-3 on 2026-11-27's Xeon; the old rtol 1e-6 between them failed there)
    loc64, raw64 = loc.detach().double().requires_grad_(), raw.detach().double().requires_grad_()
    fd64 = MeanFieldMomentDivergence.create(
        make_divergence("alpha_renyi", alpha=alpha),
        MeanFieldGaussian.from_mean_variance({"w": mp.double()}, {"w": 1.0 / lp.double()}))
    assert fd64 is not None
    ref = torch.autograd.grad(fd64({"w": loc64}, {"w": torch.nn.functional.softplus(raw64) ** 2}), (loc64, raw64))
    for got in (k_grads, t_grads):
        for a, want in zip(got, ref):
            assert bool(torch.isfinite(a).all()) and torch.allclose(a.double(), want, rtol=2e-6, atol=1e-6), (a, want)


def test_torch_moment_form_reverse_kl_gradient_finite_where_the_divergence_is():
    """The torch moment form's reverse-KL backward formed d * d first (inf at |d| ~ 2e19 in float32, where the
    value, (d / v) * d, is finite); it now forms (d / v) * d like the compiled kernel."""
    from common.local_gvi import _MomentDivergenceFn

    mean = torch.tensor([2e19], dtype=F32, requires_grad=True)
    var = torch.tensor([1e10], dtype=F32, requires_grad=True)
    val = _MomentDivergenceFn.apply(mean, var, torch.zeros(1), torch.ones(1), "reverse_kl", None, 0.5, "test")
    g_mean, g_var = torch.autograd.grad(val, (mean, var))
    assert math.isfinite(float(val)) and math.isfinite(float(g_mean)) and math.isfinite(float(g_var))
    # d/dv of 0.5 (d^2 / v + ...) is dominated by -0.5 d^2 / v^2 = -2e18
    assert float(g_var) == pytest.approx(-0.5 * 4e38 / 1e20, rel=1e-5)
