"""PreforkedExecutor: a fork request that fails *after* it reached the forkserver is never relaunched as a subprocess.

In ``popen_forkserver._launch`` the parent connects to the forkserver and passes it the pipe fds (the fork request),
the forkserver forks, the parent writes the pickled job to the child's pipe and reads the child's pid back.  A
failure after the request was sent (the forkserver dies between its fork and the pid reply, a pipe breaks) leaves
a child that may already run the ClientApp with the task's token: a subprocess fallback with the same token ran
the task twice, and in Flower 1.39 the loser's exit marks the task FAILED and revokes the token, losing the
working child's reply.  Such a launch must return Flower's ambiguous outcome (``LaunchResult.unknown``) instead,
and the next launch must fork from a working forkserver.  A failure before the request was sent still falls back
to the subprocess launch (no task lost)."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResult, LaunchResultStatus
from flwr.supercore.superexec.executor import subprocess_executor

from client import preforked_superexec as pf
from tests.test_preforked_superexec import _wait_reaped, no_forkserver_left  # noqa: F401 - the fixture, shared


def _spec(**kw) -> ExecutionSpec:
    base = dict(task_type=TaskType.CLIENT_APP, runtime_api_address="127.0.0.1:9094", token="tok-123", insecure=True,
                root_certificates_path=None, runtime_dependency_install=False, parent_pid=None,
                suppress_output=True, task_id=7)  # fmt: skip
    return ExecutionSpec(**{**base, **kw})


@pytest.fixture
def popen(monkeypatch) -> list[list[str]]:
    """Records the subprocess launches of Flower's subprocess executor instead of running them."""
    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess_executor.subprocess, "Popen", lambda args, **kw: calls.append(list(args)))
    return calls


@pytest.fixture
def make_ex(no_forkserver_left):
    """``make_ex(**kw)``: a PreforkedExecutor closed at teardown, even when the test fails."""
    made: list[pf.PreforkedExecutor] = []

    def make(**kw) -> pf.PreforkedExecutor:
        made.append(pf.PreforkedExecutor(**kw))
        return made[-1]

    yield make
    for ex in made:
        ex.close()


PROBE = """
import json, os, sys
def record():
    token = sys.argv[sys.argv.index("--token") + 1]
    tmp = os.path.join({out!r}, "%d.tmp" % os.getpid())
    with open(tmp, "w") as f:
        json.dump({{"pid": os.getpid(), "argv": sys.argv}}, f)
    os.replace(tmp, os.path.join({out!r}, "%s-%d.json" % (token, os.getpid())))
"""

#: Preloaded into the forkserver only: armed by a marker file, the forkserver SIGKILLs itself right after a fork,
#: before it sends the child's pid back (as an OOM kill of the forkserver in that window would).
KILLER = """
import os, signal
import multiprocessing.forkserver as fsmod
_orig = fsmod.write_signed
def write_signed(fd, n):
    if n > 255 and os.path.exists({mark!r}):  # the pid reply (a child's exit code is <= 255)
        os.unlink({mark!r})
        os.kill(os.getpid(), signal.SIGKILL)
    return _orig(fd, n)
fsmod.write_signed = write_signed
"""


@pytest.fixture
def probe(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    mark = tmp_path / "arm-killer"
    (tmp_path / "pgvi_review_probe.py").write_text(PROBE.format(out=str(out)))
    (tmp_path / "pgvi_review_fs_killer.py").write_text(KILLER.format(mark=str(mark)))
    monkeypatch.syspath_prepend(str(tmp_path))  # the forkserver's children get this sys.path
    # Python 3.11's forkserver imports its preload before it applies the parent's sys.path: it needs PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    return "pgvi_review_probe:record", out, mark


def _ran(out, token: str, timeout: float = 60.0) -> list[dict]:
    """The runs of the entry for ``token`` (waits for the first one, then a little for a second)."""
    deadline = time.monotonic() + timeout
    while not list(out.glob(f"{token}-*.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{token}-*.json"))]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_forkserver_dying_after_the_fork_is_an_unknown_launch_not_a_second_one(probe, popen, caplog,
                                                                                make_ex):
    from multiprocessing import forkserver

    entry, out, mark = probe
    ex = make_ex(entry=entry, preload=[*pf.PRELOAD, "pgvi_review_fs_killer"], cache_fab=False)
    assert ex.launch(_spec(token="before", task_id=1)) == LaunchResult.accepted()
    assert len(_ran(out, "before")) == 1
    _wait_reaped(ex)
    first_forkserver = forkserver._forkserver._forkserver_pid

    mark.touch()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        result = ex.launch(_spec(token="after-fork", task_id=2))
    assert not mark.exists(), "the forkserver was not killed after its fork"
    assert result.status == LaunchResultStatus.UNKNOWN, result
    assert result.message
    assert popen == [], "the task was launched a second time as a subprocess"
    assert ex.fallbacks == 0
    assert len(_ran(out, "after-fork")) == 1  # the forked child got its job and ran it, once
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "task_id 2" in warnings[0] and "not started as a subprocess" in warnings[0], warnings

    # the next launch forks from a new forkserver (the dead one is restarted), with no subprocess
    assert ex.launch(_spec(token="next", task_id=3)) == LaunchResult.accepted()
    assert forkserver._forkserver._forkserver_pid not in (None, first_forkserver)
    assert len(_ran(out, "next")) == 1 and popen == [] and ex.active
    _wait_reaped(ex)


