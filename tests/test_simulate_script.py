"""scripts/simulate.py and scripts/run_main.sh without Flower: ``flwr`` is faked (``subprocess.run`` of the
``flwr`` binary), the SuperLink is a small HTTP server answering ``/health`` on 127.0.0.1, and every process a
test starts is stopped by the test (also when the code under test fails to)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts import simulate
from scripts.lean_ray import LeanRayError

REPO = Path(__file__).resolve().parents[1]
STARTED_LOG = "Successfully started run 7\nStarting logstream for run_id `7`\nINFO :      PGVI finished\n"
FLOWER_GAVE_UP = "Error: Failed to start local SuperLink within 15s. See logs at /x/superlink.log.\n"

# a stand-in for flower-superlink: records its arguments, optionally exits at once, else answers /health on
# --host:--port after a short start-up
FAKE_SUPERLINK = r"""
import http.server, json, os, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_SUPERLINK_ARGS"], "a") as f:
    f.write(json.dumps(args) + "\n")
if os.environ.get("FAKE_SUPERLINK_EXIT"):
    sys.exit(int(os.environ["FAKE_SUPERLINK_EXIT"]))
time.sleep(0.3)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
http.server.HTTPServer((host, port), Health).serve_forever()
"""


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead, not yet reaped)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return text[text.rfind(")") + 1:].split()[0] == "Z"


def _procs_with_home(home: Path) -> list[int]:
    needle = f"FLWR_HOME={home}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                pass
    return [p for p in out if not _gone(p)]


def _kill(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _healthy(port: int) -> bool:
    import urllib.request

    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture
def fake_superlink(tmp_path, monkeypatch):
    """An executable stand-in for ``flower-superlink``; ``simulate._flwr_bin`` resolves to it."""
    script = tmp_path / "bin" / "flower-superlink"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\n{FAKE_SUPERLINK}")
    script.chmod(0o755)
    args_file = tmp_path / "superlink-args.jsonl"
    monkeypatch.setenv("FAKE_SUPERLINK_ARGS", str(args_file))
    real_bin = simulate._flwr_bin  # noqa: SLF001
    monkeypatch.setattr(simulate, "_flwr_bin",
                        lambda name: str(script) if name == "flower-superlink" else real_bin(name))
    return script, args_file


@pytest.fixture
def fake_flwr(monkeypatch, fake_superlink):
    """``flwr run`` / ``flwr ls`` faked; ``state["on_run"](cmd, env)`` returns what a ``flwr run`` prints (default:
    a started run 7); ``flwr ls`` lists run 7 as completed.  Other commands (``ss``, ``ps``) really run.
    Processes a fake ``flwr run`` leaves behind go in ``state["procs"]``; whatever survives is killed at the end."""
    real_run = subprocess.run
    state: dict = {"runs": [], "ls": 0, "procs": [], "homes": []}

    def fake_run(cmd, *args, **kw):
        if not (isinstance(cmd, list) and len(cmd) > 1 and Path(cmd[0]).name == "flwr"):
            return real_run(cmd, *args, **kw)
        env = kw.get("env") or {}
        state["homes"].append(env.get("FLWR_HOME"))
        if cmd[1] == "run":
            state["runs"].append(list(cmd))
            kw["stdout"].write(state["on_run"](cmd, env) if "on_run" in state else STARTED_LOG)
            return subprocess.CompletedProcess(cmd, 0)
        if cmd[1] == "ls":
            state["ls"] += 1
            runs = [{"run-id": "7", "status": "finished:completed", "status-details": "N/A"}]
            return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps({"success": True, "runs": runs}), stderr="")
        raise AssertionError(cmd)

    monkeypatch.setattr(simulate.subprocess, "run", fake_run)
    yield state
    for proc in state["procs"]:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    for home in state["homes"]:
        if home:
            _kill(_procs_with_home(Path(home)))


def _main(monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["simulate.py", *argv])
    with pytest.raises(SystemExit) as exc:
        simulate.main()
    return exc.value.code


def _no_tools_on_path(tmp_path, monkeypatch) -> None:
    """A slim image: no ``ss`` (iproute2), no ``ps`` (procps), nothing else either."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


# ----------------------------------------------------------------------------- 1. cleanup without ss / ps


