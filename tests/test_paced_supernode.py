"""client/paced_supernode.py: Flower's SuperNode with a geometric back-off of its idle pulls.

(a) the settings and their validation (environment variables named in every error);
(b) the back-off sequence and the stand-in for ``time`` that Flower's loop sleeps through;
(c) install / refusal on the real Flower module;
(d) Flower's own ``start_client_internal`` loop, driven with a fake connection, sleeps the paced waits (and
    Flower's 3 s / 0.5 s without the install);
(e) a real loopback deployment (2 SuperNodes, TLS + auth) with paced SuperNodes: a conjugate run equals the
    in-process run's.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from client import paced_supernode as ps

MOD = importlib.import_module(ps.MODULE)


@pytest.fixture
def restore_flower():
    """Leave Flower's SuperNode module as it was, whatever a test installed."""
    saved = (MOD.time, MOD._pull_and_store_message)
    yield
    MOD.time, MOD._pull_and_store_message = saved


# --------------------------------------------------------------------------------------------- (a)


def test_default_pacing_keeps_flowers_longest_wait():
    p = ps.Pacing()
    assert (p.pull_min, p.pull_max, p.factor, p.reply_poll) == (0.1, 3.0, 1.5, 0.1)
    assert p.pull_max == ps.FLOWER_IDLE_WAIT  # a long-idle node pulls exactly as often as Flower's


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pull_min": 0.0}, "pull_min must be in"),
        ({"pull_min": 5.0}, "pull_min must be in"),  # above pull_max = 3
        ({"pull_max": 61.0, "pull_min": 1.0}, "pull_max must be at most 60"),
        ({"factor": 0.9}, "factor must be in"),
        ({"factor": 11.0}, "factor must be in"),
        ({"reply_poll": 0.6}, "reply_poll must be in"),
        ({"reply_poll": 0.0}, "reply_poll must be in"),
        ({"pull_min": float("nan")}, "pull_min must be a finite number"),
        ({"factor": float("inf")}, "factor must be a finite number"),
    ],
)
def test_pacing_rejects_degenerate_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ps.Pacing(**kwargs)


def test_pacing_from_env_reads_validates_and_names_the_variable():
    env = {ps.ENV_PULL_MIN: "0.2", ps.ENV_PULL_MAX: "2", ps.ENV_FACTOR: "2", ps.ENV_REPLY_POLL: " 0.05 "}
    assert ps.Pacing.from_env(env) == ps.Pacing(pull_min=0.2, pull_max=2.0, factor=2.0, reply_poll=0.05)
    assert ps.Pacing.from_env({ps.ENV_PULL_MIN: ""}) == ps.Pacing()  # empty = default
    with pytest.raises(ValueError, match=f"{ps.ENV_FACTOR}='fast' is not a number"):
        ps.Pacing.from_env({ps.ENV_FACTOR: "fast"})
    with pytest.raises(ValueError, match=rf"pull_min must be in .*{ps.ENV_PULL_MIN}='4'"):
        ps.Pacing.from_env({ps.ENV_PULL_MIN: "4"})


@pytest.mark.parametrize(
    "var, value, message",
    [
        (ps.ENV_REPLY_POLL, "2", f"reply_poll must be in [0.01, 0.5], got 2.0 (from {ps.ENV_REPLY_POLL}='2')"),
        ("PGVI_OBJECT_PULL_RETRY_S", "x", "PGVI_OBJECT_PULL_RETRY_S='x' is not a number"),
    ],
)
def test_main_exits_with_one_message_on_a_bad_variable(var, value, message):
    repo = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "client.paced_supernode", "--help"], cwd=repo, capture_output=True,
                         text=True, timeout=120, env={**_clean_env(), var: value})  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"pgvi-supernode: {message}"]


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items()
            if not k.startswith("PGVI_SUPERNODE_") and k != "PGVI_OBJECT_PULL_RETRY_S"}  # fmt: skip


# --------------------------------------------------------------------------------------------- (b)


