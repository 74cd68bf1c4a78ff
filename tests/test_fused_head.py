"""common.fused_head: the fused categorical head (last hidden layer's draw, output layer, logits' draw, softmax
loss and its gradient in one pass) equals the torch formula on the same noise, value and gradients; does not
depend on the thread count; propagates NaN; refuses what it cannot take; and the model and local GVI use it."""

from __future__ import annotations

import pytest
import torch

from common import fused_head, fused_sampling
from common.divergences import make_divergence
from common.families import MeanFieldGaussian
from common.likelihoods import CategoricalOutput
from common.local_gvi import LocalGVIConfig, local_gvi
from common.losses import make_loss, weighted
from common.models import make_model

pytestmark = pytest.mark.skipif(not fused_head.available(), reason="compiled kernels unavailable")

LOSSES = {
    "nll": lambda: make_loss("nll"),
    "gce": lambda: make_loss("gce", delta=0.8),
    "weighted_gce": lambda: weighted(make_loss("gce", delta=0.5), 50.0),
}
# (R, H, C, S, D, B): one hidden layer (R = B rows, D = S draws); ragged H and R (blocks of 128 rows, vectors of
# 16); a deeper network's last layer (R = S B rows of samples, D = 1, label of row r is y[r mod B]); the most
# classes (C = MAX_CLASSES) on one hidden unit; an odd class count with an odd number of vectors and a last
# row group of one row (the kernel's class pairs and column-vector pairs)
SHAPES = [(256, 200, 10, 10, 10, 256), (300, 37, 3, 4, 4, 300), (60, 16, 5, 3, 1, 20),
          (64, 1, fused_head.MAX_CLASSES, 2, 2, 64), (133, 17, 9, 2, 2, 133)]


def _inputs(R: int, H: int, C: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(R, H, generator=g)
    var = torch.rand(R, H, generator=g) + 0.1
    wm = torch.randn(C, H, generator=g) / H**0.5
    bm = torch.randn(C, generator=g)
    wv = torch.rand(C, H, generator=g) * 0.1
    bv = torch.rand(C, generator=g) * 0.1 + 0.01
    return [t.requires_grad_() for t in (mu, var, wm, bm, wv, bv)]


def _key(seed: int) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64))


def _torch_reference(params, y, S, D, loss, key):  # type: ignore[no-untyped-def]
    """The module docstring's formula in torch on the kernel's own noise (common.fused_sampling's streams)."""
    mu, var, wm, bm, wv, bv = params
    R, H = mu.shape
    C = wm.shape[0]
    eh = torch.stack([fused_sampling.standard_normal(R * H, d, key).view(R, H) for d in range(D)])
    eo = torch.stack([fused_sampling.standard_normal(R * C, d + fused_head.OUTPUT_STREAM, key).view(R, C)
                      for d in range(D)])
    h = torch.relu(mu + var.sqrt() * eh)
    z = (h @ wm.t() + bm) + ((h * h) @ wv.t() + bv).sqrt() * eo
    labels = y.repeat(D * R // y.shape[0])
    return loss(CategoricalOutput(z.reshape(1, D * R, C)), labels).sum() / S


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_value_and_gradients_equal_the_torch_formula_on_the_same_noise(shape, loss_name) -> None:  # type: ignore[no-untyped-def]
    R, H, C, S, D, B = shape
    params = _inputs(R, H, C)
    y = torch.randint(0, C, (B,), generator=torch.Generator().manual_seed(1))
    loss = LOSSES[loss_name]()
    value = fused_head.expected_loss(*params, y, S, D, loss, torch.Generator().manual_seed(7))
    grads = torch.autograd.grad(3.0 * value, params)
    ref = _torch_reference(params, y, S, D, loss, _key(7))
    ref_grads = torch.autograd.grad(3.0 * ref, params)
    assert float(value.detach()) == pytest.approx(float(ref.detach()), rel=2e-6)
    for name, g, r in zip(["mu", "var", "w_mean", "b_mean", "w_var", "b_var"], grads, ref_grads):
        err = float((g - r).abs().max() / r.abs().max())
        assert err < 1e-5, f"{name}: relative error {err:.2e}"


def test_without_gradients_the_value_is_the_same_and_no_graph_is_built() -> None:
    params = _inputs(256, 64, 10)
    y = torch.randint(0, 10, (256,))
    loss = make_loss("gce", delta=0.8)
    with_grad = fused_head.expected_loss(*params, y, 5, 5, loss, torch.Generator().manual_seed(3))
    with torch.no_grad():
        without = fused_head.expected_loss(*params, y, 5, 5, loss, torch.Generator().manual_seed(3))
    assert without.grad_fn is None and with_grad.grad_fn is not None
    assert float(without) == float(with_grad.detach())


def test_result_does_not_depend_on_the_thread_count() -> None:
    params = _inputs(300, 50, 7)  # 3 blocks of rows
    y = torch.randint(0, 7, (300,))
    loss = make_loss("nll")
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            v = fused_head.expected_loss(*params, y, 4, 4, loss, torch.Generator().manual_seed(11))
            results.append((v.detach(), torch.autograd.grad(v, params)))
    finally:
        torch.set_num_threads(before)
    for v, grads in results[1:]:
        assert torch.equal(v, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1]))


