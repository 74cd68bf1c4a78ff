"""The real PGVI strategy against the real ClientApp through an in-process Grid.

Oracles: the closed-form posterior of the conjugate model after the updates each client made
(``strategies.reference``); the ledger identity q = pi * prod t_m; the exactly-once site versions.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message

from client.app import app as client_app
from common import protocol as P
from common.config import parse_run_config
from common.problem import build_problem
from strategies.inprocess import InProcessGrid
from strategies.pgvi import PGVIStrategy
from strategies.reference import exact_posterior, expected_posterior, max_natural_diff
from tests.wire import record_arrays, set_record_arrays

BASE = {
    "model": "gaussian_location",
    "dataset": "synthetic_gaussian_location",
    "family": "full_covariance",
    "loss": "nll",
    "divergence": "kl",
    "num-clients": 3,
    "min-clients": 3,
    "num-server-rounds": 4,
    "evaluate-clients": False,
    "wait-for-clients-s": 0,
    "round-timeout-s": 5,
}

# the conjugate parity cases with a textbook closed form (strategies/reference.py), run by the simulation and the
# real deployment (tests/test_simulation.py, tests/test_deployment.py): score matching with the constant weight
# (beta_w = sigma / sqrt(2)) and D = (1/w) KL beside NLL + KL, for both deterministic schedules
SM_CONST_WKL = {"loss": "score_matching", "sm-weight": "constant", "divergence": "weighted_kl", "divergence-w": 0.7}
TEXTBOOK_PARITY_CASES = {
    "sync-nll": {"schedule": "synchronous"},
    "seq-nll": {"schedule": "sequential"},
    "sync-sm-const-wkl": {"schedule": "synchronous", **SM_CONST_WKL},
    "seq-sm-const-wkl": {"schedule": "sequential", **SM_CONST_WKL, "loss-weight": 1.5},
}


def run(overrides: dict | None = None, reply_hook=None, between_rounds=None):
    raw = {**BASE, **(overrides or {})}
    cfg = parse_run_config(raw)
    nodes = [{"partition-id": m, "num-partitions": cfg.num_clients, "client-id": f"site-{m}"} for m in range(cfg.num_clients)]
    grid = InProcessGrid(client_app, nodes, raw, reply_hook=reply_hook)
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0,
                            on_round_end=(lambda r, row: between_rounds(r, grid)) if between_rounds else None)
    strategy.start(grid)
    return cfg, strategy, grid


def client_sites(grid: InProcessGrid, strategy: PGVIStrategy) -> dict[str, dict[str, np.ndarray]]:
    """Each client's committed site as stored in its Context, after resolving its pending update."""
    out = {}
    for node, ctx in grid.contexts.items():
        if node in grid.offline or "pgvi-meta" not in ctx.state:
            continue
        from common.client_state import ClientState

        arrays = {k: a.numpy() for k, a in ctx.state["pgvi-site"].items()}
        st = ClientState.from_arrays(arrays, dict(ctx.state["pgvi-meta"]))
        cid = strategy.node_client[node]
        # what the client's next message would carry: the ledger version, and the site itself on resync
        ledger_site = strategy.state.sites[cid].to_numpy() if cid in strategy.resync else None
        assert st.reconcile(strategy.ledger_versions[cid], ledger_site, strategy.ledger_tags.get(cid, ""))
        out[cid] = st.site
    return out


@pytest.mark.parametrize("schedule", ["synchronous", "sequential", "asynchronous"])
@pytest.mark.parametrize("loss", ["nll", "score_matching"])
def test_conjugate_posterior_matches_closed_form(schedule, loss):
    overrides = {"schedule": schedule, "loss": loss}
    if loss == "score_matching":
        overrides.update({"sm-weight": "constant", "divergence": "weighted_kl", "divergence-w": 0.7})
    cfg, strategy, grid = run(overrides)
    expected = expected_posterior(cfg, strategy.ledger_versions)
    assert max_natural_diff(strategy.state.posterior, expected) < 1e-9
    assert strategy.state.check_invariant() < 1e-10
    assert not strategy.rejections
    # every client applied one update per round (async: one per dispatch, so at least the rounds)
    for cid, k in strategy.ledger_versions.items():
        assert k >= cfg.num_server_rounds, (cid, k)
    # the clients' own sites agree with the server's ledger
    for cid, site in client_sites(grid, strategy).items():
        ledger = strategy.state.sites[cid].to_numpy()
        for k, v in ledger.items():
            np.testing.assert_allclose(site[k], v, rtol=0, atol=1e-12)


def test_sequential_rho_one_is_exact_after_one_pass():
    cfg, strategy, _ = run({"schedule": "sequential", "num-server-rounds": 1})
    assert cfg.rho() == 1.0
    assert max_natural_diff(strategy.state.posterior, exact_posterior(cfg)) < 1e-9


def test_asynchronous_converges_to_exact_posterior():
    cfg, strategy, _ = run({"schedule": "asynchronous", "num-server-rounds": 40, "damping": 0.5})
    assert max_natural_diff(strategy.state.posterior, exact_posterior(cfg)) < 1e-6


