"""scripts/deploy.py: real SuperLink + SuperNodes as OS processes on loopback (no app run).

Each deployment uses random free high ports and its own run dir, and the fixture always
stops it; the tests then check that no process carrying the deployment's marker is
left and that every port is free again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from scripts import pki
from scripts.deploy import (
    NO_AUTH_BANNER,
    Deployment,
    DeploymentError,
    _build_parser,
    _node_config_arg,
    find_free_ports,
    free_port_kwargs,
    port_is_free,
    to_toml_config,
)

COMPOSE = Path(__file__).resolve().parents[1] / "docker-compose.yml"

# ----------------------------------------------------------------------------- pure helpers


def test_to_toml_config_roundtrips_through_flower_parser(tmp_path):
    from flwr.common.config import parse_config_args

    cfg = {
        "num-server-rounds": 3,
        "damping": 0.25,
        "evaluate": False,
        "note": 'has spaces, "quotes" and = signs',
        "model.kind": "bnn",
        "tiny": 1e-300,
    }
    path = tmp_path / "rc.toml"
    path.write_text(to_toml_config(cfg))
    assert parse_config_args([str(path)]) == cfg
    with pytest.raises(TypeError, match="bad"):
        to_toml_config({"bad": [1, 2]})


def test_node_config_arg_roundtrips_through_flower_parser():
    from flwr.common.config import parse_config_args

    cfg = {"partition-id": 2, "num-partitions": 5, "client-id": "site-2",
           "state-dir": "/tmp/a b/state", "torch-threads": 1, "lr": 0.5, "flag": True}  # fmt: skip
    assert parse_config_args([_node_config_arg(cfg)]) == cfg
    with pytest.raises(ValueError, match="quotes"):
        _node_config_arg({"client-id": 'a"b'})
    with pytest.raises(ValueError, match="key"):
        _node_config_arg({"bad key": 1})


def test_constructor_guards(tmp_path):
    with pytest.raises(ValueError, match="num_nodes"):
        Deployment(0, run_dir=tmp_path)
    with pytest.raises(ValueError, match="auth"):
        Deployment(1, run_dir=tmp_path, auth=True, insecure=True)
    with pytest.raises(ValueError, match="isolation"):
        Deployment(1, run_dir=tmp_path, isolation="thread")
    with pytest.raises(ValueError, match="node_ports"):
        Deployment(2, run_dir=tmp_path, node_ports=[1])
    with pytest.raises(ValueError, match="differ"):
        Deployment(1, run_dir=tmp_path, fleet_port=9000, control_port=9000, node_ports=[9001])
    with pytest.raises(ValueError, match="superexec_poll_interval"):
        Deployment(1, run_dir=tmp_path, superexec_poll_interval=0.0)


def test_secure_by_default(tmp_path):
    """TLS and SuperNode authentication are the defaults; each opt-out is explicit."""
    dep = Deployment(1, run_dir=tmp_path)
    assert dep.auth is True and dep.insecure is False
    assert Deployment(1, run_dir=tmp_path, auth=False).auth is False
    assert Deployment(1, run_dir=tmp_path, insecure=True).auth is False  # Flower: auth needs TLS
    parse = _build_parser().parse_args
    assert parse(["up"]).auth is None and parse(["up"]).insecure is False  # -> Deployment default
    assert parse(["up", "--no-auth"]).auth is False
    assert parse(["up", "--auth"]).auth is True  # accepted for compatibility (the default anyway)


def test_cli_refuses_auth_with_insecure(tmp_path, capsys):
    from scripts.deploy import main

    assert main(["up", "--run-dir", str(tmp_path), "--insecure", "--auth"]) == 2
    assert "--auth needs TLS" in capsys.readouterr().err
    assert not (tmp_path / "deployment.json").exists()  # nothing was started


def test_free_ports_are_distinct_and_free():
    ports = find_free_ports(5)
    assert len(set(ports)) == 5 and all(20000 <= p < 60000 and port_is_free(p) for p in ports)


def test_start_refuses_busy_port(tmp_path):
    import socket

    kw = free_port_kwargs(1)
    with socket.create_server(("127.0.0.1", kw["control_port"])):
        dep = Deployment(1, run_dir=tmp_path, **kw)
        with pytest.raises(DeploymentError, match="in use"):
            dep.start()
    assert dep.procs == []


# ----------------------------------------------------------------------------- real processes


def _assert_clean(dep: Deployment) -> None:
    assert dep.leftover_processes() == []
    for p in dep.procs:
        assert p.popen is not None and p.popen.poll() is not None, p.name
    ports = [dep.fleet_port, dep.control_port, *dep.node_ports]
    deadline = time.monotonic() + 10
    while not all(port_is_free(p) for p in ports) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(port_is_free(p) for p in ports), [p for p in ports if not port_is_free(p)]


@pytest.fixture
def make_deployment(tmp_path):
    started: list[Deployment] = []

    def make(num_nodes: int, **kw) -> Deployment:
        dep = Deployment(num_nodes, run_dir=tmp_path / f"dep{len(started)}",
                         **free_port_kwargs(num_nodes), **kw)  # fmt: skip
        started.append(dep)
        return dep

    yield make
    for dep in started:
        dep.stop()
        _assert_clean(dep)


def test_tls_no_auth_deployment_warns_online_then_clean_stop(make_deployment, capsys, caplog):
    dep = make_deployment(2, auth=False)
    with caplog.at_level("WARNING", logger="pgvi.deploy"):
        dep.start()
    assert NO_AUTH_BANNER in capsys.readouterr().err
    assert any("authentication disabled" in r.getMessage() for r in caplog.records)
    rows = dep.wait_online(timeout=120)

    online = {r["node-id"] for r in rows if r["status"] == "online"}
    assert set(dep.node_ids.values()) <= online and len(dep.node_ids) == 2
    # TLS everywhere: CLI connection pins the generated CA, no process runs insecure
    conf = tomllib.loads((dep.cli_home / "config.toml").read_text())["superlink"]
    assert conf["default"] == "pgvi-deploy"
    assert conf["pgvi-deploy"] == {
        "address": f"127.0.0.1:{dep.control_port}",
        "root-certificates": str(dep.run_dir / "certs" / "ca.crt"),
    }
    for p in dep.procs:
        assert "--insecure" not in p.cmd, p.name
    link = next(p for p in dep.procs if p.role == "superlink")
    assert "--ssl-certfile" in link.cmd and "--enable-supernode-auth" not in link.cmd
    for k in range(2):
        node = next(p for p in dep.procs if p.role == "supernode" and p.index == k)
        assert "--auth-supernode-private-key" not in node.cmd
        assert node.cmd[node.cmd.index("--port") + 1] == str(dep.node_ports[k])
        cfg = node.cmd[node.cmd.index("--node-config") + 1]
        assert f'partition-id={k} num-partitions=2 client-id="site-{k}"' in cfg
        assert f'state-dir="{dep.run_dir}/nodes/site-{k}/state"' in cfg
        assert (dep.run_dir / "nodes" / f"site-{k}" / "state").is_dir()
    assert "Uvicorn running on https://" in Path(link.log_path).read_text()
    assert dep.leftover_processes()  # sanity: the marker scan does see live processes

    killed = dep.stop()
    assert all("flower-superexec" in cmd for _pid, cmd in killed)  # only the detached SuperExec
    _assert_clean(dep)


def test_tls_deployment_on_another_loopback_address_comes_online(make_deployment):
    # --host 127.0.0.2: the nodes dial 127.0.0.2, which the generated certificate did not name (every loopback address
    # was skipped as "covered"), so TLS verification failed and no node came online (docs review, stop 33)
    dep = make_deployment(1, host="127.0.0.2", auth=False)
    dep.start()
    rows = dep.wait_online(timeout=120)
    assert set(dep.node_ids.values()) <= {r["node-id"] for r in rows if r["status"] == "online"}
    assert pki.cert_covers_host(dep.pki.server_cert, "127.0.0.2")
    assert dep.fleet_address == f"127.0.0.2:{dep.fleet_port}"


def test_auth_registered_nodes_online_unregistered_refused(make_deployment, capsys):
    dep = make_deployment(2)  # the default: TLS + SuperNode authentication
    assert dep.auth
    dep.start()
    assert "AUTHENTICATION IS OFF" not in capsys.readouterr().err
    # an unregistered key (valid P-384 OpenSSH, never passed to `flwr supernode register`)
    rogue_key, rogue_pub = dep.run_dir / "rogue.key", dep.run_dir / "rogue.pub"
    pki.generate_node_keypair(rogue_key, rogue_pub, "rogue")
    probe = dep.spawn_probe_node(rogue_key, port=find_free_ports(1)[0])

    rows = dep.wait_online(timeout=120)
    registered = {dep.node_ids[0], dep.node_ids[1]}
    assert {r["node-id"] for r in rows if r["status"] == "online"} == registered
    link = next(p for p in dep.procs if p.role == "superlink")
    assert "--enable-supernode-auth" in link.cmd
    for k in range(2):
        assert dep.node_id_from_log(k) == dep.node_ids[k]
        node = next(p for p in dep.procs if p.role == "supernode" and p.index == k)
        # its own key pair, generated by pki.py under the run dir (git-ignored runs/ by default)
        assert node.cmd[node.cmd.index("--auth-supernode-private-key") + 1] == str(dep.node_key(k)[0])
        assert dep.node_key(k)[0] == dep.run_dir / "certs" / "keys" / f"site-{k}.key"

    rc = dep.wait_process_exit(probe, timeout=90)
    assert rc is not None and rc != 0
    probe_log = Path(probe.log_path).read_text()
    assert "Failed to activate SuperNode" in probe_log and "305" in probe_log
    assert "No SuperNode found with the given public key" in Path(link.log_path).read_text()
    # still exactly the two registered nodes, nothing from the rogue key
    assert {r["node-id"] for r in dep.list_nodes()} == registered

    # registering a key the SuperLink already holds is not an error (re-`up` on the same state.db)
    assert dep._register_node(0) is None
    # docker-compose.yml's register-supernodes script, run against this real SuperLink with the real CLI
    keys = dep.pki.out_dir / "keys"
    pki.generate_node_keypair(keys / "late.key", keys / "late.pub", "late")
    script = yaml.safe_load(COMPOSE.read_text())["services"]["register-supernodes"]["entrypoint"][2]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "SUPERLINK_CONTROL_API": f"127.0.0.1:{dep.control_port}", "CA_CERT": str(dep.pki.ca_cert),
           "KEYS_DIR": str(keys), "SUPERNODES": "site-0 site-1 late", "WAIT_S": "30",
           "FLWR_HOME": str(dep.run_dir / "homes" / "compose-registrar")}  # fmt: skip
    res = subprocess.run(["/bin/sh", "-c", script.replace("$$", "$")], env=env, capture_output=True,
                         text=True, timeout=180)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "site-0: public key already registered" in res.stdout and "registered late" in res.stdout
    rows = {r["node-id"]: r["status"] for r in dep.list_nodes()}
    assert {n for n, st in rows.items() if st == "online"} == registered
    assert sorted(st for n, st in rows.items() if n not in registered) == ["registered"]  # late: never online


@pytest.mark.slow
def test_auth_restart_after_sigkill_waits_for_offline(make_deployment):
    """Notes §4: a SIGKILLed registered node stays online ~40-60 s; restart must wait.

    Also: a graceful (SIGTERM) restart keeps the registered node id, and so does a new
    ``Deployment`` on the same run dir (keys already registered in the SuperLink database).
    """
    dep = make_deployment(1)
    dep.start()
    dep.wait_online(timeout=120)
    dep.restart_node(0, timeout=120)  # SIGTERM + start
    assert dep.node_id_from_log(0) == dep.node_ids[0]
    assert dep.node_status(0) == "online"

    dep.kill_node(0, signal.SIGKILL)
    assert dep.node_status(0) == "online"  # stale session: an immediate start would fail (305)
    t0 = time.monotonic()
    dep.restart_node(0, timeout=180)
    assert time.monotonic() - t0 > 10
    assert dep.node_status(0) == "online"
    assert dep.node_id_from_log(0) == dep.node_ids[0]

    # `deploy.py down`, then `up` again on the same run dir: the SuperLink's state.db still holds the
    # registration (Flower: "Public key already in use"); the node comes back with the same id.
    old_id = dep.node_ids[0]
    dep.stop()
    _assert_clean(dep)
    again = Deployment(1, run_dir=dep.run_dir, fleet_port=dep.fleet_port, control_port=dep.control_port,
                       node_ports=dep.node_ports)  # fmt: skip
    try:
        again.start()
        assert again.node_ids == {}  # not re-registered ...
        again.wait_online(timeout=120)
        assert again.node_ids == {0: old_id} and again.node_status(0) == "online"  # ... same identity
    finally:
        again.stop()
        _assert_clean(again)


# Tiny PGVI job (2 clients, 1 round, few local steps) for the end-to-end deployment check.
_TINY_RUN = {
    "num-clients": 2,
    "min-clients": 2,
    "num-server-rounds": 1,
    "local-epochs": 5,
    "mc-samples": 2,
    "eval-samples": 10,
    "wait-for-clients-s": 90.0,
}


@pytest.mark.slow
def test_process_isolation_tls_auth_runs_the_app(make_deployment):
    """The docker-compose layout on loopback: separate SuperExecs, TLS on every API
    (incl. the SuperNode Runtime API), SuperNode auth; the run's status comes from
    `flwr ls`, not from `flwr run`'s exit code (which is 0 even for failed runs)."""
    dep = make_deployment(2, isolation="process")  # auth is the default
    dep.start()
    dep.wait_online(timeout=120)
    roles = sorted(p.name for p in dep.procs)
    assert roles == ["superexec-clientapp-0", "superexec-clientapp-1", "superexec-serverapp",
                     "superlink", "supernode-0", "supernode-1"]  # fmt: skip
    for k in range(2):
        node_log = Path(next(p for p in dep.procs if p.name == f"supernode-{k}").log_path).read_text()
        assert "Uvicorn running on https://127.0.0.1" in node_log  # Runtime API over TLS

    ok = dep.run_app(_TINY_RUN, timeout=600)
    assert ok.ok, (ok, ok.log_path.read_text()[-3000:])
    assert ok.returncode == 0 and ok.run_id is not None

    bad = dep.run_app(run_config_args=['num-clients=2 min-clients=2 damping="oops"'], timeout=600)
    assert bad.status == "finished:failed" and bad.returncode == 0, bad
    refused = dep.run_app({"no-such-key": 1}, timeout=120)
    assert refused.run_id is None and refused.status == "not-started" and not refused.ok


