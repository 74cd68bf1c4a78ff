"""Resume findings of a review of checkpoint/resume across the schedules (each test failed on the code before its fix).

(1) synchronous: dividing an excluded client's site out mid-round wrote a checkpoint holding half the round's replies
    (their rejections and bad-reply counts) with the round unapplied; the resumed run sent the round again and
    counted those replies twice (an honest-but-once-bad client was excluded, its site divided out);
(4) a checkpoint whose history rows are not round rows is a ``CheckpointMismatch`` when it is loaded, not a crash
    of the resumed run's start;
(2) asynchronous: the open round's progress (outcomes so far, each client's messages) is checkpointed; a resumed
    run ran the round again from zero outcomes (one update per client too many) and repeated local seeds;
(3) the FedAvg baseline, which writes no checkpoint, refuses a ``resume`` directory before round 1 (it ran a fresh
    run and exited 0).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from client.app import app as client_app
from common import protocol as P
from common.atomic_io import atomic_save_npz, load_npz
from common.config import ConfigError, parse_run_config
from common.problem import build_problem
from server.app import prepare
from server.fedavg_app import prepare_fedavg
from strategies.checkpoint import CHECKPOINT_FILE, CheckpointMismatch, load_checkpoint
from strategies.inprocess import InProcessGrid
from strategies.pgvi import PGVIStrategy
from tests.test_inprocess import BASE, client_sites
from tests.wire import record_arrays, set_record_arrays

REPO = Path(__file__).resolve().parents[1]


class _Crash(Exception):
    """The server 'killed' at a chosen point: what a SIGKILL would leave on disk is the frozen checkpoint."""


def _setup(overrides: dict):
    raw = {**BASE, **overrides}
    cfg = parse_run_config(raw)
    nodes = [{"partition-id": m, "num-partitions": cfg.num_clients, "client-id": f"site-{m}"}
             for m in range(cfg.num_clients)]
    return raw, cfg, nodes


def _nan_in_rounds(bad: dict[str, tuple[str, ...]]):
    """A reply hook: the train replies of ``bad[client-id]``'s rounds carry a NaN Delta."""

    def hook(request, reply):
        if request.metadata.message_type == "train" and not reply.has_error() and P.DELTA in reply.content:
            if request.metadata.group_id in bad.get(request.content[P.CONFIG]["client-id"], ()):
                arrays = record_arrays(reply, P.DELTA)
                set_record_arrays(reply.content, P.DELTA, {k: np.full_like(v, np.nan) for k, v in arrays.items()})
        return [reply]

    return hook


def _same_run(a: PGVIStrategy, b: PGVIStrategy, grid_b: InProcessGrid) -> None:
    assert a.ledger_versions == b.ledger_versions
    assert a.bad_replies == b.bad_replies
    assert [(r["round"], r["client-id"]) for r in a.rejections] == [(r["round"], r["client-id"]) for r in b.rejections]
    pa, pb = a.state.posterior.to_numpy(), b.state.posterior.to_numpy()
    for k in pa:
        np.testing.assert_allclose(pb[k], pa[k], rtol=0, atol=1e-12)
    for cid, site in client_sites(grid_b, b).items():  # the clients hold the ledger's sites
        for k, v in b.state.sites[cid].to_numpy().items():
            np.testing.assert_allclose(site[k], v, rtol=0, atol=1e-12)


def test_synchronous_site_removal_mid_round_resumes_to_the_uninterrupted_run(tmp_path: Path) -> None:
    # site-0 sends one bad reply (round 3), site-1 two (rounds 2 and 3): site-1 is excluded in round 3, after
    # site-0's bad reply of that round was decoded
    raw, cfg, nodes = _setup({"schedule": "synchronous", "num-server-rounds": 4, "max-bad-replies": 2,
                              "exclusion-removes-site": True})
    hook = _nan_in_rounds({"site-0": ("3",), "site-1": ("2", "3")})
    ref = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    ref.start(InProcessGrid(client_app, nodes, raw, reply_hook=hook))
    assert ref.bad_replies == {"site-1": 2, "site-0": 1} and ref.ledger_versions["site-1"] == 0

    live, frozen = tmp_path / "live", tmp_path / "frozen"
    frozen.mkdir()
    grid = InProcessGrid(client_app, nodes, raw, reply_hook=hook)
    first = PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=live)
    remove = first._remove_site

    def remove_then_die(cid: str) -> None:
        remove(cid)
        shutil.copy(live / CHECKPOINT_FILE, frozen / CHECKPOINT_FILE)
        raise _Crash(cid)

    first._remove_site = remove_then_die  # type: ignore[method-assign]
    try:
        first.start(grid)
    except _Crash:
        pass
    else:
        raise AssertionError("the run never removed a site")
    resumed = PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=live, resume_from=frozen)
    resumed.start(grid)
    _same_run(ref, resumed, grid)


