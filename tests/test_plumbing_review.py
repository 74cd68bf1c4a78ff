"""Regression tests of the review of the client plumbing and entry points (scripts/simulate.py, scripts/fault_suite.py,
scripts/run_inprocess.py).

* simulate.py and fault_suite.py stop everything they started on SIGHUP (terminal closed, ssh session dropped) as
  on SIGTERM, and simulate.py's cleanup completes under further stop signals (a second SIGTERM used to raise out of
  its wait and skip the SIGKILL of a process that ignores SIGTERM);
* simulate.py has no hidden 30-minute limit: ``--timeout-s`` (default: none), and a timeout is one error line
  after the cleanup, not a traceback;
* fault_suite.py refuses bad numbers before it starts anything;
* run_inprocess.py refuses ``-c output-dir=...`` (the records go to --out) and records --out as its output-dir.

``flwr`` is a stand-in script (``FAKE_FLWR``), the SuperLink a stand-in process in its own session with the
simulation's FLWR_HOME (as Flower's managed one); the fault suite's deployment is two stand-in processes started by
the real :meth:`scripts.deploy.Deployment._spawn`.  Every process a test starts is killed by the test at the end,
also when the code under test fails to stop it.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts import fault_suite, simulate
from scripts.deploy import _pids_with_marker
from tests.test_simulate_script import _gone, _kill, _procs_with_home

REPO = Path(__file__).resolve().parents[1]

# `flwr run`: leaves a stand-in SuperLink (own session, inherits FLWR_HOME; with FAKE_TERM_FILE it ignores SIGTERM
# and touches that file when it gets one), writes both pids to FAKE_PIDS, says it started run 7 and sleeps;
# `flwr ls`: run 7 completed
FAKE_FLWR = r"""
import json, os, subprocess, sys, time
if sys.argv[1] == "run":
    code = "import time; time.sleep(120)"
    if os.environ.get("FAKE_TERM_FILE"):
        code = ("import pathlib, signal, time\n"
                f"signal.signal(signal.SIGTERM, lambda *a: pathlib.Path({os.environ['FAKE_TERM_FILE']!r}).touch())\n"
                "end = time.time() + 120\n"
                "while time.time() < end:\n    time.sleep(0.2)\n")
    p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = os.environ["FAKE_PIDS"]
    with open(pids + ".tmp", "w") as f:
        json.dump({"superlink": p.pid, "flwr-run": os.getpid()}, f)
    os.rename(pids + ".tmp", pids)
    print("Successfully started run 7", flush=True)
    time.sleep(float(os.environ.get("FAKE_RUN_SLEEP", "120")))
    print("INFO :      PGVI finished", flush=True)
elif sys.argv[1] == "ls":
    print(json.dumps({"success": True, "runs": [{"run-id": "7", "status": "finished:completed",
                                                 "status-details": ""}]}))
