"""common.explicit_step: the one-hidden-layer BNN step without autograd gives bit-identical objectives and
posteriors to the autograd path (same kernels, same noise, same operation order), applies only where that
path would run the kernels for every piece, and raises the same typed errors."""

from __future__ import annotations

import pytest
import torch

from common import explicit_step, fused_head, fused_meanfield
from common.divergences import make_divergence
from common.errors import DivergenceUndefinedError, NonFiniteError
from common.adam import Adam
from common.explicit_step import OneHiddenLayerStep
from common.families import MeanFieldGaussian
from common.local_gvi import LocalGVIConfig, MeanFieldMomentDivergence, local_gvi
from common.losses import make_loss
from common.models import make_model
from common.variational import MeanFieldVariational

pytestmark = pytest.mark.skipif(not (fused_head.available() and fused_meanfield.available()),
                                reason="the compiled kernels could not be built here")

CASES = [
    (("nll", {}), ("kl", {})),
    (("gce", {"delta": 0.8}), ("alpha_renyi", {"alpha": 2.5})),
    (("gce", {"delta": 0.5, "weight": 50.0}), ("weighted_kl", {"w": 3.0})),
    (("nll", {}), ("reverse_kl", {})),
    (("nll", {}), ("alpha_renyi", {"alpha": 0.5})),
]


def _problem(n: int = 300, d: int = 12, hidden: int = 20, classes: int = 4, seed: int = 0):  # type: ignore[no-untyped-def]
    model = make_model("bnn", in_features=d, hidden=[hidden], num_classes=classes)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    cavity = MeanFieldGaussian.from_mean_variance(
        {k: 0.1 * torch.randn(s, generator=g) for k, s in model.param_shapes.items()},
        {k: 0.5 + 0.5 * torch.rand(s, generator=g) for k, s in model.param_shapes.items()})
    mean = model.init_mean(torch.Generator().manual_seed(seed + 1))
    start = MeanFieldGaussian.from_mean_variance(mean, {k: torch.full_like(v, 1e-2) for k, v in mean.items()})
    return model, x, y, cavity, start


def _loss(name: str, hyper: dict):  # type: ignore[no-untyped-def]
    hyper = dict(hyper)
    weight = hyper.pop("weight", None)
    loss = make_loss(name, **hyper)
    if weight is not None:
        from common.losses import ScaledLoss

        loss = ScaledLoss(loss, weight)
    return loss


def _run_both(monkeypatch: pytest.MonkeyPatch, args: tuple):  # type: ignore[no-untyped-def]
    calls = []
    original = OneHiddenLayerStep.__call__

    def counting(self, idx, generator, check=None):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(self, idx, generator, check)

    monkeypatch.setattr(OneHiddenLayerStep, "__call__", counting)
    monkeypatch.delenv(explicit_step.ENV_SWITCH, raising=False)
    explicit = local_gvi(*args)
    used = len(calls)
    monkeypatch.setenv(explicit_step.ENV_SWITCH, "0")
    autograd = local_gvi(*args)
    assert len(calls) == used, "the switch did not turn the explicit step off"
    return explicit, autograd, used


def _assert_bit_identical(model, explicit, autograd) -> None:  # type: ignore[no-untyped-def]
    assert (explicit.epochs_run, explicit.best_epoch) == (autograd.epochs_run, autograd.best_epoch)
    assert explicit.objective_trace == autograd.objective_trace
    for k in model.param_shapes:
        assert torch.equal(explicit.posterior.mean()[k], autograd.posterior.mean()[k])
        assert torch.equal(explicit.posterior.variance()[k], autograd.posterior.variance()[k])


@pytest.mark.parametrize("loss_spec, div_spec", CASES)
def test_local_gvi_is_bit_identical_to_the_autograd_path(monkeypatch, loss_spec, div_spec) -> None:  # type: ignore[no-untyped-def]
    model, x, y, cavity, start = _problem()
    cfg = LocalGVIConfig(epochs=3, batch_size=64, n_samples=5, local_reparam=True, objective_estimate="running",
                         patience=None, seed=3, lr=1e-2)
    args = (model, _loss(*loss_spec), make_divergence(div_spec[0], **div_spec[1]), cavity, x, y, start, cfg)
    explicit, autograd, used = _run_both(monkeypatch, args)
    assert used == 3 * 5  # 300 points in batches of 64: four full batches and one of 44, three epochs
    _assert_bit_identical(model, explicit, autograd)


