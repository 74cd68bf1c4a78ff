"""Follow-ups on the core's hot loop (common/likelihoods.py, common/local_gvi.py, common/problem.py).

1. Class labels are validated once, where the data enters, not on every minibatch:
   * :class:`~common.local_gvi._Objective` (``local_gvi``, ``gvi_objective``) checks a classifier's whole label
     tensor before anything runs, a ``ValueError`` naming the model; the loop then marks its categorical outputs
     ``labels_checked`` so ``CategoricalOutput.log_prob`` skips the per-call value check (4-11 us a call,
     6-12 % of the loss's forward and backward pass on a 32-row logistic-regression minibatch);
   * ``Problem.tensors`` checks them where a client loads its shard, naming the dataset, before the ``long``
     cast (which alone truncated a float label, 0.99 -> class 0, without a word);
   * a direct ``CategoricalOutput.log_prob`` call (user code) still checks every time.
2. The Alpha-Renyi moment form of the training loop (``MeanFieldMomentDivergence``) forms the mean term's
   precision ``lambda_p / (1 + a)`` before ``d`` enters, as :mod:`common.divergences` does: ``lambda_p d^2``
   first overflowed float32 at a cavity precision ~1e20 (value and gradient ``inf``, a NonFiniteError in
   ``local_gvi``) where the divergence is ~1e20.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.config import RunConfig
from common.divergences import make_divergence
from common.errors import NonFiniteError
from common.families import MeanFieldGaussian
from common.fast_math import log1p, log_ratio
from common.likelihoods import CategoricalOutput
from common.local_gvi import LocalGVIConfig, MeanFieldMomentDivergence, gvi_objective, local_gvi
from common.losses import make_loss
from common.models import make_model
from common.problem import build_problem

F32, F64 = torch.float32, torch.float64


# --------------------------------------------------------------------------------------------------
# 1. labels checked once
def _logistic(n: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    model = make_model("logistic_regression", in_features=2, num_classes=2)
    x = torch.randn(n, 2, generator=g, dtype=F64)
    y = (x[:, 0] + 0.5 * torch.randn(n, generator=g, dtype=F64) > 0).long()
    prior = MeanFieldGaussian.isotropic(model.param_shapes, 0.0, 1.0, dtype=F64)
    return model, x, y, prior


class _CountingAminmax:
    """``torch.aminmax`` with a call counter (the label check's one reduction)."""

    def __init__(self) -> None:
        self.calls = 0
        self.inner = torch.aminmax

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("estimate", ["end_of_epoch", "running"])
def test_training_loop_checks_labels_once_not_per_minibatch(monkeypatch, estimate):
    """The number of label reductions does not grow with the number of minibatch steps (1 vs 3 epochs of 6
    steps each): the labels are checked once before the loop, not on every ``log_prob``."""
    model, x, y, prior = _logistic()
    counts = []
    for epochs in (1, 3):
        counter = _CountingAminmax()
        monkeypatch.setattr(torch, "aminmax", counter)
        cfg = LocalGVIConfig(epochs=epochs, batch_size=16, n_samples=3, patience=None, polish=False,
                             objective_estimate=estimate)
        local_gvi(model, make_loss("gce", delta=0.5), make_divergence("kl"), prior, x, y, init=prior, config=cfg)
        monkeypatch.setattr(torch, "aminmax", counter.inner)
        counts.append(counter.calls)
    assert counts[0] == counts[1], f"label checks grow with the steps: {counts} for 1 and 3 epochs"
    assert counts[0] <= 2  # the finite-input check of x and the label check of y, once each


@pytest.mark.parametrize("bad, dtype", [([0, 1, 2, 1], torch.long), ([0, -1, 1, 1], torch.long),
                                        ([0.0, 0.99, 1.0, 1.0], F64), ([0.0, 1.0, 1.0, 2.5], F32)])
@pytest.mark.parametrize("entry", ["local_gvi", "gvi_objective"])
def test_bad_labels_fail_before_optimisation_naming_the_model(monkeypatch, bad, dtype, entry):
    model, x, _, prior = _logistic(n=4)
    y = torch.tensor(bad, dtype=dtype)
    calls = []
    inner = model.output
    monkeypatch.setattr(model, "output", lambda *a, **k: calls.append(1) or inner(*a, **k))
    with pytest.raises(ValueError, match=r"local_gvi: labels y of the classifier 'logistic_regression' \(2 classes\)"
                                         r".*\[0, 2\)"):
        if entry == "local_gvi":
            local_gvi(model, make_loss("nll"), make_divergence("kl"), prior, x, y, init=prior,
                      config=LocalGVIConfig(epochs=2, objective_estimate="running"))
        else:
            gvi_objective(model, make_loss("nll"), make_divergence("kl"), prior, x, y, prior)
    assert calls == [], "the model ran before the labels were checked"


def test_direct_log_prob_calls_still_check_and_the_opt_out_only_skips_the_values():
    out = CategoricalOutput(torch.randn(2, 4, 3, dtype=F64, generator=torch.Generator().manual_seed(1)))
    with pytest.raises(ValueError, match=r"categorical likelihood: labels must be class indices in \[0, 3\)"):
        out.log_prob(torch.tensor([0, 1, 3, 2]))
    with pytest.raises(ValueError, match=r"integer-valued"):
        make_loss("nll")(out, torch.tensor([0.0, 0.5, 1.0, 2.0], dtype=F64))
    y = torch.tensor([0, 2, 1, 2])
    trusted = CategoricalOutput(out.logits, labels_checked=True)
    assert torch.equal(trusted.log_prob(y), out.log_prob(y))
    with pytest.raises(ValueError, match=r"3 label\(s\)"):  # the count is checked even for checked labels
        trusted.log_prob(y[:3])
    assert out.num_classes == 3 and not out.labels_checked


def test_training_values_unchanged_by_skipping_the_per_call_check(monkeypatch):
    """The same run gives bit-identical results whether the outputs check their labels on every call or not."""
    import common.local_gvi as lg

    model, x, y, prior = _logistic()
    cfg = LocalGVIConfig(epochs=3, batch_size=16, n_samples=3, patience=None, polish=False)
    checks = []
    a = local_gvi(model, make_loss("nll"), make_divergence("kl"), prior, x, y, init=prior, config=cfg)
    # no up-front check: every output checks its own labels, on every minibatch
    monkeypatch.setattr(lg, "_check_labels", lambda model, y: None)
    import common.likelihoods as lk
    monkeypatch.setattr(lk, "check_class_labels", lambda *args, **kw: checks.append(1))
    b = local_gvi(model, make_loss("nll"), make_divergence("kl"), prior, x, y, init=prior, config=cfg)
    assert checks, "the per-call check did not run"
    assert a.objective_trace == b.objective_trace
    assert a.posterior.max_abs_diff(b.posterior) == 0.0
    # with float labels the same values: the up-front check accepts integer-valued floats
    monkeypatch.undo()
    c = local_gvi(model, make_loss("nll"), make_divergence("kl"), prior, x, y.to(F64), init=prior, config=cfg)
    assert a.objective_trace == c.objective_trace


def _logistic_problem():
    cfg = RunConfig(model="logistic_regression", dataset="synthetic_logistic_2d", num_clients=2)
    return build_problem(cfg)


@pytest.mark.parametrize("bad", [np.array([0.0, 0.99, 1.0]), np.array([0, 1, 2]), np.array([0, -1, 1]),
                                 np.array([0.0, np.nan, 1.0])])
def test_problem_tensors_rejects_bad_labels_naming_the_dataset(bad):
    problem = _logistic_problem()
    x = np.zeros((3, 2))
    with pytest.raises(ValueError, match=r"dataset 'synthetic_logistic_2d' \(model 'logistic_regression', 2 classes\)"
                                         r".*\[0, 2\)"):
        problem.tensors(x, bad)


def test_problem_tensors_accepts_valid_labels_as_long():
    problem = _logistic_problem()
    x = np.zeros((4, 2))
    # unsigned and bool labels too (the cast to long took them; uint16/32/64 have no aminmax, review of this change)
    for y in (np.array([0, 1, 1, 0]), np.array([0, 1, 1, 0], dtype=np.int32), np.array([0.0, 1.0, 1.0, 0.0]),
              np.array([0, 1, 1, 0], dtype=np.uint8), np.array([0, 1, 1, 0], dtype=np.uint16),
              np.array([0, 1, 1, 0], dtype=np.uint32), np.array([0, 1, 1, 0], dtype=np.uint64),
              np.array([False, True, True, False])):
        xt, yt = problem.tensors(x, y)
        assert yt.dtype == torch.long and yt.tolist() == [0, 1, 1, 0] and xt.dtype == problem.dtype


# --------------------------------------------------------------------------------------------------
# 2. the Alpha-Renyi moment form at large cavity precision
def _alpha_renyi_reference(lam_p: float, d: float, var: float, alpha: float):
    """Value and gradients (mean, variance) of D_AR(N(d, var) || N(0, 1/lam_p)) for one coordinate, in float64
    through common.divergences (autograd)."""
    p = MeanFieldGaussian.from_mean_variance({"w": torch.zeros(1, dtype=F64)},
                                             {"w": torch.full((1,), 1.0 / lam_p, dtype=F64)})
    mu = torch.full((1,), d, dtype=F64, requires_grad=True)
    v = torch.full((1,), var, dtype=F64, requires_grad=True)
    val = make_divergence("alpha_renyi", alpha=alpha)(MeanFieldGaussian.from_mean_variance({"w": mu}, {"w": v}), p)
    g_mu, g_v = torch.autograd.grad(val, [mu, v])
    return float(val.detach()), float(g_mu), float(g_v)


@pytest.mark.parametrize("lam_p, d, var, alpha", [(1e20, 1e10, 1.0, 0.5), (1e30, 1e10, 1.0, 0.5),
                                                  (1e30, 1e10, 1.0, 0.9), (1e30, 3e9, 1.0, 0.2),
                                                  (1e21, 1e9, 0.5, 0.5), (1e30, 1e10, 1.0, -0.5)])
def test_alpha_renyi_moment_form_finite_at_large_cavity_precision(lam_p, d, var, alpha):
    """float32: lambda_p d^2 (~1e40) overflowed although the divergence (~1e20) and its gradients are finite."""
    p = MeanFieldGaussian.from_mean_variance({"w": torch.zeros(1, dtype=F32)},
                                             {"w": torch.full((1,), 1.0 / lam_p, dtype=F32)})
    div = make_divergence("alpha_renyi", alpha=alpha)
    fast = MeanFieldMomentDivergence.create(div, p)
    assert fast is not None
    mu = torch.full((1,), d, dtype=F32, requires_grad=True)
    v = torch.full((1,), var, dtype=F32, requires_grad=True)
    val = fast({"w": mu}, {"w": v})
    g_mu, g_v = torch.autograd.grad(val, [mu, v])
    lam_p32 = float(p.precision()["w"][0])  # the cavity's precision as float32 stores it
    ref, ref_mu, ref_v = _alpha_renyi_reference(lam_p32, d, var, alpha)  # d, var: exact in float32
    assert math.isfinite(ref)
    for got, want in ((float(val.detach()), ref), (float(g_mu), ref_mu), (float(g_v), ref_v)):
        assert math.isfinite(got) and got == pytest.approx(want, rel=1e-5)
    # and the divergence object in float32 (the form this follows) agrees
    obj32 = float(div(MeanFieldGaussian.from_mean_variance({"w": mu.detach()}, {"w": v.detach()}), p))
    assert float(val.detach()) == pytest.approx(obj32, rel=1e-5)


def test_local_objective_finite_at_large_cavity_precision():
    """What a user saw: gvi_objective (and local_gvi) raised NonFiniteError 'divergence inf'."""
    model = make_model("logistic_regression", in_features=2, num_classes=2)
    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(0)) * 1e-12
    y = torch.tensor([0, 1] * 4)
    cavity = MeanFieldGaussian.from_mean_variance({"theta": torch.zeros(3, dtype=F32)},
                                                  {"theta": torch.full((3,), 1e-20, dtype=F32)})
    q = MeanFieldGaussian.from_mean_variance({"theta": torch.tensor([1e10, -1e10, 1e10], dtype=F32)},
                                             {"theta": torch.ones(3, dtype=F32)})
    div = make_divergence("alpha_renyi", alpha=0.5)
    try:
        value = gvi_objective(model, make_loss("nll"), div, cavity, x, y, q, LocalGVIConfig(n_samples=4))
    except NonFiniteError as err:  # pragma: no cover - the old behaviour
        pytest.fail(f"non-finite local objective: {err}")
    d_ref = float(div(q, cavity))  # ~3e20; the expected loss (~4e10) is below its float32 resolution
    assert value == pytest.approx(d_ref, rel=1e-5)


