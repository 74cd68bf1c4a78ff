"""The parity tests' closed form (strategies/reference.py) is an independent oracle.

Where a textbook closed form exists (Gaussian location and linear regression, NLL or constant-weight score
matching, KL or weighted KL), the reference computes every client's site with numpy from the raw data; so a wrong
likelihood formula, score-matching formula or loss weight in the library, or a shard that loses a point, makes the
in-process run differ from the reference instead of cancelling out (the library's own quadratic path, used before,
moves with the library).  On the correct code both paths agree.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import client.pgvi_client as pgvi_client
from common import problem as problem_module
from common.config import parse_run_config
from common.divergences import make_divergence
from common.families import FullCovarianceGaussian
from common.losses import ScaledLoss
from common.models import LinearGaussianModel
from common.problem import load_full_data
from common.quadratic import QuadraticLoss
from strategies import reference as reference_module
from strategies.reference import (
    client_training_data,
    exact_posterior,
    exact_sites,
    expected_posterior,
    has_textbook_form,
    library_sites,
    max_natural_diff,
    textbook_site_natural,
)
from tests.test_inprocess import BASE, run

SM_WKL = {"loss": "score_matching", "sm-weight": "constant", "divergence": "weighted_kl", "divergence-w": 0.7}
LINREG = {"model": "linear_regression", "dataset": "synthetic_linear_regression"}

TEXTBOOK_CASES = {
    "location-nll-kl": {},
    "location-sm-wkl": SM_WKL,
    "location-nll-wkl-loss-weight": {"loss-weight": 1.7, "divergence": "weighted_kl", "divergence-w": 0.3},
    "location-sm-loss-weight-sigma": {**SM_WKL, "loss-weight": 0.6, "likelihood-sigma": 2.5},
    "location-mean-field-prior": {"family": "mean_field", "likelihood-sigma": 2.5, "prior-mean": 0.3,
                                  "prior-variance": 4.0},
    "location-size-skew": {"partitioner": "size_skew", "num-clients": 5, "min-clients": 5},
    "linreg-nll-kl": LINREG,
    "linreg-sm-wkl": {**LINREG, **SM_WKL, "likelihood-sigma": 0.4},
}


def _scale(f) -> float:
    return max(1.0, max(float(v.abs().max()) for v in f.params.values()))


@pytest.fixture
def fresh_caches():
    """The client caches its problem and shard per (config, partition): a patched library must be seen afresh, and
    no patched result may outlive the test."""
    pgvi_client._problem_and_shard.cache_clear()
    yield
    pgvi_client._problem_and_shard.cache_clear()


# ==================================================================================================
# on the correct code: the independent reference equals the library's quadratic path


@pytest.mark.parametrize("case", list(TEXTBOOK_CASES))
def test_textbook_reference_equals_the_library_quadratic_path(case):
    cfg = parse_run_config({**BASE, **TEXTBOOK_CASES[case]})
    assert has_textbook_form(cfg)
    textbook, library = exact_sites(cfg), library_sites(cfg)
    assert set(textbook) == set(library) == {f"site-{m}" for m in range(cfg.num_clients)}
    for cid, site in textbook.items():
        assert type(site) is type(library[cid])
        assert max_natural_diff(site, library[cid]) < 1e-12 * _scale(site), cid


def test_imq_score_matching_is_marked_as_the_library_path():
    cfg = parse_run_config({**BASE, **SM_WKL, "sm-weight": "imq"})
    assert not has_textbook_form(cfg)
    assert all(max_natural_diff(a, b) == 0.0 for a, b in zip(exact_sites(cfg).values(), library_sites(cfg).values()))
    # its weights are centred at the moving cavity mean: after round 1 a synchronous run was 134 (natural
    # parameters) off the 'fixed point of every schedule' it claimed; the reference posteriors refuse it
    for reference in (lambda: exact_posterior(cfg), lambda: expected_posterior(cfg, {"site-0": 2})):
        with pytest.raises(ValueError, match="cavity mean, which moves"):
            reference()


def test_reference_is_the_textbook_normal_posterior():
    """NLL + KL on the Gaussian location model: precision 1/v + N/sigma^2, mean (m/v + sum y/sigma^2) / precision,
    over every training point of the full data set, whatever the partition."""
    raw = {**BASE, "likelihood-sigma": 1.3, "prior-mean": 0.4, "prior-variance": 2.0}
    cfg = parse_run_config(raw)
    y = load_full_data(cfg).y_train[:, 0].astype(np.float64)
    prec = 1 / 2.0 + y.size / 1.3**2
    mean = (0.4 / 2.0 + y.sum() / 1.3**2) / prec
    post = exact_posterior(cfg)
    assert isinstance(post, FullCovarianceGaussian)
    np.testing.assert_allclose(float(-2 * post.params["eta2"][0, 0]), prec, rtol=1e-13)
    np.testing.assert_allclose(float(post.params["eta1"][0]) / prec, mean, rtol=1e-12)
    assert sum(len(yy) for _, yy in client_training_data(cfg)) == y.size == 60 * cfg.num_clients


def test_weighted_kl_convention_site_is_exp_of_minus_w_times_the_weighted_loss():
    """Minimise client 0's objective E_q[loss_weight * L] + D(q || prior), D the library's ``weighted_kl`` with w,
    numerically over 1-D Gaussians (not through the conjugate update): the optimum divided by the prior is the
    reference's site, exp(-w * loss_weight * L) (FedGVI Lemma B.1: (1/w) KL tempers the loss by w, not 1/w)."""
    w, lw = 0.7, 1.3
    cfg = parse_run_config({**BASE, "divergence": "weighted_kl", "divergence-w": w, "loss-weight": lw})
    _, y = client_training_data(cfg)[0]
    s2 = cfg.likelihood_sigma**2
    p_nll, h_nll = y.size / s2, float(y.sum()) / s2  # raw NLL: 1/2 P theta^2 - h theta + c
    prior = FullCovarianceGaussian(torch.zeros(1, dtype=torch.float64), torch.full((1, 1), -0.5, dtype=torch.float64))
    divergence = make_divergence("weighted_kl", w=w)

    mu = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    log_s = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([mu, log_s], lr=1, max_iter=500, tolerance_grad=1e-13, tolerance_change=1e-15,
                            line_search_fn="strong_wolfe")

    def objective():
        var = torch.exp(2 * log_s)
        expected_loss = lw * (0.5 * p_nll * (mu**2 + var) - h_nll * mu).sum()
        q = FullCovarianceGaussian(mu / var, (-0.5 / var).reshape(1, 1))
        return expected_loss + divergence(q, prior)

    def closure():
        opt.zero_grad()
        value = objective()
        value.backward()
        return value

    for _ in range(5):
        opt.step(closure)
    var = float(torch.exp(2 * log_s.detach()))
    site_eta1, site_eta2 = float(mu.detach()) / var, -0.5 / var + 0.5  # optimum / prior N(0, 1)
    eta1, eta2 = textbook_site_natural(cfg, *client_training_data(cfg)[0])
    np.testing.assert_allclose([site_eta1, site_eta2], [eta1[0], eta2[0, 0]], rtol=1e-6)
    np.testing.assert_allclose(eta1[0], w * lw * h_nll, rtol=1e-13)
    assert abs(site_eta1 - lw * h_nll / w) > 0.1 * abs(site_eta1)  # not exp(-L/w): the convention matters