def test_full_batch_is_bit_identical(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model, x, y, cavity, start = _problem(n=150)
    # one batch: a slice, not an index tensor; the evaluated (end-of-epoch) objective
    cfg = LocalGVIConfig(epochs=6, batch_size=None, n_samples=3, local_reparam=True, patience=2, seed=1, lr=0.2)
    args = (model, make_loss("gce", delta=0.8), make_divergence("kl"), cavity, x, y, start, cfg)
    explicit, autograd, used = _run_both(monkeypatch, args)
    assert used == explicit.epochs_run
    _assert_bit_identical(model, explicit, autograd)


def test_early_stopping_and_the_restored_best_state_are_bit_identical(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model, x, y, cavity, start = _problem(n=150)
    # a learning rate large enough that the objective stops improving: patience ends the run, the best is restored
    cfg = LocalGVIConfig(epochs=40, batch_size=50, n_samples=2, local_reparam=True, patience=2, seed=1, lr=0.5)
    args = (model, make_loss("gce", delta=0.8), make_divergence("kl"), cavity, x, y, start, cfg)
    explicit, autograd, used = _run_both(monkeypatch, args)
    assert explicit.epochs_run < 40 and explicit.best_epoch < explicit.epochs_run
    assert used == 3 * explicit.epochs_run
    _assert_bit_identical(model, explicit, autograd)


def _adam(q: MeanFieldVariational) -> Adam:
    return Adam([(q.loc_parameters(), 1e-2), (q.scale_parameters(), 1e-2)])


def test_applies_only_where_the_autograd_path_runs_the_kernels_for_every_piece(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model, x, y, cavity, start = _problem()
    q = MeanFieldVariational(start, dtype=torch.float32)
    fd = MeanFieldMomentDivergence.create(make_divergence("kl"), cavity)
    nll = make_loss("nll")
    assert OneHiddenLayerStep.create(model, nll, q, fd, x, y, 4, _adam(q)) is not None
    deep = make_model("bnn", in_features=12, hidden=[8, 8], num_classes=4)
    q_deep = MeanFieldVariational(MeanFieldGaussian.isotropic(deep.param_shapes, 0.0, 1.0), dtype=torch.float32)
    unfused = make_model("bnn", in_features=12, hidden=[20], num_classes=4, fused_sampling=False)
    q64 = MeanFieldVariational(start, dtype=torch.float64)
    # a parameter stored transposed (clone keeps a non-contiguous initial mean's strides)
    w = start.mean()["layers.0.weight"]
    strided_mean = dict(start.mean(), **{"layers.0.weight": w.t().contiguous().t()})
    q_strided = MeanFieldVariational(MeanFieldGaussian.from_mean_variance(strided_mean, start.variance()),
                                     dtype=torch.float32)
    assert not q_strided.locs[0].is_contiguous()
    declined = {
        "two hidden layers": (deep, nll, q_deep, fd, x, y, _adam(q_deep)),
        "fused sampling off": (unfused, nll, q, fd, x, y, _adam(q)),
        "a loss the head does not compute": (model, make_loss("beta", beta=1.5), q, fd, x, y, _adam(q)),
        "no moment-form divergence": (model, nll, q, None, x, y, _adam(q)),
        "float64 parameters": (model, nll, q64, fd, x.double(), y, _adam(q64)),
        "float labels": (model, nll, q, fd, x, y.float(), _adam(q)),
        "x of the wrong width": (model, nll, q, fd, x[:, :5], y, _adam(q)),
        "an optimiser over other parameters": (model, nll, q, fd, x, y, Adam([(q.loc_parameters(), 1e-2)])),
        "not our Adam": (model, nll, q, fd, x, y, torch.optim.SGD(q.parameters(), lr=0.1)),
        "a non-contiguous parameter": (model, nll, q_strided, fd, x, y, _adam(q_strided)),
    }
    for why, case in declined.items():
        assert OneHiddenLayerStep.create(*case[:6], 4, case[6]) is None, why
    monkeypatch.setenv(explicit_step.ENV_SWITCH, "0")
    assert OneHiddenLayerStep.create(model, nll, q, fd, x, y, 4, _adam(q)) is None


def test_alpha_renyi_undefined_region_raises_the_typed_error_before_any_draw_or_update() -> None:
    model, x, y, _, _ = _problem()
    cavity = MeanFieldGaussian.isotropic(model.param_shapes, 0.0, 1.0, dtype=torch.float32)
    wide = MeanFieldGaussian.isotropic(model.param_shapes, 0.0, 4.0, dtype=torch.float32)  # needs < 1.667
    q = MeanFieldVariational(wide, dtype=torch.float32)
    fd = MeanFieldMomentDivergence.create(make_divergence("alpha_renyi", alpha=2.5), cavity)
    step = OneHiddenLayerStep.create(model, make_loss("nll"), q, fd, x, y, 4, _adam(q))
    assert step is not None
    gen = torch.Generator().manual_seed(0)
    state, before = gen.get_state(), [p.detach().clone() for p in q.parameters()]
    with pytest.raises(DivergenceUndefinedError, match="sigma_q\\^2 < 1.667"):
        step(torch.arange(64), gen)
    assert torch.equal(gen.get_state(), state)
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, q.parameters()))
    cfg = LocalGVIConfig(epochs=1, batch_size=64, n_samples=2, local_reparam=True, objective_estimate="running",
                         patience=None)
    with pytest.raises(DivergenceUndefinedError, match="sigma_q\\^2 < 1.667"):
        local_gvi(model, make_loss("nll"), make_divergence("alpha_renyi", alpha=2.5), cavity, x, y, wide, cfg)


def test_a_refused_step_leaves_the_parameters_and_the_optimiser_alone() -> None:
    model, x, y, cavity, start = _problem()
    x = x.clone()
    x[7, 3] = float("inf")  # local_gvi refuses it up front; the step itself carries it into the objective
    q = MeanFieldVariational(start, dtype=torch.float32)
    fd = MeanFieldMomentDivergence.create(make_divergence("kl"), cavity)
    opt = _adam(q)
    step = OneHiddenLayerStep.create(model, make_loss("nll"), q, fd, x, y, 2, opt)
    assert step is not None
    before = [p.detach().clone() for p in q.parameters()]
    seen = []

    def refuse(expected, divergence):  # type: ignore[no-untyped-def]
        seen.append((float(expected), float(divergence)))
        raise NonFiniteError("refused")

    with pytest.raises(NonFiniteError, match="refused"):
        step(torch.arange(16), torch.Generator().manual_seed(0), refuse)
    assert seen and not torch.isfinite(torch.tensor(seen[0][0]))
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, q.parameters()))
    assert all(float(s) == 0.0 for s in opt.steps.values())
    # without the refusal the step goes through and moves every parameter
    x[7, 3] = 0.0
    step(torch.arange(16), torch.Generator().manual_seed(0))
    assert all(not torch.equal(a, p.detach()) for a, p in zip(before, q.parameters()))
    assert all(float(s) == 1.0 for s in opt.steps.values())
    cfg = LocalGVIConfig(epochs=1, batch_size=64, n_samples=2, local_reparam=True, patience=None)
    x[7, 3] = float("inf")
    with pytest.raises(NonFiniteError):
        local_gvi(model, make_loss("nll"), make_divergence("kl"), cavity, x, y, start, cfg)