@pytest.mark.parametrize("alpha", [2.5, 0.5, 0.3, -0.5])
def test_alpha_renyi_moment_form_unchanged_in_normal_ranges(alpha):
    """The reordered product equals the previous formula (lambda_p d d) / (1 + a) to float32 rounding."""
    g = torch.Generator().manual_seed(2)
    n = 4096
    mean_p = torch.randn(n, generator=g)
    lam_p = torch.exp(2.0 * torch.randn(n, generator=g))
    p = MeanFieldGaussian.from_mean_variance({"w": mean_p}, {"w": 1.0 / lam_p})
    mu = torch.randn(n, generator=g).requires_grad_()
    # q's variance 0.5-1.2 times p's: inside the Alpha-Renyi domain for every alpha tested
    var = ((1.0 / lam_p) * (0.5 + 0.7 * torch.rand(n, generator=g))).requires_grad_()
    fast = MeanFieldMomentDivergence.create(make_divergence("alpha_renyi", alpha=alpha), p)
    val = fast({"w": mu}, {"w": var})
    g_mu, g_v = torch.autograd.grad(val, [mu, var])
    with torch.no_grad():  # the previous float32 expressions, (lambda_p d d) / (1 + a)
        lp, d = p.precision()["w"], mu - p.mean()["w"]
        r = lp * var
        u = r - 1.0
        a = (1.0 - alpha) * u
        inv1a = 1.0 / (1.0 + a)
        log_term = log1p(a).sub_(log_ratio(r, u, log1p), alpha=1.0 - alpha).sum() / (alpha * (alpha - 1.0))
        old_val = 0.5 * (torch.dot(lp * d * d, inv1a) - log_term)
        t = lp * d * inv1a
        old_g_mu = t  # 2 c t with c = 1/2
        old_g_v = 0.5 * (-(1.0 - alpha) * t * t + (lp * inv1a - 1.0 / var) / alpha)
    assert float(val.detach()) == pytest.approx(float(old_val), rel=1e-6)
    ref = float(make_divergence("alpha_renyi", alpha=alpha)(
        MeanFieldGaussian.from_mean_variance({"w": mu.detach().double()}, {"w": var.detach().double()}), p.to(F64)))
    assert float(val.detach()) == pytest.approx(ref, rel=1e-5)
    torch.testing.assert_close(g_mu, old_g_mu, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_v, old_g_v, rtol=1e-6, atol=1e-5)
