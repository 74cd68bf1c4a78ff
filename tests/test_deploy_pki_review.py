"""scripts/deploy.py review fixes around the PKI and the warm workers (P3, P4, P6, W1).

- P4: ``up --certs DIR`` validates the PKI with pki's own checks (CA: a CA, within its validity window; each
  leaf: issued by that CA, matching its key, within its validity window; node key pairs) before anything
  starts, and names the problem and the file.
- P6: an OSError while preparing the PKI (``RUN_DIR/certs`` a regular file) is a ``DeploymentError``.
- P3: the PKI ``deploy.py`` generates has a CA that outlives its leaves.
- W1: a warm worker's socket and key left behind by a SIGKILLed worker are not taken for a ready worker: they
  are removed before a new worker is spawned, and ``_wait_worker`` waits until the socket accepts connections.
  They are removed under the worker's own ``SocketLock`` (taken without waiting): a worker that holds it while
  it starts or stops (its socket refuses connections) is not this deployment's, a ``DeploymentError`` naming the
  lock, and its socket and key are left alone (they were removed, and a second worker spawned).
  No Flower process is started here; the worker tests run a stub worker (``client.warm_worker.serve`` with a
  stub ``client.pgvi_client``, no torch) and stop it.
"""

from __future__ import annotations

import datetime as dt
import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from client import warm_worker
from scripts import pki
from scripts.deploy import Deployment, DeploymentError, ProcInfo

from tests.test_pki_review import _REAL_NOW, _cert, _clock, _key

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- P4: --certs DIR is validated


@pytest.fixture(scope="module")
def good_pki(tmp_path_factory) -> Path:
    return pki.ensure_pki(tmp_path_factory.mktemp("good") / "certs", 1).out_dir


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory) -> Path:
    return pki.ensure_pki(tmp_path_factory.mktemp("other") / "certs", 1).out_dir


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "certs"
    shutil.copytree(src, dst)
    return dst


def _prepare(tmp_path: Path, certs: Path, **kwargs) -> Deployment:
    dep = Deployment(1, run_dir=tmp_path / "run", certs_dir=certs, **kwargs)
    dep._prepare_pki()
    return dep


def _reissue(certs: Path, leaf: str, monkeypatch, shift: dt.timedelta, days: int = 300) -> None:
    """Re-sign ``leaf`` (.pem, same .key) with the CA in ``certs`` as if issued at now + ``shift``."""
    dns, ips = pki.split_sans([*pki.DEFAULT_SAN_DNS, *pki.DEFAULT_SAN_IPS])
    with _clock(monkeypatch, shift):
        cert = pki._make_server_cert(_key(certs / "ca.key"), _cert(certs / "ca.crt"),
                                     _key(certs / leaf.replace(".pem", ".key")), dns, ips, valid_days=days)  # fmt: skip
    (certs / leaf).write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def test_a_valid_certs_dir_is_accepted_and_left_alone(tmp_path, good_pki):
    certs = _copy(good_pki, tmp_path)
    snap = {p: p.read_bytes() for p in certs.rglob("*") if p.is_file()}
    (certs / "ca.key").unlink()  # the CA key may stay offline: --certs needs only ca.crt
    del snap[certs / "ca.key"]
    dep = _prepare(tmp_path, certs, isolation="process")
    assert dep.pki is not None and dep.pki.server_cert == certs / "server.pem"
    assert {p: p.read_bytes() for p in certs.rglob("*") if p.is_file()} == snap


