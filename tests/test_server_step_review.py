"""Regression tests for defects found in review of the server step, the codec and the checkpoint.

1. A full-covariance factor whose ``eta2`` is not symmetric is refused when decoded (``from_numpy``: a peer's
   Delta, a checkpoint), and the server objective uses only the symmetric part of the global site's ``eta2``.
   An antisymmetric Delta (which a KL server refused only as an improper posterior) entered the ledger under an
   optimised server step and made every later step fail to converge.
2. Fisher-Rao server step: the distance is a cone at ``q = prior``; when the prior is the minimiser the optimiser
   cannot certify it.  The prior's subgradient optimality condition is now tested first.
3. A checkpoint with client ids ``a`` and ``a|x`` resumes; a checkpoint that fails to load leaves the strategy as
   it was.
4. A zip (``.npz``) payload is a typed codec error, not an AttributeError.
5. Alpha-Renyi (alpha > 1) step whose KL starting point lies on the boundary of the divergence's domain.
"""

from __future__ import annotations

import io
import math
import random
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from common import protocol as P
from common.config import parse_run_config
from common.divergences import fisher_rao_univariate
from common.errors import ShapeMismatchError
from common.factors import PGVIServerState, damped_delta
from common.families import FullCovarianceGaussian, MeanFieldGaussian
from common.server_gvi import expected_site_loss, make_server_step
from common.variational import variational_for
from strategies.checkpoint import CheckpointMismatch, load_checkpoint, save_checkpoint
from strategies.codec import PACKED_KEY, factor_to_record, record_to_factor
from strategies.pgvi import RoundStats
from tests.test_inprocess import run

F64 = torch.float64


# ================================================================================================ (1)
def _full(eta1, eta2) -> FullCovarianceGaussian:
    return FullCovarianceGaussian(torch.tensor(eta1, dtype=F64), torch.tensor(eta2, dtype=F64))


def _check_what_from_numpy_still_accepts():
    """Rounding-level asymmetry, improper sites and mean-field factors (whose eta2 is elementwise) pass."""
    like = FullCovarianceGaussian.from_mean_covariance(torch.zeros(3, dtype=F64), torch.eye(3, dtype=F64))
    g = np.random.default_rng(0).normal(size=(3, 3))
    e2 = -(g @ g.T) * 1e3
    e2[0, 1] *= 1 + 1e-13  # far below the 1e-8 relative tolerance of improper_detail
    f = like.from_numpy({"eta1": np.ones(3), "eta2": e2})
    assert f.is_proper()
    # a site may be improper (negative precision); only the asymmetry is malformed
    assert like.from_numpy({"eta1": np.ones(3), "eta2": -e2}).improper_detail() is not None
    mf = MeanFieldGaussian.isotropic({"w": (2, 2)}, 0.0, 1.0)
    arrays = {"eta1/w": np.array([[0.0, 1e12], [-1e12, 0.0]]), "eta2/w": np.array([[-0.5, 3.0], [-7.0, -0.5]])}
    assert mf.from_numpy(arrays).max_abs_diff(MeanFieldGaussian({"w": torch.tensor(arrays["eta1/w"])},
                                                                {"w": torch.tensor(arrays["eta2/w"])})) == 0.0


@pytest.mark.parametrize("a", [0.5, 1e12, 1e17, 1.5e308])
def test_from_numpy_refuses_a_full_covariance_eta2_that_is_not_symmetric(a):
    like = FullCovarianceGaussian.from_mean_covariance(torch.zeros(2, dtype=F64), torch.eye(2, dtype=F64))
    arrays = {"eta1": np.zeros(2), "eta2": np.array([[-0.5, a], [-a, -0.5]])}
    with pytest.raises(ShapeMismatchError, match="not symmetric"):
        like.from_numpy(arrays)
    rec, layout = factor_to_record(_full([0.0, 0.0], [[-0.5, a], [-a, -0.5]]))  # the wire path refuses it too
    with pytest.raises(ShapeMismatchError, match="not symmetric"):
        record_to_factor(rec, like, layout)
    _check_what_from_numpy_still_accepts()