"""

# simulate.main() in its own process with `flwr` faked; the cleanup's wait for SIGTERMed processes shortened
SIM_DRIVER = r"""
import functools, sys
sys.path.insert(0, {repo!r})
from scripts import simulate
fake, out, stop_timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
real_bin = simulate._flwr_bin
simulate._flwr_bin = lambda name: fake if name == "flwr" else real_bin(name)
simulate.stop_local_superlink = functools.partial(simulate.stop_local_superlink, timeout=stop_timeout)
sys.argv = ["simulate.py", "--out", out]
simulate.main()
"""


def _await_file(path: Path, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        assert proc is None or proc.poll() is None, f"the process under test ended first ({proc.returncode})"
        time.sleep(0.05)


@pytest.fixture
def fake_flwr_bin(tmp_path, monkeypatch):
    """The ``flwr`` stand-in as an executable; FAKE_PIDS names its pid file.  Whatever it started is killed at the
    end, as is every process left with a FLWR_HOME under tmp_path."""
    script = tmp_path / "bin" / "flwr"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\n{FAKE_FLWR}")
    script.chmod(0o755)
    pids_file = tmp_path / "fake-pids.json"
    monkeypatch.setenv("FAKE_PIDS", str(pids_file))
    yield script, pids_file
    if pids_file.exists():
        _kill(json.loads(pids_file.read_text()).values())
    for home in tmp_path.glob("*/flwr-home"):
        _kill(_procs_with_home(home.resolve()))


def _stop_signals_default() -> None:
    """preexec_fn: the driver starts with the default stop-signal dispositions.  A test run under ``nohup`` (as a
    CI job may be) passes SIGHUP ignored down to its children, and the scripts keep a signal ignored on entry
    ignored (scripts/stop_signals.py), so the SIGHUP tests would test nothing there."""
    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


def _start_sim_driver(tmp_path: Path, fake: Path, stop_timeout: float, **env: str) -> tuple[subprocess.Popen, Path]:
    driver = tmp_path / "sim_driver.py"
    driver.write_text(SIM_DRIVER.format(repo=str(REPO)))
    out = tmp_path / "sim"
    proc = subprocess.Popen([sys.executable, str(driver), str(fake), str(out), str(stop_timeout)],
                            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_stop_signals_default)
    return proc, out


def _finish(proc: subprocess.Popen, timeout: float = 90.0) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the process under test did not end within {timeout} s:\n{out}\n{err}") from None


# ----------------------------------------------------------------------------- finding 2: signals


def test_simulate_stops_the_simulation_on_sighup(fake_flwr_bin, tmp_path):
    """SIGHUP (terminal closed) used to end simulate.py at once, leaving `flwr run` and the detached SuperLink."""
    fake, pids_file = fake_flwr_bin
    proc, out = _start_sim_driver(tmp_path, fake, stop_timeout=10.0)
    try:
        _await_file(pids_file, proc=proc)
        pids = json.loads(pids_file.read_text())
        proc.send_signal(signal.SIGHUP)
        _, err = _finish(proc)
        assert _gone(pids["superlink"]) and _gone(pids["flwr-run"]), (pids, err)
        assert _procs_with_home((out / "flwr-home").resolve()) == []
        assert proc.returncode == 130, err
        assert "simulate.py: interrupted (signal SIGHUP)" in err and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_simulate_cleanup_completes_under_further_stop_signals(fake_flwr_bin, tmp_path):
    """SIGTERM, then SIGTERM, Ctrl-C and SIGHUP while the cleanup waits for a SuperLink that ignores SIGTERM: the
    cleanup goes on to SIGKILL it (the second SIGTERM used to raise out of the wait, skipping the SIGKILL)."""
    fake, pids_file = fake_flwr_bin
    term_file = tmp_path / "superlink-got-sigterm"
    proc, out = _start_sim_driver(tmp_path, fake, stop_timeout=4.0, FAKE_TERM_FILE=str(term_file))
    try:
        _await_file(pids_file, proc=proc)
        pids = json.loads(pids_file.read_text())
        proc.send_signal(signal.SIGTERM)
        _await_file(term_file, proc=proc)  # the cleanup has SIGTERMed the SuperLink and waits for it to exit
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            proc.send_signal(sig)
            time.sleep(0.2)
        _, err = _finish(proc)
        assert _gone(pids["superlink"]), f"the SuperLink that ignores SIGTERM was not SIGKILLed:\n{err}"
        assert _procs_with_home((out / "flwr-home").resolve()) == []
        assert proc.returncode == 130, err
        assert "simulate.py: interrupted (signal SIGTERM)" in err and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


FS_DRIVER = r"""
import contextlib, os, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from scripts import fault_suite
from scripts.deploy import Deployment

out = Path(sys.argv[1])
PY = sys.executable
# the 'SuperLink' starts a child in a NEW session, as Flower's SuperLink starts its SuperExec
DETACH = ("import os, subprocess, sys, time\n"
          f"p = subprocess.Popen([{{PY!r}}, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
          f"open({{str(out / 'detached.tmp')!r}}, 'w').write(str(p.pid))\n"
          f"os.rename({{str(out / 'detached.tmp')!r}}, {{str(out / 'detached.pid')!r}})\n"
          "time.sleep(120)\n")