_SLEEPER = "import time; time.sleep(120)"
_LISTENER = """
import os, socket, subprocess, sys, time
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
env = {k: v for k, v in os.environ.items() if k != "FLWR_HOME"}
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(str(kid.pid))
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
time.sleep(120)
"""


def _await_file(path: Path, timeout: float = 20.0) -> str:
    end = time.time() + timeout
    while not path.exists():
        assert time.time() < end, f"{path} never appeared"
        time.sleep(0.05)
    return path.read_text()


def test_stop_local_superlink_needs_neither_ss_nor_ps(tmp_path, monkeypatch):
    """The SuperLink (found by its listening port, with a grandchild found by its parent id) and another
    process of the simulation (found by its FLWR_HOME) are stopped on a machine without ``ss`` and ``ps``."""
    port, home = simulate.free_port(), tmp_path / "flwr-home"
    env = {k: v for k, v in os.environ.items() if k != "FLWR_HOME"}
    listener = subprocess.Popen([sys.executable, "-c", _LISTENER, str(port), str(tmp_path / "kid")], env=env)
    other = subprocess.Popen([sys.executable, "-c", _SLEEPER], env={**env, "FLWR_HOME": str(home)})
    kid = int(_await_file(tmp_path / "kid"))
    try:
        _no_tools_on_path(tmp_path, monkeypatch)
        simulate.stop_local_superlink(port, home, timeout=5.0)
        assert listener.wait(timeout=5) is not None and other.wait(timeout=5) is not None
        end = time.time() + 5
        while not _gone(kid) and time.time() < end:
            time.sleep(0.05)
        assert _gone(kid), "the SuperLink's child survived"
    finally:
        _kill([listener.pid, other.pid, kid])
        listener.wait(timeout=10)
        other.wait(timeout=10)


def test_a_failing_lookup_does_not_keep_the_flwr_home_scan_from_running(tmp_path, monkeypatch, capsys):
    home = tmp_path / "flwr-home"
    other = subprocess.Popen([sys.executable, "-c", _SLEEPER], env={**os.environ, "FLWR_HOME": str(home)})
    try:
        def broken(port):
            raise OSError("no way to list sockets here")

        monkeypatch.setattr(simulate, "_pids_listening", broken)
        simulate.stop_local_superlink(simulate.free_port(), home, timeout=5.0)
        assert other.wait(timeout=5) is not None
        assert "no way to list sockets here" in capsys.readouterr().err  # warned, not raised
    finally:
        _kill([other.pid])
        other.wait(timeout=10)