def test_expected_site_loss_uses_the_symmetric_part_of_eta2():
    # eta2 = S + A with A antisymmetric and S + A exact in float64 (A = 2^40, S a multiple of 2^-4): the loss and its
    # gradient must be those of S; the plain sum of (S + A) * E[theta theta^T] rounded off ~1e-4
    s = torch.tensor([[-0.75, 0.25, 0.125], [0.25, -0.5, -0.0625], [0.125, -0.0625, -1.0]], dtype=F64)
    a = torch.zeros(3, 3, dtype=F64)
    a[0, 1], a[1, 0], a[1, 2], a[2, 1] = 2.0**40, -(2.0**40), -(2.0**40), 2.0**40
    e1 = torch.tensor([0.3, -0.2, 0.1], dtype=F64)
    clean, dirty = FullCovarianceGaussian(e1, s), FullCovarianceGaussian(e1, s + a)
    assert torch.equal(0.5 * dirty.eta2 + 0.5 * dirty.eta2.T, s)
    q = FullCovarianceGaussian.from_mean_covariance(
        torch.tensor([0.7, -1.3, 2.1], dtype=F64),
        torch.tensor([[0.5, 0.1, 0.0], [0.1, 0.4, 0.05], [0.0, 0.05, 0.3]], dtype=F64))
    values, grads = [], []
    for site in (clean, dirty):
        v = variational_for(q)
        value = expected_site_loss(v, site)
        values.append(float(value))
        grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, list(v.parameters()))]))
    assert abs(values[0] - values[1]) <= 1e-12
    assert float((grads[0] - grads[1]).abs().max()) <= 1e-12
    # so the optimised server step is that of the symmetric site
    prior = FullCovarianceGaussian.from_mean_covariance(torch.zeros(3, dtype=F64), 2.0 * torch.eye(3, dtype=F64))
    step = make_server_step("alpha_renyi", alpha=0.5)
    assert step(prior, dirty).max_abs_diff(step(prior, clean)) < 1e-12


def test_an_antisymmetric_delta_is_rejected_and_charged_under_an_optimised_server_step():
    cfg, s, _ = run({"num-server-rounds": 1, "model": "linear_regression", "dataset": "synthetic_linear_regression",
                     "server-divergence": "alpha_renyi", "server-divergence-alpha": 0.5})
    assert s.state.version == 1 and not s.rejections
    nodes = sorted(s.node_client, key=lambda n: s.node_client[n])
    d = s.problem.prior.eta1.shape[0]

    def reply(node, rnd, arrays):
        cid = s.node_client[node]
        content = RecordDict({
            P.CONFIG: ConfigRecord({"client-id": cid, "status": P.STATUS_OK, "reason": "",
                                    "base-site-version": s.ledger_versions[cid], "posterior-version": s.state.version,
                                    P.UPDATE_TAG: f"t{rnd}-{node}"}),
            P.METRICS: MetricRecord({"num-examples": 20.0}),
            P.DELTA: ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()}),
        })
        return Message(content, reply_to=s._train_message(node, rnd))

    def deliver(rnd, msgs):
        stats = RoundStats()
        s._apply_batch(rnd, s._decode_replies(rnd, msgs, stats), stats)
        return stats

    evil = {"eta1": np.zeros(d), "eta2": np.zeros((d, d))}
    evil["eta2"][0, 1], evil["eta2"][1, 0] = 1e12, -1e12
    before = {k: v.clone() for k, v in s.state.global_site.params.items()}
    stats = deliver(2, [reply(nodes[0], 2, evil)])
    assert (stats.applied, stats.rejected) == (0, 1)
    assert s.bad_replies == {"site-0": 1} and "not symmetric" in s.rejections[-1]["reason"]
    assert s.state.version == 1 and all(torch.equal(before[k], v) for k, v in s.state.global_site.params.items())

    def honest():
        post = s.state.posterior
        lam = -2.0 * post.eta2 + 0.5 * torch.eye(d, dtype=post.dtype)
        q = FullCovarianceGaussian(post.eta1 + 0.1, -0.5 * lam, name=post.name)
        return damped_delta(q, post, 0.5).to_numpy()

    stats = deliver(3, [reply(n, 3, honest()) for n in nodes[1:]])
    assert (stats.applied, stats.rejected) == (2, 0) and s.state.version == 2
    assert s.bad_replies == {"site-0": 1}


# ================================================================================================ (2)
def _uni(family: str, mean: float, var: float):
    if family == "full":
        return FullCovarianceGaussian.from_mean_covariance(torch.tensor([mean], dtype=F64),
                                                           torch.tensor([[var]], dtype=F64))
    return MeanFieldGaussian.isotropic({"w": (1,)}, mean, var)


def _site(family: str, e1: float, e2: float):
    if family == "full":
        return FullCovarianceGaussian(torch.tensor([e1], dtype=F64), torch.tensor([[e2]], dtype=F64))
    return MeanFieldGaussian({"w": torch.tensor([e1], dtype=F64)}, {"w": torch.tensor([e2], dtype=F64)})


