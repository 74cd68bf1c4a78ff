"""Oracles for common.aggregation: identity of "sum"; norm clipping against hand-computed norms and bounds;
coordinate-wise median / trimmed mean against numpy and scipy.stats.trim_mean; the ledger identity after
crediting; measured robustness to one Byzantine client; the heterogeneity trade-off; properness is left to the
server's check (with explicit counterexamples); registry and guards."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from common.aggregation import (
    AGGREGATORS,
    Aggregator,
    NormClip,
    TrimmedMean,
    check_batch,
    make_aggregator,
    natural_parameter_norm,
)
from common.errors import NonFiniteError, ShapeMismatchError
from common.factors import PGVIServerState, UpdateRejected
from common.families import FullCovarianceGaussian, GaussianFactor, MeanFieldGaussian
from tests.tensors import assert_close, gen

SHAPES = {"w": (3, 4), "b": (4,)}
D = 3


# ---------------------------------------------------------------------------------------------------
# builders: arbitrary (possibly improper) Deltas
def random_delta(
    family: str, g: torch.Generator, dtype: torch.dtype = torch.float64, scale: float = 1.0
) -> GaussianFactor:
    if family == "mf":
        e1 = {n: scale * torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for n, s in SHAPES.items()}
        e2 = {n: scale * torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for n, s in SHAPES.items()}
        return MeanFieldGaussian(e1, e2)
    a = scale * torch.randn(D, D, generator=g, dtype=torch.float64)
    return FullCovarianceGaussian(
        (scale * torch.randn(D, generator=g, dtype=torch.float64)).to(dtype), (0.5 * (a + a.T)).to(dtype)
    )


def random_batch(family: str, m: int, seed: int, dtype: torch.dtype = torch.float64) -> dict[str, GaussianFactor]:
    g = gen(seed)
    return {f"client-{i}": random_delta(family, g, dtype) for i in range(m)}


def flat(f: GaussianFactor) -> np.ndarray:
    return np.concatenate([v.detach().numpy().ravel() for v in f.params.values()])


def stacked(batch: dict[str, GaussianFactor], key: str) -> np.ndarray:
    return np.stack([d.params[key].numpy() for d in batch.values()])


def snapshot(batch: dict[str, GaussianFactor]) -> dict[str, dict[str, torch.Tensor]]:
    return {c: {k: v.clone() for k, v in d.params.items()} for c, d in batch.items()}


def assert_unmodified(batch, snap) -> None:
    assert list(batch) == list(snap)
    for c, d in batch.items():
        for k, v in d.params.items():
            assert torch.equal(v, snap[c][k]), (c, k)


def product(factors) -> GaussianFactor:
    factors = list(factors)
    out = factors[0].zeros_like()
    for f in factors:
        out = out * f
    return out


def mf1(e1: float, e2: float) -> MeanFieldGaussian:
    """A one-coordinate mean-field factor with the given natural parameters."""
    t = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
    return MeanFieldGaussian({"x": t(e1)}, {"x": t(e2)})


# ---------------------------------------------------------------------------------------------------
# registry and guards
def test_registry_names_and_classes():
    assert AGGREGATORS.names() == ["median", "norm_clip", "sum", "trimmed_mean"]
    for name in AGGREGATORS.names():
        agg = make_aggregator(name)
        assert isinstance(agg, Aggregator) and agg.name == name
    assert isinstance(make_aggregator("trimmed_mean", trim=0.1), TrimmedMean)
    assert make_aggregator("trimmed_mean", trim=0.1).trim == 0.1
    clip = make_aggregator("norm_clip", max_norm=2.0)
    assert isinstance(clip, NormClip) and clip.max_norm == 2.0 and "max_norm=2.0" in repr(clip)


def test_unknown_name_and_hyperparameter():
    with pytest.raises(KeyError, match="unknown aggregator 'krum'.*median.*norm_clip.*sum.*trimmed_mean"):
        make_aggregator("krum")
    with pytest.raises(ValueError, match="unknown: \\['trim'\\]"):
        make_aggregator("median", trim=0.1)
    with pytest.raises(ValueError, match="unknown: \\['max_norm'\\]"):
        make_aggregator("trimmed_mean", max_norm=1.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "abc", True])
def test_norm_clip_guards(bad):
    with pytest.raises(ValueError, match="max_norm"):
        make_aggregator("norm_clip", max_norm=bad)
    with pytest.raises(ValueError, match="multiplier"):
        make_aggregator("norm_clip", multiplier=bad)


@pytest.mark.parametrize("bad", [-0.01, 0.5, 0.7, float("nan"), "x", True])
def test_trim_guard(bad):
    with pytest.raises(ValueError, match="trim"):
        make_aggregator("trimmed_mean", trim=bad)


def test_trim_edges_accepted():
    assert make_aggregator("trimmed_mean", trim=0.0).trim == 0.0
    assert make_aggregator("trimmed_mean", trim=0.4999).trim == 0.4999


@pytest.mark.parametrize("name", ["sum", "norm_clip", "trimmed_mean", "median"])
def test_batch_validation(name):
    agg = make_aggregator(name)
    assert agg({}) == {}
    g = gen(0)
    good = random_delta("mf", g)
    nan = random_delta("mf", g)
    nan.params["eta2/b"][1] = float("nan")
    with pytest.raises(NonFiniteError, match="Delta from 'bad'"):
        agg({"a": good, "bad": nan})
    with pytest.raises(ShapeMismatchError, match="'c'"):
        agg({"a": good, "c": random_delta("full", g)})
    with pytest.raises(ShapeMismatchError, match="float32"):
        agg({"a": good, "c": good.to(torch.float32)})
    z = torch.zeros(3, 4, dtype=torch.float64)
    other = MeanFieldGaussian({"w": z}, {"w": z.clone()})
    with pytest.raises(ShapeMismatchError):
        agg({"a": good, "c": other})
    with pytest.raises(TypeError, match="GaussianFactor"):
        check_batch({"a": good, "c": {"eta1": torch.zeros(1)}})


# ---------------------------------------------------------------------------------------------------
# sum
@pytest.mark.parametrize("family", ["mf", "full"])
def test_sum_is_identity(family):
    batch = random_batch(family, 5, seed=1)
    snap = snapshot(batch)
    out = make_aggregator("sum")(batch)
    assert list(out) == list(batch)
    for c in batch:
        for k, v in out[c].params.items():
            assert torch.equal(v, snap[c][k])
    assert_unmodified(batch, snap)


# ---------------------------------------------------------------------------------------------------
# norm clipping
def test_natural_parameter_norm_by_hand():
    # eta1 = (3, 0), eta2 = [[0, 0], [0, -4]] -> sqrt(9 + 16) = 5
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    f = FullCovarianceGaussian(t([3.0, 0.0]), torch.diag(t([0.0, -4.0])))
    assert natural_parameter_norm(f) == 5.0
    # off-diagonal entries count twice (Frobenius norm of eta2): sqrt(1 + 2 * 2^2) = 3
    f = FullCovarianceGaussian(t([1.0, 0.0]), t([[0.0, 2.0], [2.0, 0.0]]))
    assert natural_parameter_norm(f) == 3.0
    # mean-field: eta1 and eta2 of every named tensor together: sqrt(1 + 4 + 4 + 16 + 0) = 5
    f = MeanFieldGaussian(
        {"a": torch.tensor([1.0, 2.0], dtype=torch.float64), "b": torch.tensor([0.0], dtype=torch.float64)},
        {"a": torch.tensor([2.0, 0.0], dtype=torch.float64), "b": torch.tensor([-4.0], dtype=torch.float64)},
    )
    assert natural_parameter_norm(f) == 5.0
    for dt in (torch.float32, torch.float64):
        g = random_delta("mf", gen(3), dt)
        assert math.isclose(natural_parameter_norm(g), float(np.linalg.norm(flat(g).astype(np.float64))), rel_tol=1e-12)


@pytest.mark.parametrize("family", ["mf", "full"])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_norm_clip_fixed_bound(family, dtype, rtol):
    g = gen(7)
    base = {f"c{i}": random_delta(family, g, dtype) for i in range(6)}
    norms = {c: natural_parameter_norm(d) for c, d in base.items()}
    bound = float(np.median(list(norms.values())))  # some Deltas above, some below
    snap = snapshot(base)
    out = make_aggregator("norm_clip", max_norm=bound)(base)
    assert list(out) == list(base)
    n_clipped = 0
    for c, d in base.items():
        r = out[c]
        assert type(r) is type(d) and r.dtype == dtype and r.params.keys() == d.params.keys()
        if norms[c] <= bound:
            for k in d.params:  # untouched, bit for bit
                assert torch.equal(r.params[k], d.params[k])
        else:
            n_clipped += 1
            assert math.isclose(natural_parameter_norm(r), bound, rel_tol=rtol)
            u, v = flat(r).astype(np.float64), flat(d).astype(np.float64)
            np.testing.assert_allclose(u / np.linalg.norm(u), v / np.linalg.norm(v), rtol=0, atol=10 * rtol)
            np.testing.assert_allclose(u, v * (bound / norms[c]), rtol=rtol, atol=0)
        if family == "full":
            assert torch.equal(r.eta2, r.eta2.T)
    assert n_clipped == 3
    assert_unmodified(base, snap)


def test_norm_clip_adaptive_bound_by_hand():
    # three clients with norms 1, 2, 10 (hand-made); multiplier 1.5 -> bound 1.5 * median = 3
    a = mf1(0.6, -0.8)  # norm 1
    b = mf1(-2.0, 0.0)  # norm 2
    c = mf1(6.0, 8.0)  # norm 10
    out = make_aggregator("norm_clip", multiplier=1.5)({"a": a, "b": b, "c": c})
    assert out["a"] is a and out["b"] is b
    assert_close(out["c"].params["eta1/x"], torch.tensor([1.8], dtype=torch.float64))  # 6 * 3/10
    assert_close(out["c"].params["eta2/x"], torch.tensor([2.4], dtype=torch.float64))  # 8 * 3/10
    assert math.isclose(natural_parameter_norm(out["c"]), 3.0, rel_tol=1e-15)
    # multiplier 1: bound 2 -> c scaled to norm 2 = (1.2, 1.6); a and b untouched
    out = make_aggregator("norm_clip")({"a": a, "b": b, "c": c})
    assert out["a"] is a and out["b"] is b
    assert_close(out["c"].params["eta1/x"], torch.tensor([1.2], dtype=torch.float64))
    assert_close(out["c"].params["eta2/x"], torch.tensor([1.6], dtype=torch.float64))
    # even M: median of norms 1, 2, 4, 10 is 3 (mean of the middle two)
    d = mf1(0.0, 4.0)
    out = make_aggregator("norm_clip")({"a": a, "b": b, "d": d, "c": c})
    assert out["a"] is a and out["b"] is b
    assert_close(out["d"].params["eta2/x"], torch.tensor([3.0], dtype=torch.float64))
    assert_close(out["c"].params["eta1/x"], torch.tensor([1.8], dtype=torch.float64))
    # M = 1: the bound is the Delta's own norm -> untouched
    assert make_aggregator("norm_clip")({"c": c})["c"] is c
    # majority of zero Deltas: bound 0, the non-zero Delta is credited as zero
    z = mf1(0.0, 0.0)
    out = make_aggregator("norm_clip")({"z1": z, "z2": z.clone(), "c": c})
    assert natural_parameter_norm(out["c"]) == 0.0


def test_norm_clip_single_delta_keeps_properness():
    # convexity: q proper and q * Delta proper  =>  q * Delta**s proper for s in [0, 1]
    g = gen(11)
    checked = 0
    for _ in range(50):
        a = torch.randn(D, D, generator=g, dtype=torch.float64)
        lam = a @ a.T + 0.1 * torch.eye(D, dtype=torch.float64)
        q = FullCovarianceGaussian.from_mean_precision(torch.randn(D, generator=g, dtype=torch.float64), lam)
        delta = random_delta("full", g)
        if not (q * delta).is_proper():
            continue
        checked += 1
        n = natural_parameter_norm(delta)
        for frac in (0.9, 0.5, 0.1, 1e-3):
            clipped = make_aggregator("norm_clip", max_norm=frac * n)({"x": delta})["x"]
            assert (q * clipped).is_proper()
    assert checked >= 10


# ---------------------------------------------------------------------------------------------------
# coordinate-wise median and trimmed mean against numpy / scipy
CASES = [(m, fam, dt) for m in (1, 2, 5, 10, 11) for fam in ("mf", "full") for dt in (torch.float32, torch.float64)]


@pytest.mark.parametrize("m,family,dtype", CASES)
def test_median_matches_numpy(m, family, dtype):
    batch = random_batch(family, m, seed=100 + m, dtype=dtype)
    snap = snapshot(batch)
    out = make_aggregator("median")(batch)
    assert list(out) == list(batch)
    loc = out["client-0"]
    assert type(loc) is type(batch["client-0"]) and loc.dtype == dtype
    for k in loc.params:
        expected = torch.from_numpy(np.median(stacked(batch, k), axis=0))
        assert_close(loc.params[k], expected, rtol=1e-6 if dtype == torch.float32 else 1e-15)
    for c in batch:  # every client credited the same
        assert out[c].max_abs_diff(loc) == 0.0
    if family == "full":
        assert torch.equal(loc.eta2, loc.eta2.T)
    assert_unmodified(batch, snap)


@pytest.mark.parametrize("trim", [0.0, 0.1, 0.2, 0.3, 0.45])
@pytest.mark.parametrize("m,family,dtype", CASES)
def test_trimmed_mean_matches_scipy(trim, m, family, dtype):
    batch = random_batch(family, m, seed=200 + m, dtype=dtype)
    snap = snapshot(batch)
    out = make_aggregator("trimmed_mean", trim=trim)(batch)
    loc = out["client-0"]
    assert type(loc) is type(batch["client-0"]) and loc.dtype == dtype
    for k in loc.params:
        x = stacked(batch, k)
        expected = stats.trim_mean(x.astype(np.float64), trim, axis=0)
        tol = 1e-6 if dtype == torch.float32 else 1e-13
        assert_close(loc.params[k].to(torch.float64), torch.from_numpy(expected), rtol=tol, atol=0.1 * tol)
    for c in batch:
        assert out[c].max_abs_diff(loc) == 0.0
    if family == "full":
        assert torch.equal(loc.eta2, loc.eta2.T)
    assert_unmodified(batch, snap)


def test_trimmed_mean_counts_by_hand():
    # 10 clients, trim 0.2 -> drop 2 at each end; values 0..9 (shuffled) -> mean(2..7) = 4.5
    vals = [7.0, 0.0, 9.0, 3.0, 1.0, 8.0, 2.0, 6.0, 4.0, 5.0]
    batch = {f"c{i}": mf1(v, -v) for i, v in enumerate(vals)}
    loc = make_aggregator("trimmed_mean", trim=0.2)(batch)["c0"]
    assert float(loc.params["eta1/x"]) == 4.5 and float(loc.params["eta2/x"]) == -4.5
    # trim 0.29 with M = 10 -> floor(2.9) = 2 too; 0.3 -> 3: mean(3..6) = 4.5 (symmetric), use a skewed set
    skew = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 100.0]
    batch = {f"c{i}": mf1(v, 0.0) for i, v in enumerate(skew)}
    assert float(make_aggregator("trimmed_mean", trim=0.29)(batch)["c0"].params["eta1/x"]) == 4.5  # mean(2..7)
    assert float(make_aggregator("trimmed_mean", trim=0.0)(batch)["c0"].params["eta1/x"]) == 13.6
    assert float(make_aggregator("trimmed_mean", trim=0.3)(batch)["c0"].params["eta1/x"]) == 4.5  # mean(3..6)
    assert float(make_aggregator("median")(batch)["c0"].params["eta1/x"]) == 4.5
    # M = 1: the single Delta itself
    one = {"only": random_delta("mf", gen(5))}
    for name in ("trimmed_mean", "median"):
        assert make_aggregator(name)(one)["only"].max_abs_diff(one["only"]) == 0.0


@pytest.mark.parametrize("name", ["median", "trimmed_mean", "norm_clip"])
def test_deterministic_and_order_invariant(name):
    batch = random_batch("mf", 9, seed=17)
    rev = dict(reversed(list(batch.items())))
    agg = make_aggregator(name)
    a, b, c = agg(batch), agg(batch), agg(rev)
    assert list(c) == list(rev)
    for cid in batch:
        assert a[cid].max_abs_diff(b[cid]) == 0.0
        assert a[cid].max_abs_diff(c[cid]) == 0.0


# ---------------------------------------------------------------------------------------------------
# ledger: credited sum = M x location, and posterior = prior * prod sites
@pytest.mark.parametrize("name", ["median", "trimmed_mean"])
@pytest.mark.parametrize("family", ["mf", "full"])
def test_credited_sum_and_ledger(name, family):
    m = 7
    g = gen(31)
    batch = {f"c{i}": random_delta(family, g, scale=0.01) for i in range(m)}
    agg = make_aggregator(name)
    credited = agg(batch)
    loc = agg.location(batch)  # type: ignore[attr-defined]
    total = product(credited.values())
    assert total.max_abs_diff(loc ** m) < 1e-15
    if family == "mf":
        prior = MeanFieldGaussian.isotropic(SHAPES, variance=2.0)
    else:
        eye = torch.eye(D, dtype=torch.float64)
        prior = FullCovarianceGaussian.from_mean_covariance(torch.zeros(D, dtype=torch.float64), 2.0 * eye)
    state = PGVIServerState(prior=prior)
    state.apply(credited)
    assert state.posterior.max_abs_diff(prior * loc ** m) < 1e-14
    assert state.check_invariant() < 1e-15
    for c in batch:
        assert state.sites[c].max_abs_diff(loc) == 0.0  # each client's site is its credited Delta


def test_norm_clip_credited_sum_and_ledger():
    g = gen(32)
    batch = {f"c{i}": random_delta("mf", g, scale=0.05 * (1 + i)) for i in range(5)}
    credited = make_aggregator("norm_clip", max_norm=0.3)(batch)
    state = PGVIServerState(prior=MeanFieldGaussian.isotropic(SHAPES, variance=2.0))
    state.apply(credited)
    assert state.check_invariant() < 1e-15
    assert state.global_site.max_abs_diff(product(credited.values())) < 1e-15
    for c in batch:
        assert state.sites[c].max_abs_diff(credited[c]) == 0.0


# ---------------------------------------------------------------------------------------------------
# robustness to one Byzantine client (measured)
def honest_and_byzantine(family: str, attack: float, seed: int = 41, sigma: float = 0.01):
    """10 honest Deltas = centre + N(0, sigma^2) noise, plus one Byzantine = attack x (an honest-like draw)."""
    g = gen(seed)
    centre = random_delta(family, g)
    honest = {f"h{i}": centre * random_delta(family, g, scale=sigma) for i in range(10)}
    byz = (centre * random_delta(family, g, scale=sigma)) ** attack
    return honest, byz


def mean_factor(batch: dict[str, GaussianFactor]) -> GaussianFactor:
    return product(batch.values()) ** (1.0 / len(batch))


def distance(a: GaussianFactor, b: GaussianFactor) -> float:
    return natural_parameter_norm(a / b)


@pytest.mark.parametrize("attack", [100.0, -1.0, -100.0])
@pytest.mark.parametrize("family", ["mf", "full"])
def test_robust_to_one_byzantine(family, attack):
    honest, byz = honest_and_byzantine(family, attack)
    batch = dict(honest, byz=byz)
    m = len(batch)
    h_mean = mean_factor(honest)
    err_sum = distance(product(make_aggregator("sum")(batch).values()) ** (1.0 / m), h_mean)
    sigma_scale = 0.01 * math.sqrt(h_mean.numel())  # expected norm of one honest noise vector
    # plain sum: far off (x100: ~ 99/11 |centre|; sign flip: ~ 2/11 |centre|)
    assert err_sum > 0.1 * natural_parameter_norm(h_mean)
    assert err_sum > 5 * sigma_scale
    for name in ("median", "trimmed_mean"):
        loc = make_aggregator(name)(batch)["byz"]
        err = distance(loc, h_mean)
        assert err < 0.5 * sigma_scale, (name, err, sigma_scale)
        assert err < 0.05 * err_sum
        # deterministic: every coordinate lies inside the honest values' range (for the median, between the
        # 5th and 6th honest order statistics, since the single outlier is on one side)
        for k in loc.params:
            h = np.sort(stacked(honest, k), axis=0)
            x = loc.params[k].numpy()
            lo, hi = (h[4], h[5]) if name == "median" else (h[0], h[-1])
            assert np.all(lo <= x) and np.all(x <= hi)
    # adaptive norm clipping bounds the attacker's norm by the median norm: helps against x100, not against a
    # sign flip of ordinary size (documented)
    credited = make_aggregator("norm_clip", multiplier=1.0)(batch)
    med = float(np.median([natural_parameter_norm(d) for d in batch.values()]))
    assert natural_parameter_norm(credited["byz"]) <= med * (1 + 1e-12)
    err_clip = distance(product(credited.values()) ** (1.0 / m), h_mean)
    if abs(attack) == 100.0:
        assert err_clip < 0.25 * err_sum
    else:
        assert err_clip > 0.5 * err_sum


def test_robustness_numbers_are_reported(capsys):
    """Print the measured distances |location - honest mean| (for the report)."""
    lines = []
    for family in ("mf", "full"):
        for attack in (100.0, -1.0, -100.0):
            honest, byz = honest_and_byzantine(family, attack)
            batch = dict(honest, byz=byz)
            h_mean = mean_factor(honest)
            errs = {}
            for name in ("sum", "norm_clip", "trimmed_mean", "median"):
                cr = make_aggregator(name)(batch)
                errs[name] = distance(product(cr.values()) ** (1.0 / len(batch)), h_mean)
            lines.append(f"{family} attack x{attack:g}: " + ", ".join(f"{k} {v:.3g}" for k, v in errs.items()))
            assert max(errs["median"], errs["trimmed_mean"]) < 0.05 * errs["sum"]
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# ---------------------------------------------------------------------------------------------------
# the trade-off: heterogeneous honest clients
def test_heterogeneous_clients_median_biased_clip_not():
    g = gen(51)
    # honest but heterogeneous: client i's Delta is centred at (i+1) x a common direction (different data sizes)
    direction = random_delta("mf", g, scale=0.1)
    batch = {f"c{i}": (direction ** (i + 1.0)) * random_delta("mf", g, scale=0.001) for i in range(6)}
    plain = product(batch.values())
    bound = 1.01 * max(natural_parameter_norm(d) for d in batch.values())
    clipped = make_aggregator("norm_clip", max_norm=bound)(batch)
    assert product(clipped.values()).max_abs_diff(plain) == 0.0  # no bias: everything within bound
    median_total = product(make_aggregator("median")(batch).values())
    rel_bias = distance(median_total, plain) / natural_parameter_norm(plain)
    # sizes 1..6: median 3.5, mean 3.5 -> unbiased for this symmetric spread; use a skewed one below
    assert rel_bias < 0.05
    skewed = {f"c{i}": (direction ** s) * random_delta("mf", g, scale=0.001) for i, s in enumerate([1, 1, 1, 1, 2, 20])}
    plain = product(skewed.values())
    median_total = product(make_aggregator("median")(skewed).values())
    trimmed_total = product(make_aggregator("trimmed_mean")(skewed).values())
    # plain total = 26 x direction; median total = 6 x 1 x direction; trimmed (drop 1 each end) = 6 x 1.25
    assert math.isclose(distance(median_total, plain) / natural_parameter_norm(plain), 20 / 26, rel_tol=0.01)
    assert math.isclose(distance(trimmed_total, plain) / natural_parameter_norm(plain), 18.5 / 26, rel_tol=0.01)


# ---------------------------------------------------------------------------------------------------
# properness is not guaranteed: the server's check after aggregation is what enforces it
def test_aggregate_can_be_improper_where_sum_is_proper():
    prior = mf1(0.0, -0.5)  # N(0, 1)
    # one client adds precision 20, two remove 0.8 each; each alone keeps the posterior proper
    batch = {"a": mf1(0.0, -10.0), "b": mf1(0.0, 0.4), "c": mf1(0.0, 0.4)}
    for d in batch.values():
        assert (prior * d).is_proper()
    assert (prior * product(batch.values())).is_proper()  # plain sum: precision 1 + 20 - 1.6
    state = PGVIServerState(prior=prior)
    credited = make_aggregator("median")(batch)  # 3 x 0.4 -> eta2 = -0.5 + 1.2 > 0
    with pytest.raises(UpdateRejected, match="improper"):
        state.apply(credited)
    assert state.version == 0 and state.sites == {} and state.posterior.max_abs_diff(prior) == 0.0
    # norm clipping: the large Delta clipped to norm 0.5, three small ones untouched -> net precision decrease
    batch = {"a": mf1(0.0, -10.0), "b": mf1(0.0, 0.4), "c": mf1(0.0, 0.4), "d": mf1(0.0, 0.4)}
    assert (prior * product(batch.values())).is_proper()
    credited = make_aggregator("norm_clip", max_norm=0.5)(batch)
    assert float(credited["a"].params["eta2/x"]) == -0.5
    with pytest.raises(UpdateRejected, match="improper"):
        state.apply(credited)
    assert state.version == 0


def test_norm_clip_scales_a_delta_whose_norm_overflows_instead_of_zeroing_it():
    # review of 2026-11-28: entries 1e200 (finite, float64) have norm 2e200 but their squares overflow: the norm was
    # inf and d ** (bound / inf) credited the client a zero Delta instead of one scaled to the bound
    from common.aggregation import NormClip, natural_parameter_norm

    f64 = torch.float64
    big = FullCovarianceGaussian(torch.full((2,), 1e200, dtype=f64), -1e200 * torch.eye(2, dtype=f64))
    assert natural_parameter_norm(big) == pytest.approx(2e200, rel=1e-12)
    out = NormClip(max_norm=10.0)({"a": big})["a"]
    assert natural_parameter_norm(out) == pytest.approx(10.0, rel=1e-12)
    torch.testing.assert_close(out.params["eta1"], torch.full((2,), 5.0, dtype=f64))


def test_norm_clip_scales_a_delta_whose_norm_is_beyond_float64_and_its_adaptive_bound_stays_finite():
    # review of stop 35: entries 1e308 x 4 have norm 2e308, beyond float64's range; the norm was inf and
    # d ** (bound / inf) still credited zeros. The adaptive bound's median of two norms near the maximum was
    # (a + b) / 2 = inf, so nothing was clipped.
    from common.aggregation import NormClip

    f64 = torch.float64
    huge = FullCovarianceGaussian(torch.full((2,), 1e308, dtype=f64), -1e308 * torch.eye(2, dtype=f64))
    out = NormClip(max_norm=10.0)({"a": huge})["a"]
    torch.testing.assert_close(out.params["eta1"], torch.full((2,), 5.0, dtype=f64))  # norm 10, same direction
    torch.testing.assert_close(out.params["eta2"], -5.0 * torch.eye(2, dtype=f64))
    big = {k: FullCovarianceGaussian(torch.tensor([v, 0.0], dtype=f64), torch.zeros(2, 2, dtype=f64))
           for k, v in (("a", 1.0e308), ("b", 1.5e308), ("c", 1.0), ("d", 1.7e308))}
    clip = NormClip(multiplier=1.0)
    assert clip.bound([1.0e308, 1.5e308]) == pytest.approx(1.25e308, rel=1e-15)
    credited = clip(big)
    assert float(credited["d"].params["eta1"][0]) == pytest.approx(1.25e308, rel=1e-12)  # scaled to the bound
    assert credited["c"] is big["c"] and credited["a"] is big["a"]


def test_norm_clip_adaptive_bound_that_overflows_is_the_largest_float_not_inf():
    # review of stop 35: multiplier * median overflowed to inf (2 x 1.3e308) and an infinite bound credited a Delta
    # of norm beyond float64's range unchanged
    import sys

    from common.aggregation import NormClip

    f64 = torch.float64
    batch = {k: FullCovarianceGaussian(torch.tensor(v, dtype=f64), torch.zeros(2, 2, dtype=f64))
             for k, v in (("a", [1.5e308, 1.5e308]), ("b", [1.2e308, 0.0]), ("c", [1.3e308, 0.0]))}
    clip = NormClip(multiplier=2.0)
    assert clip.bound([1.2e308, 1.3e308, float("inf")]) == sys.float_info.max
    credited = clip(batch)
    expected = sys.float_info.max / math.sqrt(2.0)
    assert float(credited["a"].params["eta1"][0]) == pytest.approx(expected, rel=1e-12)
    assert torch.isfinite(credited["a"].params["eta1"]).all()
    assert credited["b"] is batch["b"] and credited["c"] is batch["c"]
