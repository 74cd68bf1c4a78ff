"""client/preforked_superexec.py: a flower-superexec whose ClientApps are forks of a warm forkserver.

(a) the argv of a forked ClientApp is exactly the one Flower's SubprocessExecutor would exec;
(b) a real forked child runs the entry function with that argv (and is reaped, and forgets this project's
    package so the FAB's ClientApp is the one Flower loads);
(c) the fallback to Flower's subprocess launch when the forkserver cannot start or a fork fails;
(d) a real loopback deployment (3 SuperNodes, process isolation, TLS + auth) with the preforked SuperExec:
    the conjugate run's posterior equals the in-process run's and the closed form.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResult, SubprocessExecutor
from flwr.supercore.superexec.executor import subprocess_executor

from client import preforked_superexec as pf


def _spec(task_type=TaskType.CLIENT_APP, **kw) -> ExecutionSpec:
    base = dict(task_type=task_type, runtime_api_address="127.0.0.1:9094", token="tok-123", insecure=False,
                root_certificates_path="/certs/ca.crt", runtime_dependency_install=False, parent_pid=4242,
                suppress_output=False, task_id=7)  # fmt: skip
    return ExecutionSpec(**{**base, **kw})


class _PopenRecorder:
    """Stands in for ``subprocess.Popen`` inside Flower's subprocess_executor: records the args."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], dict]] = []

    def __call__(self, args, **kwargs):
        self.calls.append((list(args), kwargs))
        return None


@pytest.fixture
def popen(monkeypatch) -> _PopenRecorder:
    rec = _PopenRecorder()
    monkeypatch.setattr(subprocess_executor.subprocess, "Popen", rec)
    return rec


@pytest.fixture
def no_forkserver_left():
    """Every test that may start the forkserver leaves none (and no resource tracker it started) behind."""
    from multiprocessing import forkserver, resource_tracker

    tracker_before = resource_tracker._resource_tracker._pid
    yield
    pid = forkserver._forkserver._forkserver_pid
    pf.stop_forkserver()
    assert pid is None, f"the test left forkserver {pid} running"
    if tracker_before is None and resource_tracker._resource_tracker._pid is not None:
        pf._stop_resource_tracker()
        pytest.fail("the test left the resource tracker it started running")


# --------------------------------------------------------------------------------------------- (a)


SPECS = [
    _spec(**dict(zip(("insecure", "root_certificates_path", "parent_pid", "runtime_dependency_install",
                      "suppress_output", "task_type"), combo)))
    for combo in itertools.product((False, True), (None, "/c/ca.crt"), (None, 31337), (False, True), (False, True),
                                   (TaskType.CLIENT_APP, TaskType.SERVER_APP))
]  # fmt: skip


