"""Review findings on the warm compute worker (client/warm_worker.py) and the ClientApp's timeout (client/app.py).

W2. One worker per socket path, also when two start together on a stale socket: the check "is the socket
    stale?" and the unlink of it were two steps nothing held, so a worker that had found the socket stale could
    unlink a second worker's fresh socket and bind its own: two workers ran, one unreachable with torch and its
    data loaded.  A worker now holds an exclusive ``flock`` on ``<socket>.lock`` from before the check until it
    has cleaned up; a second worker fails with an error naming the socket, and a lock file left behind by a
    killed worker blocks nobody (the kernel drops the lock with its holder).  A lock that cannot be taken at all
    (``ENOLCK`` from a filesystem without locks, e.g. NFS without a lock manager) is an ``OSError`` naming the
    lock file and saying to put the socket on a local filesystem, not a bare ``[Errno 37] No locks available``.
W3. Timeouts too large for the socket layer: ``compute-worker-timeout-s`` 1e7 made ``call()`` raise
    ``OverflowError`` from ``Connection.poll`` (neither a result nor a fallback), and ``--handshake-timeout-s
    1e10`` made the worker refuse every connection.  Both are now capped where they are read (30 days, 3600 s)
    with an error naming the key and the limit; ``call()`` waits up to the cap (``poll`` alone cannot wait more
    than ~24.8 days) and turns an unexpected ``OverflowError`` from the socket layer into ``WorkerUnavailable``.

W4. A stop signal at any moment ends the worker cleanly: its handler raises ``KeyboardInterrupt`` to break a
    blocking ``accept``, and that exception was caught only around ``accept``, the handshake and the request
    itself, so a SIGTERM between two requests (in the "request served" line or the connection's close: hit
    under load in the full suite) escaped ``serve()`` with a traceback and exit status -2; a second signal
    during the clean-up cut it short (socket and key files left).  Both now end with exit status 0 and nothing
    left behind.

The workers here run the real ``warm_worker.serve()`` with a stand-in ``client.pgvi_client`` (no torch), except
where ``python -m client.warm_worker`` itself is under test.  Every process a test starts is stopped by it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
import types
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace

import pytest

import client.app as app_module
from client import warm_worker

ROOT = Path(__file__).resolve().parents[1]

#: ``serve()`` with a stand-in ``client.pgvi_client`` whose ``handle`` echoes the request and the worker's pid.
#: With ``PAUSE_DIR`` set, the worker stops in the stale check that precedes its unlink of the stale socket
#: (the one after the handle "import") until ``PAUSE_DIR/go`` exists, having touched ``PAUSE_DIR/paused``: the
#: microsecond window between check and unlink, widened so that the interleaving of two workers is certain.
_STUB = r"""
import os, signal, sys, time, types
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import client
stub = types.ModuleType("client.pgvi_client")
imported = []

def handle(req):
    return {"echo": req, "pid": os.getpid()}

def __getattr__(name):  # serve()'s "from client.pgvi_client import handle": the torch import of the real one
    if name == "handle":
        imported.append(True)
        return handle
    raise AttributeError(name)

stub.__getattr__ = __getattr__
sys.modules["client.pgvi_client"] = stub
client.pgvi_client = stub
from client import warm_worker as W

pause = os.environ.get("PAUSE_DIR")
if pause:
    real = W.check_no_live_worker

    def paused(p):
        stale = real(p)
        if stale and imported:
            Path(pause, "paused").touch()
            deadline = time.monotonic() + 60
            while not Path(pause, "go").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        return stale

    W.check_no_live_worker = paused
term_at = os.environ.get("TERM_AT")  # the worker sends itself SIGTERM at this point (W4)
if term_at == "after-request":  # in the "request served" line, after the request's own try block
    def _print(*args, **kwargs):
        print(*args, **kwargs)
        if args and str(args[0]).startswith("[warm-worker] request "):
            os.kill(os.getpid(), signal.SIGTERM)

    W.print = _print
elif term_at == "cleanup":  # a second signal as it starts removing its socket and key after the first
    real_remove = W._remove_if_ours
    sent = []

    def _remove(*args, **kwargs):
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_remove(*args, **kwargs)

    W._remove_if_ours = _remove
try:
    served = W.serve(sys.argv[1], handshake_timeout=float(os.environ.get("HS", "10")))
