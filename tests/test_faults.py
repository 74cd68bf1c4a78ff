"""Fault injection through the real ClientApp (node config ``fault``), in process.

For every fault: the final posterior is the closed form of the updates the ledger says were applied, every
client's own site equals the ledger's, and invalid replies are all rejected with a reason.
"""

from __future__ import annotations

import numpy as np
import pytest

from client.app import app as client_app
from common.config import parse_run_config
from common.problem import build_problem
from strategies.inprocess import InProcessGrid
from strategies.pgvi import PGVIStrategy
from strategies.reference import expected_posterior, max_natural_diff
from tests.test_inprocess import BASE, client_sites

ROUNDS = 3


def _run(fault: str, schedule: str = "synchronous", **overrides):
    raw = {**BASE, "num-server-rounds": ROUNDS, "schedule": schedule, **overrides}
    cfg = parse_run_config(raw)
    nodes = [{"partition-id": m, "client-id": f"site-{m}", **({"fault": fault} if m == 1 else {})} for m in range(3)]
    grid = InProcessGrid(client_app, nodes, raw)
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    strategy.start(grid)
    return cfg, strategy, grid


def ledger_matches_clients(cfg, strategy, grid):
    assert strategy.state.check_invariant() < 1e-10
    sites = client_sites(grid, strategy)
    assert set(sites) == {"site-0", "site-1", "site-2"}
    for cid, site in sites.items():
        for k, v in strategy.state.sites[cid].to_numpy().items():
            np.testing.assert_allclose(site[k], v, rtol=0, atol=1e-12)


@pytest.mark.parametrize("schedule", ["synchronous", "sequential"])
@pytest.mark.parametrize("fault", ["nan@2", "wrong-shape@2", "improper@2", "huge@2"])
def test_invalid_reply_is_rejected_and_nothing_else_changes(fault, schedule):
    cfg, strategy, grid = _run(fault, schedule)
    assert len(strategy.rejections) == 1 and strategy.rejections[0]["client-id"] == "site-1"
    assert strategy.rejections[0]["round"] == 2
    assert strategy.ledger_versions == {"site-0": ROUNDS, "site-1": ROUNDS - 1, "site-2": ROUNDS}
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9
    ledger_matches_clients(cfg, strategy, grid)


@pytest.mark.parametrize("fault", ["lose-reply@2", "crash-before-reply@2", "lose-reply@1,2"])
def test_lost_reply_or_crash_loses_no_update_and_counts_none_twice(fault):
    cfg, strategy, grid = _run(fault)
    lost = len(fault.split("@")[1].split(","))
    assert strategy.ledger_versions == {"site-0": ROUNDS, "site-1": ROUNDS - lost, "site-2": ROUNDS}
    assert not strategy.rejections
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9
    ledger_matches_clients(cfg, strategy, grid)


@pytest.mark.parametrize("fault", ["scale:10@2", "flip@2"])
def test_byzantine_update_is_applied_consistently_by_plain_sum(fault):
    """Plain PGVI trusts clients: the corrupted Delta is applied and the ledger records what was sent."""
    cfg, strategy, grid = _run(fault)
    honest = expected_posterior(cfg, strategy.ledger_versions)
    assert max_natural_diff(strategy.state.posterior, honest) > 1e-3
    ledger_matches_clients(cfg, strategy, grid)


def _run_many(fault: str, aggregator: str, n: int = 7, rounds: int = 3, **extra):
    raw = {**BASE, "num-server-rounds": rounds, "num-clients": n, "min-clients": n, "aggregator": aggregator, **extra}
    cfg = parse_run_config(raw)
    nodes = [{"partition-id": m, "client-id": f"site-{m}", **({"fault": fault} if fault and m == 1 else {})}
             for m in range(n)]
    grid = InProcessGrid(client_app, nodes, raw)
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    strategy.start(grid)
    return cfg, strategy, grid


@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean", "norm_clip"])
def test_robust_aggregation_resists_a_scaled_byzantine_client_and_keeps_the_ledger(aggregator):
    _, honest, _ = _run_many("", "sum")
    _, plain, _ = _run_many("scale:50", "sum")
    cfg, robust, grid = _run_many("scale:50", aggregator)
    honest_mean = float(honest.state.posterior.mean()[0])
    err_plain = abs(float(plain.state.posterior.mean()[0]) - honest_mean)
    err_robust = abs(float(robust.state.posterior.mean()[0]) - honest_mean)
    # location estimators ignore the outlier; clipping bounds it to multiplier x the median norm (2x here)
    limit = 0.25 if aggregator == "norm_clip" else 0.1
    assert err_robust < limit * err_plain, (err_robust, err_plain)
    # every client adopted the site the server credited it (resync), so ledger and clients agree
    for cid, site in client_sites(grid, robust).items():
        for k, v in robust.state.sites[cid].to_numpy().items():
            np.testing.assert_allclose(site[k], v, rtol=0, atol=1e-12)
    assert robust.state.check_invariant() < 1e-10


def test_a_client_that_keeps_sending_bad_replies_is_excluded():
    cfg, strategy, grid = _run_many("nan", "sum", n=3, rounds=5, **{"max-bad-replies": 2})
    assert [r["round"] for r in strategy.rejections] == [1, 2]
    assert strategy.ledger_versions == {"site-0": 5, "site-1": 0, "site-2": 5}
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9


def test_an_excluded_clients_site_is_divided_out_of_the_posterior():
    # site-1 contributes in round 1, then sends NaN in rounds 2 and 3 and is excluded after the second
    cfg, strategy, _ = _run("nan@2,3", **{"num-server-rounds": 4, "max-bad-replies": 2, "exclusion-removes-site": True})
    assert [(r["round"], r["client-id"]) for r in strategy.rejections] == [(2, "site-1"), (3, "site-1")]
    assert strategy.ledger_versions == {"site-0": 4, "site-1": 0, "site-2": 4}
    assert max(abs(v).max() for v in strategy.state.sites["site-1"].to_numpy().values()) == 0.0
    assert strategy.state.check_invariant() < 1e-10
    # the posterior is exactly prior x the two honest clients' sites: site-1's round-1 update is gone
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9


def test_exclusion_keeps_the_site_by_default():
    cfg, strategy, _ = _run("nan@2,3", **{"num-server-rounds": 4, "max-bad-replies": 2})
    assert strategy.ledger_versions == {"site-0": 4, "site-1": 1, "site-2": 4}
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9
