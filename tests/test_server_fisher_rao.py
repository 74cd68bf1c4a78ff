"""The Fisher-Rao server step against an independent global minimiser, and its extra start.

The oracle minimises ``F(q) = sum_i L_i + sqrt(sum_i d_i^2)`` by another route than the step: with ``sqrt(S) =
min_t S / (2 t) + t / 2`` the problem is ``min_t t / 2 + sum_i min_{q_i} (L_i + d_i^2 / (2 t))``, whose inner
problems are one coordinate each; they are solved on a grid (mean x log scale), ``t`` on a grid, and the best point
is polished by scipy's BFGS on ``F`` itself.  The distance is the hyperbolic (arccosh) form in numpy, not the
project's log1p form.  Before the extra start (and the steepest-descent retry at the family's edge) the step was
above this oracle in 14 of 100 one-coordinate and 7 of 60 two-coordinate problems of this distribution (seed 5) and
raised 'left the family of distributions' on bounded problems.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from common.divergences import fisher_rao_univariate
from common.families import FullCovarianceGaussian, MeanFieldGaussian
from common.server_fisher_rao import fisher_rao_starts
from common import server_gvi
from common.server_gvi import make_server_step

F64 = torch.float64


def _fr(m1, s1, m2, s2):
    return math.sqrt(2.0) * np.arccosh(1.0 + (0.5 * (m1 - m2) ** 2 + (s1 - s2) ** 2) / (2.0 * s1 * s2))


def _objective(x, e1, e2, mp, sp):
    d = len(e1)
    m, s = x[:d], np.exp(x[d:])
    return float(-(e1 * m + e2 * (m * m + s * s)).sum() + np.sqrt((_fr(m, s, mp, sp) ** 2).sum()))


def _oracle(e1, e2, mp, sp, n=161, nt=120):
    """(objective, point ``[m, log s]``) of a global minimiser, by the separable ``t`` route (module docstring)."""
    d = len(e1)
    c = e1 / (-2.0 * e2)
    span = np.abs(c - mp)
    grids = []
    for i in range(d):
        m = np.linspace(min(mp[i], c[i]) - 0.5 * span[i] - 5 * sp[i], max(mp[i], c[i]) + 0.5 * span[i] + 5 * sp[i], n)
        u = np.linspace(np.log(sp[i]) - 8.0, np.log(sp[i] + span[i]) + 3.0, n)
        mm, uu = (a.ravel() for a in np.meshgrid(m, u))
        ss = np.exp(uu)
        grids.append((mm, uu, -(e1[i] * mm + e2[i] * (mm ** 2 + ss ** 2)), _fr(mm, ss, mp[i], sp[i]) ** 2))
    best = (math.inf, None)
    for t in np.exp(np.linspace(-8.0, 8.0, nt)):
        x = np.empty(2 * d)
        for i, (mm, uu, loss, sq) in enumerate(grids):
            k = int(np.argmin(loss + sq / (2.0 * t)))
            x[i], x[d + i] = mm[k], uu[k]
        f = _objective(x, e1, e2, mp, sp)
        if f < best[0]:
            best = (f, x)
    polished = minimize(_objective, best[1], args=(e1, e2, mp, sp), method="BFGS",
                        options={"gtol": 1e-10, "maxiter": 5000})
    return (float(polished.fun), polished.x) if polished.fun < best[0] else best


def _factors(mp, vp, e1, e2):
    t = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float64))  # noqa: E731
    return (MeanFieldGaussian.from_mean_variance({"w": t(mp)}, {"w": t(vp)}),
            MeanFieldGaussian({"w": t(e1)}, {"w": t(e2)}))


def _value(q, e1, e2, mp, sp):
    return _objective(np.r_[q.mean()["w"].numpy(), 0.5 * np.log(q.variance()["w"].numpy())], e1, e2, mp, sp)


@pytest.mark.parametrize("d, n", [(1, 30), (2, 15), (5, 4)])
def test_step_reaches_the_independent_global_minimum_on_random_problems(d, n):
    rng = np.random.default_rng(5)
    gaps = []
    for _ in range(n):
        mp, sp = rng.normal(0, 1, d), np.exp(0.5 * rng.normal(0, 1, d))
        e2, e1 = -0.5 * np.exp(rng.normal(-2, 2, d)), rng.normal(0, 2, d)
        prior, site = _factors(mp, sp ** 2, e1, e2)
        q = make_server_step("fisher_rao")(prior, site)
        best, _ = _oracle(e1, e2, mp, sp)
        gaps.append(_value(q, e1, e2, mp, sp) - best)
        # the oracle is an upper bound on the minimum, and the step's result is a point: never far below it
        assert gaps[-1] > -1e-6 * (1 + abs(best)), (gaps[-1], mp, sp, e1, e2)
    worst = max(gaps)
    assert worst <= 1e-6 * (1 + abs(best)), (worst, gaps)


@pytest.mark.parametrize("family", ["mean_field", "full"])
def test_a_weak_far_site_moves_the_posterior_to_its_mode_at_a_wide_scale(family):
    # a review's example: the prior N(1.17, 2.05) passes its first-order test (the step returned it, objective
    # -0.632), but N(214.1, 543.6), near the site's mode 219.4 and wide, is the global minimiser (objective -49.70)
    mp, vp, e1, e2 = 1.17, 2.05, 0.544, -0.00124
    if family == "full":
        prior = FullCovarianceGaussian.from_mean_covariance(torch.tensor([mp], dtype=F64),
                                                            torch.tensor([[vp]], dtype=F64))
        site = FullCovarianceGaussian(torch.tensor([e1], dtype=F64), torch.tensor([[e2]], dtype=F64))
    else:
        prior, site = _factors([mp], [vp], [e1], [e2])
    step = make_server_step("fisher_rao")
    q = step(prior, site)
    mean, var = (q.mean()[0], q.covariance()[0, 0]) if family == "full" else (q.mean()["w"][0], q.variance()["w"][0])
    best, x = _oracle(np.array([e1]), np.array([e2]), np.array([mp]), np.array([math.sqrt(vp)]))
    assert step.last_info["objective"] == pytest.approx(best, abs=1e-8)
    assert float(mean) == pytest.approx(x[0], rel=1e-6) and float(var) == pytest.approx(math.exp(2 * x[1]), rel=1e-5)
    assert step.last_info["winner"] == "mixed" and step.last_info["starts"] == "kl, mixed"
    # the plain descent (method="optimise") still stops at the prior: the extra start is what finds the minimum
    plain = make_server_step("fisher_rao", method="optimise")
    assert plain(prior, site).max_abs_diff(prior) == 0.0 and plain.last_info["starts"] == "kl"


def test_the_site_side_basin_is_found_where_neither_the_kl_solution_nor_the_mode_is_below_the_prior():
    # the KL solution and the site's mode both have objectives above the prior's (0.413 and 0.432 against 0.235), yet
    # N(-4.325, 3.475) reaches 0.052: the basin's bottom is short of the mode.  With B at the mode (ad9ae15) no extra
    # start ran and the step returned the prior; B is now the best point on the way to the mode for the coordinate
    # alone, which is below A, so the mixed start runs and finds the minimum
    mp, sp, e1, e2 = 0.14761217, 0.5709777, -1.34835071, -0.10225633
    prior, site = _factors([mp], [sp ** 2], [e1], [e2])
    (name, _), = fisher_rao_starts(prior, site, prior * site, 1e-8)
    step = make_server_step("fisher_rao")
    q = step(prior, site)
    best, x = _oracle(np.array([e1]), np.array([e2]), np.array([mp]), np.array([sp]))
    value = _value(q, np.array([e1]), np.array([e2]), np.array([mp]), np.array([sp]))
    assert name == "mixed" and value == pytest.approx(best, abs=1e-8) and best < 0.06
    assert float(q.mean()["w"][0]) == pytest.approx(-4.3253, abs=1e-4) and step.last_info["winner"] == "mixed"
    plain = make_server_step("fisher_rao", method="optimise")
    assert plain(prior, site).max_abs_diff(prior) == 0.0  # the descent from the KL solution alone: the prior


def test_a_quasi_newton_direction_into_the_family_edge_is_retried_as_steepest_descent():
    # a bounded problem (both site precisions positive) on which the descent from the KL solution ran a scale to
    # min_scale along an L-BFGS direction while the objective fell for the other coordinate's sake, and raised 'left
    # the family of distributions ... may be unbounded below' at objective -96.38; the minimum is -168.95
    mp, sp = np.array([-1.11959998, 1.26280944]), np.array([0.98040567, 1.03802287])
    e1, e2 = np.array([1.05428292, -0.65830986]), np.array([-0.08148672, -0.00060542])
    prior, site = _factors(mp, sp ** 2, e1, e2)
    best, _ = _oracle(e1, e2, mp, sp)
    for method in ("optimise", "auto"):  # the retry alone (one start), and with the extra start
        q = make_server_step("fisher_rao", method=method)(prior, site)
        assert _value(q, e1, e2, mp, sp) == pytest.approx(best, abs=1e-7 * abs(best))


def _segment_point(ma, sa, e1, e2, mp, sp):
    """B by the rule of common.server_fisher_rao, in numpy: of the points 1/8, 2/8, ..., 1 of the way from A to the
    site's mode and variance (mean, log variance), the one with the lowest L_i - L_i(A) + d_i (the first on a tie)."""
    mode, var = e1 / (-2 * e2), -0.5 / e2
    best, bm, bs = np.full(len(ma), np.inf), mode.copy(), np.sqrt(var)
    for f in np.arange(1, 9) / 8:
        m, s = ma + f * (mode - ma), np.exp(0.5 * (np.log(sa ** 2) + f * (np.log(var) - np.log(sa ** 2))))
        value = -(e1 * m + e2 * (m * m + s * s)) + (e1 * ma + e2 * (ma * ma + sa * sa)) + _fr(m, s, mp, sp)
        lower = value < best
        best, bm, bs = np.where(lower, value, best), np.where(lower, m, bm), np.where(lower, s, bs)
    return bm, bs