# ==================================================================================================
# a library defect makes the in-process run differ from the reference (it cancelled out of the library path)


def _half_nll_precision(monkeypatch):
    """The audited mutant: the NLL precision divided by 2 sigma^2 instead of sigma^2."""
    original = LinearGaussianModel.nll_quadratic

    def wrong(self, x, y):
        q = original(self, x, y)
        return QuadraticLoss(q.precision / 2.0, q.shift, q.constant, q.name)

    monkeypatch.setattr(LinearGaussianModel, "nll_quadratic", wrong)


def _half_sm_precision(monkeypatch):
    """Score matching's precision with (w / sigma^2)^2 instead of 2 (w / sigma^2)^2."""
    original = LinearGaussianModel.score_matching_quadratic

    def wrong(self, x, y, w, grad_w):
        q = original(self, x, y, w, grad_w)
        return QuadraticLoss(q.precision / 2.0, q.shift, q.constant, q.name)

    monkeypatch.setattr(LinearGaussianModel, "score_matching_quadratic", wrong)


def _drop_a_point(monkeypatch):
    """A shard that loses its first training point on the way to the client."""
    original = problem_module.client_shard

    def wrong(cfg, partition_id):
        s = original(cfg, partition_id)
        return problem_module.ArraysSplit(s.x_train[1:], s.y_train[1:], s.x_test, s.y_test, s.num_classes)

    for module in (problem_module, pgvi_client, reference_module):  # everywhere it was imported, as a real defect
        monkeypatch.setattr(module, "client_shard", wrong)


