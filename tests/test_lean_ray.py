"""scripts/lean_ray.py (a Ray head without the processes a one-host simulation does not use) and
``simulate.py --lean-ray``: the head runs exactly GCS, raylet and the raylet's two agents; Flower's simulation on it
gives the in-process run's posterior; the cleanup leaves nothing of it, also when it failed to start."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from scripts import lean_ray, simulate
from scripts.lean_ray import LeanRayError, start_lean_ray_head
from scripts.remove_tree import remove_tree
from tests.test_inprocess import BASE, TEXTBOOK_PARITY_CASES, run

pytestmark = pytest.mark.slow

#: the processes a lean head runs, by a word of their command line; and those of the head Flower's ray.init
#: starts that it leaves out
KEPT = ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent")
LEFT_OUT = ("dashboard/dashboard.py", "autoscaler/_private/monitor.py", "_private/log_monitor.py",
            "ray.util.client.server")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _head_family(marker: str) -> list[int]:
    head = simulate._pids_with_env(simulate.LEAN_RAY_MARKER, marker)
    return [p for p in dict.fromkeys([*head, *(c for p in head for c in simulate._children(p))])
            if not simulate._stat_fields(p) or simulate._stat_fields(p)[0] != "Z"]


def _naming(temp_dir: Path) -> list[int]:
    """Live processes whose command line names ``temp_dir`` (GCS and raylet do): found without the cleanup's own
    marker-and-children lookup."""
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and str(temp_dir) in _cmdline(int(d.name))
            and (simulate._stat_fields(int(d.name)) or ["Z"])[0] != "Z"]


def _kill(pids: list[int], temp_dir: Path | None = None) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if temp_dir is not None:  # retried while the killed processes still exit (a teardown: never raises)
        with contextlib.suppress(OSError):
            remove_tree(temp_dir)


def _start(marker: str, temp_dir: Path, **kw) -> str:
    env = {**os.environ, **simulate.FLWR_ENV, simulate.LEAN_RAY_MARKER: marker}
    return start_lean_ray_head(env, simulate.free_port(), simulate.free_port(), temp_dir, **kw)


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""


def test_the_head_runs_only_gcs_raylet_and_the_agents_and_the_cleanup_stops_it(tmp_path):
    head = simulate.LeanHead("t1-" + os.urandom(4).hex(), Path(tempfile.mkdtemp(prefix="pgvi-ray-")))
    try:
        address = _start(head.marker, head.temp_dir, cwd=tmp_path)
        assert address.startswith("127.0.0.1:")
        end = time.time() + 60  # ray start returns once the raylet is up; it starts its agents right after
        while time.time() < end:
            cmds = [_cmdline(p) for p in _head_family(head.marker)]
            if all(any(k in c for c in cmds) for k in KEPT):
                break
            time.sleep(0.5)
        assert sorted(k for c in cmds for k in KEPT if k in c) == sorted(KEPT), cmds
        assert len(cmds) == len(KEPT), cmds  # nothing else: no monitor, log monitor, dashboard or client server
        assert not [c for c in cmds for k in LEFT_OUT if k in c]
        assert {_cwd(p) for p in _head_family(head.marker)} == {str(tmp_path)}  # and so its workers' (actors')
        # workers on kernel-chosen ports, not Ray's fixed range 10002-19999, which two heads on one machine walk in
        # the same order (one worker or driver then fails to bind: 7 of 16 pairs of simultaneous simulations)
        raylet = [c for c in cmds if "raylet" in c.split(" ")[0]]
        assert len(raylet) == 1 and "--min_worker_port=0 " in raylet[0] and "--max_worker_port=0 " in raylet[0], raylet
        assert (head.temp_dir / "ray_current_cluster").read_text().strip().endswith(address.split(":")[1])
        _check_the_gcs_wants_the_token(head.temp_dir, address)
        _check_the_raylet_and_the_runtime_env_agent_want_the_token(head)
        t0 = time.time()
        simulate._cleanup(simulate.free_port(), head.temp_dir / "no-flwr-home", None, head)
        assert time.time() - t0 < simulate.LEAN_RAY_STOP_GRACE_S + 10  # the GCS ignores SIGTERM: killed after the grace
        assert _head_family(head.marker) == [] and _naming(head.temp_dir) == []
        assert not head.temp_dir.exists()
    finally:
        _kill(_head_family(head.marker), head.temp_dir)


#: Asks the GCS at argv[1] for its keys (one RPC, 5-s deadline) and prints OK or the error's class.
_GCS_PROBE = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_keys(b"", None, timeout=5)
    print("OK")
except Exception as err:
    print("ERR", type(err).__name__, err)
"""