def test_the_mixed_start_is_the_lowest_of_the_t_ordered_combinations():
    # brute force: for each t on a fine grid, each coordinate takes A (the KL solution) or B (the point on the way to
    # the site's mode and variance that is best for the coordinate alone), whichever has the lower L_i + d_i^2 / (2 t);
    # the start returned has the lowest objective of those
    rng = np.random.default_rng(11)
    seen = 0
    for _ in range(20):
        d = 8
        mp, sp = rng.normal(0, 1, d), np.exp(0.5 * rng.normal(0, 1, d))
        e2, e1 = -0.5 * np.exp(rng.normal(-2, 2, d)), rng.normal(0, 2, d)
        prior, site = _factors(mp, sp ** 2, e1, e2)
        kl = prior * site
        ma, sa = kl.mean()["w"].numpy(), np.sqrt(kl.variance()["w"].numpy())
        mb, sb = _segment_point(ma, sa, e1, e2, mp, sp)
        la, lb = -(e1 * ma + e2 * (ma ** 2 + sa ** 2)), -(e1 * mb + e2 * (mb ** 2 + sb ** 2))
        qa, qb = _fr(ma, sa, mp, sp) ** 2, _fr(mb, sb, mp, sp) ** 2
        brute = math.inf
        for t in np.exp(np.linspace(-12, 12, 4001)):
            b = lb + qb / (2 * t) < la + qa / (2 * t)
            brute = min(brute, _objective(np.r_[np.where(b, mb, ma), np.log(np.where(b, sb, sa))], e1, e2, mp, sp))
        a_only = _objective(np.r_[ma, np.log(sa)], e1, e2, mp, sp)
        starts = fisher_rao_starts(prior, site, kl, 1e-8)
        if not starts:  # only when no combination is below A
            assert brute >= a_only - 1e-9 * (1 + abs(a_only)), (brute, a_only)
            continue
        seen += 1
        (name, start), = starts
        found = _value(start, e1, e2, mp, sp)
        assert name == "mixed" and found < a_only
        assert found <= brute + 1e-9 * (1 + abs(brute)), (found, brute)
        chosen = np.isclose(start.mean()["w"].numpy(), mb, rtol=1e-12, atol=0) & np.isclose(
            start.variance()["w"].numpy(), sb ** 2, rtol=1e-12, atol=0)
        kept = np.isclose(start.mean()["w"].numpy(), ma, rtol=1e-12, atol=0)
        assert np.all(chosen | kept)  # every coordinate is A or B, nothing else
    assert seen >= 5


