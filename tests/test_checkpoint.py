"""Server checkpoint and resume: a ServerApp that dies anywhere resumes to the uninterrupted run's posterior."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from client.app import app as client_app
from common.config import parse_run_config
from common.problem import build_problem
from server.app import run_strategy
from strategies.checkpoint import CheckpointMismatch, load_checkpoint
from strategies.inprocess import InProcessGrid
from strategies.pgvi import PGVIStrategy
from strategies.reference import expected_posterior, max_natural_diff
from tests.test_inprocess import BASE, client_sites


class ServerCrash(Exception):
    pass


def _setup(overrides: dict):
    raw = {**BASE, **overrides}
    cfg = parse_run_config(raw)
    nodes = [{"partition-id": m, "num-partitions": cfg.num_clients, "client-id": f"site-{m}"} for m in range(cfg.num_clients)]
    return raw, cfg, nodes


def _crash_after(n_train_replies: int):
    """A reply hook that lets ``n`` train replies through, then 'kills the server' on the next one."""
    seen = {"n": 0}

    def hook(request, reply):
        if request.metadata.message_type == "train":
            seen["n"] += 1
            if seen["n"] > n_train_replies:
                raise ServerCrash(f"server died while receiving train reply #{seen['n']}")
        return [reply]

    return hook


@pytest.mark.parametrize("schedule,crash_after", [("synchronous", 4), ("sequential", 4), ("sequential", 7), ("asynchronous", 5)])
def test_resume_after_a_crash_ends_in_the_uninterrupted_posterior(tmp_path, schedule, crash_after):
    overrides = {"schedule": schedule, "num-server-rounds": 4, "loss": "score_matching", "sm-weight": "imq",
                 "divergence": "weighted_kl", "divergence-w": 0.8}
    if schedule == "asynchronous":
        overrides.update({"loss": "nll", "divergence": "kl", "damping": 0.5})
    raw, cfg, nodes = _setup(overrides)
    # the uninterrupted run
    ref_grid = InProcessGrid(client_app, nodes, raw)
    ref = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    ref.start(ref_grid)
    # the same run, with a server crash, then a new ServerApp that resumes from the checkpoint
    grid = InProcessGrid(client_app, nodes, raw, reply_hook=_crash_after(crash_after))
    first = PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=tmp_path)
    with pytest.raises(ServerCrash):
        first.start(grid)
    grid.reply_hook = None  # the clients (and their states) survive; only the server restarts
    second = PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=tmp_path, resume_from=tmp_path)
    second.start(grid)
    if schedule != "asynchronous":  # deterministic schedules: the very same posterior and ledger
        assert second.ledger_versions == ref.ledger_versions
        assert max_natural_diff(second.state.posterior, ref.state.posterior) < 1e-9
    else:  # asynchronous: the interleaving may differ, so check the closed form of the ledger it reached
        assert max_natural_diff(second.state.posterior, expected_posterior(cfg, second.ledger_versions)) < 1e-9
    assert second.state.check_invariant() < 1e-10
    for cid, site in client_sites(grid, second).items():  # no update lost or applied twice
        for k, v in second.state.sites[cid].to_numpy().items():
            np.testing.assert_allclose(site[k], v, rtol=0, atol=1e-12)
    assert [int(r["round"]) for r in second.history] == list(range(cfg.num_server_rounds + 1))


def test_checkpoint_after_a_round_holds_that_rounds_history_row(tmp_path):
    raw, cfg, nodes = _setup({"num-server-rounds": 2})
    s = PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=tmp_path)
    s.start(InProcessGrid(client_app, nodes, raw))
    loaded = PGVIStrategy(build_problem(cfg))
    load_checkpoint(loaded, tmp_path)
    assert loaded.round_completed == 2
    assert [int(r["round"]) for r in loaded.history] == [0, 1, 2]
    assert loaded.history == s.history


def _rows(out_dir):
    jsonl = [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    with (out_dir / "metrics.csv").open() as f:
        table = list(csv.DictReader(f))
    return jsonl, table, json.loads((out_dir / "summary.json").read_text())


@pytest.mark.parametrize("schedule,crash_after", [("synchronous", 3), ("synchronous", 4), ("sequential", 4),
                                                  ("sequential", 7), ("asynchronous", 5), ("synchronous", 12)])
def test_resumed_run_records_every_round_exactly_once(tmp_path, schedule, crash_after):
    """Through the ServerApp's ``run_strategy``: the resumed run's history, ``metrics.jsonl``, ``metrics.csv`` and
    ``summary.json`` hold rounds 0..N once each, and the rounds taken from the checkpoint are the first run's rows."""
    overrides = {"schedule": schedule, "num-server-rounds": 4}
    if schedule == "asynchronous":
        overrides["damping"] = 0.5
    raw, cfg, nodes = _setup(overrides)
    first_out, second_out = tmp_path / "first", tmp_path / "second"
    grid = InProcessGrid(client_app, nodes, raw, reply_hook=_crash_after(crash_after))
    if crash_after < 12:
        with pytest.raises(ServerCrash):
            run_strategy(grid, cfg, build_problem(cfg), first_out)
    else:  # 12 = every train reply: the first run completes; resuming from its last checkpoint runs no round
        run_strategy(grid, cfg, build_problem(cfg), first_out)
    done = PGVIStrategy(build_problem(cfg))
    load_checkpoint(done, first_out)
    first_rows = [json.loads(ln) for ln in (first_out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    grid.reply_hook = None
    cfg2 = parse_run_config({**raw, "resume": str(first_out)})
    second = run_strategy(grid, cfg2, build_problem(cfg2), second_out)
    rounds = list(range(cfg.num_server_rounds + 1))
    jsonl, table, summary = _rows(second_out)
    assert [int(r["round"]) for r in second.history] == rounds
    assert [int(r["round"]) for r in jsonl] == rounds
    assert [int(float(r["round"])) for r in table] == rounds
    assert summary["final"] == second.history[-1] and int(summary["final"]["round"]) == cfg.num_server_rounds
    assert jsonl[: done.round_completed + 1] == first_rows[: done.round_completed + 1]
    # updates applied in an interrupted round before the crash are in the ledger, but their round's counters
    # died with the server (the round's row is the resumed run's, which counts only what it applied)
    unrecorded = sum(done.ledger_versions.values()) - sum(int(r["applied"]) for r in done.history)
    assert sum(int(r["applied"]) for r in jsonl) == sum(second.ledger_versions.values()) - unrecorded


def test_resume_refuses_a_different_run_config(tmp_path):
    raw, cfg, nodes = _setup({"num-server-rounds": 1})
    s = PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=tmp_path)
    s.start(InProcessGrid(client_app, nodes, raw))
    other = parse_run_config({**raw, "prior-variance": 2.0})
    with pytest.raises(CheckpointMismatch, match="prior-variance"):
        load_checkpoint(PGVIStrategy(build_problem(other)), tmp_path)
    # keys that may change on resume do not matter
    more = parse_run_config({**raw, "num-server-rounds": 5, "round-timeout-s": 9, "object-pull-retry-s": 1.0})
    load_checkpoint(PGVIStrategy(build_problem(more)), tmp_path)
