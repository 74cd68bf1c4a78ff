"""common.fused_meanfield: the fused variances, divergence value and gradients equal the torch path's
(softplus scales + MeanFieldMomentDivergence) for every moment-form divergence, the Alpha-Renyi undefined
region raises the same typed error from local_gvi, and a local GVI run is the same on both paths."""

from __future__ import annotations

import math

import pytest
import torch

from common import fused_meanfield as fm
from common.divergences import make_divergence
from common.errors import DivergenceUndefinedError
from common.families import MeanFieldGaussian
from common.local_gvi import LocalGVIConfig, MeanFieldMomentDivergence, local_gvi
from common.losses import make_loss
from common.models import make_model
from common.variational import MeanFieldVariational

pytestmark = pytest.mark.skipif(not fm.available(), reason="mean-field kernels could not be built here")

DIVERGENCES = [("kl", {}), ("weighted_kl", {"w": 3.0}), ("reverse_kl", {}), ("alpha_renyi", {"alpha": 2.5}),
               ("alpha_renyi", {"alpha": 0.5}), ("alpha_renyi", {"alpha": -0.05})]  # alpha < 0: q no narrower than 0.048 x p


def _setup(n: int = 5000, seed: int = 0) -> tuple[MeanFieldVariational, MeanFieldGaussian]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (n // 50, 50), "b": (7,)}
    mean = {k: 0.3 * torch.randn(s, generator=g) for k, s in shapes.items()}
    var = {k: 0.05 + 0.3 * torch.rand(s, generator=g) for k, s in shapes.items()}
    q = MeanFieldVariational(MeanFieldGaussian.from_mean_variance(mean, var), dtype=torch.float32)
    p_mean = {k: 0.2 * torch.randn(s, generator=g) for k, s in shapes.items()}
    p_var = {k: 0.3 + 0.3 * torch.rand(s, generator=g) for k, s in shapes.items()}
    return q, MeanFieldGaussian.from_mean_variance(p_mean, p_var)


@pytest.mark.parametrize("name, hyper", DIVERGENCES)
def test_value_and_gradients_equal_the_torch_path(name: str, hyper: dict) -> None:
    q, p = _setup()
    fd = MeanFieldMomentDivergence.create(make_divergence(name, **hyper), p)
    assert fd is not None
    g = torch.Generator().manual_seed(1)
    g_var = {k: torch.randn(v.shape, generator=g) for k, v in zip(q.names, q.locs)}

    # torch path
    scales = q.scales()
    var_t = {k: s * s for k, s in scales.items()}
    d_t = fd(q.means(), var_t)
    obj_t = d_t + sum((g_var[k] * var_t[k]).sum() for k in q.names)
    grads_t = torch.autograd.grad(obj_t, [*q.locs, *q.raw_scales])

    # fused path
    total = None
    var_f = {}
    for k, loc, raw in zip(q.names, q.locs, q.raw_scales):
        v, value, bad = fm.variance_and_divergence(loc, raw, fd.mean_p[k], fd.lam_p[k], fd.kind, fd.alpha,
                                                   0.5 * fd.weight, q.min_scale)
        assert bad == 0
        var_f[k] = v
        total = value if total is None else total + value
    obj_f = total + sum((g_var[k] * var_f[k]).sum() for k in q.names)
    grads_f = torch.autograd.grad(obj_f, [*q.locs, *q.raw_scales])

    for k in q.names:
        assert torch.allclose(var_f[k], var_t[k], rtol=2e-6, atol=0)
    assert abs(float(total.detach()) - float(d_t.detach())) <= 1e-5 * abs(float(d_t.detach()))
    for a, b in zip(grads_f, grads_t):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_divergence_value_against_the_float64_closed_form() -> None:
    q, p = _setup(seed=3)
    div = make_divergence("alpha_renyi", alpha=2.5)
    fd = MeanFieldMomentDivergence.create(div, p)
    total = 0.0
    for k, loc, raw in zip(q.names, q.locs, q.raw_scales):
        _, value, _ = fm.variance_and_divergence(loc, raw, fd.mean_p[k], fd.lam_p[k], fd.kind, fd.alpha, 0.5,
                                                 q.min_scale)
        total += float(value.detach())
    with torch.no_grad():
        ref = float(div(q.distribution().to(torch.float64), p.to(torch.float64)))
    assert abs(total - ref) <= 1e-5 * abs(ref)


def test_only_the_loss_gradient_or_only_the_divergence_gradient() -> None:
    q, p = _setup(n=600)
    fd = MeanFieldMomentDivergence.create(make_divergence("kl"), p)
    k, loc, raw = q.names[0], q.locs[0], q.raw_scales[0]
    v, value, _ = fm.variance_and_divergence(loc, raw, fd.mean_p[k], fd.lam_p[k], "kl", 1.0, 0.5, q.min_scale)
    g_loc, g_raw = torch.autograd.grad(v.sum(), (loc, raw), allow_unused=True)
    assert float(g_loc.abs().max()) == 0.0
    s = torch.nn.functional.softplus(raw.detach()) + q.min_scale
    assert torch.allclose(g_raw, 2 * s * torch.sigmoid(raw.detach()), rtol=1e-5)
    v, value, _ = fm.variance_and_divergence(loc, raw, fd.mean_p[k], fd.lam_p[k], "kl", 1.0, 0.5, q.min_scale)
    g_loc, _ = torch.autograd.grad(value, (loc, raw))
    d = loc.detach() - fd.mean_p[k]
    assert torch.allclose(g_loc, fd.lam_p[k] * d, rtol=1e-5, atol=1e-7)


def test_alpha_renyi_undefined_region_raises_the_typed_error_in_local_gvi() -> None:
    model = make_model("logistic_regression", in_features=3, num_classes=2)
    shapes = model.param_shapes
    # q's variance 4x the cavity's: alpha = 2.5 needs sigma_q^2 < 1.667 sigma_p^2
    cavity = MeanFieldGaussian.isotropic(shapes, 0.0, 1.0, dtype=torch.float32)
    start = MeanFieldGaussian.isotropic(shapes, 0.0, 4.0, dtype=torch.float32)
    x = torch.randn(20, 3)
    y = torch.randint(0, 2, (20,))
    cfg = LocalGVIConfig(epochs=1, batch_size=10, n_samples=2, local_reparam=True, objective_estimate="running",
                         patience=None)
    with pytest.raises(DivergenceUndefinedError, match="sigma_q\\^2 < 1.667"):
        local_gvi(model, make_loss("nll"), make_divergence("alpha_renyi", alpha=2.5), cavity, x, y, start, cfg)


def test_local_gvi_is_the_same_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model("bnn", in_features=8, hidden=[16], num_classes=3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 8, generator=g)
    y = torch.randint(0, 3, (300,), generator=g)
    prior = MeanFieldGaussian.isotropic(model.param_shapes, 0.0, 1.0, dtype=torch.float32)
    mean = model.init_mean(torch.Generator().manual_seed(1))
    start = MeanFieldGaussian.from_mean_variance(mean, {k: torch.full_like(v, 1e-2) for k, v in mean.items()})
    cfg = LocalGVIConfig(epochs=3, batch_size=64, n_samples=4, local_reparam=True, objective_estimate="running",
                         patience=None, seed=5, lr=1e-2)
    args = (model, make_loss("gce", delta=0.8), make_divergence("alpha_renyi", alpha=2.5), prior, x, y, start, cfg)
    fused = local_gvi(*args)
    monkeypatch.setattr(fm, "applies_to", lambda t: False)
    plain = local_gvi(*args)
    # the same noise (the model's sampler is not affected), so the runs differ by float32 rounding only
    assert fused.objective_trace == pytest.approx(plain.objective_trace, rel=1e-4)
    for k in model.param_shapes:
        assert torch.allclose(fused.posterior.mean()[k], plain.posterior.mean()[k], rtol=1e-3, atol=1e-4)
        assert torch.allclose(fused.posterior.variance()[k], plain.posterior.variance()[k], rtol=1e-3, atol=1e-6)


def test_rejects_what_it_cannot_take() -> None:
    q, p = _setup(n=600)
    fd = MeanFieldMomentDivergence.create(make_divergence("kl"), p)
    k, loc, raw = q.names[0], q.locs[0], q.raw_scales[0]
    with pytest.raises(ValueError, match="unknown"):
        fm.variance_and_divergence(loc, raw, fd.mean_p[k], fd.lam_p[k], "tv", 1.0, 0.5, 0.0)
    with pytest.raises(ValueError, match="float32"):
        fm.variance_and_divergence(loc.double(), raw, fd.mean_p[k], fd.lam_p[k], "kl", 1.0, 0.5, 0.0)


def test_results_do_not_depend_on_the_thread_count_and_zero_size_works() -> None:
    """Chunk boundaries are multiples of BLOCK and the sum runs over fixed blocks in a fixed order (a review
    found last-bit differences at the chunk edges with unaligned chunks, n = 100,003)."""
    n = 100_003
    g = torch.Generator().manual_seed(0)
    loc, raw = torch.randn(n, generator=g), 0.5 * torch.randn(n, generator=g) - 4.0  # inside the AR domain
    mp, lp = 0.1 * torch.randn(n, generator=g), 1.0 + torch.rand(n, generator=g)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            l_, r_ = loc.clone().requires_grad_(True), raw.clone().requires_grad_(True)
            v, value, bad = fm.variance_and_divergence(l_, r_, mp, lp, "alpha_renyi", 2.5, 0.5, 1e-8)
            grads = torch.autograd.grad(value + v.sum(), (l_, r_))
            results.append((v.detach(), float(value.detach()), bad, *grads))
    finally:
        torch.set_num_threads(before)
    assert results[0][2] == 0 and math.isfinite(results[0][1])
    for other in results[1:]:
        assert torch.equal(results[0][0], other[0]) and results[0][1] == other[1] and results[0][2] == other[2]
        assert torch.equal(results[0][3], other[3]) and torch.equal(results[0][4], other[4])
    empty = torch.zeros(0, requires_grad=True)
    v, value, bad = fm.variance_and_divergence(empty, torch.zeros(0), torch.zeros(0), torch.ones(0), "kl", 1.0, 0.5,
                                               1e-8)
    assert v.shape == (0,) and float(value.detach()) == 0.0 and bad == 0


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_tensors_in_one_call_equal_one_call_each(threads: int) -> None:
    """variances_and_divergence over tensors of mixed sizes (empty, smaller than a block, several blocks with a
    partial last one) equals per-tensor calls: the same variances and gradients, the value as the sum of theirs,
    and each Alpha-Renyi violation counted against its own tensor."""
    g = torch.Generator().manual_seed(4)
    sizes = [fm.BLOCK * 2 + 17, 0, 7, fm.BLOCK, 3 * fm.BLOCK + 1]
    locs = [torch.randn(n, generator=g).requires_grad_(True) for n in sizes]
    raws = [(0.5 * torch.randn(n, generator=g) - 4.0).requires_grad_(True) for n in sizes]
    mps = [0.1 * torch.randn(n, generator=g) for n in sizes]
    lps = [1.0 + torch.rand(n, generator=g) for n in sizes]
    lps[2] = lps[2].clone()
    lps[2][3] = 1e9  # lambda_p v >> 1: outside the alpha = 2.5 domain, in tensor 2 only
    g_vars = [torch.randn(n, generator=g) for n in sizes]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        vs, value, bad = fm.variances_and_divergence(locs, raws, mps, lps, "alpha_renyi", 2.5, 0.5, 1e-8)
        assert bad == [0, 0, 1, 0, 0]
        grads = torch.autograd.grad(value + sum((gv * v).sum() for gv, v in zip(g_vars, vs)), [*locs, *raws])
        singles = [fm.variance_and_divergence(*t, "alpha_renyi", 2.5, 0.5, 1e-8) for t in zip(locs, raws, mps, lps)]
    finally:
        torch.set_num_threads(before)
    assert [b for _, _, b in singles] == bad
    ok = [i for i in range(len(sizes)) if i != 2]  # tensor 2's value is meaningless (outside the domain)
    want = sum(float(singles[i][1].detach()) for i in ok)
    got_ok = fm.variances_and_divergence([locs[i] for i in ok], [raws[i] for i in ok], [mps[i] for i in ok],
                                         [lps[i] for i in ok], "alpha_renyi", 2.5, 0.5, 1e-8)[1]
    assert float(got_ok.detach()) == pytest.approx(want, rel=1e-6)
    for i, (v, value_i, _) in enumerate(singles):
        assert torch.equal(vs[i], v)
        gl, gr = torch.autograd.grad(value_i + (g_vars[i] * v).sum(), [locs[i], raws[i]])
        if i != 2:
            assert torch.equal(grads[i], gl) and torch.equal(grads[len(sizes) + i], gr)


def _closed_form64(kind: str, alpha: float, v, lam_p: float, d):  # type: ignore[no-untyped-def]
    """One coordinate's divergence term (times 1/2), float64: KL(q || p), KL(p || q) or Alpha-Renyi."""
    r = lam_p * v
    if kind == "kl":
        return 0.5 * (r - 1.0 - torch.log(r) + lam_p * d * d)
    if kind == "reverse_kl":
        return 0.5 * (1.0 / r - 1.0 + torch.log(r) + d * d / v)
    one_a = alpha + (1.0 - alpha) * r
    return 0.5 * (lam_p * d * d / one_a - (torch.log(one_a) - (1.0 - alpha) * torch.log(r)) / (alpha * (alpha - 1.0)))


@pytest.mark.parametrize("kind, alpha", [("kl", 1.0), ("reverse_kl", 0.0), ("alpha_renyi", 2.5),
                                         ("alpha_renyi", 0.5)])
def test_float32_terms_and_gradients_stay_accurate_for_variances_far_from_the_cavitys(kind: str, alpha: float) -> None:
    # r = lambda_p v from 1e-12 to 1e6 (Alpha-Renyi 2.5: below its bound 5/3): in float32 r - 1 rounds to -1 for
    # r < 3e-8, so a log1p of it made the KL inf (and lost digits well before); both paths, the C kernel and the
    # torch moment form, against the float64 closed form with float64 gradients w.r.t. the loc and the raw scale
    ratios = [10.0 ** e for e in range(-12, 7)] + [0.3, 0.7, 1.3]
    if kind == "alpha_renyi" and alpha > 1.0:
        ratios = [r for r in ratios if r < 1.6]
    lam_p = 2.0
    for r in ratios:
        s64 = torch.tensor([math.sqrt(r / lam_p)], dtype=torch.float64)
        raw64 = torch.log(torch.expm1(s64))  # softplus^-1 of the scale
        loc = torch.tensor([0.45], requires_grad=True)
        raw = raw64.float().requires_grad_(True)
        mp, lp = torch.tensor([0.15]), torch.tensor([lam_p])
        loc64, rawd = loc.detach().double().requires_grad_(True), raw.detach().double().requires_grad_(True)
        ref = _closed_form64(kind, alpha, torch.nn.functional.softplus(rawd) ** 2, lam_p, loc64 - 0.15).sum()
        ref_grads = torch.autograd.grad(ref, (loc64, rawd))
        ref = ref.detach()
        _, fused, bad = fm.variance_and_divergence(loc, raw, mp, lp, kind, alpha, 0.5, 0.0)
        assert bad == 0
        p = MeanFieldGaussian.from_mean_variance({"w": mp}, {"w": 1.0 / lp})
        div = make_divergence(kind, **({"alpha": alpha} if kind == "alpha_renyi" else {}))
        fd = MeanFieldMomentDivergence.create(div, p)
        assert fd is not None
        var_t = torch.nn.functional.softplus(raw) ** 2
        torch_path = fd({"w": loc}, {"w": var_t})
        for name, value in (("kernel", fused), ("torch", torch_path)):
            grads = torch.autograd.grad(value, (loc, raw))
            assert math.isfinite(value.item()), (name, kind, r)
            assert abs(value.item() - float(ref)) <= 2e-6 * abs(float(ref)) + 1e-6, (name, kind, r, value.item(),
                                                                                    float(ref))
            for got, want in zip(grads, ref_grads):
                assert abs(float(got) - float(want)) <= 1e-4 * abs(float(want)) + 1e-6, (name, kind, r, float(got),
                                                                                         float(want))
