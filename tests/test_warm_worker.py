"""The node's warm compute worker (client/warm_worker.py) against the in-process ClientApp path.

Oracle: the same run with every message computed in the ClientApp process; the posterior after the
run must be bit-for-bit the same when a warm worker computes the updates.  Plus the worker's guards:
authentication, errors reported with their traceback, fallback when the worker is down, clean shutdown.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from client import warm_worker
from client.app import app as client_app
from client.node_request import InjectedFault, Request
from common.config import parse_run_config
from common.problem import build_problem
from strategies.inprocess import InProcessGrid
from strategies.pgvi import PGVIStrategy

ROOT = Path(__file__).resolve().parents[1]
RAW = {
    "model": "bnn", "hidden": "16", "dataset": "digits", "family": "mean_field", "dtype": "float32",
    "loss": "gce", "loss-delta": 0.5, "divergence": "alpha_renyi", "divergence-alpha": 2.0,
    "num-clients": 2, "min-clients": 2, "num-server-rounds": 2, "local-epochs": 1, "batch-size": 64,
    "mc-samples": 2, "eval-samples": 5, "evaluate-clients": True, "wait-for-clients-s": 0, "round-timeout-s": 60,
    "seed": 3,
}


def _start_worker(sock: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "client.warm_worker", "--socket", str(sock)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (sock.exists() and warm_worker.key_path(sock).exists()):
        if proc.poll() is not None:
            raise AssertionError(f"worker exited with {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("worker did not start within 180 s")
        time.sleep(0.05)
    return proc


@pytest.fixture
def worker(tmp_path):
    sock = tmp_path / "node" / "worker.sock"
    proc = _start_worker(sock)
    yield sock, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.stderr.close()


def _run(node_extra: dict) -> tuple[PGVIStrategy, list[dict]]:
    cfg = parse_run_config(RAW)
    nodes = [{"partition-id": m, "num-partitions": 2, "client-id": f"site-{m}", **node_extra} for m in range(2)]
    grid = InProcessGrid(client_app, nodes, RAW)
    rows: list[dict] = []
    strategy = PGVIStrategy(build_problem(cfg), poll_interval=0.0, on_round_end=lambda r, row: rows.append(row))
    strategy.start(grid)
    return strategy, rows


def test_client_app_module_imports_no_torch():
    code = "import sys, client.app; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_worker_gives_the_in_process_posterior_bit_for_bit(worker):
    sock, proc = worker
    local, local_rows = _run({})
    warm, warm_rows = _run({"compute-worker": str(sock)})
    a, b = local.state.posterior.to_numpy(), warm.state.posterior.to_numpy()
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    warm_rows, local_rows = [r for r in warm_rows if r["round"] >= 1], [r for r in local_rows if r["round"] >= 1]
    assert len(warm_rows) == len(local_rows) == RAW["num-server-rounds"]
    assert [r["applied"] for r in warm_rows] == [2, 2], warm_rows
    for lr, wr in zip(local_rows, warm_rows):  # client-side evaluation went through the worker too
        assert 0.0 < wr["client-accuracy"] == lr["client-accuracy"]
    assert proc.poll() is None  # still serving


def test_worker_down_falls_back_to_the_clientapp_process(tmp_path, caplog):
    local, _ = _run({})
    missing = tmp_path / "nowhere" / "worker.sock"
    warm, rows = _run({"compute-worker": str(missing)})
    for k, v in local.state.posterior.to_numpy().items():
        np.testing.assert_array_equal(v, warm.state.posterior.to_numpy()[k])
    assert [r["applied"] for r in rows if r["round"] >= 1] == [2, 2]


def _request(kind: str = "train", **kw) -> Request:
    cfg = parse_run_config(RAW)
    prior = build_problem(cfg).prior.to_numpy()
    base = {"kind": kind, "run_config": RAW, "node_config": {"partition-id": 0, "num-partitions": 2},
            "posterior": prior, "config": {"server-round": 1, "site-version": 0, "posterior-version": 0}}
    return Request(**{**base, **kw})


def test_worker_reports_errors_with_traceback_and_keeps_serving(worker):
    sock, proc = worker
    with pytest.raises(warm_worker.WorkerError, match="unknown request kind 'bogus'") as info:
        warm_worker.call(sock, _request("bogus"))
    assert "in the compute worker" in str(info.value) and "Traceback" in str(info.value)
    with pytest.raises(InjectedFault, match="crashed before staging"):
        warm_worker.call(sock, _request(fault="crash-before-reply"))
    res = warm_worker.call(sock, _request())  # the worker survived both
    assert res.metrics["status"] == "ok" and res.state.pending_version == 1 and res.delta
    assert proc.poll() is None


def test_worker_socket_is_private_and_refuses_a_wrong_key(worker, tmp_path):
    sock, proc = worker
    assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(warm_worker.key_path(sock)).st_mode) == 0o600
    from multiprocessing.connection import Client

    with pytest.raises(Exception):  # noqa: B017 - multiprocessing.AuthenticationError
        Client(str(sock), family="AF_UNIX", authkey=b"not-the-key")
    res = warm_worker.call(sock, _request("evaluate"))  # the worker survived the failed handshake
    assert 0.0 <= res.metrics["accuracy"] <= 1.0
    assert proc.poll() is None


def test_wrong_key_file_is_unavailable_not_a_crash(worker):
    sock, _ = worker
    kp = warm_worker.key_path(sock)
    good = kp.read_bytes()
    kp.write_bytes(b"x" * 32)
    try:
        with pytest.raises(warm_worker.WorkerUnavailable):
            warm_worker.call(sock, _request("evaluate"))
    finally:
        kp.write_bytes(good)


def test_sigterm_stops_the_worker_and_removes_socket_and_key(tmp_path):
    sock = tmp_path / "w" / "worker.sock"
    proc = _start_worker(sock)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    proc.stderr.close()
    assert not sock.exists() and not warm_worker.key_path(sock).exists()
    with pytest.raises(warm_worker.WorkerUnavailable):
        warm_worker.call(sock, _request("evaluate"))