def test_completed_run_without_ss_is_reported_as_completed_and_its_superlink_stopped(fake_flwr, fake_superlink,
                                                                                       tmp_path, monkeypatch, capsys):
    """The reviewer's slim-image run: ``flwr run`` leaves its SuperLink running detached and the run completed;
    without ``ss`` the script used to crash in the cleanup (rc 1, nothing stopped)."""
    script, _ = fake_superlink

    def flower_run(cmd, env):  # Flower starts its SuperLink detached and leaves it running
        port = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
        fake_flwr["procs"].append(subprocess.Popen([str(script), "--host", "127.0.0.1", "--port", port], env=env,
                                                   start_new_session=True))
        end = time.time() + 20
        while not _healthy(int(port)):
            assert time.time() < end
            time.sleep(0.05)
        return STARTED_LOG

    fake_flwr["on_run"] = flower_run
    _no_tools_on_path(tmp_path, monkeypatch)
    code = _main(monkeypatch, "--supernodes", "3", "--out", str(tmp_path / "sim"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "status: finished:completed" in out
    [superlink] = fake_flwr["procs"]
    superlink.wait(timeout=5)  # stopped by the cleanup (raises TimeoutExpired if it still runs)
    assert _procs_with_home((tmp_path / "sim" / "flwr-home").resolve()) == []


# ----------------------------------------------------------------------------- 2. SuperLink start retry


@pytest.fixture
def short_health_waits(monkeypatch):
    """Every health wait capped at 5 s (the old retry waited 180 s per attempt for a SuperLink Flower had killed)."""
    real = simulate._wait_healthy  # noqa: SLF001

    def capped(port, timeout, *args, **kw):
        return real(port, min(timeout, 5.0), *args, **kw)

    monkeypatch.setattr(simulate, "_wait_healthy", capped)


def test_superlink_flower_gave_up_on_is_started_here_and_used(fake_flwr, fake_superlink, short_health_waits,
                                                               tmp_path):
    """Flower's `flwr run` kills the SuperLink it started when it does not answer within 15 s: the script starts
    one itself (loopback, private ports, the simulation's FLWR_HOME), waits for its /health and runs `flwr run`
    again, which finds it answering (as Flower does) and uses it."""
    _, args_file = fake_superlink

    ports = []

    def flower_run(cmd, env):  # like Flower: use a SuperLink answering on the port, else start one (and give up)
        ports.append((env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"], env["FLWR_LOCAL_CONTROL_API_PORT"]))
        return STARTED_LOG if _healthy(int(ports[-1][0])) else FLOWER_GAVE_UP

    fake_flwr["on_run"] = flower_run
    t0 = time.time()
    res = simulate.run_simulation({"num-server-rounds": 1}, 2, tmp_path / "sim")
    assert res["status"] == "finished:completed" and res["run_id"] == "7", res
    assert len(fake_flwr["runs"]) == 2 and time.time() - t0 < 30
    [args] = [json.loads(line) for line in args_file.read_text().splitlines()]
    home = (tmp_path / "sim" / "flwr-home").resolve()
    (http_port, control_port), = set(ports)  # the private ports `flwr run` was told to use, both times
    assert args[args.index("--host") + 1] == "127.0.0.1" and args[args.index("--port") + 1] == http_port
    assert args[args.index("--control-api-address") + 1] == f"127.0.0.1:{control_port}" and "--simulation" in args
    assert Path(args[args.index("--database") + 1]).parent == home / "local-superlink"
    assert _procs_with_home(home) == []  # and it was stopped


def test_superlink_that_cannot_start_is_given_up_at_once(fake_flwr, fake_superlink, short_health_waits, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("FAKE_SUPERLINK_EXIT", "3")
    fake_flwr["on_run"] = lambda cmd, env: FLOWER_GAVE_UP
    t0 = time.time()
    res = simulate.run_simulation({"num-server-rounds": 1}, 2, tmp_path / "sim")
    assert time.time() - t0 < 4.5  # no health wait on a SuperLink that has exited
    assert res["status"] == "not-started" and "exited with code 3" in res["status-details"], res
    assert len(fake_flwr["runs"]) == 1 and fake_flwr["ls"] == 0


# ----------------------------------------------------------------------------- 3. run-config values


@pytest.mark.parametrize("item, key", [("hidden=[100,100]", "hidden"), ("resume=1979-05-27", "resume"),
                                       ("sequential-order={a=1}", "sequential-order"), ("t=07:32:00", "t"),
                                       ("lr=0.1 when=1979-05-27T07:32:00Z", "when")])
def test_overrides_refuse_values_that_are_no_run_config_values(item, key):
    with pytest.raises(ValueError, match=rf"{key}=.*(array|inline table|date/time).*bool, an int, a float"):
        simulate.parse_overrides(item)


def test_cli_refuses_an_array_override_before_starting_anything(fake_flwr, tmp_path, monkeypatch, capsys):
    assert _main(monkeypatch, "--out", str(tmp_path / "sim"), "-c", "hidden=[100,100]") == 2
    assert "hidden=[100,100] is a TOML array" in capsys.readouterr().err
    assert fake_flwr["runs"] == []


def test_run_config_strings_round_trip_through_toml_and_flower(tmp_path):
    from flwr.common.config import parse_config_args

    values = {"emoji": "run-\U0001F600", "latin": "caf\u00e9", "cjk": "\u6570\u636e", "quote": 'say "hi"',
              "squote": "it's", "backslash": "C:\\data", "controls": "a\tb\nc\rd\x01e\x1bf", "del": "a\x7fb",
              "spaces": "/tmp/my data", "small": 1e-20, "big": 1e300, "int": 7, "bool": False}
    path = simulate.write_run_config(tmp_path / "rc.toml", values)
    import tomllib

    assert tomllib.loads(path.read_text(encoding="utf-8")) == values
    assert parse_config_args([str(path)]) == values


@pytest.mark.parametrize("value", [[100, 100], {"a": 1}, None])
def test_write_run_config_refuses_a_value_that_is_no_run_config_value(tmp_path, value):
    with pytest.raises(ValueError, match="hidden"):
        simulate.write_run_config(tmp_path / "rc.toml", {"lr": 0.1, "hidden": value})


def test_output_dir_override_is_refused_with_a_pointer_to_out(fake_flwr, tmp_path, monkeypatch, capsys):
    code = _main(monkeypatch, "--out", str(tmp_path / "sim"), "-c", f'output-dir="{tmp_path / "mine"}"')
    assert code == 2
    err = capsys.readouterr().err
    assert "output-dir" in err and "--out" in err
    assert fake_flwr["runs"] == []


# ----------------------------------------------------------------------------- 4. number of SuperNodes


def test_supernodes_follow_num_clients_by_default(fake_flwr, tmp_path, monkeypatch):
    """One SuperNode per client: num-clients of the -c overrides, else of pyproject.toml."""
    import tomllib

    assert _main(monkeypatch, "--out", str(tmp_path / "sim"), "-c", "num-clients=4 min-clients=4") == 0
    assert _main(monkeypatch, "--out", str(tmp_path / "sim"), "-c", "num-clients=2", "-c", "min-clients=1") == 0
    assert _main(monkeypatch, "--out", str(tmp_path / "sim"), "-c", "num-server-rounds=1") == 0
    clients = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]["num-clients"]
    federation = [cmd[cmd.index("--federation-config") + 1].split()[0] for cmd in fake_flwr["runs"]]
    assert federation == ["num-supernodes=4", "num-supernodes=2", f"num-supernodes={clients}"]


def test_supernodes_disagreeing_with_num_clients_are_warned_about(fake_flwr, tmp_path, monkeypatch, capsys):
    _main(monkeypatch, "--supernodes", "3", "--out", str(tmp_path / "sim"), "-c", "num-clients=4 min-clients=4")
    assert "--supernodes 3 differs from num-clients=4" in capsys.readouterr().err


def test_each_run_keeps_its_own_log_beside_its_records(fake_flwr, tmp_path, monkeypatch, capsys):
    """Two simulations into one --out: OUT/flwr-run.log is the last run's, and each run's records directory holds
    a copy of that run's own log (the first run's log was lost before); a run that wrote no records gets none."""
    import tomllib

    def flower_run(cmd, env):  # like the ServerApp: the records go to <output-dir>/run-<id>
        n = len(fake_flwr["runs"])
        config = tomllib.loads(Path(cmd[cmd.index("--run-config") + 1]).read_text())
        if n < 3:
            (Path(config["output-dir"]) / f"run-{n}").mkdir(parents=True)
        return f"Successfully started run {n}\nStarting logstream for run_id `{n}`\nINFO :      PGVI run {n} done\n"

    fake_flwr["on_run"] = flower_run
    out = tmp_path / "sim"
    for _ in range(3):
        _main(monkeypatch, "--out", str(out), "-c", "num-server-rounds=1")
    assert "PGVI run 3 done" in (out / "flwr-run.log").read_text()
    for n in (1, 2):
        assert "PGVI run %d done" % n in (out / "outputs" / f"run-{n}" / "flwr-run.log").read_text()
    assert not (out / "outputs" / "run-3").exists()
    assert "records: none written" in capsys.readouterr().out


def test_run_main_sh_lets_simulate_py_choose_the_supernodes(tmp_path):
    """run_main.sh with setup.sh and the venv's python faked: simulate.py gets the user's arguments and no
    --supernodes of its own (it used to force 3, so -c 'num-clients=4 min-clients=4' failed after 120 s)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "run_main.sh").write_text((REPO / "scripts" / "run_main.sh").read_text())
    (tmp_path / "scripts" / "setup.sh").write_text("exit 0\n")
    py = tmp_path / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    py.chmod(0o755)
    out = tmp_path / "args.txt"
    subprocess.run(["bash", str(tmp_path / "scripts" / "run_main.sh"), "-c", "num-clients=4 min-clients=4"],
                   env={**os.environ, "ARGS_OUT": str(out)}, check=True, timeout=30)
    assert out.read_text().splitlines() == ["scripts/simulate.py", "--out", "runs/main", "-c",
                                            "num-clients=4 min-clients=4"]


# ----------------------------------------------------------------------------- 5. --lean-ray (tests/test_lean_ray.py runs it for real)


@pytest.fixture
def fake_lean_head(monkeypatch):
    """``start_lean_ray_head`` faked: records the environment and temp dir it is given; ``state["fail"]`` makes it
    raise LeanRayError."""
    state: dict = {"calls": []}

    def fake_start(env, port, agent_port, temp_dir, **kw):
        state["calls"].append({"env": env, "temp_dir": Path(temp_dir), "existed": Path(temp_dir).is_dir(),
                               "cwd": kw.get("cwd")})
        if "fail" in state:
            raise LeanRayError(state["fail"])
        return f"127.0.0.1:{port}"

    monkeypatch.setattr(simulate, "start_lean_ray_head", fake_start)
    return state


def test_lean_ray_starts_a_head_that_flwr_run_joins_and_removes_its_temp_dir(fake_flwr, fake_lean_head, tmp_path,
                                                                              monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "f" * 64)  # would take precedence over the head's token file
    seen, auth = [], []
    fake_flwr["on_run"] = lambda cmd, env: (seen.append(env.get("RAY_ADDRESS")), auth.append(
        {k: v for k, v in env.items() if k.startswith("RAY_AUTH")})) and STARTED_LOG
    assert _main(monkeypatch, "--out", str(tmp_path / "sim"), "-c", "num-clients=2 min-clients=2") == 0
    assert fake_lean_head["calls"] == [] and seen == [None]  # not asked for: Flower's own ray.init
    assert _main(monkeypatch, "--lean-ray", "--out", str(tmp_path / "sim"), "-c", "num-clients=2 min-clients=2") == 0
    (call,) = fake_lean_head["calls"]
    assert call["existed"] and not call["temp_dir"].exists()  # made before the start, removed by the cleanup
    # not stopped with FLWR_HOME's processes when Flower's SuperLink is replaced between the two `flwr run`s
    assert "FLWR_HOME" not in call["env"]
    assert call["cwd"] == simulate.ROOT  # where Flower's own head and its workers run
    assert call["env"][simulate.LEAN_RAY_MARKER]
    assert seen[1] is not None and seen[1].startswith("127.0.0.1:")
    # the lean head wants its token (scripts/lean_ray.py): `flwr run`, and so Flower's ray.init, gets its file
    assert auth[1] == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(call["temp_dir"] / "auth-token")}


def test_a_lean_head_that_cannot_start_is_one_error_and_no_run(fake_flwr, fake_lean_head, tmp_path, monkeypatch,
                                                               capsys):
    fake_lean_head["fail"] = "`ray start --head` failed (exit 1): boom"
    assert _main(monkeypatch, "--lean-ray", "--out", str(tmp_path / "sim"), "-c", "num-clients=2 min-clients=2") == 1
    err = capsys.readouterr().err
    assert "simulate.py: error: `ray start --head` failed (exit 1): boom" in err
    assert fake_flwr["runs"] == []
    assert not fake_lean_head["calls"][0]["temp_dir"].exists()


def test_lean_ray_takes_its_temp_dir_under_ray_tmpdir_and_the_superlinks_ports_after_the_head(
        fake_flwr, fake_lean_head, tmp_path, monkeypatch):
    # RAY_TMPDIR: where Ray's own head keeps its sessions (a short one is the way round long socket paths)
    ray_tmp = tmp_path / "raytmp"
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    picked: list[int] = []
    real_free_port = simulate.free_port

    def recording_free_port() -> int:
        picked.append(real_free_port())
        return picked[-1]

    monkeypatch.setattr(simulate, "free_port", recording_free_port)
    real_fake_start = simulate.start_lean_ray_head

    def start(*args, **kw):
        picked.append(-1)  # the head starts here
        return real_fake_start(*args, **kw)

    monkeypatch.setattr(simulate, "start_lean_ray_head", start)
    seen = []
    fake_flwr["on_run"] = lambda cmd, env: seen.append(env) or STARTED_LOG
    assert _main(monkeypatch, "--lean-ray", "--out", str(tmp_path / "sim"), "-c", "num-clients=2 min-clients=2") == 0
    (call,) = fake_lean_head["calls"]
    assert call["temp_dir"].parent == ray_tmp and call["temp_dir"].name.startswith("pgvi-ray-")
    assert not call["temp_dir"].exists()
    # the SuperLink's ports are picked after the head has bound its own, which could otherwise take them
    after = picked[picked.index(-1) + 1:]
    assert int(seen[0]["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]) in after
    assert int(seen[0]["FLWR_LOCAL_CONTROL_API_PORT"]) in after


@pytest.mark.parametrize("name", ["flwr-home", "a\nb c:d $(x) caf\udce9"])  # a newline, not UTF-8 (byte 0xe9)
def test_the_reaper_exits_on_done_and_stops_the_simulations_processes_at_end_of_file(tmp_path, name):
    """simulate.py's reaper (a shell reading a pipe): ``done`` ends it with nothing stopped; end of file without it
    (simulate.py died) runs ``simulate.py --reap``, which stops every process of the simulation's FLWR_HOME, whatever
    bytes its path holds, and meanwhile holds the FLWR_HOME lock with its own pid in it."""
    import fcntl

    home = tmp_path / name
    home.mkdir()

    def sleeper() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                env={**os.environ, "FLWR_HOME": str(home)}, start_new_session=True)

    a = sleeper()
    try:
        reaper = simulate._Reaper(home)
        reaper.tell("--port=1")
        reaper.dismiss()
        assert reaper.proc.returncode == 0 and a.poll() is None  # told "done": nothing stopped
        with open(home / ".simulate.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            lock.write("12345\n")
            lock.flush()
            reaper = simulate._Reaper(home, lock.fileno())
        assert reaper.proc.stdin is not None  # the lock is now held by the reaper alone
        with open(home / ".simulate.lock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        reaper.tell("--port=1")
        reaper.proc.stdin.close()  # as when simulate.py is killed: end of file, no "done"
        assert reaper.proc.wait(timeout=60) == 0
        assert a.wait(timeout=10) == -signal.SIGTERM
        assert (home / ".simulate.lock").read_text() == f"{reaper.proc.pid}\n"  # the shell exec'd the cleanup
        with open(home / ".simulate.lock") as other:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the reaper exited
    finally:
        if a.poll() is None:
            a.kill()


def test_without_bin_sh_the_simulation_runs_without_a_reaper_and_says_so(monkeypatch, capsys, tmp_path):
    real_popen = simulate.subprocess.Popen

    def no_sh(cmd, *a, **kw):
        if cmd[0] == "/bin/sh":
            raise FileNotFoundError(2, "No such file or directory", "/bin/sh")
        return real_popen(cmd, *a, **kw)

    monkeypatch.setattr(simulate.subprocess, "Popen", no_sh)
    reaper = simulate._Reaper(tmp_path / "home")
    reaper.tell("--port=2")
    reaper.dismiss()
    assert reaper.proc is None
    assert "no reaper (FileNotFoundError" in capsys.readouterr().err


def test_the_report_of_a_refused_run_is_its_error_line_and_no_records(tmp_path):
    # a walkthrough's run with loss="foo": the report showed a traceback's "raise ConfigError(...)" line besides the
    # ERROR line, and a records directory that was never created
    log = tmp_path / "flwr-run.log"
    log.write_text("\x1b[91mERROR \x1b[0m:     ServerApp raised: invalid run config: loss: unknown loss 'foo'\n"
                   "Traceback (most recent call last):\n"
                   "    raise ConfigError(_format_validation_error(err)) from None\n"
                   "common.config.ConfigError: invalid run config: loss: unknown loss 'foo'\n")
    res = {"status": "finished:failed", "status-details": "x", "seconds": 1.0,
           "out_dir": str(tmp_path / "outputs" / "run-1")}
    lines = simulate.report_lines(res, log)
    assert len(lines) == 2 and "ERROR" in lines[0] and "unknown loss 'foo'" in lines[0]
    assert lines[1] == "status: finished:failed x; 1.0s; records: none written"
    (tmp_path / "outputs" / "run-1").mkdir(parents=True)
    assert simulate.report_lines(res, log)[-1].endswith(f"records: {tmp_path / 'outputs' / 'run-1'}")