def test_pid_reply_lost_after_the_fork_is_an_unknown_launch(probe, popen, caplog, monkeypatch, make_ex):
    """Deterministic variant: the pid reply cannot be read (the forkserver itself stays up)."""
    from multiprocessing import forkserver

    entry, out, _ = probe
    ex = make_ex(entry=entry, cache_fab=False)
    real = forkserver.read_signed
    calls = []

    def lost_once(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise EOFError("unexpected EOF")
        return real(fd)

    monkeypatch.setattr(forkserver, "read_signed", lost_once)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        result = ex.launch(_spec(token="lost-pid", task_id=5))
    monkeypatch.setattr(forkserver, "read_signed", real)
    assert calls, "the pid reply was never read"
    assert result.status == LaunchResultStatus.UNKNOWN and popen == [] and ex.fallbacks == 0
    assert len(_ran(out, "lost-pid")) == 1
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "task_id 5" in warnings[0] and "EOFError" in warnings[0], warnings
    assert ex.launch(_spec(token="then", task_id=6)) == LaunchResult.accepted()
    assert len(_ran(out, "then")) == 1 and popen == []
    _wait_reaped(ex)


def test_failure_before_the_request_is_sent_still_falls_back(probe, popen, caplog, monkeypatch, make_ex):
    """Passing the fds to the forkserver fails: nothing can run the task, so the subprocess launch does."""
    from multiprocessing import reduction

    entry, out, _ = probe
    ex = make_ex(entry=entry, cache_fab=False)

    def broken(sock, fds):
        raise OSError("sendmsg failed")

    real = reduction.sendfds
    monkeypatch.setattr(reduction, "sendfds", broken)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        spec = _spec(token="sendfds", task_id=8)
        assert ex.launch(spec) == LaunchResult.accepted()
    monkeypatch.setattr(reduction, "sendfds", real)
    assert popen == [pf.clientapp_argv(spec)] and ex.fallbacks == 1 and ex.forked == 0
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "starting it as a subprocess" in warnings[0] and "sendmsg failed" in warnings[0]
    assert _ran(out, "sendfds", timeout=1.0) == []  # no fork ran it


def test_unknown_launches_count_toward_turning_forking_off(probe, popen, caplog, monkeypatch, make_ex):
    from multiprocessing import forkserver

    entry, out, _ = probe
    ex = make_ex(entry=entry, cache_fab=False)

    def lost(fd):
        raise EOFError("unexpected EOF")

    real = forkserver.read_signed
    monkeypatch.setattr(forkserver, "read_signed", lost)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        results = [ex.launch(_spec(token=f"u{i}", task_id=20 + i)) for i in range(pf.MAX_CONSECUTIVE_FAILURES)]
    monkeypatch.setattr(forkserver, "read_signed", real)
    assert [r.status for r in results] == [LaunchResultStatus.UNKNOWN] * pf.MAX_CONSECUTIVE_FAILURES
    assert not ex.active and popen == []
    assert "forking is now off" in _warnings(caplog)[-1]
    spec = _spec(token="sub", task_id=30)
    assert ex.launch(spec) == LaunchResult.accepted() and popen == [pf.clientapp_argv(spec)]
    for i in range(pf.MAX_CONSECUTIVE_FAILURES):
        assert len(_ran(out, f"u{i}")) == 1


def test_the_packages_a_forked_clientapp_forgets_are_the_projects_own_not_its_neighbours(tmp_path):
    """Installed (``pip install .``, the image), ``client/`` sits in site-packages beside flwr, numpy and grpc: a
    child that forgot "every package beside client/" re-imported numpy, which refuses ("cannot load module more
    than once per process"), and every ClientApp of the node failed.  The set is the wheel's package list."""
    import shutil
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    wheel = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert pf._OWN_PACKAGES == frozenset(wheel["packages"])
    # the module imported from a site-packages-like directory: client/ and common/ beside a third-party package
    site = tmp_path / "site"
    site.mkdir()
    for name in ("client", "common"):  # copies: a symlink would resolve to the checkout
        shutil.copytree(root / name, site / name, ignore=shutil.ignore_patterns("__pycache__"))
    (site / "third_party_pkg").mkdir()
    (site / "third_party_pkg" / "__init__.py").write_text("")
    out = subprocess.run([sys.executable, "-c", "from client import preforked_superexec as p; "
                          "print(','.join(sorted(p._OWN_PACKAGES)))"],
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["client,common,server,strategies"]