@pytest.mark.parametrize("history", [[[0], [1]], [{"version": 0.0}], [{"round": "one"}], [{"round": 0}, {"round": 0}],
                                     [{"round": 0}, {"round": 5}], [{"round": True}], [{"round": 0.5}]],
                         ids=["rows-are-lists", "row-without-round", "round-not-number", "round-repeated",
                              "round-after-round-completed", "round-bool", "round-fractional"])
def test_damaged_history_rows_are_a_checkpoint_mismatch(tmp_path: Path, history: list) -> None:
    # the rows passed the header check and crashed start() (TypeError / KeyError / ValueError) when it replayed them,
    # after the records of the output directory had been cleared
    raw, cfg, nodes = _setup({"num-server-rounds": 1})
    PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=tmp_path).start(
        InProcessGrid(client_app, nodes, raw))
    arrays, meta = load_npz(tmp_path / CHECKPOINT_FILE)
    assert [row["round"] for row in meta["history"]] == [0, 1]
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    atomic_save_npz(damaged / CHECKPOINT_FILE, arrays, {**meta, "history": history})
    with pytest.raises(CheckpointMismatch, match="damaged header: .*'history' has a row"):
        load_checkpoint(PGVIStrategy(build_problem(cfg)), damaged)
    with pytest.raises(ConfigError, match="invalid run config: resume: .*'history' has a row"):
        prepare({**raw, "resume": str(damaged), "num-server-rounds": 2})  # before any record is written


def test_the_fedavg_baseline_refuses_resume_before_round_1(tmp_path: Path) -> None:
    # run_inprocess.py --method fedavg with -c resume=<a PGVI run> exited 0 after a fresh run from round 1 (the
    # baseline never reads or writes a checkpoint) and recorded the resume key in its run_config.json
    raw, cfg, nodes = _setup({"num-server-rounds": 1})
    PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=tmp_path / "pgvi").start(
        InProcessGrid(client_app, nodes, raw))
    fedavg = {"model": "logistic_regression", "dataset": "digits", "num-clients": 2, "min-clients": 2,
              "num-server-rounds": 1, "fedavg-local-epochs": 1, "label-noise": 0.0, "torch-threads": 1}
    with pytest.raises(ConfigError, match="invalid run config: resume: the FedAvg baseline writes no checkpoint"):
        prepare_fedavg({**fedavg, "resume": str(tmp_path / "pgvi")})
    assert prepare_fedavg(fedavg).resume == ""  # without it the same config passes
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "OMP_NUM_THREADS": "1"}
    overrides = [arg for key, value in {**fedavg, "resume": str(tmp_path / "pgvi")}.items()
                 for arg in ("-c", f"{key}={json.dumps(value)}")]
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "run_inprocess.py"), "--method", "fedavg",
                           *overrides, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode in (1, 2), proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("run_inprocess.py: invalid run config: resume:"), proc.stderr
    assert not (tmp_path / "out" / "run_config.json").exists()