@contextlib.contextmanager
def fake_deployment(self, n):
    dep = Deployment(n, run_dir=self.out / "deploy-fake", app_dir=self.app_dir)
    self.deployments.append(dep)
    try:
        dep._spawn("superlink", None, [PY, "-c", DETACH], dep.run_dir / "homes" / "x")
        (out / "token.tmp").write_text(dep.token)
        os.rename(out / "token.tmp", out / "token")
        yield dep
    finally:
        self._stop(dep)


fault_suite.snapshot_app = lambda where: ({repo!r}, "0" * 64)
fault_suite.Suite.deployment = fake_deployment
fault_suite.Suite.with_retry = lambda self, name, fn: time.sleep(120)
sys.exit(fault_suite.main(["--only", "baseline", "--out", str(out)]))
"""


def test_fault_suite_stops_its_deployment_on_sighup(tmp_path):
    out = tmp_path / "fs"
    out.mkdir()
    driver = tmp_path / "fs_driver.py"
    driver.write_text(FS_DRIVER.format(repo=str(REPO)))
    proc = subprocess.Popen([sys.executable, str(driver), str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_stop_signals_default)
    token, detached = "", None
    try:
        _await_file(out / "token", proc=proc)
        _await_file(out / "detached.pid", proc=proc)
        token, detached = (out / "token").read_text(), int((out / "detached.pid").read_text())
        assert len(_pids_with_marker(token)) == 2  # the 'SuperLink' and its new-session child
        proc.send_signal(signal.SIGHUP)
        text, err = _finish(proc)
        assert _pids_with_marker(token) == [] and _gone(detached), text + err
        assert proc.returncode == 130, text + err
        assert "interrupted (signal SIGHUP); every process was stopped" in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if token:
            _kill(_pids_with_marker(token))
        if detached is not None:
            _kill([detached])


# ----------------------------------------------------------------------------- finding 3: simulate.py's time limit


def _main(monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["simulate.py", *argv])
    with pytest.raises(SystemExit) as exc:
        simulate.main()
    return exc.value.code


def test_simulate_timeout_is_one_error_line_after_the_cleanup(fake_flwr_bin, tmp_path, monkeypatch, capsys):
    fake, pids_file = fake_flwr_bin
    real_bin = simulate._flwr_bin  # noqa: SLF001
    monkeypatch.setattr(simulate, "_flwr_bin", lambda name: str(fake) if name == "flwr" else real_bin(name))
    out = tmp_path / "sim"
    assert _main(monkeypatch, "--out", str(out), "--timeout-s", "1") == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [f"simulate.py: error: the simulation did not finish within 1 s; `flwr run` was killed and the "
                     f"simulation's processes stopped (log {out / 'flwr-run.log'})"], err
    pids = json.loads(pids_file.read_text())
    assert _gone(pids["superlink"]) and _gone(pids["flwr-run"])


def test_simulate_has_no_time_limit_unless_given(tmp_path, monkeypatch):
    seen: list = []

    def fake_run_simulation(run_config, num_supernodes, workdir, num_cpus_per_client=1.0, **kw):
        seen.append(kw.get("timeout", "not passed"))
        (Path(workdir) / "flwr-run.log").write_text("")
        return {"status": "finished:completed", "status-details": "", "run_id": "7", "out_dir": None,
                "seconds": 0.0}

    assert inspect.signature(simulate.run_simulation).parameters["timeout"].default is None
    monkeypatch.setattr(simulate, "run_simulation", fake_run_simulation)
    assert _main(monkeypatch, "--out", str(tmp_path / "a")) == 0
    assert _main(monkeypatch, "--out", str(tmp_path / "b"), "--timeout-s", "7200") == 0
    assert seen == [None, 7200.0]


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_simulate_refuses_a_bad_timeout(value, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(simulate, "run_simulation", lambda *a, **k: pytest.fail("started"))
    assert _main(monkeypatch, "--out", str(tmp_path / "sim"), f"--timeout-s={value}") == 2
    assert "--timeout-s" in capsys.readouterr().err


# ----------------------------------------------------------------------------- finding 5: fault_suite.py's arguments


class _NoSuite:
    """Stands in for fault_suite.Suite: records that the suite would have started; starts nothing."""

    started: list = []

    def __init__(self, args) -> None:
        _NoSuite.started.append(args)
        self.out, self.app_sha = Path(args.out), "0" * 64

    def run(self, selected) -> int:
        return 0


@pytest.fixture
def no_suite(monkeypatch):
    monkeypatch.setattr(fault_suite, "Suite", _NoSuite)
    _NoSuite.started = []
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    yield _NoSuite.started
    for s, h in handlers.items():  # (the old code installed its SIGTERM handler for good)
        signal.signal(s, h)


@pytest.mark.parametrize(("argv", "option"), [
    (["--retries", "-1"], "--retries"), (["--byz-rounds", "0"], "--byz-rounds"), (["--honest", "0"], "--honest"),
    (["--round-timeout", "0"], "--round-timeout"), (["--round-timeout", "nan"], "--round-timeout"),
    (["--run-timeout", "-1"], "--run-timeout"), (["--poll-interval", "0"], "--poll-interval"),
    (["--wait-for-clients", "-1"], "--wait-for-clients"), (["--rounds", "2"], "--rounds"),
    (["--honest", "ten"], "--honest"),
])
def test_fault_suite_refuses_bad_numbers_before_starting(no_suite, tmp_path, capsys, argv, option):
    with pytest.raises(SystemExit) as exc:
        fault_suite.main([*argv, "--out", str(tmp_path / "fs")])
    assert exc.value.code == 2 and no_suite == []
    err = capsys.readouterr().err
    assert f"argument {option}: " in err, err


def test_fault_suite_takes_the_smallest_sensible_numbers(no_suite, tmp_path):
    argv = ["--retries", "0", "--byz-rounds", "1", "--honest", "1", "--round-timeout", "0.5", "--wait-for-clients",
            "0", "--load-wait", "0", "--rounds", "3", "--out", str(tmp_path / "fs")]
    assert fault_suite.main(argv) == 0
    (args,) = no_suite
    assert (args.retries, args.byz_rounds, args.honest, args.round_timeout, args.wait_for_clients, args.rounds) == \
        (0, 1, 1, 0.5, 0.0, 3)


# ----------------------------------------------------------------------------- finding 6: run_inprocess.py's output-dir

_CHEAP = ('model="gaussian_location" dataset="synthetic_gaussian_location" num-server-rounds=1 '
          "evaluate-clients=false checkpoint=false num-clients=2 min-clients=2 torch-threads=1")


def _run_inprocess(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPO / "scripts" / "run_inprocess.py"), *argv], capture_output=True,
                          text=True, timeout=600, cwd=REPO, env=env)


def test_run_inprocess_refuses_an_output_dir_override(tmp_path):
    wanted, out = tmp_path / "wanted", tmp_path / "out"
    res = _run_inprocess("--out", str(out), "-c", f'{_CHEAP} output-dir="{wanted}"')
    assert res.returncode == 2, res.stderr
    assert "output-dir is not taken here" in res.stderr and "--out" in res.stderr and "Traceback" not in res.stderr
    assert not wanted.exists() and not out.exists()


def test_run_inprocess_records_out_as_its_output_dir(tmp_path):
    out = tmp_path / "out"
    res = _run_inprocess("--out", str(out), "-c", _CHEAP)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((out / "run_config.json").read_text())["output-dir"] == str(out)


def test_run_inprocess_defaults_each_method_to_its_own_directory():
    # a walkthrough ran the README's two in-process rows one after the other: the FedAvg baseline's records replaced
    # PGVI's (both went to runs/inprocess) and left PGVI's checkpoint beside FedAvg's model
    sys.path.insert(0, str(REPO))
    from scripts.run_inprocess import default_out

    assert default_out("pgvi") == REPO / "runs" / "inprocess"
    assert default_out("fedavg") == REPO / "runs" / "inprocess-fedavg"
