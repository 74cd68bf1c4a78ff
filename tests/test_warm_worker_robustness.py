"""The warm compute worker (client/warm_worker.py) when things go wrong around a request.

1. The worker dies mid-request (crash, OOM kill, SIGTERM on a restart): ``call()`` raises a
   :class:`~client.warm_worker.WorkerUnavailable` subclass, so the ClientApp computes the message itself
   instead of failing it (before, the ``EOFError``/``ConnectionResetError`` escaped ``call()``).
2. A request the worker cannot unpickle (a FAB whose code differs from the worker's, or garbage) is answered
   with an error reply and the worker keeps serving (before, ``serve()`` raised and the worker process died).
3. A second worker on a live worker's socket path refuses to start (before, it took the path over), a stale
   socket file is still replaced, and a stopping worker removes its socket and key only if they are still its
   own (before, it deleted its successor's, and every ClientApp of the node silently computed in-process).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path
from types import SimpleNamespace

import pytest

import client.app as app_module
from client import warm_worker
from client.node_request import Request
from tests.test_warm_worker import _bounded, _in_background, _stop_worker

ROOT = Path(__file__).resolve().parents[1]
RAW = {"model": "gaussian_location", "dataset": "synthetic_gaussian_location", "family": "full_covariance",
       "loss": "nll", "divergence": "kl", "num-clients": 2, "min-clients": 2, "num-server-rounds": 2,
       "evaluate-clients": False, "wait-for-clients-s": 0, "round-timeout-s": 5}


def _request(kind: str = "train") -> Request:
    from common.config import parse_run_config
    from common.problem import build_problem

    prior = build_problem(parse_run_config(RAW)).prior.to_numpy()
    return Request(kind=kind, run_config=RAW, node_config={"partition-id": 0, "num-partitions": 2},
                   posterior=prior, config={"server-round": 1, "site-version": 0, "posterior-version": 0})


def _has_key(sock: Path, other_than: bytes | None) -> bool:
    try:
        return warm_worker.key_path(sock).read_bytes() != other_than
    except FileNotFoundError:
        return False


def _wait_ready(proc: subprocess.Popen, sock: Path, limit: float = 180, *, stale_key: bytes | None = None) -> None:
    """Wait for the worker's socket and a key (one other than ``stale_key``, a dead worker's left in place)."""
    deadline = time.monotonic() + limit
    while not (sock.exists() and _has_key(sock, stale_key)):
        if proc.poll() is not None:
            raise AssertionError(f"worker exited with {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"worker did not start within {limit:g} s")
        time.sleep(0.05)


def _start_worker(sock: Path, *, stale_key: bytes | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "client.warm_worker", "--socket", str(sock)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_ready(proc, sock, stale_key=stale_key)
    return proc


def _file_id(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


# --------------------------------------------------------------------------- 1. the worker dies mid-request


class _DyingWorker:
    """A socket and key laid out like the worker's; one thread completes the HMAC handshake, then:

    ``eof``: reads the request and closes (the worker died computing it: the ClientApp reads EOF);
    ``reset``: closes without reading the request (the kernel resets the connection: ``ECONNRESET``/``EPIPE``);
    ``garbage``: reads the request and replies with bytes that are no pickle (a worker of other code)."""

    def __init__(self, directory: Path, mode: str) -> None:
        directory.mkdir(mode=0o700)
        self.sock = directory / "w.sock"
        self.key = secrets.token_bytes(32)
        warm_worker.key_path(self.sock).write_bytes(self.key)
        self.mode = mode
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.sock))
        self._listener.listen(1)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        raw, _ = self._listener.accept()
        conn = Connection(raw.detach())
        try:
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
            if self.mode == "reset":
                # wait until the request is in our receive queue, then close with it unread
                s = socket.socket(fileno=os.dup(conn.fileno()))
                s.recv(1, socket.MSG_PEEK)
                s.close()
            else:
                conn.recv_bytes()
                if self.mode == "garbage":
                    conn.send_bytes(b"this is not a pickle")
        finally:
            conn.close()

    def close(self) -> None:
        self._thread.join(10)
        self._listener.close()


@pytest.fixture
def fallback_handle(monkeypatch):
    """The ClientApp's in-process computation, stubbed: records that the fallback ran; and the warnings."""
    import client.pgvi_client

    computed: list[Request] = []
    logged: list[tuple[int, str]] = []
    monkeypatch.setattr(client.pgvi_client, "handle", lambda req: computed.append(req) or "computed in the ClientApp")
    monkeypatch.setattr(app_module, "log", lambda level, msg, *args: logged.append((level, msg % args)))
    return computed, logged