def _moments(q) -> tuple[float, float]:
    if isinstance(q, FullCovarianceGaussian):
        return float(q.mean()[0]), float(q.covariance()[0, 0])
    return float(q.mean()["w"][0]), float(q.variance()["w"][0])


def _fr_objective(e1, e2, m, v, pm, pv) -> float:
    """The server objective E_q[l_s] + FR(q, prior), computed independently of common.server_gvi."""
    s, sp = math.sqrt(v), math.sqrt(pv)
    num = (m - pm) ** 2 + 2.0 * (s - sp) ** 2
    den = (m - pm) ** 2 + 2.0 * (s + sp) ** 2
    dist = math.sqrt(2.0) * math.log1p((num + math.sqrt(num * den)) / (4.0 * s * sp))
    return -(e1 * m + e2 * (m * m + v)) + dist


@pytest.mark.parametrize("family", ["full", "mean_field"])
@pytest.mark.parametrize("mean, var", [(1.0, 2.5), (0.0, 2.5), (0.0, 1e-4), (0.3, 0.7), (-2.0, 40.0)])
def test_fisher_rao_initial_step_is_the_prior_exactly(family, mean, var):
    prior = (_uni("full", mean, var) if family == "full"
             else MeanFieldGaussian.isotropic({"w": (3,), "b": (2, 2)}, mean, var))
    state = PGVIServerState(prior=prior, server_step=make_server_step("fisher_rao"))
    assert state.posterior.max_abs_diff(prior) == 0.0
    assert state.server_step.last_info["path"] == "prior"


def test_fisher_rao_dual_norm_is_the_steepest_first_order_decrease_per_unit_distance():
    # independent check of the metric in the condition: the dual norm is sup_delta -dL(delta) / FR(p + delta, p)
    from common.server_gvi import fisher_rao_prior_dual_norm

    pm, pv, e1, e2 = 0.4, 2.5, 0.3, -0.2
    t, best = 1e-6, 0.0
    for k in range(3600):
        ang = 2 * math.pi * k / 3600
        dm, ds = t * math.cos(ang), t * math.sin(ang)
        m, s = pm + dm, math.sqrt(pv) + ds
        drop = (e1 * m + e2 * (m * m + s * s)) - (e1 * pm + e2 * (pm * pm + pv))
        dist = float(fisher_rao_univariate(torch.tensor(m, dtype=F64), torch.tensor(s, dtype=F64),
                                           torch.tensor(pm, dtype=F64), torch.tensor(math.sqrt(pv), dtype=F64)))
        best = max(best, drop / dist)
    for family in ("full", "mean_field"):
        got = fisher_rao_prior_dual_norm(_uni(family, pm, pv), _site(family, e1, e2))
        assert got == pytest.approx(best, rel=1e-5)
    # mean-field: the product-manifold distance sqrt(sum FR_i^2) gives one condition, the sum of squares
    prior = MeanFieldGaussian.isotropic({"w": (2,)}, pm, pv)
    site = MeanFieldGaussian({"w": torch.tensor([e1, -e1], dtype=F64)}, {"w": torch.tensor([e2, e2], dtype=F64)})
    one = fisher_rao_prior_dual_norm(_uni("mean_field", pm, pv), _site("mean_field", e1, e2))
    other = fisher_rao_prior_dual_norm(_uni("mean_field", pm, pv), _site("mean_field", -e1, e2))
    assert fisher_rao_prior_dual_norm(prior, site) == pytest.approx(math.hypot(one, other), rel=1e-14)


# (prior mean, prior variance, e1, e2): the exact minimiser is the prior (dual norm <= 1) or found by the optimiser
FR_CASES = [
    (0.0, 1.0, 0.05, -0.02, "prior"),
    (0.0, 1.0, 0.01, -0.1, "prior"),
    (0.5, 2.0, -0.3, -0.05, "prior"),
    (0.0, 1e-4, 50.0, -2000.0, "prior"),
    (0.0, 1.0, 0.9, -0.1, "prior"),
    (0.0, 1.0, 2.0, -1.5, "optimise"),
    (0.0, 1.0, 1.2, -0.1, "optimise"),
    (0.3, 0.5, 0.0, -3.0, "optimise"),
    # the prior is a local minimiser (dual norm 0.99) but N(46.6, 63.0) has a far lower objective: that is returned
    (0.0, 1.0, 0.99, -0.01, "optimise"),
]