except W.WorkerAlreadyRunning as err:  # as main() does
    sys.exit(f"[warm-worker] {err}")
print(f"[stub] served {served}", file=sys.stderr, flush=True)
"""


class _Proc:
    """A started worker process whose stderr goes to a file (readable while it runs)."""

    def __init__(self, args: list[str], log: Path, **env: str) -> None:
        self.log = log
        self._out = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self._out, text=True,
                                     env={**os.environ, **env})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.log.read_text()

    def ready(self) -> bool:
        return " ready on " in self.text()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready_or_exit(self, limit: float = 120) -> bool:
        """True once it logged "ready", False once it exited; fails the test if neither happens in ``limit`` s."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.ready():
                return True
            if not self.alive():
                return self.ready()
            time.sleep(0.05)
        pytest.fail(f"worker {self.pid} neither got ready nor exited within {limit:g} s: {self.text()}")

    def stop(self) -> int:
        """SIGTERM (SIGKILL after 30 s); the exit code.  A worker still running 30 s after SIGTERM gets its
        scheduler state and signal masks (``/proc/<pid>/status``) and each thread's kernel wait channel appended
        to its log before the SIGKILL, so that a failure says why the signal was not acted on (blocked, stopped,
        or a thread stuck in the kernel)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self._out.write(f"\n[test] no exit 30 s after SIGTERM: {_process_state(self.pid)}\n")
                self._out.flush()
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        return self.proc.returncode


def _process_state(pid: int) -> str:
    """The lines of ``/proc/<pid>/status`` that tell why a signal is not handled, and every thread's wchan."""
    keep = ("State", "Threads", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        threads = []
        for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
            wchan = (task / "wchan").read_text() if (task / "wchan").exists() else "?"
            threads.append(f"{task.name}:{(task / 'comm').read_text().strip()}:{wchan or '0'}")
    except OSError as err:
        return f"(could not read /proc/{pid}: {err})"
    return "; ".join(line.replace("\t", " ") for line in status if line.split(":")[0] in keep) + \
        "; threads " + ", ".join(threads)


@pytest.fixture
def procs():
    """Start worker processes; every one still running at the end of the test is stopped."""
    started: list[_Proc] = []

    def start(args: list[str], log: Path, **env: str) -> _Proc:
        started.append(_Proc(args, log, **env))
        return started[-1]

    yield start
    for p in started:
        p.stop()


@pytest.fixture
def stub_worker(tmp_path, procs):
    script = tmp_path / "stub_worker.py"
    script.write_text(_STUB)
    n = [0]

    def start(sock: Path, **env: str) -> _Proc:
        n[0] += 1
        return procs([sys.executable, str(script), str(sock), str(ROOT)], tmp_path / f"stub-{n[0]}.log", **env)

    return start


def _stale_socket(sock: Path) -> None:
    """A killed worker's socket file: bound once, nobody listens on it."""
    warm_worker.check_socket_dir(sock)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sock))
    dead.close()