def test_the_forward_made_ahead_is_dropped_when_torch_changes_a_parameter_in_place() -> None:
    # each step's update also forms the next step's variances and divergence (while the parameters are in cache);
    # an in-place change from torch between steps (an early-stopping restore) must make the next step form them anew
    model, x, y, cavity, start = _problem()
    q = MeanFieldVariational(start, dtype=torch.float32)
    fd = MeanFieldMomentDivergence.create(make_divergence("kl"), cavity)
    step = OneHiddenLayerStep.create(model, make_loss("nll"), q, fd, x, y, 2, _adam(q))
    assert step is not None

    def divergence_now() -> float:
        _, total, _ = fused_meanfield.forward([p.detach() for p in q.locs], [p.detach() for p in q.raw_scales],
                                              step.mean_ps, step.lam_ps, step.kind, step.alpha, step.min_scale)
        return float(torch.tensor(step.c * total, dtype=torch.float32))

    gen = torch.Generator().manual_seed(0)
    step(torch.arange(16), gen)
    want = divergence_now()
    assert float(step(torch.arange(16), gen)[1]) == want  # the forward made ahead, at the same parameters
    snapshot = q.snapshot()
    step(torch.arange(16), gen)
    q.restore(snapshot)  # load_state_dict: an in-place copy_ under no_grad
    want = divergence_now()
    assert float(step(torch.arange(16), gen)[1]) == want
    with torch.no_grad():
        q.locs[0].add_(0.25)
    want = divergence_now()
    assert float(step(torch.arange(16), gen)[1]) == want
