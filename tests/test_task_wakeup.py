"""client/task_wakeup.py: a node's SuperNode wakes its SuperExec when a message arrives.

(a) the socket path (absolute, short enough; from the environment with the variable named in errors);
(b) the listener: one datagram ends one wait, no datagram lets the wait time out, stale sockets are replaced,
    other files are not touched; ``notify`` without a listener fails silently;
(c) Flower's own ``run_superexec`` loop, driven with a fake Runtime API client: installed, each datagram makes
    it ask for a task at once (its poll wait is 60 s); install refuses another loop; uninstall restores Flower;
(d) the paced SuperNode sends one datagram per stored message, none for empty pulls;
(e) a real loopback deployment (paced SuperNodes, preforked SuperExecs, TLS + auth, 60-s task polls): the
    conjugate run equals the in-process one and every message's ClientApp was started by a wake-up.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from client import paced_supernode as ps
from client import task_wakeup as tw

RS = importlib.import_module(tw.MODULE)


@pytest.fixture
def sock_path(tmp_path):
    d = Path(f"/tmp/pgvi-wake-{os.getpid()}-{threading.get_ident()}")  # short: tmp_path may exceed 107 bytes
    d.mkdir(mode=0o700, exist_ok=True)
    yield d / "w.sock"
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


@pytest.fixture
def restore_flower():
    saved = RS.time
    yield
    if isinstance(RS.time, tw.WakeableTime):
        RS.time.listener.close()
    RS.time = saved


# --------------------------------------------------------------------------------------------- (a)


def test_socket_path_checks(tmp_path):
    assert tw.check_socket_path("/tmp/x.sock") == Path("/tmp/x.sock")
    with pytest.raises(ValueError, match="absolute"):
        tw.check_socket_path("rel/x.sock")
    with pytest.raises(ValueError, match="at most 107"):
        tw.check_socket_path("/" + "d" * 120 + "/x.sock")
    assert tw.socket_path_from_env({}) is None and tw.socket_path_from_env({tw.ENV_SOCKET: " "}) is None
    assert tw.socket_path_from_env({tw.ENV_SOCKET: "/tmp/a.sock"}) == Path("/tmp/a.sock")
    with pytest.raises(ValueError, match=tw.ENV_SOCKET):
        tw.socket_path_from_env({tw.ENV_SOCKET: "a.sock"})


# --------------------------------------------------------------------------------------------- (b)


def test_one_datagram_ends_one_wait(sock_path):
    listener = tw.WakeupListener(sock_path)
    try:
        assert listener.wait(0.05) is False  # nothing sent: the wait runs out
        assert tw.notify(sock_path) and tw.notify(sock_path)
        assert listener.wait(30) is True and listener.wait(30) is True  # two datagrams, two early returns
        assert listener.wait(0.05) is False and listener.woken == 2
    finally:
        listener.close()
    assert not sock_path.exists()
    assert tw.notify(sock_path) is False  # nobody listens: no error


def test_listener_replaces_a_stale_socket_but_no_other_file(sock_path):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(sock_path))
    stale.close()  # the file stays, as after a killed SuperExec
    listener = tw.WakeupListener(sock_path)
    assert tw.notify(sock_path) and listener.wait(30)
    listener.close()
    sock_path.write_text("not a socket")
    with pytest.raises(FileExistsError, match="not a socket"):
        tw.WakeupListener(sock_path)
    assert sock_path.read_text() == "not a socket"
    assert tw.notify(sock_path) is False


# --------------------------------------------------------------------------------------------- (c)


class _Stop(Exception):
    pass


def _drive_superexec_loop(monkeypatch, calls: int, on_acquire) -> list[float]:
    """Run Flower's real ``run_superexec`` with a fake Runtime API client whose ``AcquireTask`` calls
    ``on_acquire(n)`` and, at call ``calls + 1``, stops the loop; return the times of the calls."""
    import time

    times: list[float] = []

    class _Res:
        token = ""

        def HasField(self, _name):
            return False

    class _Client:
        def AcquireTask(self, _req):
            times.append(time.monotonic())
            if len(times) > calls:
                raise _Stop
            on_acquire(len(times))
            return _Res()

        def close(self):
            pass

    class _Executor:
        def reconcile(self):
            pass

        def get_eligible_capacity(self, types, **_kw):
            return list(types), []

        def close(self):
            pass

    class _Plugin:
        supported_task_types = ["client-app"]

        def __init__(self, **_kw):
            pass

    monkeypatch.setenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "60")
    monkeypatch.setattr(RS, "get_executor", lambda *a, **k: _Executor())
    monkeypatch.setattr(RS.RuntimeHttpClient, "from_server_address", staticmethod(lambda **_kw: _Client()))
    monkeypatch.setattr(RS, "register_signal_handlers", lambda **_kw: None)
    monkeypatch.setattr(RS, "AutoExecPlugin", _Plugin)
    with pytest.raises(_Stop):
        RS.run_superexec("127.0.0.1:1", insecure=True)
    return times


def test_flowers_superexec_loop_polls_at_once_when_woken(monkeypatch, sock_path, restore_flower):
    listener = tw.install(sock_path)
    assert listener is not None and isinstance(RS.time, tw.WakeableTime)
    waits: list[float] = []
    wait = listener.wait
    listener.wait = lambda timeout: (waits.append(timeout), wait(timeout))[1]  # type: ignore[method-assign]
    # each AcquireTask is followed by a message's datagram (sent before the loop sleeps, as when the SuperNode
    # stores a message while the SuperExec is busy): three polls without a single 60-s wait running out
    times = _drive_superexec_loop(monkeypatch, 3, lambda n: tw.notify(sock_path))
    assert len(times) == 4 and listener.woken == 3
    assert waits == [60.0, 60.0, 60.0]  # Flower's configured interval is the timeout of every wait
    assert times[-1] - times[0] < 30.0  # (generous: one unwoken wait alone would be 60 s)


def test_install_refuses_another_loop(monkeypatch, sock_path, restore_flower, caplog):
    import time

    monkeypatch.setattr(tw.inspect, "getsource", lambda _m: "time.sleep(1)\ntime.sleep(task_poll_interval)\n")
    assert "exactly one" in tw.incompatibility()
    assert tw.install(sock_path) is None and RS.time is time and not sock_path.exists()
    assert "tasks are found at the SuperExec's polls only" in caplog.text


def test_install_refuses_another_flower(monkeypatch, sock_path, restore_flower):
    import time

    monkeypatch.setattr(tw, "version_problem", lambda: "flwr 1.40.0 is not 1.39.x")
    assert tw.install(sock_path) is None and RS.time is time


def test_uninstall_restores_flower(sock_path, restore_flower):
    import time

    assert tw.incompatibility() is None
    assert tw.install(sock_path) is not None and sock_path.exists()
    tw.uninstall()
    assert RS.time is time and not sock_path.exists()


# --------------------------------------------------------------------------------------------- (d)


def test_paced_supernode_wakes_its_superexec_once_per_message(monkeypatch, sock_path):
    mod = importlib.import_module(ps.MODULE)
    saved = (mod.time, mod._pull_and_store_message)
    listener = tw.WakeupListener(sock_path)
    try:
        script = iter([None, 7, None, 8, 9])
        monkeypatch.setattr(mod, "_pull_and_store_message", lambda **_kw: next(script))
        assert ps.install(ps.Pacing(), wakeup=sock_path)
        got = [mod._pull_and_store_message() for _ in range(5)]
        assert got == [None, 7, None, 8, 9]
        assert [listener.wait(0.05) for _ in range(4)] == [True, True, True, False]
    finally:
        listener.close()
        mod.time, mod._pull_and_store_message = saved


def test_deployment_sets_the_socket_only_for_paced_and_preforked(tmp_path):
    from scripts.deploy import Deployment, _build_parser

    both = Deployment(2, run_dir=tmp_path / "a", isolation="process", superexec="preforked", supernode="paced")
    assert both.task_wakeup_socket(1) == (tmp_path / "a").resolve() / "wake" / "1.sock"
    assert both._node_env(1)[tw.ENV_SOCKET] == str(both.task_wakeup_socket(1))
    assert Deployment(2, run_dir=tmp_path / "b", supernode="paced").task_wakeup_socket(0) is None
    assert Deployment(2, run_dir=tmp_path / "c", isolation="process", superexec="preforked").task_wakeup_socket(0) is None
    off = Deployment(2, run_dir=tmp_path / "d", isolation="process", superexec="preforked", supernode="paced",
                     task_wakeup=False)
    assert off.task_wakeup_socket(0) is None and tw.ENV_SOCKET not in off._node_env(0)
    deep = Deployment(1, run_dir=tmp_path / ("x" * 110), isolation="process", superexec="preforked",
                      supernode="paced")
    assert deep.task_wakeup_socket(0) is None  # too long for a Unix socket: off, with a warning
    assert _build_parser().parse_args(["up", "--no-task-wakeup"]).task_wakeup is False
    assert _build_parser().parse_args(["up"]).task_wakeup is True


# --------------------------------------------------------------------------------------------- (e)


@pytest.mark.slow
def test_woken_superexecs_deployment_matches_inprocess():
    """2 nodes, paced SuperNodes + preforked SuperExecs polling for tasks only every 60 s, TLS + auth: a 3-round
    conjugate run completes, equals the in-process run, and each SuperExec was woken for every message."""
    import shutil
    import tempfile

    from scripts.deploy import Deployment, free_port_kwargs
    from tests.test_deployment import DEPLOY_RUN
    from tests.test_inprocess import run

    base = Path(tempfile.mkdtemp(prefix="pgvi-wk-", dir="/tmp"))  # short run dir: the sockets live in it
    dep = Deployment(2, run_dir=base / "dep", isolation="process", superexec="preforked", supernode="paced",
                     superexec_poll_interval=60.0, **free_port_kwargs(2))
    overrides = {"num-clients": 2, "min-clients": 2}
    try:
        dep.start()
        dep.wait_online(timeout=180)
        out = base / "out"
        res = dep.run_app({**DEPLOY_RUN, **overrides, "output-dir": str(out)}, timeout=900)
        assert res.ok, (res, res.log_path.read_text()[-3000:] if res.log_path else "")
        execs = [p for p in dep.procs if p.role == "superexec-clientapp"]
    finally:
        dep.stop()
    try:
        assert dep.leftover_processes() == []
        for p in execs:
            text = Path(p.log_path).read_text()
            assert "pgvi-superexec: polls for a task at once when its SuperNode signals a message" in text
            # one identity query and three train messages per node, each woken (the exit line counts them)
            woken = [int(line.split("woken ")[1].split()[0]) for line in text.splitlines() if "woken " in line]
            assert woken and woken[-1] >= 4, text[-2000:]
        (run_dir,) = [p for p in out.iterdir() if p.name == f"run-{res.run_id}"]
        post = dict(np.load(run_dir / "posterior.npz"))
        summary = json.loads((run_dir / "summary.json").read_text())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    _, strategy, _ = run({"dtype": "float64", "num-server-rounds": 3, **overrides})
    assert summary["ledger-versions"] == strategy.ledger_versions
    for k, v in strategy.state.posterior.to_numpy().items():
        np.testing.assert_allclose(post[k], v, rtol=0, atol=1e-6 * max(1.0, float(np.abs(v).max())))