def _resign_with_names(certs: Path, leaf: str, names: list[str]) -> None:
    """Re-sign ``leaf`` (.pem, same .key) by the CA in ``certs`` listing only ``names`` (an operator's own cert)."""
    dns, ips = pki.split_sans(names)
    cert = pki._make_server_cert(_key(certs / "ca.key"), _cert(certs / "ca.crt"),
                                 _key(certs / leaf.replace(".pem", ".key")), dns, ips, valid_days=300)  # fmt: skip
    (certs / leaf).write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def test_a_certs_dir_whose_certificates_miss_the_dialled_loopback_address_is_refused(tmp_path, good_pki):
    """The SuperNodes and the CLI dial 127.0.0.1 (a node's SuperExec its Runtime API there too): a certificate not
    made by pki.py need not list it, and such a one passed the check and failed at the health check's timeout."""
    certs = _copy(good_pki, tmp_path)
    _resign_with_names(certs, "server.pem", ["fl.example.org"])
    with pytest.raises(DeploymentError, match=re.escape(str(certs / "server.pem")) + r" does not list 127\.0\.0\.1"):
        _prepare(tmp_path, certs)
    _resign_with_names(certs, "server.pem", ["fl.example.org", "127.0.0.1"])
    _prepare(tmp_path, certs)  # subprocess isolation: no Runtime API certificates
    runtime = f"runtime/{pki.node_key_name(0)}.pem"
    _resign_with_names(certs, runtime, ["supernode-0"])
    with pytest.raises(DeploymentError, match=re.escape(str(certs / runtime)) + r" does not list 127\.0\.0\.1"):
        _prepare(tmp_path, certs, isolation="process")


def test_server_cert_from_another_ca_is_refused(tmp_path, good_pki, other_pki):
    certs = _copy(good_pki, tmp_path)
    shutil.copy(other_pki / "server.pem", certs / "server.pem")
    shutil.copy(other_pki / "server.key", certs / "server.key")
    with pytest.raises(DeploymentError, match=re.escape(str(certs / "server.pem")) + r".*not issued by"):
        _prepare(tmp_path, certs)


def test_server_key_not_matching_is_refused(tmp_path, good_pki, other_pki):
    certs = _copy(good_pki, tmp_path)
    shutil.copy(other_pki / "server.key", certs / "server.key")
    with pytest.raises(DeploymentError, match=re.escape(str(certs / "server.pem")) + r".*does not match server\.key"):
        _prepare(tmp_path, certs)


def test_expired_ca_is_refused(tmp_path, monkeypatch):
    certs = tmp_path / "certs"
    with _clock(monkeypatch, -dt.timedelta(days=400)):  # a whole PKI issued 400 days ago with short lifetimes
        pki.ensure_pki(certs, 1, valid_days=30, ca_valid_days=67)
    with pytest.raises(DeploymentError, match=re.escape(str(certs / "ca.crt")) + r".*expired"):
        _prepare(tmp_path, certs)


def test_expired_server_cert_is_refused(tmp_path, good_pki, monkeypatch):
    certs = _copy(good_pki, tmp_path)
    _reissue(certs, "server.pem", monkeypatch, -dt.timedelta(days=40), days=30)
    with pytest.raises(DeploymentError, match=re.escape(str(certs / "server.pem")) + r".*expired on"):
        _prepare(tmp_path, certs)


def test_not_yet_valid_server_cert_is_refused(tmp_path, good_pki, monkeypatch):
    certs = _copy(good_pki, tmp_path)
    _reissue(certs, "server.pem", monkeypatch, dt.timedelta(days=30))
    with pytest.raises(DeploymentError, match=re.escape(str(certs / "server.pem")) + r".*not valid before"):
        _prepare(tmp_path, certs)


def test_not_yet_valid_ca_is_refused(tmp_path, monkeypatch):
    certs = tmp_path / "certs"
    with _clock(monkeypatch, dt.timedelta(days=2)):
        pki.ensure_pki(certs, 1)
    with pytest.raises(DeploymentError, match=re.escape(str(certs / "ca.crt")) + r".*not valid before"):
        _prepare(tmp_path, certs)


def test_ca_that_is_not_a_ca_is_refused(tmp_path, good_pki):
    certs = _copy(good_pki, tmp_path)
    shutil.copy(certs / "server.pem", certs / "ca.crt")  # a leaf (CA:FALSE) posing as the CA
    with pytest.raises(DeploymentError, match=re.escape(str(certs / "ca.crt")) + r".*not a CA"):
        _prepare(tmp_path, certs)