@pytest.mark.slow
def test_in_memory_superlink_state_runs_the_app_with_auth(make_deployment):
    """`superlink_state="memory"`: Flower's in-memory LinkState (no SQLite file, so no "database is locked"
    under load); node registration and a run still work."""
    dep = make_deployment(2, superlink_state="memory")
    dep.start()
    dep.wait_online(timeout=120)
    link = next(p for p in dep.procs if p.name == "superlink")
    assert link.cmd[link.cmd.index("--database") + 1] == ":flwr-in-memory:"
    assert "--enable-supernode-auth" in link.cmd
    assert not (dep.run_dir / "superlink" / "state.db").exists()
    ok = dep.run_app(_TINY_RUN, timeout=600)
    assert ok.ok, (ok, ok.log_path.read_text()[-3000:])


def test_superlink_state_guard(tmp_path):
    with pytest.raises(ValueError, match="superlink_state"):
        Deployment(2, run_dir=tmp_path, superlink_state="postgres")


# ----------------------------------------------------------------------------- review fixes (deploy.py)


def test_free_ports_stay_below_the_ephemeral_range(tmp_path):
    low, _high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = find_free_ports(40)
    assert all(20000 <= p < low for p in ports), sorted(ports)

    from scripts.deploy import ephemeral_port_range

    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_port_range(f) == (40000, 50000)
    assert ephemeral_port_range(tmp_path / "missing") == (32768, 60999)
    f.write_text("garbage")
    assert ephemeral_port_range(f) == (32768, 60999)