def test_coordinates_without_a_usable_site_keep_the_first_start():
    # no precision (e2 = 0, e1 = 0), or a site scale at or below min_scale: the coordinate stays at A
    prior, site = _factors([0.0, 0.0, 0.5], [1.0, 1.0, 2.0], [0.0, 4e20, 0.544], [0.0, -2e20, -0.00124])
    start = prior * site
    (name, q), = fisher_rao_starts(prior, site, start, 1e-8)
    mean, var = q.mean()["w"], q.variance()["w"]
    assert float(mean[0]) == float(start.mean()["w"][0]) and float(var[0]) == float(start.variance()["w"][0])
    assert float(mean[1]) == float(start.mean()["w"][1]) and float(var[1]) == float(start.variance()["w"][1])
    # the third is B: a point on the way from A to the site's mode 219.4 and variance 403.2
    ma, va = float(start.mean()["w"][2]), float(start.variance()["w"][2])
    frac = (float(mean[2]) - ma) / (0.544 / 0.00248 - ma)
    assert frac in [pytest.approx(k / 8) for k in range(1, 9)]
    assert math.log(float(var[2])) == pytest.approx(math.log(va) + frac * (math.log(0.5 / 0.00124) - math.log(va)))
    no_site = _factors([0.0], [1.0], [0.0], [0.0])
    assert fisher_rao_starts(*no_site, no_site[0], 1e-8) == []