def _ignore_loss_weight(monkeypatch):
    monkeypatch.setattr(ScaledLoss, "quadratic", lambda self, model, x, y, reference_theta=None:
                        self.base.quadratic(model, x, y, reference_theta))


DEFECTS = {
    "nll-precision": (_half_nll_precision, {}),
    "nll-precision-linreg": (_half_nll_precision, LINREG),
    "sm-precision": (_half_sm_precision, SM_WKL),
    "shard-drops-a-point": (_drop_a_point, {}),
    "loss-weight-ignored": (_ignore_loss_weight, {"loss-weight": 2.0}),
}


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
@pytest.mark.parametrize("defect", list(DEFECTS))
def test_a_library_defect_no_longer_matches_the_reference(defect, schedule, monkeypatch, fresh_caches):
    inject, overrides = DEFECTS[defect]
    overrides = {**overrides, "schedule": schedule, "num-server-rounds": 3}
    cfg, strategy, _ = run(overrides)  # the correct code matches the reference ...
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9
    healthy = strategy.state.posterior

    inject(monkeypatch)
    pgvi_client._problem_and_shard.cache_clear()
    cfg, strategy, _ = run(overrides)  # ... the defective code does not
    assert not strategy.rejections
    assert max_natural_diff(strategy.state.posterior, healthy) > 1e-3  # the defect does change the result
    expected = expected_posterior(cfg, strategy.ledger_versions)
    assert max_natural_diff(strategy.state.posterior, expected) > 1e-3 * _scale(expected)
    # the library path moves with the library: it would have passed the defective run
    library = library_sites(cfg)
    power = {cid: 1.0 - (1.0 - cfg.rho()) ** k for cid, k in strategy.ledger_versions.items()}
    post = strategy.problem.prior
    for cid, e in library.items():
        post = post * (e ** power[cid])
    assert max_natural_diff(strategy.state.posterior, post) < 1e-9


@pytest.mark.parametrize("server", [{"server-divergence": "weighted_kl", "server-divergence-w": 0.5},
                                    {"server-divergence": "alpha_renyi", "server-divergence-alpha": 0.5}])
def test_the_reference_posterior_refuses_a_server_divergence_other_than_kl(server):
    # a review: with server-divergence weighted_kl (w 0.5) the run's posterior is prior x (prod sites)^0.5, and
    # expected_posterior returned prior x prod sites, 97 away, as the reference of a correct run
    cfg = parse_run_config({**BASE, **server})
    with pytest.raises(ValueError, match="server step of server-divergence 'kl'"):
        expected_posterior(cfg, {"site-0": 1})
    with pytest.raises(ValueError, match="server step of server-divergence 'kl'"):
        exact_posterior(cfg)
    assert set(exact_sites(cfg)) == {f"site-{m}" for m in range(cfg.num_clients)}  # the sites hold whatever D_s