def test_argv_is_the_one_subprocess_executor_execs(popen):
    for spec in SPECS:
        popen.calls.clear()
        assert SubprocessExecutor().launch(spec) == LaunchResult.accepted()
        ((flower_argv, kwargs),) = popen.calls
        assert pf.clientapp_argv(spec) == flower_argv, spec
        if spec.suppress_output:
            assert kwargs == {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    # the CLIENT_APP argv is flwr-clientapp's and its parser accepts it
    from flwr.supernode.cli.flwr_clientapp import _parse_args_run_flwr_clientapp

    argv = pf.clientapp_argv(_spec(runtime_dependency_install=True))
    assert argv[0] == "flwr-clientapp"
    ns = _parse_args_run_flwr_clientapp().parse_args(argv[1:])
    assert (ns.runtime_api_address, ns.token, ns.root_certificates, ns.parent_pid) == (
        "127.0.0.1:9094", "tok-123", "/certs/ca.crt", 4242)


def test_other_task_types_are_flowers_subprocess_launch(popen, no_forkserver_left):
    ex = pf.PreforkedExecutor(start=False)
    spec = _spec(TaskType.SERVER_APP, suppress_output=True)
    assert ex.launch(spec) == LaunchResult.accepted()
    assert popen.calls == [(pf.clientapp_argv(spec), {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL})]
    assert ex.children == [] and ex.forked == 0
    ex.close()


# --------------------------------------------------------------------------------------------- (b)

PROBE = '''
import json, os, sys, time
OUT = {out!r}

def record():
    info = {{"argv": sys.argv, "pid": os.getpid(), "ppid": os.getppid(),
            "own_package_loaded": sorted(n for n in sys.modules
                                         if n.split(".")[0] in ("client", "common", "strategies", "server")),
            "run_clientapp_preloaded": "flwr.supernode.runtime.run_clientapp" in sys.modules,
            "initial_backoff": __import__("flwr.supercore.inflatable.inflatable_utils",
                                          fromlist=["x"]).pull_objects.__kwdefaults__["initial_backoff"],
            "fab_cache": getattr(__import__("flwr.supernode.runtime.run_clientapp", fromlist=["x"]).install_from_fab,
                                 "pgvi_fab_cache", False),
            "stdout": os.readlink("/proc/self/fd/1"), "stderr": os.readlink("/proc/self/fd/2"),
            "main": [getattr(sys.modules["__main__"], "__file__", None), sys.modules["__main__"].__spec__,
                     "__mp_main__" in sys.modules]}}
    token = sys.argv[sys.argv.index("--token") + 1]
    if "spawn" in token:  # a ClientApp that starts 'spawn' processes (e.g. a DataLoader's workers)
        import multiprocessing
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            info["spawned"] = pool.map_async(abs, [-3]).get(timeout=120)
    if "atexit" in token:  # a ClientApp that registers an exit handler (a metrics logger's flush, say)
        import atexit
        atexit.register(lambda: open(os.path.join(OUT, token + ".atexit"), "w").close())
    print("probe stdout", flush=True)
    tmp = os.path.join(OUT, "%d.tmp" % os.getpid())
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, os.path.join(OUT, "%s.json" % sys.argv[sys.argv.index("--token") + 1]))
    if "exit-3" in sys.argv[sys.argv.index("--token") + 1]:
        sys.exit(3)
'''


@pytest.fixture
def probe_entry(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "pgvi_probe_entry.py").write_text(PROBE.format(out=str(out)))
    monkeypatch.syspath_prepend(str(tmp_path))  # the forkserver and its children get this sys.path
    return "pgvi_probe_entry:record", out


def _wait_reaped(ex: pf.PreforkedExecutor, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while ex.children and time.monotonic() < deadline:
        ex.reconcile()
        time.sleep(0.05)
    assert ex.children == [], "children not reaped"


def _cmdline_after_exec(pid: int, timeout: float = 30.0) -> bytes:
    """``/proc/pid/cmdline`` once it is set: multiprocessing records the forkserver's pid right after the fork, and
    until the child's exec completes the file can read empty (seen once under load in a CI run)."""
    deadline = time.monotonic() + timeout
    while not (cmdline := Path(f"/proc/{pid}/cmdline").read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return cmdline


def _exists(pid: int) -> bool:
    """``pid`` is alive or a zombie (not yet reaped)."""
    return Path(f"/proc/{pid}").exists()


def test_forked_child_runs_the_entry_with_flowers_argv_and_is_reaped(probe_entry, popen, no_forkserver_left):
    entry, out = probe_entry
    ex = pf.PreforkedExecutor(entry=entry, initial_retry=0.07)
    from multiprocessing import forkserver

    server = forkserver._forkserver._forkserver_pid
    assert server is not None and server != os.getpid()
    assert b"multiprocessing.forkserver" in _cmdline_after_exec(server)
    specs = [_spec(token="plain-spawn-atexit", task_id=1),
             _spec(token="quiet-exit-3-atexit", task_id=2, suppress_output=True),
             _spec(token="insecure", task_id=3, insecure=True, root_certificates_path=None, parent_pid=None)]
    for spec in specs:
        assert ex.launch(spec) == LaunchResult.accepted()
    assert popen.calls == []  # nothing was exec'd
    assert ex.forked == 3 and ex.fallbacks == 0 and len(ex.children) == 3
    procs = list(ex.children)
    pids = [p.pid for p in procs]
    codes = {}
    deadline = time.monotonic() + 60
    while len(codes) < 3 and time.monotonic() < deadline:
        codes.update({p.name: p.exitcode for p in ex.children if p.exitcode is not None})
        time.sleep(0.05)
    assert codes == {"flwr-clientapp-task-1": 0, "flwr-clientapp-task-2": 3, "flwr-clientapp-task-3": 0}
    _wait_reaped(ex)
    for pid in pids:  # reaped by the forkserver (it reports the exit code after waitpid): no zombie left
        assert not _exists(pid), pid
    for spec in specs:
        got = json.loads((out / f"{spec.token}.json").read_text())
        assert got["argv"] == pf.clientapp_argv(spec)  # == SubprocessExecutor's (test above)
        assert got["ppid"] == server and got["pid"] != os.getpid()  # a fork of the forkserver, not of us
        # the FAB's `client` and `common` packages will be the ones imported (a kept `common` mixed two versions)
        assert got["own_package_loaded"] == []
        assert got["run_clientapp_preloaded"]
        assert got["initial_backoff"] == 0.07  # client/object_pulls.py, set in the child
        assert got["fab_cache"] is True  # client/fab_cache.py, installed in the child (default on)
        assert got["main"] == [None, None, False]  # a bare __main__: spawned processes re-import nothing
        assert got.get("spawned") == ([3] if "spawn" in spec.token else None)
        assert (out / f"{spec.token}.atexit").exists() == ("atexit" in spec.token)  # also after sys.exit(3)
        if spec.suppress_output:
            assert got["stdout"] == got["stderr"] == "/dev/null"
        else:
            assert got["stdout"] != "/dev/null"
    # the parent is not bound to its children any more: multiprocessing's atexit would not join them
    import multiprocessing.process

    assert not any(p in multiprocessing.process._children for p in procs)
    ex.close()
    assert not _exists(server)


def test_close_does_not_wait_for_running_children(tmp_path, monkeypatch, no_forkserver_left):
    (tmp_path / "pgvi_probe_sleep.py").write_text("import time\ndef sleep():\n    time.sleep(600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ex = pf.PreforkedExecutor(entry="pgvi_probe_sleep:sleep")
    ex.launch(_spec(task_id=1))
    (child,) = ex.children
    pid = child.pid
    try:
        t0 = time.monotonic()
        ex.close()
        assert time.monotonic() - t0 < 6.0
        assert ex.children == []
    finally:
        os.kill(pid, 9)  # in the SuperExec it would exit by itself (--parent-pid)


# --------------------------------------------------------------------------------------------- (c)


def test_falls_back_to_subprocess_when_the_forkserver_cannot_start(popen, monkeypatch, caplog, no_forkserver_left):
    from multiprocessing import forkserver

    def broken():
        raise OSError("no forkserver here")

    monkeypatch.setattr(forkserver, "ensure_running", broken)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        ex = pf.PreforkedExecutor()
        specs = [_spec(task_id=1), _spec(task_id=2, token="other", suppress_output=True)]
        assert [ex.launch(s) for s in specs] == [LaunchResult.accepted()] * 2
    assert not ex.active and ex.children == [] and ex.forked == 0
    assert [args for args, _ in popen.calls] == [pf.clientapp_argv(s) for s in specs]
    assert popen.calls[1][1] == {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no forkserver here" in warnings[0].getMessage()
    ex.close()


def test_falls_back_to_subprocess_when_a_fork_fails(probe_entry, popen, caplog, no_forkserver_left):
    from multiprocessing import forkserver

    entry, out = probe_entry
    ex = pf.PreforkedExecutor(entry=entry, cache_fab=False)
    assert ex.launch(_spec(token="before", task_id=1)) == LaunchResult.accepted()
    _wait_reaped(ex)
    assert (out / "before.json").exists() and popen.calls == []
    before = json.loads((out / "before.json").read_text())
    assert before["initial_backoff"] == 1  # no initial_retry: Flower's
    assert before["fab_cache"] is False  # cache_fab=False: Flower's install_from_fab
    # the forkserver's socket goes away (as if the server had been replaced): the fork request raises
    fs = forkserver._forkserver
    good = fs._forkserver_address
    fs._forkserver_address = "\0pgvi-no-such-forkserver"
    try:
        with caplog.at_level(logging.WARNING, logger="flwr"):
            specs = [_spec(token=f"fallback-{i}", task_id=10 + i) for i in range(pf.MAX_CONSECUTIVE_FAILURES + 1)]
            assert [ex.launch(s) for s in specs] == [LaunchResult.accepted()] * len(specs)
    finally:
        fs._forkserver_address = good
    assert [args for args, _ in popen.calls] == [pf.clientapp_argv(s) for s in specs]  # no task lost
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # one warning per failed fork; after MAX_CONSECUTIVE_FAILURES, forking is off (no more attempts)
    assert len(warnings) == pf.MAX_CONSECUTIVE_FAILURES, warnings
    assert "forking is now off" in warnings[-1] and not ex.active
    assert ex.fallbacks == pf.MAX_CONSECUTIVE_FAILURES and ex.forked == 1
    assert not any(out.glob("fallback-*.json"))  # no fork ran any of them (no double launch)
    ex.close()


def test_only_failures_in_a_row_turn_forking_off(probe_entry, popen, caplog, no_forkserver_left):
    """A successful fork resets the count: MAX_CONSECUTIVE_FAILURES - 1 failures, a fork, and as many failures
    again leave forking on."""
    from multiprocessing import forkserver

    entry, out = probe_entry
    ex = pf.PreforkedExecutor(entry=entry)
    fs = forkserver._forkserver
    good = fs._forkserver_address
    n = pf.MAX_CONSECUTIVE_FAILURES - 1
    task = itertools.count(1)

    def fail(k: int) -> None:
        fs._forkserver_address = "\0pgvi-no-such-forkserver"
        try:
            for _ in range(k):
                assert ex.launch(_spec(token=f"fallback-{next(task)}")) == LaunchResult.accepted()
        finally:
            fs._forkserver_address = good

    fail(n)
    assert ex.launch(_spec(token="forked", task_id=next(task))) == LaunchResult.accepted()
    fail(n)
    assert ex.active and ex.fallbacks == 2 * n and ex.forked == 1
    assert ex.launch(_spec(token="still-forked", task_id=next(task))) == LaunchResult.accepted()
    assert ex.forked == 2 and len(popen.calls) == 2 * n
    _wait_reaped(ex)
    assert (out / "forked.json").exists() and (out / "still-forked.json").exists()
    ex.close()


def test_install_patches_only_the_subprocess_executor(monkeypatch, no_forkserver_left):
    from flwr.supercore.constant import ExecutorType
    from flwr.supercore.superexec import run_superexec as rs

    original = rs.get_executor
    monkeypatch.setattr(rs, "get_executor", original)  # restored after the test
    assert pf.incompatibility() is None
    assert pf.install() and pf.install()  # idempotent
    assert rs.get_executor is not original and rs.get_executor._pgvi_original is original
    ex = rs.get_executor(ExecutorType.SUBPROCESS, insecure=True)
    try:
        assert isinstance(ex, pf.PreforkedExecutor) and isinstance(ex, SubprocessExecutor)
    finally:
        ex.close()
    with pytest.raises(ValueError, match="executor-config"):  # delegated to Flower's factory
        rs.get_executor(ExecutorType.KUBERNETES)


def test_install_refuses_another_flower_version(monkeypatch, caplog):
    from flwr.supercore.superexec import run_superexec as rs

    original = rs.get_executor
    monkeypatch.setattr(rs, "get_executor", original)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.40.0")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert pf.install() is False
    assert rs.get_executor is original
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "1.40.0" in rec.getMessage() and "unchanged" in rec.getMessage()


def test_module_refuses_a_bad_object_pull_retry():
    repo = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "client.preforked_superexec", "--help"], cwd=repo,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PGVI_OBJECT_PULL_RETRY_S": "0"})  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "pgvi-superexec: PGVI_OBJECT_PULL_RETRY_S must be in [0.001, 10.0] s, got 0.0"]


def test_module_runs_as_flower_superexec():
    """``python -m client.preforked_superexec`` from the repo root is Flower's CLI (same arguments)."""
    repo = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-m", "client.preforked_superexec", "--help"], cwd=repo,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "--runtime-api-address" in res.stdout and "--root-certificates" in res.stdout


def test_bench_network_attributes_forked_clientapps_by_parent(tmp_path, monkeypatch, no_forkserver_left):
    """bench_network's per-role CPU table: a child of the forkserver (same command line as the forkserver)
    counts as ``flwr-clientapp``; the forkserver as the process that started it (in a deployment, the
    SuperExec); ``python -m client.preforked_superexec`` as ``flower-superexec``."""
    from multiprocessing import forkserver

    from scripts.bench_network import _proc_role, _role

    (tmp_path / "pgvi_probe_sleep.py").write_text("import time\ndef sleep():\n    time.sleep(600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ex = pf.PreforkedExecutor(entry="pgvi_probe_sleep:sleep")
    ex.launch(_spec(task_id=1))
    (child,) = ex.children
    server = forkserver._forkserver._forkserver_pid

    def cmd(pid: int) -> list[str]:
        return [c for c in Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0") if c]

    try:
        assert cmd(child.pid) == cmd(server)  # what the sampler sees: the forkserver's command line
        assert _proc_role(cmd(child.pid), server) == "flwr-clientapp"
        assert _proc_role(cmd(server), os.getpid()) == _role(cmd(os.getpid()))  # the parent's role
        superexec_cmd = [sys.executable, "-m", "client.preforked_superexec", "--runtime-api-address", "x:1"]
        assert _role(superexec_cmd) == "flower-superexec"
        assert _role(["/v/bin/flwr-clientapp", "--token", "t"]) == "flwr-clientapp"  # unchanged
    finally:
        os.kill(child.pid, 9)
        ex.close()


def test_deployment_superexec_option_guards(tmp_path):
    from scripts.deploy import Deployment, _build_parser, _up_isolation, main

    assert Deployment(1, run_dir=tmp_path).superexec == "flower"  # default unchanged
    assert Deployment(1, run_dir=tmp_path, isolation="process", superexec="preforked").superexec == "preforked"
    with pytest.raises(ValueError, match="needs isolation='process'"):
        Deployment(1, run_dir=tmp_path, superexec="preforked")
    with pytest.raises(ValueError, match="superexec must be"):
        Deployment(1, run_dir=tmp_path, isolation="process", superexec="other")
    parse = _build_parser().parse_args
    assert _up_isolation(parse(["up"]).isolation, parse(["up"]).superexec) == "subprocess"  # defaults unchanged
    assert _up_isolation(None, "preforked") == "process"  # --superexec preforked implies --isolation process
    assert _up_isolation("process", "flower") == "process"
    assert main(["up", "--run-dir", str(tmp_path), "--superexec", "preforked", "--isolation", "subprocess"]) == 2
    assert not (tmp_path / "deployment.json").exists()  # nothing was started


# --------------------------------------------------------------------------------------------- (d)


@pytest.mark.slow
def test_preforked_superexec_deployment_matches_inprocess(tmp_path):
    """3 SuperNodes, ``isolation="process"``, ``superexec="preforked"``, TLS + SuperNode auth (defaults): a
    2-round conjugate run completes; its posterior equals the in-process run's and the closed form."""
    from scripts.deploy import Deployment, free_port_kwargs
    from strategies.reference import expected_posterior, max_natural_diff
    from tests.test_deployment import DEPLOY_RUN
    from tests.test_inprocess import run

    dep = Deployment(3, run_dir=tmp_path / "dep", isolation="process", superexec="preforked", **free_port_kwargs(3))
    assert dep.auth and not dep.insecure
    try:
        dep.start()
        dep.wait_online(timeout=180)
        execs = [p for p in dep.procs if p.role == "superexec-clientapp"]
        assert len(execs) == 3
        for p in execs:
            assert p.cmd[1:3] == ["-m", "client.preforked_superexec"] and "--root-certificates" in p.cmd
        out = tmp_path / "out"
        res = dep.run_app({**DEPLOY_RUN, "num-server-rounds": 2, "output-dir": str(out)}, timeout=900)
        assert res.ok, (res, res.log_path.read_text()[-3000:] if res.log_path else "")
    finally:
        dep.stop()
    assert dep.leftover_processes() == []  # incl. the forkservers and their children
    logs = [Path(p.log_path).read_text() for p in execs]
    for text in logs:
        assert "ClientApps are forked from a forkserver" in text
        assert "starting it as a subprocess" not in text and "could not start" not in text  # every one forked
    assert sum(t.count("Start `flwr-clientapp` process") for t in logs) >= 2 * 3  # the forked ClientApps' logs
    (run_dir,) = [p for p in out.iterdir() if p.name == f"run-{res.run_id}"]
    post = dict(np.load(run_dir / "posterior.npz"))
    summary = json.loads((run_dir / "summary.json").read_text())
    cfg, strategy, _ = run({"dtype": "float64", "num-server-rounds": 2})
    assert summary["ledger-versions"] == strategy.ledger_versions
    for k, v in strategy.state.posterior.to_numpy().items():
        np.testing.assert_allclose(post[k], v, rtol=0, atol=1e-6 * max(1.0, float(np.abs(v).max())))
    expected = expected_posterior(cfg, summary["ledger-versions"])
    assert max_natural_diff(expected.from_numpy(post), expected) < 1e-6


def test_preforked_executor_refuses_a_bad_initial_retry():
    with pytest.raises(ValueError, match="initial_retry must be in"):
        pf.PreforkedExecutor(start=False, initial_retry=0)


def test_bench_network_places_process_starts_on_the_wall_clock():
    """bench_network turns /proc/<pid>/stat start ticks into wall time; whole-second btime put them up to 1 s early."""
    from scripts.bench_network import BOOT_TIME, CLK_TCK

    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ticks = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    finally:
        proc.kill()
        proc.wait()
    assert abs(BOOT_TIME + ticks / CLK_TCK - t0) < 0.1