def test_a_failing_extra_descent_never_turns_the_step_into_an_error():
    # a review's case on the prior path: a coordinate with site precision 2e-200 and linear term 6.3e-99 makes the
    # mixed start's descent fail at scales ~1e100 after seeing objective -664.7; the step returned the prior before
    # the extra start existed and still does (the failure is recorded), as method="optimise" does; it raised before
    prior = MeanFieldGaussian.from_mean_variance({"w": torch.tensor([0.0, 1.0], dtype=F64)},
                                                 {"w": torch.tensor([1.0, 1.0], dtype=F64)})
    site = MeanFieldGaussian({"w": torch.tensor([math.sqrt(4e3) * 1e-100, 0.3], dtype=F64)},
                             {"w": torch.tensor([-1e-200, -0.1], dtype=F64)})
    step = make_server_step("fisher_rao")
    q = step(prior, site)
    assert q.max_abs_diff(prior) == 0.0
    assert q.max_abs_diff(make_server_step("fisher_rao", method="optimise")(prior, site)) == 0.0
    info = step.last_info
    assert info["path"] == "prior" and info["starts"] == "kl, mixed"
    assert "from 'mixed': did not converge, saw objective -664.7" in info["explored"], info["explored"]


# ----------------------------------------------------------------------------- the preconditioner of the descent
def _random_mean_field(n, seed):
    g = torch.Generator().manual_seed(seed)
    prior = MeanFieldGaussian.from_mean_variance({"w": torch.randn(n, generator=g, dtype=F64)},
                                                 {"w": torch.exp(torch.randn(n, generator=g, dtype=F64))})
    precision = 10.0 ** (-2.0 + 3.0 * torch.rand(n, generator=g, dtype=F64))
    site = MeanFieldGaussian({"w": precision * torch.randn(n, generator=g, dtype=F64)}, {"w": -0.5 * precision})
    return prior, site