def _fake_flwr(tmp_path: Path, body: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    flwr = bin_dir / "flwr"
    flwr.write_text("#!/bin/sh\n" + body)
    flwr.chmod(0o755)
    return bin_dir


def test_attach_restores_every_option_of_up(tmp_path):
    """`deploy.py run|status|down` attach to the state `up` saved: the deployment they see has up's options."""
    run_dir = tmp_path / "dep"
    dep = Deployment(2, run_dir=run_dir, isolation="process", superexec="preforked", supernode="paced",
                     superlink_state="memory", warm_workers=True, superexec_poll_interval=1.0,
                     node_config={"torch-threads": 1}, node_configs={1: {"fault": "nan@2"}}, env={"X": "1"},
                     **free_port_kwargs(2))  # fmt: skip
    run_dir.mkdir()
    dep._save_state()
    again = Deployment.attach(run_dir)
    for name in ("num_nodes", "isolation", "superexec", "supernode", "superlink_state", "warm_workers",
                 "superexec_poll_interval", "node_config", "node_configs", "extra_env", "node_ports", "auth",
                 "insecure", "token"):
        assert getattr(again, name) == getattr(dep, name), name
    assert again.node_config_for(1) == dep.node_config_for(1)


def test_run_counter_survives_reattach(tmp_path):
    """`deploy.py run` twice on one deployment: the second run gets its own log and run config."""
    bin_dir = _fake_flwr(tmp_path, 'echo "fake flwr $*"\nexit 1\n')
    run_dir = tmp_path / "dep"
    dep = Deployment(1, run_dir=run_dir, insecure=True, bin_dir=bin_dir, **free_port_kwargs(1))
    run_dir.mkdir()
    dep._save_state()  # the deployment.json `up` leaves behind
    first = dep.run_app({"num-server-rounds": 1})
    assert first.status == "not-started" and first.log_path == run_dir / "logs" / "flwr-run-1.log"
    again = Deployment.attach(run_dir)  # what the next `deploy.py run` does
    second = again.run_app({"num-server-rounds": 2})
    assert second.log_path == run_dir / "logs" / "flwr-run-2.log"
    assert (run_dir / "run-config-1.toml").read_text() == '"num-server-rounds" = 1\n'
    assert (run_dir / "run-config-2.toml").read_text() == '"num-server-rounds" = 2\n'
    assert "run-config-1.toml" in first.log_path.read_text()
    assert Deployment.attach(run_dir)._run_counter == 2
    # a new `up` on the same run dir starts its own counter at 0, but never overwrites an earlier run
    fresh = Deployment(1, run_dir=run_dir, insecure=True, bin_dir=bin_dir, **free_port_kwargs(1))
    assert fresh.run_app({"num-server-rounds": 3}).log_path == run_dir / "logs" / "flwr-run-3.log"
    assert (run_dir / "run-config-1.toml").read_text() == '"num-server-rounds" = 1\n'


def _pid_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat.rsplit(")", 1)[-1].split()[0] == "Z":
            return True
        time.sleep(0.1)
    return False


def test_run_app_interrupted_stops_the_flwr_cli(tmp_path):
    pidfile = tmp_path / "flwr.pid"
    bin_dir = _fake_flwr(tmp_path, 'echo $$ > "$PIDFILE"\nexec sleep 60\n')
    dep = Deployment(1, run_dir=tmp_path / "dep", insecure=True, bin_dir=bin_dir, env={"PIDFILE": str(pidfile)},
                     **free_port_kwargs(1))  # fmt: skip

    def interrupt(_sig, _frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            dep.run_app({"num-server-rounds": 1})
        pid = int(pidfile.read_text())
        assert _pid_gone(pid), "flwr run CLI still running after the interrupt"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if pidfile.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)


class _Unhandled(Exception):
    pass


def test_up_down_after_tears_down_on_sigterm_during_run(tmp_path, monkeypatch):
    """Unit-level wiring: SIGTERM while `up --run --down-after` waits for the run -> stop() runs, rc 130,
    and the caller's SIGTERM handler is back afterwards."""
    from scripts import deploy

    calls: list[str] = []
    monkeypatch.setattr(deploy.Deployment, "start", lambda self, timeout=90.0: calls.append("start"))
    monkeypatch.setattr(deploy.Deployment, "wait_online", lambda self, timeout=90.0, nodes=None: [])

    def run_app(self, *a, **kw):
        calls.append("run")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        calls.append("run finished")  # never reached

    monkeypatch.setattr(deploy.Deployment, "run_app", run_app)
    monkeypatch.setattr(deploy.Deployment, "stop", lambda self, grace=10.0: calls.append("stop") or [])

    def not_main(_sig, _frame):  # what SIGTERM does if deploy.main installs no handler of its own
        raise _Unhandled

    old = signal.signal(signal.SIGTERM, not_main)
    try:
        rc = deploy.main(["up", "--run-dir", str(tmp_path), "--insecure", "--run", "--down-after"])
        assert signal.getsignal(signal.SIGTERM) is not_main
    finally:
        signal.signal(signal.SIGTERM, old)
    assert rc == 130 and calls == ["start", "run", "stop"]

    # KeyboardInterrupt (Ctrl-C) during the run: same teardown
    calls.clear()

    def ctrl_c(self, *a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(deploy.Deployment, "run_app", ctrl_c)
    assert deploy.main(["up", "--run-dir", str(tmp_path), "--insecure", "--run", "--down-after"]) == 130
    assert calls == ["start", "stop"]
    # without --down-after/--foreground an interrupted `up --run` leaves the deployment up (by design)
    calls.clear()
    assert deploy.main(["up", "--run-dir", str(tmp_path), "--insecure", "--run"]) == 130
    assert calls == ["start"]


def test_up_foreground_stops_everything_on_sigterm(tmp_path):
    """A real `deploy.py up --foreground` (insecure, 1 node) in a subprocess, then SIGTERM."""
    from scripts.deploy import _pids_with_marker

    run_dir = tmp_path / "dep"
    kw = free_port_kwargs(1)
    cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "deploy.py"), "up",
           "--run-dir", str(run_dir), "--nodes", "1", "--insecure", "--foreground",
           "--fleet-port", str(kw["fleet_port"]), "--control-port", str(kw["control_port"]),
           "--node-port-base", str(kw["node_ports"][0])]  # fmt: skip
    out = open(tmp_path / "up.out", "w+")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while "running; Ctrl-C" not in (tmp_path / "up.out").read_text():
            assert proc.poll() is None, (tmp_path / "up.out").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.out").read_text()
            time.sleep(0.5)
        token = json.loads((run_dir / "deployment.json").read_text())["token"]
        assert _pids_with_marker(token)  # SuperLink, SuperNode, ... are up
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=90)
        text = (tmp_path / "up.out").read_text()
        assert rc == 0, text
        assert "stopping all processes" in text
        assert _pids_with_marker(token) == [], text
        ports = [kw["fleet_port"], kw["control_port"], *kw["node_ports"]]
        deadline = time.monotonic() + 10
        while not all(port_is_free(p) for p in ports) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(port_is_free(p) for p in ports)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if (run_dir / "deployment.json").exists():
            Deployment.attach(run_dir).stop()  # whatever the test left behind
        out.close()


