"""scripts/deploy.py: real SuperLink + SuperNodes as OS processes on loopback (no app run).

Each deployment uses random free high ports and its own run dir, and the fixture always
stops it; the tests then check that no process carrying the deployment's marker is
left and that every port is free again.
"""

from __future__ import annotations

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