def test_nan_propagates_and_bad_labels_are_refused() -> None:
    params = [t.detach() for t in _inputs(20, 16, 4)]
    y = torch.randint(0, 4, (20,))
    params[0][3, 5] = float("nan")
    assert torch.isnan(fused_head.expected_loss(*params, y, 2, 2, make_loss("nll")))
    params[0][3, 5] = 0.0
    # a ValueError with the torch path's message (CategoricalOutput's check_class_labels), not an IndexError
    with pytest.raises(ValueError, match=r"fused head: labels must be class indices in \[0, 4\), got labels from 4"):
        fused_head.expected_loss(*params, torch.full((20,), 4), 2, 2, make_loss("nll"))
    with pytest.raises(ValueError, match=r"fused head: labels must be class indices in \[0, 4\)"):
        fused_head.expected_loss(*params, torch.full((20,), -1), 2, 2, make_loss("nll"))


def test_rejects_what_it_cannot_take() -> None:
    params = [t.detach() for t in _inputs(20, 16, 4)]
    y = torch.randint(0, 4, (20,))
    with pytest.raises(ValueError, match="loss"):
        fused_head.expected_loss(*params, y, 2, 2, make_loss("beta", beta=1.5))
    with pytest.raises(ValueError, match="labels"):
        fused_head.expected_loss(*params, y[:7], 2, 2, make_loss("nll"))  # 7 does not divide 40 rows
    with pytest.raises(ValueError, match="weights"):
        fused_head.expected_loss(params[0], params[1], params[2][:, :5], *params[3:], y, 2, 2, make_loss("nll"))
    with pytest.raises(RuntimeError, match="float32"):
        fused_head.expected_loss(*[p.double() for p in params], y, 2, 2, make_loss("nll"))
    assert fused_head.loss_spec(make_loss("nll")) == (0.0, 1.0)
    assert fused_head.loss_spec(weighted(make_loss("gce", delta=0.3), 4.0)) == (0.3, 4.0)
    assert fused_head.loss_spec(make_loss("gamma", gamma=1.5)) is None


@pytest.mark.parametrize("R", [3, 5, 130])
def test_a_zero_output_bias_variance_gives_finite_gradients_with_a_ragged_last_row_group(R) -> None:
    """b_var = 0 exactly (a deterministic output bias): the empty slots of the last group of 4 rows had variance
    0, sqrt 0 and gradient 0 * 0 / 0 = NaN, which the block sum spread over all of d/dw_var and d/db_var."""
    params = _inputs(R, 7, 3, seed=3)
    with torch.no_grad():
        params[5].zero_()
    y = torch.randint(0, 3, (R,), generator=torch.Generator().manual_seed(4))
    loss = make_loss("nll")
    value = fused_head.expected_loss(*params, y, 2, 2, loss, torch.Generator().manual_seed(7))
    grads = torch.autograd.grad(value, params)
    ref_grads = torch.autograd.grad(_torch_reference(params, y, 2, 2, loss, _key(7)), params)
    for name, g, r in zip(["mu", "var", "w_mean", "b_mean", "w_var", "b_var"], grads, ref_grads):
        assert bool(torch.isfinite(g).all()), name
        assert float((g - r).abs().max() / r.abs().max()) < 1e-4, name