def test_non_loopback_host_is_in_the_server_certificate(tmp_path):
    run_dir = tmp_path / "dep"
    dep = Deployment(1, run_dir=run_dir, host="10.1.2.3")
    dep._prepare_pki()
    assert pki.cert_covers_host(dep.pki.server_cert, "10.1.2.3")
    assert pki.cert_covers_host(dep.pki.server_cert, "127.0.0.1")
    ca = (run_dir / "certs" / "ca.crt").read_bytes()
    # an existing certs dir without that SAN: the server certificate is re-issued by the same CA
    dep2 = Deployment(1, run_dir=run_dir, host="192.0.2.7")
    dep2._prepare_pki()
    assert pki.cert_covers_host(dep2.pki.server_cert, "192.0.2.7")
    assert (run_dir / "certs" / "ca.crt").read_bytes() == ca
    # ... and with the CA key offline, a clear error instead of a new CA
    (run_dir / "certs" / "ca.key").rename(tmp_path / "ca.key.offline")
    with pytest.raises(DeploymentError, match=r"198\.51\.100\.1.*ca\.key"):
        Deployment(1, run_dir=run_dir, host="198.51.100.1")._prepare_pki()
    assert (run_dir / "certs" / "ca.crt").read_bytes() == ca
    # --certs given: checked, never modified
    with pytest.raises(DeploymentError, match=r"does not list 203\.0\.113\.9.*--san 203\.0\.113\.9"):
        Deployment(1, run_dir=tmp_path / "d3", certs_dir=run_dir / "certs", host="203.0.113.9")._prepare_pki()
    Deployment(1, run_dir=tmp_path / "d4", certs_dir=run_dir / "certs", host="192.0.2.7")._prepare_pki()

    for host, want in (("10.1.2.3", ["10.1.2.3"]), ("edge.example.org", ["edge.example.org"]),
                       ("0.0.0.0", []), ("127.0.0.1", []), ("::1", []), ("localhost", []), ("[::1]", []),
                       ("127.0.0.2", ["127.0.0.2"]), ("::", [])):  # fmt: skip
        assert Deployment(1, run_dir=tmp_path, host=host).host_sans() == want, host