def _clientapp_compute_against(fake: _DyingWorker) -> tuple[bool, dict]:
    """The ClientApp's ``_compute`` of an evaluate request with ``fake`` as its node's worker (30-s worker
    timeout, bounded at 60 s); the fake is closed afterwards.  ``(finished, outcome)`` as :func:`_bounded`."""
    try:
        ctx = SimpleNamespace(node_config={"compute-worker": str(fake.sock), "compute-worker-timeout-s": 30})
        done, out, _ = _bounded(lambda: app_module._compute(_request("evaluate"), ctx), 60)
    finally:
        fake.close()
    return done, out


@pytest.mark.parametrize("mode", ["eof", "reset"])
def test_worker_dying_mid_request_is_unavailable_and_the_clientapp_falls_back(tmp_path, mode, fallback_handle):
    computed, logged = fallback_handle
    fake = _DyingWorker(tmp_path / "call", mode)
    try:
        done, out, _ = _bounded(lambda: warm_worker.call(fake.sock, _request("evaluate"), timeout=30), 60)
    finally:
        fake.close()
    assert done, out
    err = out.get("error")
    # before the fix: a bare EOFError / ConnectionResetError, which client/app.py does not catch
    assert isinstance(err, warm_worker.WorkerUnavailable) and not isinstance(err, warm_worker.WorkerTimeout), out
    assert isinstance(err, warm_worker.WorkerLost), out
    assert "mid-request" in str(err)

    done, out = _clientapp_compute_against(_DyingWorker(tmp_path / "app", mode))
    assert done and out.get("value") == "computed in the ClientApp", out
    assert len(computed) == 1
    assert [lv for lv, m in logged if "mid-request" in m and "computing in the ClientApp process" in m] == [30]


def test_a_reply_the_clientapp_cannot_unpickle_is_unavailable(tmp_path, fallback_handle):
    computed, logged = fallback_handle
    done, out = _clientapp_compute_against(_DyingWorker(tmp_path / "w", "garbage"))
    assert done and out.get("value") == "computed in the ClientApp", out
    assert [lv for lv, m in logged if "could not read the worker's reply" in m] == [30], logged


_SLOW_WORKER = """
import sys, time
from pathlib import Path
import client.pgvi_client as pc

def slow(req):  # the request is being computed: tell the test, then take long enough to be killed
    Path(sys.argv[2]).touch()
    time.sleep(60)
    raise AssertionError("not killed")

pc.handle = slow
from client import warm_worker
warm_worker.serve(sys.argv[1])
"""


def test_a_worker_stopped_mid_request_makes_the_clientapp_compute_itself(tmp_path, fallback_handle):
    computed, logged = fallback_handle
    sock, started = tmp_path / "node" / "worker.sock", tmp_path / "computing"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WORKER, str(sock), str(started)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(proc, sock)
        ctx = SimpleNamespace(node_config={"compute-worker": str(sock), "compute-worker-timeout-s": 120})
        request = _request("evaluate")
        thread, result = _in_background(lambda: app_module._compute(request, ctx))
        deadline = time.monotonic() + 60
        while not started.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the worker never took the request"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # a restart (or an OOM kill) while it computes
        thread.join(60)
        assert not thread.is_alive()
    finally:
        log = _stop_worker(proc)
    assert result.get("value") == "computed in the ClientApp", (result, log)
    assert [lv for lv, m in logged if "mid-request" in m and "computing in the ClientApp process" in m] == [30]
    assert "signal 15: stopping" in log, log


# --------------------------------------------------------------------------- 2. a request the worker cannot read

_UNKNOWN_MODULE = "pgvi_module_only_the_clientapp_has"


class _OnlyInTheClientApp:
    """Pickled by reference to a module the worker cannot import (a FAB whose code differs from the worker's)."""