def test_an_empty_batch_is_refused_with_a_clear_error() -> None:
    params = _inputs(0, 7, 3)
    with pytest.raises(ValueError, match="no rows"):
        fused_head.expected_loss(*params, torch.zeros(0, dtype=torch.int64), 2, 2, make_loss("nll"),
                                 torch.Generator().manual_seed(7))


def _bnn(hidden: list[int], fused: bool = True):  # type: ignore[no-untyped-def]
    model = make_model("bnn", in_features=12, hidden=hidden, num_classes=4, fused_sampling=fused)
    mean = model.init_mean(torch.Generator().manual_seed(0))
    var = {k: torch.full_like(v, 0.05) for k, v in mean.items()}
    return model, mean, var


@pytest.mark.parametrize("hidden", [[16], [16, 8]])
def test_model_estimate_agrees_in_distribution_with_the_torch_path(hidden) -> None:  # type: ignore[no-untyped-def]
    """Mean over 400 keys of the fused estimate and of output_local_reparam + loss: equal within 5 s.e."""
    model, mean, var = _bnn(hidden)
    x = torch.randn(32, 12, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 4, (32,), generator=torch.Generator().manual_seed(3))
    loss = make_loss("gce", delta=0.7)
    fused, plain = [], []
    for seed in range(400):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            v = model.expected_loss_local_reparam(mean, var, x, y, 4, loss, g)
            assert v is not None
            fused.append(float(v))
            out = model.output_local_reparam(mean, var, x, 4, torch.Generator().manual_seed(10_000 + seed))
            plain.append(float(loss(out, y).sum() / 4))
    f, p = torch.tensor(fused, dtype=torch.float64), torch.tensor(plain, dtype=torch.float64)
    se = (f.var() / len(f) + p.var() / len(p)).sqrt()
    assert abs(float(f.mean() - p.mean())) < 5 * float(se)


def test_model_declines_where_the_kernel_does_not_apply() -> None:
    model, mean, var = _bnn([16])
    x, y = torch.randn(8, 12), torch.randint(0, 4, (8,))
    assert model.expected_loss_local_reparam(mean, var, x, y, 2, make_loss("beta", beta=1.5)) is None
    off, mean_off, var_off = _bnn([16], fused=False)
    assert off.expected_loss_local_reparam(mean_off, var_off, x, y, 2, make_loss("nll")) is None
    linear = make_model("bnn", in_features=12, hidden=[], num_classes=4)
    m0 = linear.init_mean(torch.Generator().manual_seed(0))
    assert linear.expected_loss_local_reparam(m0, {k: torch.ones_like(v) for k, v in m0.items()}, x, y, 2,
                                              make_loss("nll")) is None
    m64 = {k: v.double() for k, v in mean.items()}
    assert model.expected_loss_local_reparam(m64, {k: v.double() for k, v in var.items()}, x, y, 2,
                                             make_loss("nll")) is None


def test_local_gvi_uses_the_head_and_reaches_the_torch_paths_objective(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 12, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    calls = []
    real = fused_head.loss_and_gradients  # the kernel's entry point on both routes (autograd and explicit step)
    monkeypatch.setattr(fused_head, "loss_and_gradients", lambda *a, **k: calls.append(1) or real(*a, **k))
    results = {}
    for fused in (True, False):
        model = make_model("bnn", in_features=12, hidden=[16], num_classes=4, fused_sampling=fused)
        prior = MeanFieldGaussian.isotropic(model.param_shapes, 0.0, 1.0, dtype=torch.float32)
        mean = model.init_mean(torch.Generator().manual_seed(1))
        init = MeanFieldGaussian.from_mean_variance(mean, {k: torch.full_like(v, 1e-3) for k, v in mean.items()})
        cfg = LocalGVIConfig(epochs=30, batch_size=64, lr=1e-2, n_samples=4, patience=None, seed=3,
                             local_reparam=True, objective_estimate="running")
        res = local_gvi(model, make_loss("gce", delta=0.8), make_divergence("kl"), prior, x, y, init, cfg)
        assert res.objective_trace[-1] < 0.6 * res.objective_trace[0]
        results[fused] = res.objective_trace[-1]
        if fused:
            assert len(calls) == 30 * 8  # every step of every epoch
    assert results[True] == pytest.approx(results[False], rel=0.1)