def _load_key(path: Path):
    from cryptography.hazmat.primitives import serialization

    return serialization.load_pem_private_key(path.read_bytes(), password=None)


def _load_cert(path: Path):
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes())


def test_superlink_readiness_reports_the_tls_error(tmp_path):
    """A SuperLink whose certificate lacks the address clients use: the TLS error is in the message."""
    import socket
    import ssl
    import threading

    from scripts.deploy import ProcInfo

    files = pki.ensure_pki(tmp_path / "certs")
    ca_key = _load_key(files.ca_key)
    ca_cert = _load_cert(files.ca_cert)
    bad_cert, bad_key = tmp_path / "bad.pem", tmp_path / "bad.key"
    pki._ensure_leaf(bad_cert, bad_key, ca_key, ca_cert, ["only.example.org"], [], renew=True, valid_days=5,
                     say=lambda _m: None)  # fmt: skip
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(bad_cert, bad_key)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with contextlib.suppress(OSError, ssl.SSLError):
                ctx.wrap_socket(conn, server_side=True).close()
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()

    class _Running:
        pid = 0

        def poll(self):
            return None

    dep = Deployment(1, run_dir=tmp_path / "dep", control_port=port, fleet_port=find_free_ports(1)[0],
                     node_ports=[find_free_ports(1)[0]])  # fmt: skip
    dep.pki = files
    link = ProcInfo("superlink", None, 0, [], str(tmp_path / "none.log"), time.time(), _Running())
    try:
        with pytest.raises(DeploymentError, match=r"TLS handshake .* failed: .*CERTIFICATE_VERIFY_FAILED.*127\.0\.0\.1"):
            dep._wait_superlink_ready(link, timeout=3)
    finally:
        stop.set()
        t.join(timeout=5)
        listener.close()