def _tamper(kind: str, victim: str = "site-1", once: bool = True):
    done = {"n": 0}

    def hook(request: Message, reply: Message) -> list[Message]:
        if request.metadata.message_type != "train" or reply.has_error():
            return [reply]
        if str(reply.content[P.CONFIG].get("client-id")) != victim or (once and done["n"]):
            return [reply]
        done["n"] += 1
        if kind == "lose":
            return []
        if kind == "duplicate":
            return [reply, reply]
        delta = record_arrays(reply, P.DELTA)
        key = next(k for k in delta if k.startswith("eta2"))
        arr = delta[key]
        if kind == "nan":
            arr[...] = np.nan
        elif kind == "improper":
            arr[...] = 1e6  # eta2 = -Lambda/2 hugely positive: negative precision
        elif kind == "shape":
            arr = np.zeros((arr.shape[0] + 1,) + arr.shape[1:], dtype=arr.dtype)
        delta[key] = arr
        set_record_arrays(reply.content, P.DELTA, delta)
        return [reply]

    return hook


@pytest.mark.parametrize("kind", ["nan", "improper", "shape", "lose", "duplicate"])
def test_faulty_reply_never_corrupts_the_posterior(kind):
    cfg, strategy, grid = run({"schedule": "synchronous", "num-server-rounds": 3}, reply_hook=_tamper(kind))
    if kind in ("nan", "improper", "shape"):
        assert len(strategy.rejections) == 1
        assert strategy.rejections[0]["client-id"] == "site-1"
    if kind == "duplicate":
        assert any("second reply" in str(r["reason"]) for r in strategy.rejections)
    # site-1 lost exactly one update; everything else applied exactly once
    assert strategy.ledger_versions["site-1"] == cfg.num_server_rounds - (0 if kind == "duplicate" else 1)
    assert strategy.ledger_versions["site-0"] == cfg.num_server_rounds
    expected = expected_posterior(cfg, strategy.ledger_versions)
    assert max_natural_diff(strategy.state.posterior, expected) < 1e-9
    assert strategy.state.check_invariant() < 1e-10
    for cid, site in client_sites(grid, strategy).items():
        for k, v in strategy.state.sites[cid].to_numpy().items():
            np.testing.assert_allclose(site[k], v, rtol=0, atol=1e-12)


def test_rejected_delta_leaves_the_posterior_unchanged():
    raw = {**BASE, "num-server-rounds": 1, "num-clients": 1, "min-clients": 1}
    cfg = parse_run_config(raw)
    grid = InProcessGrid(client_app, [{"partition-id": 0, "client-id": "site-0"}], raw, reply_hook=_tamper("nan", "site-0"))
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    strategy.start(grid)
    assert len(strategy.rejections) == 1 and "non-finite" in str(strategy.rejections[0]["reason"])
    assert max_natural_diff(strategy.state.posterior, build_problem(cfg).prior) == 0.0
    assert strategy.ledger_versions["site-0"] == 0


def test_client_that_goes_offline_does_not_stop_the_run():
    def kill_after_round_1(rnd, grid):
        if rnd == 1:
            victim = next(n for n, c in strategy_nodes(grid).items() if c == "site-2")
            grid.remove_node(victim)

    def strategy_nodes(grid):
        return {n: ctx.node_config["client-id"] for n, ctx in grid.contexts.items()}

    cfg, strategy, _ = run({"num-server-rounds": 3, "min-clients": 2, "round-timeout-s": 0.5}, between_rounds=kill_after_round_1)
    assert strategy.ledger_versions["site-2"] == 1
    assert strategy.ledger_versions["site-0"] == 3 and strategy.ledger_versions["site-1"] == 3
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9


def test_restarted_client_without_state_resyncs_from_the_ledger():
    """A node restarts with an empty state (new node id): the server resends its site and it continues."""

    def restart_site0(rnd, grid):
        if rnd == 2:
            old = next(n for n, ctx in grid.contexts.items() if ctx.node_config["client-id"] == "site-0" and n not in grid.offline)
            grid.remove_node(old)
            grid.add_node(dict(grid.contexts[old].node_config))  # fresh Context: lost state

    cfg, strategy, grid = run({"num-server-rounds": 4}, between_rounds=restart_site0)
    assert strategy.ledger_versions["site-0"] == 4
    assert max_natural_diff(strategy.state.posterior, expected_posterior(cfg, strategy.ledger_versions)) < 1e-9
    for cid, site in client_sites(grid, strategy).items():
        for k, v in strategy.state.sites[cid].to_numpy().items():
            np.testing.assert_allclose(site[k], v, rtol=0, atol=1e-12)


def test_run_stops_with_the_clients_reason_when_every_client_fails():
    from client.app import app as capp
    from strategies.pgvi import AllClientsFailed

    raw = {**BASE, "num-server-rounds": 2}
    cfg = parse_run_config(raw)
    # every node claims a federation of 5 partitions while the run config says 3: each ClientApp raises
    nodes = [{"partition-id": m, "num-partitions": 5, "client-id": f"site-{m}"} for m in range(3)]
    grid = InProcessGrid(capp, nodes, raw)
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    with pytest.raises((AllClientsFailed, RuntimeError)) as ei:
        strategy.start(grid)
    assert "num-partitions=5" in str(ei.value)