@pytest.mark.parametrize("family", ["full", "mean_field"])
def test_fisher_rao_step_returns_the_prior_exactly_when_it_is_the_minimiser(family):
    from scipy import optimize

    for pm, pv, e1, e2, path in FR_CASES:
        step = make_server_step("fisher_rao")
        prior = _uni(family, pm, pv)
        q = step(prior, _site(family, e1, e2))
        assert step.last_info["path"] == path, (pm, pv, e1, e2, step.last_info)
        assert "fisher_rao_dual_norm" in step.last_info or path == "optimise"
        m, v = _moments(q)
        got = _fr_objective(e1, e2, m, v, pm, pv)
        if path == "prior":
            assert q.max_abs_diff(prior) == 0.0
        # brute force: Nelder-Mead from several starts never beats the returned point (beyond rounding)
        def obj(x):
            if abs(x[0]) > 1e4 or abs(x[1]) > 30:
                return math.inf
            return _fr_objective(e1, e2, x[0], math.exp(2 * x[1]), pm, pv)
        best = min(optimize.minimize(obj, x0, method="Nelder-Mead",
                                     options=dict(xatol=1e-10, fatol=1e-14, maxiter=20000)).fun
                   for x0 in ([pm, 0.5 * math.log(pv)], [m, 0.5 * math.log(v)], [pm + 0.5, 0.0], [pm - 1.0, -0.5],
                              [pm + 20.0, 1.5], [pm + 45.0, 2.0]))
        assert got <= best + 1e-7, (pm, pv, e1, e2, got, best)


def test_fisher_rao_small_deltas_are_applied():
    # a Delta of one observation damped by rho = 0.2: the exact minimiser of eq. 7 is the prior (it was rejected)
    step = make_server_step("fisher_rao")
    for prior, delta in (
        (_uni("full", 0.0, 1.0), _site("full", 0.01, -0.1)),
        (MeanFieldGaussian.isotropic({"w": (3,)}, 0.0, 1.0),
         MeanFieldGaussian({"w": torch.full((3,), 0.01, dtype=F64)}, {"w": torch.full((3,), -0.1, dtype=F64)})),
    ):
        state = PGVIServerState(prior=prior, server_step=step)
        for _ in range(3):
            state.apply({"c0": delta})
        assert state.version == 3 and state.posterior.max_abs_diff(prior) == 0.0
        # the ledger grows, and once the global site is large enough the posterior leaves the prior
        for _ in range(40):
            state.apply({"c0": delta})
        assert step.last_info["path"] == "optimise" and state.posterior.max_abs_diff(prior) > 1e-3


# ================================================================================================ (5)
@pytest.mark.parametrize("family", ["full", "mean_field", "full2"])
def test_alpha_renyi_step_whose_kl_start_is_on_the_domain_boundary(family):
    # alpha = 2.5, prior N(0, 1), site eta2 = 0.2: the KL solution has variance 1 / 0.6 = alpha / (alpha - 1), the
    # boundary of the domain.  The minimiser solves 1/(alpha + (1 - alpha) v) - 1/v = 2 alpha eta2: v = sqrt(5/3)
    if family == "full2":
        prior = FullCovarianceGaussian.from_mean_covariance(torch.zeros(2, dtype=F64), torch.eye(2, dtype=F64))
        site = FullCovarianceGaussian(torch.zeros(2, dtype=F64), 0.2 * torch.eye(2, dtype=F64))
    else:
        prior, site = _uni(family, 0.0, 1.0), _site(family, 0.0, 0.2)
    q = make_server_step("alpha_renyi", alpha=2.5)(prior, site)
    if family == "full2":
        np.testing.assert_allclose(q.covariance().numpy(), math.sqrt(5 / 3) * np.eye(2), atol=1e-7)
        np.testing.assert_allclose(q.mean().numpy(), 0.0, atol=1e-7)
    else:
        m, v = _moments(q)
        assert abs(m) < 1e-7 and v == pytest.approx(math.sqrt(5 / 3), rel=1e-7)
    from common.server_gvi import alpha_renyi_margin

    assert abs(alpha_renyi_margin(prior * site, prior, 2.5)) < 1e-14  # the KL start: on the boundary to rounding
    assert alpha_renyi_margin(q, prior, 2.5) > 0.1


# ================================================================================================ (3)
def _ckpt_strategy(ids, prior, delta):
    st = PGVIServerState(prior=prior)
    for cid in ids:
        st.apply({cid: delta})
    return SimpleNamespace(state=st, cfg=parse_run_config({}), problem=SimpleNamespace(prior=prior),
                           ledger_versions={c: 1 for c in ids}, ledger_tags={c: f"tag-{c}" for c in ids},
                           resync=set(), round_completed=1, round_applied=1, done_in_round=set(),
                           rng=random.Random(0), sampling_state_to_checkpoint=lambda: random.Random(0).getstate(),
                           rejections=[], bad_replies={}, history=[{"round": 0}], _posterior_record=None,
                           async_resolved=0, async_messages={})