def _check_the_gcs_wants_the_token(temp_dir: Path, address: str) -> None:
    """The head's GCS listens on every interface (Ray's launcher gives it no address to bind to): without the head's
    token, or with another one, it refuses the RPC; with :func:`lean_ray.auth_env` it answers."""
    import subprocess
    import sys

    token = temp_dir / lean_ray.AUTH_TOKEN_FILE
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64  # 256 bits, this user's only
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    cases = {"none": clean, "head's": {**clean, **lean_ray.auth_env(temp_dir)},
             "other": {**clean, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}}
    seen = {}
    for name, env in cases.items():
        res = subprocess.run([sys.executable, "-c", _GCS_PROBE, address], env=env, capture_output=True, text=True,
                             timeout=120)
        seen[name] = (res.stdout.strip().splitlines() or [res.stderr[-500:]])[-1]
    assert seen["head's"] == "OK", seen
    for name in ("none", "other"):
        assert seen[name].startswith("ERR AuthenticationError") and "InvalidAuthToken" in seen[name], seen


def _listening(pid: int) -> list[tuple[str, int]]:
    """The TCP (v4 and v6) addresses ``pid`` listens on, from its socket inodes and ``/proc/net/tcp*``."""
    import socket

    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                raw, port = fields[1].split(":")
                words = bytes.fromhex(raw)  # the kernel prints each 32-bit word in host (little-endian) order
                packed = b"".join(words[i:i + 4][::-1] for i in range(0, len(words), 4))
                found.append((socket.inet_ntop(family, packed), int(port, 16)))
    return found


