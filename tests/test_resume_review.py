"""Resume findings of a review of checkpoint/resume across the schedules (each test failed on the code before its fix).

(1) synchronous: dividing an excluded client's site out mid-round wrote a checkpoint holding half the round's replies
    (their rejections and bad-reply counts) with the round unapplied; the resumed run sent the round again and
    counted those replies twice (an honest-but-once-bad client was excluded, its site divided out);
(4) a checkpoint whose history rows are not round rows is a ``CheckpointMismatch`` when it is loaded, not a crash
    of the resumed run's start;
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