def test_the_fisher_rao_majoriser_touches_the_objective_and_drops_only_the_rank_one_curvature():
    """At the chart's centre the majoriser has the objective's value and gradient, elsewhere it is not below it, and
    its Hessian is the objective's plus (grad S)(grad S)^T / (4 S^(3/2)) (dense autograd Hessians, 4 coordinates)."""
    prior, site = _random_mean_field(4, 0)
    centre = (prior * site).detach()
    chart = server_gvi._chart(centre, site, 1e-8)
    step = server_gvi.ServerGVIStep(make_server_step("fisher_rao").divergence)
    objective = step._objective_of(chart, prior)
    majoriser = server_gvi._fisher_rao_majoriser(chart, prior)
    z0 = torch.zeros(chart.dim, dtype=F64)
    assert float(majoriser(z0)) == pytest.approx(float(objective(z0)), rel=1e-14)
    g_obj = torch.autograd.functional.jacobian(objective, z0)
    g_maj = torch.autograd.functional.jacobian(majoriser, z0)
    torch.testing.assert_close(g_maj, g_obj, rtol=1e-12, atol=1e-12)
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        z = 0.5 * torch.randn(chart.dim, generator=gen, dtype=F64)
        assert float(majoriser(z)) >= float(objective(z)) - 1e-12 * abs(float(objective(z)))

    def squared(z):
        m, _, var = chart._moments(z)
        mp, sp = prior.flat(prior.mean()), prior.flat(prior.variance()).sqrt()
        return (fisher_rao_univariate(m, var.sqrt(), mp, sp) ** 2).sum()

    s0 = float(squared(z0))
    grad_s = torch.autograd.functional.jacobian(squared, z0)
    h_obj = torch.autograd.functional.hessian(objective, z0)
    h_maj = torch.autograd.functional.hessian(majoriser, z0)
    torch.testing.assert_close(h_maj - h_obj, torch.outer(grad_s, grad_s) / (4.0 * s0 ** 1.5), rtol=1e-9, atol=1e-12)
    # block-diagonal: coordinate i's (u_i, v_i) pair couples with no other coordinate
    n = chart.n
    mask = torch.zeros_like(h_maj, dtype=torch.bool)
    for i in range(n):
        for a in (i, n + i):
            mask[a, i] = mask[a, n + i] = True
    assert float(h_maj[~mask].abs().max()) == 0.0
    # at the prior (distance 0, the kink) there is none
    assert server_gvi._fisher_rao_majoriser(server_gvi._chart(prior, site, 1e-8), prior) is None


def test_the_fisher_rao_descent_is_preconditioned_and_reaches_the_unpreconditioned_minimum(monkeypatch):
    """2,000 coordinates: the mean-field Fisher-Rao descent runs preconditioned by the majoriser's blocks and needs
    far fewer iterations than without them (a 159,010-coordinate step took 62.5 s without, 13.2 s with, on one
    thread), to the same minimum."""
    prior, site = _random_mean_field(2000, 3)
    step = make_server_step("fisher_rao", method="optimise")
    q = step(prior, site)
    with_info = dict(step.last_info)
    monkeypatch.setattr(server_gvi, "_fisher_rao_majoriser", lambda chart, prior64: None)
    plain = make_server_step("fisher_rao", method="optimise")
    q_plain = plain(prior, site)
    assert with_info["preconditioned"] and not plain.last_info["preconditioned"]
    assert with_info["iterations"] * 2 < plain.last_info["iterations"], (with_info, plain.last_info)
    assert with_info["objective"] == pytest.approx(plain.last_info["objective"], rel=1e-12)
    assert q.max_abs_diff(q_plain) < 1e-6 * max(1.0, max(float(t.abs().max()) for t in q_plain.params.values()))