def _wait_for(cond, limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {limit:g} s waiting for {what}")
        time.sleep(0.02)


def _lock_file(sock: Path) -> Path:
    return Path(str(sock) + ".lock")


# --------------------------------------------------------------------------- W2: one worker per socket path


def test_two_workers_started_together_on_a_stale_socket_leave_one_running(tmp_path, stub_worker):
    sock = tmp_path / "node" / "w.sock"
    _stale_socket(sock)
    pause = tmp_path / "pause"
    pause.mkdir()
    b = stub_worker(sock, PAUSE_DIR=str(pause))  # found the socket stale, not yet unlinked it
    _wait_for(lambda: (pause / "paused").exists() or not b.alive(), 60, "worker B's stale check")
    assert b.alive(), b.text()
    a = stub_worker(sock)
    a_ready = a.wait_ready_or_exit(60)  # before the fix: A replaces the stale socket and serves
    (pause / "go").touch()  # B unlinks what it thinks is the stale socket
    assert b.wait_ready_or_exit(60), b.text()
    time.sleep(0.3)
    running = [p.pid for p in (a, b) if p.alive()]
    assert running == [b.pid], f"workers {running} run on one socket path (A ready: {a_ready}): {a.text()}"
    assert a.proc.returncode != 0, a.text()
    assert str(sock) in a.text() and "already" in a.text(), a.text()
    assert warm_worker.call(sock, {"x": 1}, timeout=30)["pid"] == b.pid
    assert b.stop() == 0, b.text()
    assert sorted(p.name for p in sock.parent.iterdir()) == [], "B left files behind"


def test_python_m_warm_worker_refuses_a_path_whose_lock_another_worker_holds(tmp_path, procs):
    # another worker that is still starting (importing torch, loading its data): it holds the lock, no socket yet
    sock = tmp_path / "node" / "w.sock"
    warm_worker.check_socket_dir(sock)
    held = os.open(_lock_file(sock), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        w = procs([sys.executable, "-m", "client.warm_worker", "--socket", str(sock)], tmp_path / "w.log")
        started = w.wait_ready_or_exit(180)
        assert not started, f"a second worker started on a path another worker holds: {w.text()}"
        assert w.proc.returncode != 0
        err = w.text()
        assert str(sock) in err and str(_lock_file(sock)) in err, err
        assert "Traceback" not in err, err  # a clear message, not a crash
        assert not sock.exists() and not warm_worker.key_path(sock).exists()
        assert _lock_file(sock).exists()  # the holder's lock file is left alone
    finally:
        os.close(held)


def test_a_lock_file_left_by_a_killed_worker_blocks_nobody(tmp_path, stub_worker, procs):
    sock = tmp_path / "node" / "w.sock"
    _stale_socket(sock)
    warm_worker.key_path(sock).write_bytes(b"stale-key" * 4)
    holder = procs([sys.executable, "-c", "import fcntl, os, sys, time\n"
                    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
                    "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
                    "print(' ready on lock', file=sys.stderr, flush=True)\ntime.sleep(300)\n",
                    str(_lock_file(sock))], tmp_path / "holder.log")
    assert holder.wait_ready_or_exit(30), holder.text()
    holder.proc.kill()  # SIGKILL: no cleanup, the lock file stays
    holder.proc.wait(10)
    assert _lock_file(sock).exists()
    w = stub_worker(sock)
    assert w.wait_ready_or_exit(60), w.text()
    assert warm_worker.call(sock, {"x": 2}, timeout=30)["pid"] == w.pid
    assert w.stop() == 0, w.text()
    left = sorted(p.name for p in sock.parent.iterdir())
    assert left == [], f"a clean stop left {left} behind"


def test_socket_lock_is_exclusive_and_removed_on_release(tmp_path):
    sock = tmp_path / "node" / "w.sock"
    warm_worker.check_socket_dir(sock)
    first = warm_worker.SocketLock(sock).acquire()
    try:
        assert first.path == _lock_file(sock) == warm_worker.lock_path(sock) and first.path.exists()
        with pytest.raises(warm_worker.WorkerAlreadyRunning, match=str(sock)):
            warm_worker.SocketLock(sock).acquire()  # a second open file description: flock refuses it
    finally:
        first.release()
    assert not _lock_file(sock).exists()
    with warm_worker.SocketLock(sock) as again:  # free again once released
        assert again.path.exists()
    assert not _lock_file(sock).exists()


def test_socket_lock_taken_on_a_file_its_holder_just_removed_is_taken_again(tmp_path, monkeypatch):
    # B opens the lock file while A holds it; A releases (removes the file, then unlocks) before B's flock: B's
    # flock succeeds on the removed file, which locks nothing any other worker will open.  B must notice and
    # lock the file at the path, or a third worker C could take the path alongside it.
    sock = tmp_path / "node" / "w.sock"
    warm_worker.check_socket_dir(sock)
    a = warm_worker.SocketLock(sock).acquire()
    real_flock, calls = fcntl.flock, []

    def flock_after_a_releases(fd, op):
        calls.append(os.fstat(fd).st_ino)
        if len(calls) == 1:
            a.release()
        return real_flock(fd, op)

    monkeypatch.setattr(warm_worker.fcntl, "flock", flock_after_a_releases)
    b = warm_worker.SocketLock(sock).acquire()
    monkeypatch.setattr(warm_worker.fcntl, "flock", real_flock)
    try:
        assert len(calls) == 2, calls  # B retried once
        assert b.path.exists() and os.stat(b.path).st_ino == calls[1]
        with pytest.raises(warm_worker.WorkerAlreadyRunning):
            warm_worker.SocketLock(sock).acquire()  # C
    finally:
        b.release()


def _no_locks(fd, op):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_socket_lock_on_a_filesystem_without_locks_names_the_lock_file(tmp_path, monkeypatch):
    sock = tmp_path / "node" / "w.sock"
    warm_worker.check_socket_dir(sock)
    monkeypatch.setattr(warm_worker.fcntl, "flock", _no_locks)
    lock, fds = warm_worker.SocketLock(sock), _open_fds()
    with pytest.raises(OSError) as info:
        lock.acquire()
    assert info.value.errno == errno.ENOLCK  # still the OSError callers catch, with its errno
    text = str(info.value)
    assert str(_lock_file(sock)) in text and "No locks available" in text and "local filesystem" in text, text
    assert not lock.held and _open_fds() == fds  # the lock file's descriptor is closed


def test_python_m_warm_worker_on_a_filesystem_without_locks_says_which_file(tmp_path, monkeypatch):
    sock = tmp_path / "node" / "w.sock"
    monkeypatch.setattr(warm_worker.fcntl, "flock", _no_locks)
    with pytest.raises(SystemExit) as info:
        warm_worker.main(["--socket", str(sock)])
    assert str(info.value.code).startswith("[warm-worker] ")
    assert str(_lock_file(sock)) in str(info.value.code) and "local filesystem" in str(info.value.code)


# --------------------------------------------------------------------------- W3: timeouts the socket layer can take


@pytest.mark.parametrize("raw", [1e7, "1e10", 30 * 86400 + 1])
def test_compute_worker_timeout_over_30_days_is_refused(raw):
    with pytest.raises(ValueError, match=r"compute-worker-timeout-s.*at most 2592000"):
        app_module._worker_timeout({"compute-worker-timeout-s": raw})


def test_compute_worker_timeout_of_30_days_is_accepted():
    assert app_module._worker_timeout({"compute-worker-timeout-s": 30 * 86400}) == 30 * 86400
    assert app_module._worker_timeout({"compute-worker-timeout-s": "2592000"}) == warm_worker.MAX_RESULT_TIMEOUT_S


def test_query_refuses_a_compute_worker_timeout_over_the_limit():
    ctx = SimpleNamespace(node_config={"partition-id": 0, "compute-worker-timeout-s": 1e7}, run_config={},
                          state={})
    with pytest.raises(ValueError, match="compute-worker-timeout-s"):
        app_module.query(None, ctx)  # before round 1


@pytest.mark.parametrize("timeout", [30 * 86400, 1e7])
def test_call_waits_with_a_timeout_longer_than_poll_can_take(tmp_path, stub_worker, timeout):
    # poll() takes milliseconds in a C int (~24.8 days): 30 days, the largest the node config allows, must work,
    # and so must a larger value handed to call() directly
    sock = tmp_path / "node" / "w.sock"
    w = stub_worker(sock)
    assert w.wait_ready_or_exit(60), w.text()
    out = warm_worker.call(sock, {"t": timeout}, timeout=timeout)
    assert out == {"echo": {"t": timeout}, "pid": w.pid}
    assert w.stop() == 0, w.text()


@pytest.fixture
def fallback(monkeypatch):
    """The ClientApp's in-process computation, stubbed (no torch): records that it ran; and the warnings."""
    computed: list = []
    logged: list[tuple[int, str]] = []
    stub = types.ModuleType("client.pgvi_client")
    stub.handle = lambda req: computed.append(req) or "computed in the ClientApp"
    monkeypatch.setitem(sys.modules, "client.pgvi_client", stub)
    monkeypatch.setattr(app_module, "log", lambda level, msg, *args: logged.append((level, msg % args)))
    return computed, logged


def test_an_overflow_in_the_socket_layer_makes_the_clientapp_fall_back(tmp_path, stub_worker, monkeypatch, fallback):
    computed, logged = fallback
    sock = tmp_path / "node" / "w.sock"
    w = stub_worker(sock)
    assert w.wait_ready_or_exit(60), w.text()

    def poll(self, timeout=0.0):
        raise OverflowError("timeout is too large")

    monkeypatch.setattr(Connection, "poll", poll)
    with pytest.raises(warm_worker.WorkerUnavailable, match="OverflowError"):
        warm_worker.call(sock, {"x": 3}, timeout=60)
    ctx = SimpleNamespace(node_config={"compute-worker": str(sock), "compute-worker-timeout-s": 60})
    assert app_module._compute({"x": 4}, ctx) == "computed in the ClientApp"
    assert computed == [{"x": 4}]
    assert [lv for lv, m in logged if "OverflowError" in m and "computing in the ClientApp process" in m] == [30]
    monkeypatch.undo()
    assert w.alive()
    assert w.stop() == 0, w.text()


def test_call_with_a_handshake_timeout_the_socket_layer_cannot_take_is_unavailable(tmp_path, stub_worker):
    sock = tmp_path / "node" / "w.sock"
    w = stub_worker(sock)
    assert w.wait_ready_or_exit(60), w.text()
    with pytest.raises(warm_worker.WorkerUnavailable):
        warm_worker.call(sock, {"x": 5}, timeout=60, handshake_timeout=1e10)
    assert warm_worker.call(sock, {"x": 6}, timeout=60)["echo"] == {"x": 6}
    assert w.stop() == 0, w.text()


@pytest.mark.parametrize("raw", ["1e10", "3600.5"])
def test_handshake_timeout_option_over_an_hour_is_refused(raw, capsys):
    with pytest.raises(SystemExit) as info:
        warm_worker.build_parser().parse_args(["--socket", "x", "--handshake-timeout-s", raw])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--handshake-timeout-s" in err and "at most 3600" in err and raw in err, err


def test_handshake_timeout_option_of_an_hour_is_accepted():
    ns = warm_worker.build_parser().parse_args(["--socket", "x", "--handshake-timeout-s", "3600"])
    assert ns.handshake_timeout_s == warm_worker.MAX_HANDSHAKE_TIMEOUT_S == 3600


def test_serve_refuses_a_handshake_timeout_over_the_limit_before_taking_the_path(tmp_path, stub_worker):
    sock = tmp_path / "node" / "w.sock"
    w = stub_worker(sock, HS="1e10")
    started = w.wait_ready_or_exit(60)
    assert not started, f"the worker started with a handshake timeout it cannot use: {w.text()}"
    assert w.proc.returncode != 0
    assert "ValueError" in w.text() and "handshake_timeout" in w.text() and "3600" in w.text(), w.text()
    assert not sock.parent.exists(), "serve() created the socket directory before checking its arguments"


def test_serve_refuses_a_lock_for_another_path(tmp_path):
    sock, other = tmp_path / "node" / "w.sock", tmp_path / "node" / "other.sock"
    warm_worker.check_socket_dir(sock)
    with warm_worker.SocketLock(other) as lock, pytest.raises(ValueError, match=str(sock)):
        warm_worker.serve(sock, lock=lock)
    assert not sock.exists()


# --------------------------------------------------------------------------- W4: a stop signal at any moment


def test_a_stop_signal_between_two_requests_ends_the_worker_cleanly(tmp_path, stub_worker):
    sock = tmp_path / "node" / "w.sock"
    w = stub_worker(sock, TERM_AT="after-request")
    assert w.wait_ready_or_exit(60), w.text()
    assert warm_worker.call(sock, {"x": 7}, timeout=30)["echo"] == {"x": 7}
    w.proc.wait(30)  # it stops itself: the signal comes in its "request served" line
    text = w.text()
    assert "signal 15: stopping" in text and "[stub] served 1" in text, text
    assert "Traceback" not in text, text
    assert w.stop() == 0, text
    assert sorted(p.name for p in sock.parent.iterdir()) == [], "the worker left files behind"


def test_a_second_stop_signal_does_not_cut_the_clean_up_short(tmp_path, stub_worker):
    sock = tmp_path / "node" / "w.sock"
    w = stub_worker(sock, TERM_AT="cleanup")
    assert w.wait_ready_or_exit(60), w.text()
    assert w.stop() == 0, w.text()
    text = w.text()
    assert "signal 15: stopping" in text and "signal 15: already stopping" in text and "[stub] served 0" in text, text
    assert "Traceback" not in text, text
    assert sorted(p.name for p in sock.parent.iterdir()) == [], "the clean-up was cut short: files left behind"