def test_backoff_grows_geometrically_to_the_cap_and_restarts():
    b = ps.Backoff(ps.Pacing(pull_min=0.1, pull_max=1.0, factor=2.0))
    assert [b.next_wait() for _ in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    b.reset()
    assert b.next_wait() == 0.1
    flat = ps.Backoff(ps.Pacing(pull_min=0.5, pull_max=0.5, factor=1.0))
    assert [flat.next_wait() for _ in range(3)] == [0.5, 0.5, 0.5]


def test_paced_time_maps_flowers_two_waits_and_nothing_else():
    slept: list[float] = []
    t = ps.PacedTime(ps.Backoff(ps.Pacing(pull_min=0.1, factor=1.5, reply_poll=0.05)), sleep=slept.append)
    for s in (3, 3, 0.5, 0.25, 3.0, 7):
        t.sleep(s)
    assert slept == pytest.approx([0.1, 0.15, 0.05, 0.25, 0.225, 7])
    import time

    assert t.time is time.time and t.monotonic is time.monotonic  # the rest of `time` is time's


# --------------------------------------------------------------------------------------------- (c)


def test_install_paces_this_flower_and_uninstall_restores_it(restore_flower):
    import time

    assert ps.incompatibility() is None
    original_pull = MOD._pull_and_store_message
    assert ps.install(ps.Pacing(pull_min=0.2)) is True
    assert isinstance(MOD.time, ps.PacedTime) and MOD.time.backoff.pacing.pull_min == 0.2
    assert MOD._pull_and_store_message._pgvi_original is original_pull
    assert ps.install(ps.Pacing(pull_min=0.3)) is True  # again: new settings, not a second wrapper
    assert MOD._pull_and_store_message._pgvi_original is original_pull
    assert MOD.time.backoff.pacing.pull_min == 0.3
    ps.uninstall()
    assert MOD.time is time and MOD._pull_and_store_message is original_pull


def test_install_refuses_another_flower_version(monkeypatch, caplog, restore_flower):
    import time

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.40.0")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert ps.install(ps.Pacing()) is False
    assert MOD.time is time
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "1.40.0" in rec.getMessage() and "unchanged" in rec.getMessage()


def test_install_refuses_a_loop_without_flowers_waits(monkeypatch, restore_flower):
    """If Flower's loop changed (no ``time.sleep(3)`` after the pull), nothing is patched."""
    import time

    def start_client_internal():  # a loop that waits differently
        while _pull_and_store_message() is None:  # noqa: F821
            time.sleep(1)

    monkeypatch.setattr(MOD, "start_client_internal", start_client_internal)
    assert "time.sleep(3)" in ps.incompatibility()
    assert ps.install(ps.Pacing()) is False and MOD.time is time


# --------------------------------------------------------------------------------------------- (d)


class _StopLoop(Exception):
    pass


def _drive_flowers_loop(monkeypatch, paced: bool) -> list[float]:
    """Run Flower's real ``start_client_internal`` against a fake connection: pulls find nothing three times,
    then one message (whose reply Flower's ``_push_messages`` waits for once), then nothing twice; return
    every wait the loop slept."""
    script = iter([None, None, None, 7, None, None])
    slept: list[float] = []

    def fake_pull(**_kw):
        try:
            return next(script)
        except StopIteration:
            raise _StopLoop from None

    def fake_push(**_kw):
        MOD.time.sleep(0.5)  # Flower's wait for the ClientApp's reply, looked up like Flower's own

    @contextlib.contextmanager
    def fake_connection(**_kw):
        yield (lambda: None,) * 8

    class _State:
        def set_node_id(self, node_id):
            pass

    class _Factory:
        objectstore_factory = type("OSF", (), {"store": staticmethod(lambda: object())})()

        def state(self):
            return _State()

    monkeypatch.setattr(MOD, "_pull_and_store_message", fake_pull)  # before install: install wraps this one
    monkeypatch.setattr(MOD, "_push_messages", fake_push)
    monkeypatch.setattr(MOD, "_init_connection", fake_connection)
    monkeypatch.setattr(MOD, "register_signal_handlers", lambda **_kw: None)
    if paced:
        assert ps.install(ps.Pacing(pull_min=0.1, pull_max=3.0, factor=1.5, reply_poll=0.05))
        MOD.time._sleep = slept.append
    else:
        monkeypatch.setattr(MOD, "time", type("T", (), {"sleep": staticmethod(slept.append)})())
    with pytest.raises(_StopLoop):
        MOD.start_client_internal(state_factory=_Factory(), server_address="127.0.0.1:1", node_config={}, transport="grpc-rere",
                                  insecure=True, isolation="process")  # fmt: skip
    return slept


def test_flowers_loop_sleeps_the_paced_waits(monkeypatch, restore_flower):
    assert _drive_flowers_loop(monkeypatch, paced=True) == pytest.approx([0.1, 0.15, 0.225, 0.05, 0.1, 0.15])


def test_flowers_loop_unpaced_sleeps_flowers_waits(monkeypatch, restore_flower):
    assert _drive_flowers_loop(monkeypatch, paced=False) == [3, 3, 3, 0.5, 3, 3]


def test_module_runs_as_flower_supernode():
    """``python -m client.paced_supernode`` from the repo root is Flower's CLI (same arguments)."""
    repo = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "client.paced_supernode", "--help"], cwd=repo,
                         capture_output=True, text=True, timeout=120, env=_clean_env())  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "--superlink" in res.stdout and "--auth-supernode-private-key" in res.stdout