def test_a_request_the_worker_cannot_unpickle_leaves_it_serving(tmp_path, monkeypatch, fallback_handle):
    computed, logged = fallback_handle
    module = types.ModuleType(_UNKNOWN_MODULE)
    monkeypatch.setattr(_OnlyInTheClientApp, "__module__", _UNKNOWN_MODULE)
    module._OnlyInTheClientApp = _OnlyInTheClientApp
    monkeypatch.setitem(sys.modules, _UNKNOWN_MODULE, module)

    sock = tmp_path / "node" / "worker.sock"
    proc = _start_worker(sock)
    try:
        done, out, _ = _bounded(lambda: warm_worker.call(sock, _OnlyInTheClientApp(), timeout=60), 90)
        assert done, out
        err = out.get("error")
        assert isinstance(err, warm_worker.WorkerUnavailable), out  # the ClientApp falls back
        assert isinstance(err, warm_worker.WorkerIncompatible) and _UNKNOWN_MODULE in str(err), out
        time.sleep(0.5)
        assert proc.poll() is None, "the worker died of a request it could not unpickle"

        # not a pickle at all, from a plain stdlib client: an error reply, and the worker still serves
        with Client(str(sock), family="AF_UNIX", authkey=warm_worker.key_path(sock).read_bytes()) as conn:
            conn.send_bytes(b"\x80\x05garbage")
            status, (kind, _message, _trace) = conn.recv()
        assert status == "unreadable" and kind == "UnpicklingError", (status, kind)

        ctx = SimpleNamespace(node_config={"compute-worker": str(sock), "compute-worker-timeout-s": 60})
        done, out, _ = _bounded(lambda: app_module._compute(_OnlyInTheClientApp(), ctx), 90)
        assert done and out.get("value") == "computed in the ClientApp", out
        assert [lv for lv, m in logged if "could not read the request" in m] == [30], logged

        res = warm_worker.call(sock, _request(), timeout=120)  # the next good request is served
        assert res.metrics["status"] == "ok" and proc.poll() is None
    finally:
        log = _stop_worker(proc)
    assert log.count("could not read a request") == 3, log


# --------------------------------------------------------------------------- 3. one worker per socket path


def test_a_second_worker_refuses_a_live_workers_socket_and_stopping_leaves_a_successors_files(tmp_path):
    sock = tmp_path / "node" / "worker.sock"
    kp = warm_worker.key_path(sock)
    first = _start_worker(sock)
    try:
        sock_id, key = _file_id(sock), kp.read_bytes()
        try:
            second = subprocess.run([sys.executable, "-m", "client.warm_worker", "--socket", str(sock)], cwd=ROOT,
                                    capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("a second worker started on a live worker's socket")
        assert second.returncode != 0
        assert "a compute worker is already listening" in second.stderr, second.stderr
        assert _file_id(sock) == sock_id and kp.read_bytes() == key  # the first worker's files are untouched
        assert warm_worker.call(sock, _request(), timeout=120).metrics["status"] == "ok"

        # the path changes hands behind the first worker's back (an operator, or a start racing ours):
        # stopping the first worker must not delete its successor's socket and key
        sock.unlink()
        successor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            successor.bind(str(sock))
            successor.listen(1)
            kp.unlink()
            kp.write_bytes(b"k" * 32)
            new_id = _file_id(sock)
            log = _stop_worker(first)
            assert first.returncode == 0, log
            assert sock.exists() and _file_id(sock) == new_id, "the stopping worker deleted its successor's socket"
            assert kp.read_bytes() == b"k" * 32, "the stopping worker deleted its successor's key"
            assert "not this worker's" in log, log
        finally:
            successor.close()
    finally:
        _stop_worker(first)
    sock.unlink()
    kp.unlink()


def test_a_stale_socket_file_is_replaced_and_a_worker_removes_its_own_files(tmp_path):
    node = tmp_path / "node"
    node.mkdir(mode=0o700)
    sock, kp = node / "worker.sock", warm_worker.key_path(node / "worker.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sock))  # a worker that was SIGKILLed: its socket file stays, nobody listens
    dead.close()
    kp.write_bytes(b"stale-key" * 4)
    proc = _start_worker(sock, stale_key=b"stale-key" * 4)
    try:
        assert warm_worker.call(sock, _request(), timeout=120).metrics["status"] == "ok"
        assert kp.read_bytes() != b"stale-key" * 4  # (the new socket may reuse the stale one's inode number)
    finally:
        _stop_worker(proc)
    assert proc.returncode == 0
    assert not sock.exists() and not kp.exists()