def test_corrupt_or_unreadable_ca_cert_is_refused(tmp_path, good_pki):
    certs = _copy(good_pki, tmp_path)
    (certs / "ca.crt").write_text("garbage\n")
    with pytest.raises(DeploymentError, match=re.escape(str(certs / "ca.crt"))):
        _prepare(tmp_path, certs)
    (certs / "ca.crt").unlink()
    (certs / "ca.crt").mkdir()  # an OSError on read
    with pytest.raises(DeploymentError, match=re.escape(str(certs / "ca.crt"))):
        _prepare(tmp_path, certs)


def test_runtime_cert_is_checked_with_process_isolation(tmp_path, good_pki, other_pki):
    certs = _copy(good_pki, tmp_path)
    shutil.copy(other_pki / "runtime" / "site-0.pem", certs / "runtime" / "site-0.pem")
    shutil.copy(other_pki / "runtime" / "site-0.key", certs / "runtime" / "site-0.key")
    _prepare(tmp_path, certs)  # subprocess isolation does not use it
    with pytest.raises(DeploymentError, match=re.escape(str(certs / "runtime" / "site-0.pem")) + r".*not issued by"):
        _prepare(tmp_path, certs, isolation="process")


def test_node_key_pair_is_checked_with_auth(tmp_path, good_pki, other_pki):
    certs = _copy(good_pki, tmp_path)
    shutil.copy(other_pki / "keys" / "site-0.pub", certs / "keys" / "site-0.pub")
    _prepare(tmp_path, certs, auth=False)  # no authentication: the node keys are not used
    with pytest.raises(DeploymentError, match=re.escape(str(certs / "keys" / "site-0.key")) + r".*matching"):
        _prepare(tmp_path, certs)


def test_certs_dir_host_with_a_zone_id_is_a_clear_error(tmp_path, good_pki):
    certs = _copy(good_pki, tmp_path)
    with pytest.raises(DeploymentError, match="zone"):
        _prepare(tmp_path, certs, host="fe80::1%eth0")


# ----------------------------------------------------------------------------- P6 / P3: generated PKI


def test_run_dir_certs_that_is_a_file_is_a_deployment_error(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "certs").write_text("")
    with pytest.raises(DeploymentError, match=re.escape(str(run_dir / "certs"))):
        Deployment(1, run_dir=run_dir)._prepare_pki()


def test_generated_pki_has_a_long_lived_ca(tmp_path):
    dep = Deployment(2, run_dir=tmp_path / "run")
    dep._prepare_pki()
    assert dep.pki is not None
    now = _REAL_NOW()
    assert _cert(dep.pki.ca_cert).not_valid_after_utc - now > dt.timedelta(days=3600)
    assert _cert(dep.pki.server_cert).not_valid_after_utc - now <= dt.timedelta(days=365)
    Deployment(2, run_dir=tmp_path / "run2", certs_dir=dep.pki.out_dir)._prepare_pki()  # passes the --certs checks


# ----------------------------------------------------------------------------- W1: stale worker socket

_STUB = r'''
"""client.warm_worker.serve() with a stub client.pgvi_client (no torch); the 'import' takes STUB_IMPORT_DELAY s."""
import os, sys, time, types
sys.path.insert(0, os.environ["REPO"])
import client
stub = types.ModuleType("client.pgvi_client")
def handle(req):
    return {"echo": req}
def __getattr__(name):
    if name == "handle":
        time.sleep(float(os.environ.get("STUB_IMPORT_DELAY", "0")))
        return handle
    raise AttributeError(name)
stub.__getattr__ = __getattr__
sys.modules["client.pgvi_client"] = stub
client.pgvi_client = stub
from client import warm_worker
warm_worker.serve(sys.argv[1])
'''