def _check_the_raylet_and_the_runtime_env_agent_want_the_token(head: simulate.LeanHead) -> None:
    """Besides the GCS, the head's raylet (its node manager listens on every interface) and its runtime-env agent
    (an HTTP server on the machine's address that installs packages and fetches code for runtime environments)
    refuse a request without the head's token, or with another one, and answer one with it."""
    import urllib.error
    import urllib.request

    import grpc
    from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

    token = (head.temp_dir / lean_ray.AUTH_TOKEN_FILE).read_text().strip()
    tokens = {"none": None, "other": "0" * 64, "head's": token}
    family = {p: _cmdline(p) for p in _head_family(head.marker)}
    raylet = next(p for p, c in family.items() if "raylet" in c.split(" ")[0])
    answers = {}
    for _, port in _listening(raylet):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
            for name, tok in tokens.items():
                try:
                    stub.GetSystemConfig(node_manager_pb2.GetSystemConfigRequest(), timeout=10,
                                         metadata=None if tok is None else [("authorization", f"Bearer {tok}")])
                    answers[(port, name)] = "OK"
                except grpc.RpcError as err:
                    answers[(port, name)] = err.code().name
    node_manager = [port for (port, name), a in answers.items() if name == "head's" and a == "OK"]
    assert len(node_manager) == 1, answers
    assert answers[(node_manager[0], "none")] == answers[(node_manager[0], "other")] == "UNAUTHENTICATED", answers

    agent = next(p for p, c in family.items() if "ray::RuntimeEnvAgent" in c)
    end = time.time() + 60  # the agent starts its server after the raylet is up
    while not (addresses := _listening(agent)) and time.time() < end:
        time.sleep(0.5)
    assert addresses, "the runtime-env agent listens nowhere"
    host, port = addresses[0]
    status = {}
    for name, tok in tokens.items():
        req = urllib.request.Request(f"http://{'[' + host + ']' if ':' in host else host}:{port}/get_runtime_envs_info",
                                     data=b"", method="POST",
                                     headers={} if tok is None else {"Authorization": f"Bearer {tok}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as res:
                status[name] = res.status
        except urllib.error.HTTPError as err:
            status[name] = err.code
    assert status["head's"] == 200 and status["none"] in (401, 403) and status["other"] in (401, 403), status


def test_a_second_head_in_the_same_temp_dir_does_not_reuse_or_follow_its_token_file(tmp_path):
    (tmp_path / lean_ray.AUTH_TOKEN_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(LeanRayError, match=r"cannot create the head's token file .*auth-token"):
        lean_ray._write_token(tmp_path)
    assert not (tmp_path / "elsewhere").exists()


def test_a_head_that_cannot_start_is_one_error_with_rays_output_and_the_cleanup_stops_what_it_started():
    head = simulate.LeanHead("t2-" + os.urandom(4).hex(), Path(tempfile.mkdtemp(prefix="pgvi-ray-")))
    try:
        with pytest.raises(LeanRayError, match=r"ray start --head` failed \(exit 1\).*nonnegative"):
            _start(head.marker, head.temp_dir, num_cpus=-1)  # refused by Ray after its GCS has started
        simulate._cleanup(simulate.free_port(), head.temp_dir / "no-flwr-home", None, head)
        assert _head_family(head.marker) == [] and _naming(head.temp_dir) == []
        assert not head.temp_dir.exists()
    finally:
        _kill(_head_family(head.marker), head.temp_dir)


def test_the_launcher_refuses_a_ray_without_the_steps_it_leaves_out(monkeypatch, capsys):
    monkeypatch.setattr(lean_ray, "_PATCHES", (("ray._private.node", "Node.no_such_step", lambda self: None),))
    with pytest.raises(LeanRayError, match=r"has no ray\._private\.node\.Node\.no_such_step.*without --lean-ray"):
        lean_ray._patch_ray()
    assert lean_ray._main(["--port", "1", "--temp-dir", "/nonexistent", "--dashboard-agent-listen-port", "2"]) == 2
    assert "no ray._private.node.Node.no_such_step" in capsys.readouterr().err


def test_the_launcher_says_when_ray_is_not_installed(monkeypatch, capsys):
    import importlib

    real = importlib.import_module

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", no_ray)
    with pytest.raises(LeanRayError, match=r"Ray is not installed here .*needs flwr\[simulation\]"):
        lean_ray._patch_ray()
    assert lean_ray._main(["--port", "1", "--temp-dir", "/nonexistent", "--dashboard-agent-listen-port", "2"]) == 2
    assert "Ray is not installed here" in capsys.readouterr().err


def test_a_temp_dir_too_long_for_rays_socket_paths_says_to_set_ray_tmpdir(tmp_path):
    long_dir = tmp_path / ("d" * 60)
    long_dir.mkdir()
    head = simulate.LeanHead("t5-" + os.urandom(4).hex(), long_dir)
    try:
        with pytest.raises(LeanRayError, match=r"path length.*too long for Ray's socket paths.*set RAY_TMPDIR"):
            _start(head.marker, head.temp_dir)
    finally:
        simulate._cleanup(simulate.free_port(), long_dir / "no-flwr-home", None, head)
        _kill(_head_family(head.marker), long_dir)
    assert _naming(long_dir) == []


def test_a_simulation_on_the_lean_head_gives_the_inprocess_posterior_and_leaves_nothing(tmp_path, monkeypatch):
    started: list[str] = []
    real_start = simulate.start_lean_ray_head

    def recording_start(env, *a, **kw):
        started.append(env[simulate.LEAN_RAY_MARKER])
        return real_start(env, *a, **kw)

    monkeypatch.setattr(simulate, "start_lean_ray_head", recording_start)
    drivers: list[str] = []  # the drivers that joined the head (Flower's ray.init), read just before the cleanup
    real_cleanup = simulate._cleanup

    def cleanup(*a):
        drivers.extend(p.name for p in ray_tmp.glob("session_latest/logs/python-core-driver-*"))
        real_cleanup(*a)

    monkeypatch.setattr(simulate, "_cleanup", cleanup)
    ray_tmp = Path(tempfile.mkdtemp(prefix="pgvi-ray-t"))  # short: Ray's socket paths must stay under 108 bytes
    monkeypatch.setattr(simulate.tempfile, "mkdtemp", lambda *a, **k: str(ray_tmp))  # to check its removal
    overrides = {**TEXTBOOK_PARITY_CASES["sync-nll"], "num-server-rounds": 2, "dtype": "float64",
                 "evaluate-clients": False, "wait-for-clients-s": 180, "round-timeout-s": 120}
    raw = {**BASE, **overrides}
    res = simulate.run_simulation(raw, num_supernodes=raw["num-clients"], workdir=tmp_path / "sim", timeout=900,
                                  lean_ray=True)
    assert res["status"] == "finished:completed", res["log"].read_text()[-3000:]
    assert len(started) == 1
    assert len(drivers) == 1, drivers  # flwr-simulation's ray.init joined the lean head, not a head of its own
    assert _head_family(started[0]) == [] and _naming(ray_tmp) == [] and not ray_tmp.exists()
    post = dict(np.load(res["out_dir"] / "posterior.npz"))
    summary = json.loads((res["out_dir"] / "summary.json").read_text())
    _, strategy, _ = run(overrides)
    assert summary["ledger-versions"] == strategy.ledger_versions
    for k, v in strategy.state.posterior.to_numpy().items():
        np.testing.assert_allclose(post[k], v, rtol=0, atol=1e-6 * max(1.0, float(np.abs(v).max())))


def test_the_second_flwr_run_after_flowers_superlink_gave_up_still_has_the_head(tmp_path, monkeypatch):
    """When Flower's SuperLink misses its 15 s, simulate.py stops every process of FLWR_HOME, starts a SuperLink
    itself and runs `flwr run` again: the lean head must survive that stop (it used to be in FLWR_HOME, was
    stopped, and the second run's ray.init retried the dead address until the timeout)."""
    real_run = simulate.subprocess.run
    faked = []

    def first_flwr_run_gives_up(cmd, *a, **kw):
        if isinstance(cmd, list) and Path(cmd[0]).name == "flwr" and cmd[1] == "run" and not faked:
            faked.append(cmd)
            kw["stdout"].write("Error: Failed to start local SuperLink within 15s. See logs at /x/superlink.log.\n")
            return simulate.subprocess.CompletedProcess(cmd, 0)
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(simulate.subprocess, "run", first_flwr_run_gives_up)
    overrides = {**TEXTBOOK_PARITY_CASES["sync-nll"], "num-server-rounds": 1, "dtype": "float64",
                 "evaluate-clients": False, "wait-for-clients-s": 120, "round-timeout-s": 120}
    raw = {**BASE, **overrides}
    res = simulate.run_simulation(raw, num_supernodes=raw["num-clients"], workdir=tmp_path / "sim", timeout=300,
                                  lean_ray=True)
    assert len(faked) == 1
    assert res["status"] == "finished:completed", res["log"].read_text()[-3000:]


def test_a_simulate_py_killed_outright_leaves_no_superlink_no_head_and_no_reaper(tmp_path):
    """SIGKILL (or the OOM killer) gives simulate.py no chance to clean up; Flower's SuperLink and the lean Ray head
    run detached and used to stay.  Its reaper (a shell waiting on a pipe from it) runs the cleanup instead."""
    import subprocess
    import sys

    ray_tmp = Path(tempfile.mkdtemp(prefix="pgvi-ray-k"))  # short: Ray's socket paths must stay under 108 bytes
    out = tmp_path / "sim"
    home = out / "flwr-home"
    overrides = " ".join(f"{k}={json.dumps(v)}" for k, v in {**BASE, "num-server-rounds": 100000,
                                                              "round-timeout-s": 60}.items())
    env = {**os.environ, **simulate.FLWR_ENV, "RAY_TMPDIR": str(ray_tmp)}
    log = open(tmp_path / "simulate.out", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, str(simulate.ROOT / "scripts" / "simulate.py"), "--lean-ray", "--out",
                             str(out), "-c", overrides], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        end = time.time() + 300
        while time.time() < end and proc.poll() is None:  # until rounds are being recorded
            if list(out.glob("outputs/run-*/metrics.jsonl")):
                break
            time.sleep(0.5)
        assert proc.poll() is None, (tmp_path / "simulate.out").read_text()[-3000:]
        assert simulate._pids_with_env("FLWR_HOME", str(home)) and _naming(ray_tmp)  # a SuperLink and a head run
        reapers = [p for p in simulate._children(proc.pid) if "/bin/sh" in _cmdline(p)]
        assert len(reapers) == 1, [_cmdline(p) for p in simulate._children(proc.pid)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        end = time.time() + 90
        while time.time() < end and (simulate._pids_with_env("FLWR_HOME", str(home)) or _naming(ray_tmp)
                                     or simulate._alive(reapers[0]) or any(ray_tmp.iterdir())):
            time.sleep(0.5)
        assert simulate._pids_with_env("FLWR_HOME", str(home)) == []
        assert _naming(ray_tmp) == [] and list(ray_tmp.iterdir()) == []  # head stopped, its temp dir removed
        assert not simulate._alive(reapers[0])
        log.close()
        assert "the simulation's process died without stopping its processes" in (
            tmp_path / "simulate.out").read_text()
    finally:
        log.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill(simulate._pids_with_env("FLWR_HOME", str(home)) + _naming(ray_tmp), ray_tmp)


def test_the_heads_temp_dir_is_removed_after_the_superlink_stops(tmp_path, monkeypatch):
    """The Ray driver inside the SuperLink's processes writes its logs into the head's session dir until it stops:
    removing the dir before that left it behind once in CI (a file made mid-rmtree keeps its directory)."""
    temp_dir = tmp_path / "head"
    (temp_dir / "session" / "logs").mkdir(parents=True)
    seen = []

    def stop_superlink(port, home):  # the driver still writes when the SuperLink is being stopped
        seen.append(temp_dir.exists())
        (temp_dir / "session" / "logs" / "python-core-driver.log").write_text("still running")

    monkeypatch.setattr(simulate, "stop_local_superlink", stop_superlink)
    simulate._stop_everything(None, tmp_path / "home", None, simulate.LeanHead("no-such-marker", temp_dir))
    assert seen == [True] and not temp_dir.exists()


def test_a_temp_dir_that_cannot_be_removed_is_warned_about_and_the_cleanup_goes_on(tmp_path, monkeypatch, capsys):
    def failing(path):
        raise OSError(39, "Directory not empty")

    monkeypatch.setattr(simulate, "remove_tree", failing)
    simulate._remove_tree(tmp_path)
    assert f"could not remove {tmp_path}: OSError" in capsys.readouterr().err