@pytest.mark.parametrize("command", ["down", "run", "status"])
def test_commands_without_a_deployment_give_a_clear_error(tmp_path, capsys, command):
    from scripts.deploy import main

    assert main([command, "--run-dir", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert "no deployment state" in err and "deploy.py up" in err


# ----------------------------------------------------------------------------- review fixes (simulate.py)


def test_pick_run_never_takes_a_run_this_invocation_did_not_start():
    from scripts.simulate import pick_run

    earlier = {"run-id": "570153098676490552", "status": "finished:completed"}
    mine = {"run-id": "3831847892416236757", "status": "finished:failed"}
    assert pick_run([earlier], "Error: [code: 15] Invalid run configuration.") == {}
    assert pick_run([earlier, mine], "no run id") == {}
    assert pick_run([earlier, mine], "\x1b[32mSuccessfully started run 3831847892416236757\x1b[0m\n") == mine
    assert pick_run([earlier, mine], "Starting logstream for run_id `3831847892416236757`") == mine


_REFUSED_LOG = """Using SuperLink: pgvi-sim (:local:)
Starting local SuperLink on 127.0.0.1:39091...
\u256d\u2500 Error \u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u256e
\u2502 [code: 15] Invalid run configuration.  \u2502
\u2570\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u2500\u256f
"""


@pytest.fixture
def fake_sim(monkeypatch):
    """scripts.simulate with `flwr` faked: `flwr run` prints ``log``; `flwr ls` lists an EARLIER completed run
    (the persistent local-superlink/state.db); nothing is started or stopped."""
    from scripts import simulate

    state = {"log": _REFUSED_LOG, "rc": 1, "cmds": []}
    earlier = {"run-id": "570153098676490552", "status": "finished:completed", "status-details": ""}

    def fake_run(cmd, **kw):
        state["cmds"].append(cmd)
        if cmd[1] == "run":
            kw["stdout"].write(state["log"])
            return subprocess.CompletedProcess(cmd, state["rc"])
        if cmd[1] == "ls":
            return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps({"success": True, "runs": [earlier]}), stderr="")
        raise AssertionError(cmd)

    monkeypatch.setattr(simulate.subprocess, "run", fake_run)
    monkeypatch.setattr(simulate, "stop_local_superlink", lambda port, home=None, timeout=20.0: state.setdefault("stopped", port))
    return simulate, state


def test_refused_run_is_not_reported_as_an_earlier_run(fake_sim, tmp_path, monkeypatch, capsys):
    simulate, state = fake_sim
    res = simulate.run_simulation({"bogus": 1}, 2, tmp_path / "sim")
    assert res["run_id"] == "" and res["status"] == "not-started" and res["out_dir"] is None
    assert "[code: 15] Invalid run configuration." in res["status-details"]
    assert "stopped" in state  # the managed SuperLink is still stopped
    # the CLI: exit 1 with the server's message
    monkeypatch.setattr(sys, "argv", ["simulate.py", "--supernodes", "2", "--out", str(tmp_path / "sim")])
    with pytest.raises(SystemExit) as exc:
        simulate.main()
    assert exc.value.code == 1
    assert "no run was started: [code: 15] Invalid run configuration." in capsys.readouterr().err
    # a run that did start is reported with its own id, even if `flwr ls` does not list it
    state["log"], state["rc"] = "Successfully started run 42\nStarting logstream for run_id `42`\n", 0
    res = simulate.run_simulation({}, 2, tmp_path / "sim")
    assert res["run_id"] == "42" and res["status"] == "unknown"


def test_second_simulation_on_the_same_out_dir_is_refused(fake_sim, tmp_path):
    import fcntl

    simulate, state = fake_sim
    home = tmp_path / "sim" / "flwr-home"
    home.mkdir(parents=True)
    with open(home / ".simulate.lock", "a+") as held:  # another simulation holds the FLWR_HOME
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("12345\n")
        held.flush()
        with pytest.raises(RuntimeError, match="another simulation .*12345"):
            simulate.run_simulation({}, 2, tmp_path / "sim")
    assert state["cmds"] == [] and "stopped" not in state  # nothing run, nobody's SuperLink stopped
    simulate.run_simulation({}, 2, tmp_path / "sim")  # lock released: runs
    assert state["cmds"]


def test_stop_local_superlink_tolerates_a_process_exiting_meanwhile(monkeypatch):
    from scripts import simulate

    monkeypatch.setattr(simulate, "_pids_listening", lambda port: [999_999_999])
    monkeypatch.setattr(simulate, "_children", lambda pid: [])
    monkeypatch.setattr(simulate, "_alive", lambda pid: True)  # looks alive until the very kill

    def kill(pid, sig):
        raise ProcessLookupError(pid)

    monkeypatch.setattr(simulate.os, "kill", kill)
    simulate.stop_local_superlink(1, None, timeout=0.0)


def test_simulate_overrides_parse_or_fail_clearly():
    script = Path(__file__).resolve().parents[1] / "scripts" / "simulate.py"
    for bad, needle in (("note=bare", "note=bare"), ("bare", "'bare'"), ("a=1 junk", "'a=1 junk'")):
        # argument errors come before anything is started
        res = subprocess.run([sys.executable, str(script), "--out", "/nonexistent/never", "-c", bad],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr, res.stderr

    from scripts.simulate import parse_overrides

    # several pairs in one -c, as `flwr run -c` takes them
    assert parse_overrides('a=1 b=2') == {"a": 1, "b": 2}
    assert parse_overrides('note="x y" model.kind="bnn" evaluate=false') == {
        "note": "x y", "model.kind": "bnn", "evaluate": False}


def test_warm_workers_import_this_repository_like_the_nodes(tmp_path, monkeypatch):
    """A warm worker (``python -m client.warm_worker`` in the run directory) gets this repository first on its
    ``PYTHONPATH``, as the paced SuperNodes and forking SuperExecs do, not whatever checkout the venv's editable
    install points to."""
    from scripts.deploy import REPO_ROOT

    dep = Deployment(1, run_dir=tmp_path, warm_workers=True)
    calls = []
    monkeypatch.setattr(dep, "_spawn", lambda role, index, cmd, home, env=None: calls.append((role, cmd, env)))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    dep._spawn_worker(0)  # noqa: SLF001
    [(role, cmd, env)] = calls
    assert role == "warm-worker" and cmd[cmd.index("-m") + 1] == "client.warm_worker"
    assert env is not None and env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/elsewhere"]