@pytest.fixture
def short_dir():
    """A run dir with a short path (a Unix socket path is limited to 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="dpr-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def stub_workers(short_dir):
    """Start stub workers with ``spawn(sock, delay)``; every one still running is killed at the end."""
    stub = short_dir / "stub_worker.py"
    stub.write_text(_STUB)
    procs: list[subprocess.Popen] = []

    def spawn(sock: Path, delay: float) -> subprocess.Popen:
        env = {**os.environ, "REPO": str(REPO), "STUB_IMPORT_DELAY": str(delay)}
        p = subprocess.Popen([sys.executable, str(stub), str(sock)], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
        procs.append(p)
        return p

    try:
        yield spawn
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _killed_worker_leftovers(spawn, sock: Path) -> None:
    """A worker that served, then was SIGKILLed: its socket and key stay behind."""
    first = spawn(sock, 0.0)
    _wait_for(lambda: warm_worker.key_path(sock).exists())
    assert warm_worker.call(sock, {"x": 1}, timeout=10) == {"echo": {"x": 1}}
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert sock.exists() and warm_worker.key_path(sock).exists()


def test_wait_worker_waits_for_a_listening_worker_not_stale_files(short_dir, stub_workers):
    """The 10 repro: _wait_worker on a replacement worker while the killed one's files are still there."""
    dep = Deployment(1, run_dir=short_dir / "run", warm_workers=True)
    sock = dep.worker_socket(0)
    _killed_worker_leftovers(stub_workers, sock)
    second = stub_workers(sock, 2.0)  # its "torch import" takes 2 s
    info = ProcInfo("warm-worker", 0, second.pid, [], str(short_dir / "w.log"), time.time(), second)
    t0 = time.monotonic()
    dep._wait_worker(0, info, timeout=30)
    assert time.monotonic() - t0 >= 1.5, "_wait_worker took the killed worker's files for a ready worker"
    assert warm_worker.call(sock, {"x": 2}, timeout=10) == {"echo": {"x": 2}}


def test_spawn_worker_removes_a_killed_workers_files(short_dir, stub_workers, monkeypatch):
    dep = Deployment(1, run_dir=short_dir / "run", warm_workers=True)
    sock = dep.worker_socket(0)
    _killed_worker_leftovers(stub_workers, sock)
    seen: list[tuple[bool, bool]] = []

    def fake_spawn(role, index, cmd, home, env=None):
        seen.append((sock.exists(), warm_worker.key_path(sock).exists()))
        return ProcInfo(role, index, 0, cmd, str(short_dir / "w.log"), time.time(), None)

    monkeypatch.setattr(dep, "_spawn", fake_spawn)
    dep._spawn_worker(0)
    assert seen == [(False, False)], "the new worker was spawned next to the killed worker's socket and key"


def test_spawn_worker_refuses_a_live_worker_on_the_path(short_dir, stub_workers, monkeypatch):
    dep = Deployment(1, run_dir=short_dir / "run", warm_workers=True)
    sock = dep.worker_socket(0)
    live = stub_workers(sock, 0.0)
    _wait_for(lambda: warm_worker.key_path(sock).exists())
    spawned: list[str] = []
    monkeypatch.setattr(dep, "_spawn", lambda *a, **kw: spawned.append("spawned"))
    with pytest.raises(DeploymentError, match="already listens on " + re.escape(str(sock))):
        dep._spawn_worker(0)
    assert spawned == [] and live.poll() is None
    assert warm_worker.call(sock, {"x": 3}, timeout=10) == {"echo": {"x": 3}}  # left alone


def test_spawn_worker_with_no_socket_yet(short_dir, monkeypatch):
    dep = Deployment(1, run_dir=short_dir / "run", warm_workers=True)
    calls: list[str] = []
    monkeypatch.setattr(dep, "_spawn", lambda role, *a, **kw: calls.append(role))
    dep._spawn_worker(0)
    assert calls == ["warm-worker"]


def test_stale_socket_file_without_a_process(short_dir, monkeypatch):
    """A socket file nobody ever listened on (bound, then the process died) and a key: both removed."""
    dep = Deployment(1, run_dir=short_dir / "run", warm_workers=True)
    sock = dep.worker_socket(0)
    sock.parent.mkdir(parents=True, mode=0o700)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(sock))
    s.close()
    warm_worker.key_path(sock).write_bytes(b"k" * 32)
    monkeypatch.setattr(dep, "_spawn", lambda *a, **kw: None)
    dep._spawn_worker(0)
    assert not sock.exists() and not warm_worker.key_path(sock).exists()