def test_asynchronous_resume_records_a_full_round_once_and_keeps_its_message_counts(tmp_path: Path) -> None:
    # killed while round 1 (full: one update of each client applied and checkpointed) was being closed: the resumed
    # run ran round 1 again from zero outcomes (every client one update more than the uninterrupted run: 15 for
    # 12), and each client's second round-1 message reused its first's round-message 0, so its local seed
    raw, cfg, nodes = _setup({"schedule": "asynchronous", "num-server-rounds": 4, "damping": 0.5})
    ref = PGVIStrategy(build_problem(cfg), poll_interval=0.0)
    ref.start(InProcessGrid(client_app, nodes, raw))
    sent: list[tuple[str, int, int]] = []  # (client, round, round-message) of every train message of both runs

    def hook(request, reply):
        if request.metadata.message_type == "train":
            c = request.content[P.CONFIG]
            sent.append((str(c["client-id"]), int(c["server-round"]), int(c.get(P.ROUND_MESSAGE, 0))))
        return [reply]

    live, frozen = tmp_path / "live", tmp_path / "frozen"
    frozen.mkdir()
    calls = {"n": 0}

    def evaluate_then_die(q):  # noqa: ANN001
        calls["n"] += 1
        if calls["n"] == 2:  # round 0's row, then round 1's
            shutil.copy(live / CHECKPOINT_FILE, frozen / CHECKPOINT_FILE)
            raise _Crash("killed during round 1's evaluation")
        return {}

    grid = InProcessGrid(client_app, nodes, raw, reply_hook=hook)
    first = PGVIStrategy(build_problem(cfg), poll_interval=0.0, server_evaluate=evaluate_then_die, checkpoint_dir=live)
    with pytest.raises(_Crash):
        first.start(grid)
    resumed = PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=live, resume_from=frozen)
    resumed.start(grid)
    assert ref.ledger_versions == {"site-0": 4, "site-1": 4, "site-2": 4}
    assert resumed.ledger_versions == ref.ledger_versions
    assert [int(r["round"]) for r in resumed.history] == [0, 1, 2, 3, 4]
    assert len(sent) == len(set(sent)), sorted(s for s in sent if sent.count(s) > 1)
    pa, pb = ref.state.posterior.to_numpy(), resumed.state.posterior.to_numpy()
    for k in pa:  # every update was computed against the same posteriors as in the uninterrupted run
        np.testing.assert_allclose(pb[k], pa[k], rtol=0, atol=1e-12)


def test_asynchronous_progress_is_checkpointed_and_refused_when_damaged(tmp_path: Path) -> None:
    raw, cfg, nodes = _setup({"schedule": "asynchronous", "num-server-rounds": 2})
    s = PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=tmp_path)
    s.start(InProcessGrid(client_app, nodes, raw))
    arrays, meta = load_npz(tmp_path / CHECKPOINT_FILE)
    assert meta["async-resolved"] == 0 and meta["async-messages"] == {}  # the last round was closed
    for key, value in (("async-resolved", -1), ("async-resolved", True), ("async-messages", {"site-0": 1.5}),
                       ("async-messages", [1])):
        damaged = tmp_path / f"{key}-{value!r}"
        damaged.mkdir()
        atomic_save_npz(damaged / CHECKPOINT_FILE, arrays, {**meta, key: value})
        with pytest.raises(CheckpointMismatch, match=f"damaged header: .*'{key}'"):
            load_checkpoint(PGVIStrategy(build_problem(cfg)), damaged)
    older = tmp_path / "older"  # a checkpoint written before the keys existed
    older.mkdir()
    atomic_save_npz(older / CHECKPOINT_FILE, arrays,
                    {k: v for k, v in meta.items() if k not in ("async-resolved", "async-messages")})
    load_checkpoint(PGVIStrategy(build_problem(cfg)), older)


def test_asynchronous_failures_are_checkpointed_with_the_rounds_progress(tmp_path: Path) -> None:
    # a review: an asynchronous failure or rejection resolved a message of the round, but only the next applied
    # update wrote a checkpoint; a server killed in between resumed with one outcome fewer in the round
    raw, cfg, nodes = _setup({"schedule": "asynchronous", "num-server-rounds": 3, "max-bad-replies": 0})
    hook = _nan_in_rounds({"site-1": ("2",)})  # site-1's round-2 Delta is rejected (NaN)
    live, frozen = tmp_path / "live", tmp_path / "frozen"
    frozen.mkdir()
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0, checkpoint_dir=live)
    real_checkpoint = strategy._checkpoint

    def die_at_the_third_outcomes_checkpoint() -> None:  # what is on disk then is what a SIGKILL leaves
        if strategy.round_completed == 1 and strategy.async_resolved == 3:
            shutil.copy(live / CHECKPOINT_FILE, frozen / CHECKPOINT_FILE)
            raise _Crash("killed before round 2's third outcome was checkpointed")
        real_checkpoint()

    strategy._checkpoint = die_at_the_third_outcomes_checkpoint  # type: ignore[method-assign]
    with pytest.raises(_Crash):
        strategy.start(InProcessGrid(client_app, nodes, raw, reply_hook=hook))
    assert any(r["client-id"] == "site-1" and r["round"] == 2 for r in strategy.rejections)
    restored = PGVIStrategy(build_problem(cfg))
    load_checkpoint(restored, frozen)
    assert restored.round_completed == 1
    # round 2's first two outcomes (site-0 applied, site-1 rejected) are in the checkpoint
    assert restored.async_resolved == 2
    assert any(r["client-id"] == "site-1" and r["round"] == 2 for r in restored.rejections)