def test_deployment_supernode_option(tmp_path):
    from scripts.bench_network import _role
    from scripts.deploy import Deployment, _build_parser

    assert Deployment(1, run_dir=tmp_path).supernode == "flower"  # default unchanged
    dep = Deployment(1, run_dir=tmp_path, supernode="paced")
    assert dep._supernode_cmd()[1:] == ["-m", "client.paced_supernode"]
    with pytest.raises(ValueError, match="supernode must be one of"):
        Deployment(1, run_dir=tmp_path, supernode="fast")
    assert _build_parser().parse_args(["up", "--supernode", "paced"]).supernode == "paced"
    assert _role([sys.executable, "-m", "client.paced_supernode", "--superlink", "x:1"]) == "flower-supernode"


# --------------------------------------------------------------------------------------------- (e)


@pytest.mark.slow
def test_paced_supernode_deployment_matches_inprocess(tmp_path):
    """2 paced SuperNodes with TLS + SuperNode auth (defaults): a 3-round conjugate run completes, its
    posterior equals the in-process run's, and each node logged its pacing."""
    from scripts.deploy import Deployment, free_port_kwargs
    from tests.test_deployment import DEPLOY_RUN
    from tests.test_inprocess import run

    dep = Deployment(2, run_dir=tmp_path / "dep", supernode="paced", **free_port_kwargs(2))
    assert dep.auth and not dep.insecure
    overrides = {"num-clients": 2, "min-clients": 2}
    try:
        dep.start()
        dep.wait_online(timeout=180)
        nodes = [p for p in dep.procs if p.role == "supernode"]
        assert [p.cmd[1:3] for p in nodes] == [["-m", "client.paced_supernode"]] * 2
        out = tmp_path / "out"
        res = dep.run_app({**DEPLOY_RUN, **overrides, "output-dir": str(out)}, timeout=900)
        assert res.ok, (res, res.log_path.read_text()[-3000:] if res.log_path else "")
    finally:
        dep.stop()
    assert dep.leftover_processes() == []
    for p in nodes:
        text = Path(p.log_path).read_text()
        assert "pgvi-supernode: idle pulls after 0.1 s, x1.5, up to 3.0 s; reply checks every 0.1 s" in text
        assert "running Flower's SuperNode unchanged" not in text
        assert "pgvi-supernode: first retry of an object not yet at the SuperLink after 0.05 s" in text
        assert "pgvi-supernode: the Fleet channel's connectivity is not polled for DEBUG logs" in text
    (run_dir,) = [p for p in out.iterdir() if p.name == f"run-{res.run_id}"]
    post = dict(np.load(run_dir / "posterior.npz"))
    summary = json.loads((run_dir / "summary.json").read_text())
    _, strategy, _ = run({"dtype": "float64", "num-server-rounds": 3, **overrides})
    assert summary["ledger-versions"] == strategy.ledger_versions
    for k, v in strategy.state.posterior.to_numpy().items():
        np.testing.assert_allclose(post[k], v, rtol=0, atol=1e-6 * max(1.0, float(np.abs(v).max())))