def _ckpt_problem():
    prior = MeanFieldGaussian.isotropic({"w": (2,)}, 0.0, 1.0)
    delta = MeanFieldGaussian({"w": torch.tensor([0.1, 0.2], dtype=F64)}, {"w": torch.tensor([-0.1, -0.1], dtype=F64)})
    return prior, delta


def test_checkpoint_with_client_ids_that_extend_each_other_resumes():
    prior, delta = _ckpt_problem()
    ids = ["a", "a|x", "a|x|y", "b|", "|c"]
    with tempfile.TemporaryDirectory() as tmp:
        written = _ckpt_strategy(ids, prior, delta)
        save_checkpoint(written, tmp)
        fresh = _ckpt_strategy([], prior, delta)
        load_checkpoint(fresh, tmp)
    assert list(fresh.state.sites) == sorted(ids)
    for cid in ids:
        assert fresh.state.sites[cid].max_abs_diff(written.state.sites[cid]) == 0.0
    assert fresh.state.posterior.max_abs_diff(written.state.posterior) == 0.0
    assert fresh.state.version == len(ids) and fresh.ledger_tags == written.ledger_tags


def _snapshot(s):
    return {"posterior": s.state.posterior.to_numpy(), "global": s.state.global_site.to_numpy(),
            "sites": {c: f.to_numpy() for c, f in s.state.sites.items()}, "version": s.state.version,
            "ledger": dict(s.ledger_versions), "tags": dict(s.ledger_tags), "history": list(s.history),
            "rng": s.rng.getstate(), "round": (s.round_completed, s.round_applied)}


def _same(a, b):
    for k in a:
        if k == "sites":
            assert a[k].keys() == b[k].keys()
            for c in a[k]:
                assert all(np.array_equal(a[k][c][n], b[k][c][n]) for n in a[k][c])
        elif k in ("posterior", "global"):
            assert all(np.array_equal(a[k][n], b[k][n]) for n in a[k])
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("corrupt", ["ledger", "rng", "meta-int", "stray-array"])
def test_a_checkpoint_that_fails_to_load_leaves_the_strategy_unchanged(corrupt):
    from common.atomic_io import atomic_save_npz, load_npz
    from strategies.checkpoint import CHECKPOINT_FILE

    prior, delta = _ckpt_problem()
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(_ckpt_strategy(["a", "b"], prior, delta), tmp)
        arrays, meta = load_npz(f"{tmp}/{CHECKPOINT_FILE}")
        if corrupt == "ledger":
            arrays["site|b|eta1/w"] = arrays["site|b|eta1/w"] + 1.0  # global site != product of sites
        elif corrupt == "rng":
            meta["rng"] = "(3, (1, 2), None)"
        elif corrupt == "meta-int":
            meta["history"] = None
        else:
            arrays["other|eta1/w"] = np.zeros(2)
        atomic_save_npz(f"{tmp}/{CHECKPOINT_FILE}", arrays, meta)
        target = _ckpt_strategy(["c"], prior, delta)
        target.state.apply({"c": delta})
        target.ledger_versions, target.round_completed, target.round_applied = {"c": 2}, 5, 5
        before = _snapshot(target)
        with pytest.raises((CheckpointMismatch, ValueError, TypeError)):
            load_checkpoint(target, tmp)
        _same(_snapshot(target), before)


# ================================================================================================ (4)
def _npz_bytes(values: np.ndarray, compressed: bool = False) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, x=values)
    return buf.getvalue()


@pytest.mark.parametrize("compressed", [False, True])
def test_a_zip_payload_is_a_typed_codec_error(compressed):
    like = MeanFieldGaussian.isotropic({"w": (2, 3), "b": (3,)}, 0.0, 1.0)
    _, layout = factor_to_record(like)
    total = like.numel()
    packed = Array(dtype="float64", shape=(total,), stype="numpy.ndarray",
                   data=_npz_bytes(np.arange(total, dtype=np.float64), compressed))
    with pytest.raises(ShapeMismatchError, match="not an array"):
        record_to_factor(ArrayRecord({PACKED_KEY: packed}), like, layout)
    # one Array per tensor (no layout): the same
    arrays = {k: Array(np.ascontiguousarray(v)) for k, v in like.to_numpy().items()}
    arrays["eta1/b"] = Array(dtype="float64", shape=(3,), stype="numpy.ndarray", data=_npz_bytes(np.zeros(3)))
    with pytest.raises(ShapeMismatchError, match="not an array"):
        record_to_factor(ArrayRecord(arrays), like, None)