def test_round_rows_report_the_local_epochs_run():
    conj = run()[1]  # conjugate closed form: no optimiser epochs
    assert all(r["client-epochs-max"] == 0.0 for r in conj.history if r["round"] >= 1)
    raw = {"model": "logistic_regression", "dataset": "breast_cancer", "num-clients": 2, "min-clients": 2,
           "num-server-rounds": 2, "local-epochs": 40, "patience": 2, "batch-size": 64, "lr": 0.05,
           "evaluate-clients": False, "wait-for-clients-s": 0, "round-timeout-s": 60}
    cfg = parse_run_config(raw)
    grid = InProcessGrid(client_app, [{"partition-id": m, "client-id": f"site-{m}"} for m in range(2)], raw)
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    strategy.start(grid)
    rows = [r for r in strategy.history if r["round"] >= 1]
    assert len(rows) == 2
    for r in rows:
        assert 1.0 <= r["client-epochs-mean"] <= r["client-epochs-max"] <= 40.0


def test_synthetic_logistic_2d_dataset_runs_end_to_end():
    """The 2-D logistic data with outliers (FedGVI S5.3) through the real strategy and ClientApp."""
    raw = {"model": "logistic_regression", "dataset": "synthetic_logistic_2d", "num-clients": 2, "min-clients": 2,
           "num-server-rounds": 1, "local-epochs": 20, "lr": 0.05, "evaluate-clients": False,
           "wait-for-clients-s": 0, "round-timeout-s": 60}
    cfg = parse_run_config(raw)
    grid = InProcessGrid(client_app, [{"partition-id": m, "client-id": f"site-{m}"} for m in range(2)], raw)
    problem = build_problem(cfg)
    strategy = PGVIStrategy(problem, poll_interval=0.0)
    strategy.start(grid)
    assert strategy.ledger_versions == {"site-0": 1, "site-1": 1}
    from common.evaluation import evaluate_posterior
    from common.problem import load_full_data

    data = load_full_data(cfg)
    assert data.x_train.shape == (106, 2) and data.x_test.shape == (100, 2)  # 100 clean points + 6 outliers
    assert evaluate_posterior(problem, strategy.state.posterior, data.x_test, data.y_test, 100)["accuracy"] > 0.8


def test_asynchronous_default_staleness_scales_with_the_federation():
    """All M replies of a burst are computed against one posterior and applied one by one, so the last has
    staleness M - 1.  The default bound ('auto' = M) accepts them all, which makes the burst equal the
    synchronous round; a fixed bound of 2 rejects every reply after the third (the defect this replaced)."""
    common = {"num-clients": 8, "min-clients": 8, "num-server-rounds": 3}
    cfg, strategy, _ = run({**common, "schedule": "asynchronous"})
    assert cfg.max_staleness == "auto" and cfg.staleness_bound() == 8
    assert strategy.rejections == []
    _, sync, _ = run({**common, "schedule": "synchronous"})
    assert max_natural_diff(strategy.state.posterior, sync.state.posterior) < 1e-12
    _, starved, _ = run({**common, "schedule": "asynchronous", "max-staleness": 2})
    stale = [r for r in starved.rejections if "stale update" in r["reason"]]
    assert len(stale) == 3 * (8 - 3)


# ==================================================================================================
# scripts/run_inprocess.py's command line: a bad override or run-config value is one line, not a traceback


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model=bnn", "model=bnn is not a TOML value (strings need quotes"),
        ('loss="foo"', "invalid run config: loss: unknown loss 'foo'"),
        ("no-such-key=1", "no-such-key: unknown run-config key"),
        ("damping=2", "damping: damping rho must be in (0, 1]"),
    ],
)
def test_run_inprocess_reports_a_bad_override_without_a_traceback(override: str, message: str) -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "scripts" / "run_inprocess.py"), "-c", override],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_run_inprocess_overrides_take_flwr_run_syntax() -> None:
    from scripts.run_inprocess import load_run_config

    raw = load_run_config(['num-server-rounds=2 loss="gce"', "loss-delta=0.5"])
    assert (raw["num-server-rounds"], raw["loss"], raw["loss-delta"]) == (2, "gce", 0.5)
    assert raw["model"] == load_run_config([])["model"]  # the rest from pyproject.toml


def test_the_scripts_read_one_run_config_and_later_overrides_win() -> None:
    from scripts.bench_network import pyproject_config
    from scripts.run_inprocess import load_run_config
    from scripts.simulate import pyproject_run_config

    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    assert pyproject_config() == load_run_config([]) == pyproject_run_config() == declared
    raw = pyproject_run_config(["num-server-rounds=2", "num-server-rounds=5 seed=7"])
    assert (raw["num-server-rounds"], raw["seed"]) == (5, 7)
    with pytest.raises(ValueError, match="not a TOML value"):
        pyproject_run_config(["loss=gce"])