def _lock_is_held(sock: Path) -> bool:
    """Whether some process holds an ``flock`` on the worker lock file of ``sock``, read from ``/proc/locks``
    (``N: FLOCK ADVISORY WRITE pid MAJ:MIN:INODE 0 EOF``): a probe that took the lock, however briefly, could
    make the worker's own non-blocking attempt fail."""
    try:
        st = os.stat(warm_worker.lock_path(sock))
    except FileNotFoundError:
        return False
    file_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(f[1] == "FLOCK" and f[5] == file_id
               for f in (line.split() for line in Path("/proc/locks").read_text().splitlines()) if len(f) > 5)


def test_spawn_worker_leaves_the_files_of_a_worker_holding_the_lock_alone(short_dir, monkeypatch):
    """A worker that holds the lock and has bound its socket and written its key but does not accept yet (the
    moment between its bind and listen; its socket refuses connections like a killed worker's)."""
    dep = Deployment(1, run_dir=short_dir / "run", warm_workers=True)
    sock = dep.worker_socket(0)
    warm_worker.check_socket_dir(sock)
    spawned: list[str] = []
    monkeypatch.setattr(dep, "_spawn", lambda *a, **kw: spawned.append("spawned"))
    with warm_worker.SocketLock(sock), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:
        bound.bind(str(sock))
        warm_worker.key_path(sock).write_bytes(b"k" * 32)
        with pytest.raises(DeploymentError, match="holds the lock " + re.escape(str(warm_worker.lock_path(sock)))):
            dep._spawn_worker(0)
        assert spawned == [] and sock.exists() and warm_worker.key_path(sock).read_bytes() == b"k" * 32
        assert warm_worker.lock_path(sock).exists()  # the holder's lock file is not removed either
    dep._spawn_worker(0)  # the lock free again: the files are stale now and removed
    assert spawned == ["spawned"] and not sock.exists() and not warm_worker.key_path(sock).exists()
    assert not warm_worker.lock_path(sock).exists()


def test_spawn_worker_refuses_a_starting_worker_on_killed_workers_files(short_dir, stub_workers, monkeypatch):
    """A worker started by someone else in its slow import (it holds the lock; the killed worker's socket still
    refuses connections) is refused, not raced: nothing is removed or spawned, and it comes up and serves."""
    dep = Deployment(1, run_dir=short_dir / "run", warm_workers=True)
    sock = dep.worker_socket(0)
    _killed_worker_leftovers(stub_workers, sock)
    starting = stub_workers(sock, 3.0)
    _wait_for(lambda: _lock_is_held(sock))
    spawned: list[str] = []
    monkeypatch.setattr(dep, "_spawn", lambda *a, **kw: spawned.append("spawned"))
    with pytest.raises(DeploymentError, match="does not track holds the lock .*starting or stopping"):
        dep._spawn_worker(0)
    assert spawned == [] and sock.exists() and warm_worker.key_path(sock).exists()
    _wait_for(lambda: dep._worker_listening(0))
    assert warm_worker.call(sock, {"x": 4}, timeout=10) == {"echo": {"x": 4}} and starting.poll() is None


def test_spawn_worker_on_a_filesystem_without_locks_is_a_deployment_error(short_dir, monkeypatch):
    dep = Deployment(1, run_dir=short_dir / "run", warm_workers=True)
    sock = dep.worker_socket(0)
    warm_worker.check_socket_dir(sock)

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(warm_worker.fcntl, "flock", no_locks)
    monkeypatch.setattr(dep, "_spawn", lambda *a, **kw: pytest.fail("spawned without the lock"))
    with pytest.raises(DeploymentError, match=re.escape(str(warm_worker.lock_path(sock))) + ".*local filesystem"):
        dep._spawn_worker(0)
