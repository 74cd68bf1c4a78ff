"""The real deployment with every SuperNode on a host of its own (``Deployment(lan=VirtualLan(3))``).

Each SuperNode (with its SuperExec) runs in a network namespace of its own, wired to the SuperLink's host by a
bridge: a LAN of three client machines and one server, with TLS and SuperNode authentication on, as
``deploy.py up --netns`` starts it. Unlike loopback, the nodes reach the SuperLink only at its LAN address (the
server certificate must name it), they cannot reach its Control API, all use the same Runtime API port, and a
node's network can fail without its process dying. Needs root and iproute2; skipped (with the reason) otherwise.

Also the LAN itself (``scripts/netns.py``): its addresses and names, and that it leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from scripts.deploy import MARKER_VAR, Deployment, find_free_ports
from scripts.netns import NetnsError, VirtualLan, namespaces, unavailable_reason
from strategies.reference import expected_posterior, max_natural_diff
from tests.test_deployment import _run, assert_site_2_dropped_out, online, run_with_fault_after_round_1
from tests.test_inprocess import run

REPO = Path(__file__).resolve().parents[1]
NEEDS_NETNS = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _make_lan(num_hosts: int) -> VirtualLan:
    lan = VirtualLan(num_hosts)
    try:
        return lan.create()
    except NetnsError as err:  # root without CAP_NET_ADMIN (an unprivileged container): not this machine's case
        pytest.skip(f"network namespaces cannot be made here: {err}")


# ---------------------------------------------------------------------------------------------- the LAN alone


def test_names_fit_linux_interface_names_and_round_trip():
    lan = VirtualLan(250, tag="abc123", subnet="10.210.3.0/24")
    names = [lan.bridge, *(lan._port(k) for k in range(250)), *(lan._peer(k) for k in range(250))]
    assert max(map(len, names)) <= 15 and len(set(names)) == len(names)
    assert lan.server_address == "10.210.3.1" and lan.host_address(0) == "10.210.3.2"
    assert lan.host_address(249) == "10.210.3.251"
    again = VirtualLan.from_json(json.loads(json.dumps(lan.to_json())))
    assert (again.tag, again.subnet, again.num_hosts, again.created) == ("abc123", lan.subnet, 250, False)
    assert VirtualLan(2).server_address == "10.208.0.1"  # the default /24, private to the LAN's namespaces
    with pytest.raises(ValueError, match="num_hosts"):
        VirtualLan(251)
    with pytest.raises(ValueError, match="tag"):
        VirtualLan(2, tag="has-dash")
    with pytest.raises(ValueError, match="/24"):
        VirtualLan(2, subnet="10.210.0.0/16")
    with pytest.raises(ValueError, match="host index"):
        lan.host_address(250)


def test_deployment_on_a_lan_is_checked_and_survives_attach(tmp_path):
    """No namespace is made: a LAN with its subnet set stands in for a created one."""
    lan = VirtualLan(3, tag="t0", subnet="10.210.9.0/24")
    dep = Deployment(2, run_dir=tmp_path, lan=lan, owns_lan=True, fleet_port=21000, control_port=21001)
    assert dep.host == "10.210.9.1" and dep.fleet_address == "10.210.9.1:21000"
    assert dep.node_ports == [9094, 9094] and dep.control_address == "127.0.0.1:21001"
    assert "10.210.9.1" in dep.host_sans()
    with pytest.raises(Exception, match="does not exist"):  # start() wants the namespaces themselves
        dep.start()
    dep._save_state()
    again = Deployment.attach(tmp_path)
    assert (again.lan.tag, again.lan.subnet, again.owns_lan, again.host) == ("t0", lan.subnet, True, dep.host)
    with pytest.raises(ValueError, match="server address"):
        Deployment(2, run_dir=tmp_path, lan=lan, host="192.0.2.7")
    with pytest.raises(ValueError, match="3 hosts for 4 nodes"):
        Deployment(4, run_dir=tmp_path, lan=lan)
    with pytest.raises(ValueError, match="needs a lan"):
        Deployment(2, run_dir=tmp_path, owns_lan=True)
    with pytest.raises(ValueError, match="must differ"):
        Deployment(2, run_dir=tmp_path, lan=lan, fleet_port=21000, control_port=21000)


def _connect_from(lan: VirtualLan, k: int, *addresses: tuple[str, int]) -> list[str]:
    """From host ``k``: for each address, the local address of a connection to it, or the error's class name."""
    code = (
        "import socket, sys\n"
        f"for a in {list(addresses)!r}:\n"
        "    try:\n"
        "        s = socket.create_connection(a, timeout=2); print(s.getsockname()[0]); s.close()\n"
        "    except OSError as e: print(type(e).__name__)\n"
    )
    out = subprocess.run([*lan.exec_prefix(k), sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out
    return out.stdout.split()


@NEEDS_NETNS
def test_lan_hosts_reach_their_own_server_only_and_leave_nothing():
    """Two LANs at once, both on 10.208.0.0/24: a host reaches its own server host's LAN address, not another LAN's
    (the same address), nor the server's loopback; the server's sockets are not this machine's namespace's."""
    with _make_lan(2) as lan, _make_lan(1) as other:
        assert {lan.server_namespace, lan.namespace(0), lan.namespace(1)} <= set(namespaces())
        server = lan.in_server(lambda: socket.create_server((lan.server_address, 0)))
        port = server.getsockname()[1]
        loop = lan.in_server(lambda: socket.create_server(("127.0.0.1", 0)))
        assert _connect_from(lan, 1, (lan.server_address, port), ("127.0.0.1", loop.getsockname()[1])) == [
            lan.host_address(1), "ConnectionRefusedError"]
        assert _connect_from(other, 0, (other.server_address, port)) == ["ConnectionRefusedError"]
        listen = ("import socket, time\ns = socket.create_server(('0.0.0.0', 7777))\n"
                  "print('up', flush=True)\ntime.sleep(30)")
        listener = subprocess.Popen([*lan.exec_prefix(1), sys.executable, "-c", listen],  # host 1, every address
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert listener.stdout.readline().strip() == "up"
            assert _connect_from(lan, 1, ("127.0.0.1", 7777)) == ["127.0.0.1"]  # it listens
            assert _connect_from(lan, 0, (lan.host_address(1), 7777)) == ["TimeoutError"]  # node to node: nothing
        finally:
            listener.kill()
            listener.wait()
        # (a connection from this namespace is no test here: this sandbox's gateway answers every address)
        here = subprocess.run(["ss", "-Htln"], capture_output=True, text=True, check=True).stdout
        assert f":{port} " not in here  # the server socket is the server host's, not this namespace's
        lan.set_link(1, False)
        assert _connect_from(lan, 1, (lan.server_address, port))[0] in ("TimeoutError", "OSError")  # no answer
        lan.set_link(1, True)
        assert _connect_from(lan, 1, (lan.server_address, port)) == [lan.host_address(1)]
        with pytest.raises(NetnsError, match="exists already"):  # a second LAN of the same tag touches nothing
            VirtualLan(2, tag=lan.tag).create()
        assert len(lan.leftovers()) == 3
        server.close()
        loop.close()
    assert lan.leftovers() == [] and other.leftovers() == [] and not lan.created
    assert lan.destroy() == []  # twice is fine


# ---------------------------------------------------------------------------------------------- the deployment


@pytest.fixture(scope="module")
def lan_deployment(tmp_path_factory):
    if unavailable_reason() is not None:
        pytest.skip(str(unavailable_reason()))
    lan = _make_lan(3)
    fleet, control = find_free_ports(2)
    try:
        with online(Deployment(3, run_dir=tmp_path_factory.mktemp("deploy-lan"), lan=lan, owns_lan=True,
                               fleet_port=fleet, control_port=control)) as dep:
            yield dep
        assert lan.leftovers() == []  # owns_lan: stop() removed the namespaces
    finally:
        lan.destroy()  # a Deployment that failed before start() owns nothing yet


def _endpoint(text: str) -> tuple[str, str]:
    """``ss``'s ``addr:port`` (``[::ffff:10.0.0.2]:5`` for an IPv4 peer of a dual-stack socket) as (IPv4, port)."""
    addr, _, port = text.rpartition(":")
    return addr.strip("[]").removeprefix("::ffff:"), port


def _in_host(dep: Deployment, k: int, *cmd: str) -> str:
    assert dep.lan is not None
    return subprocess.run([*dep.lan.exec_prefix(k), *cmd], capture_output=True, text=True, timeout=30,
                          check=True).stdout


@NEEDS_NETNS
def test_a_create_that_fails_at_any_step_leaves_nothing(monkeypatch):
    from scripts import netns

    not_steps = {("netns", "list"), ("link", "show"), ("netns", "del"), ("link", "del")}  # queries and clean-up
    real_ip, calls = netns._ip, []
    monkeypatch.setattr(netns, "_ip", lambda *a, **k: calls.append(a) or real_ip(*a, **k))
    with _make_lan(2):
        steps = [a for a in calls if a[:2] not in not_steps]
    assert len(steps) == 5 + 2 * 11
    for fail_at in range(len(steps)):
        seen = []

        def failing(*args, check=True, **kw):
            if args[:2] not in not_steps:
                seen.append(args)
                if len(seen) == fail_at + 1:
                    raise NetnsError(f"injected at step {fail_at}: {args}")
            return real_ip(*args, check=check, **kw)

        monkeypatch.setattr(netns, "_ip", failing)
        lan = VirtualLan(2)
        with pytest.raises(NetnsError, match=f"injected at step {fail_at}:"):
            lan.create()
        monkeypatch.setattr(netns, "_ip", real_ip)
        assert lan.leftovers() == [] and not lan.created, (fail_at, steps[fail_at])


@pytest.mark.slow
@NEEDS_NETNS
def test_up_netns_and_down_from_the_command_line(tmp_path):
    """``deploy.py up --netns`` in one process, ``down`` in another, removes the LAN; an ``up`` after a deployment
    whose recorded processes all died stops what is left of it (its LAN, and processes that left their group, such
    as the SuperLink's SuperExec) before it replaces its state file."""
    run_dir = tmp_path / "dep"
    cli = [sys.executable, "scripts/deploy.py"]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}

    def up() -> tuple[str, str]:
        # in-memory SuperLink state: the second SuperLink has not seen the first one's node, which was SIGKILLed
        # and would stay online in a kept state.db until its heartbeat expired (the known restart gotcha)
        out = subprocess.run([*cli, "up", "--run-dir", str(run_dir), "--netns", "--nodes", "1", "--superlink-state",
                              "memory"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads((run_dir / "deployment.json").read_text())["lan"]["tag"], out.stderr

    stray = None
    try:
        first, _ = up()
        assert {f"pgvi-{first}-s", f"pgvi-{first}-0"} <= set(namespaces())
        dep = Deployment.attach(run_dir)
        for p in dep.procs:  # every process dies at once (a crash, the OOM killer): the LAN stays
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        deadline = time.time() + 30
        while any(r["alive"] for r in dep.process_table()) and time.time() < deadline:
            time.sleep(0.2)
        assert f"pgvi-{first}-s" in namespaces()
        # a process of that deployment in a session of its own, as the SuperLink starts its SuperExec: the kill of the
        # recorded process groups misses it
        stray = subprocess.Popen(["sleep", "300"], env={**env, MARKER_VAR: dep.token}, start_new_session=True)
        second, said = up()
        assert second != first and f"pgvi-{first}-s" not in namespaces() and f"pgvi-{second}-s" in namespaces()
        # the sleep, and the SuperLink's own SuperExec when it had started by then
        assert re.search(rf"stopping what is left of the earlier deployment in {re.escape(str(run_dir))}: [12] stray "
                         rf"process\(es\) and the virtual LAN {first}\n", said), said
        assert stray.wait(timeout=10) == -signal.SIGTERM and dep.leftover_processes() == []
        out = subprocess.run([*cli, "down", "--run-dir", str(run_dir)], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out
        assert not any(ns.startswith((f"pgvi-{first}-", f"pgvi-{second}-")) for ns in namespaces())
        assert Deployment.attach(run_dir).leftover_processes() == []
    finally:  # whatever failed above: nothing of either deployment stays
        if stray is not None and stray.poll() is None:
            stray.kill()
            stray.wait()
        if (run_dir / "deployment.json").exists():
            Deployment.attach(run_dir).stop()


@pytest.mark.slow
def test_each_node_runs_on_its_own_host(lan_deployment):
    dep, lan = lan_deployment, lan_deployment.lan
    assert dep.host == lan.server_address and dep.fleet_address == f"{lan.server_address}:{dep.fleet_port}"
    assert len(set(dep.node_ports)) == 1  # every node alone on its host's loopback
    for k in range(3):
        established = _in_host(dep, k, "ss", "-Htn", "state", "established")
        # the node's gRPC connection to the Fleet API, from its own LAN address
        pairs = [tuple(map(_endpoint, line.split()[2:4])) for line in established.splitlines()]
        assert any(local[0] == lan.host_address(k) and peer == (lan.server_address, str(dep.fleet_port))
                   for local, peer in pairs), established
        listening = _in_host(dep, k, "ss", "-Htln")
        assert f"127.0.0.1:{dep.node_ports[k]}" in listening  # its Runtime API, on its own loopback
        # the Control API is on the server's loopback: no node reaches it, nor the Fleet API on its own loopback
        closed = [(lan.server_address, dep.control_port), ("127.0.0.1", dep.control_port),
                  ("127.0.0.1", dep.fleet_port)]
        assert _connect_from(lan, k, *closed) == ["ConnectionRefusedError"] * 3
    # the SuperLink listens on its own host (the Fleet API on the LAN, the Control API on that host's loopback),
    # and nothing of the deployment listens in this machine's namespace
    on_server = subprocess.run([*lan.server_prefix(), "ss", "-Htln"], capture_output=True, text=True, check=True)
    listening = {_endpoint(line.split()[3]) for line in on_server.stdout.splitlines()}
    assert {(lan.server_address, str(dep.fleet_port)), ("127.0.0.1", str(dep.control_port))} <= listening
    here = subprocess.run(["ss", "-Htln"], capture_output=True, text=True, check=True).stdout
    assert not {_endpoint(line.split()[3])[1] for line in here.splitlines()} & {str(dep.fleet_port),
                                                                                 str(dep.control_port)}
    routes = _in_host(dep, 0, "ip", "-4", "route").splitlines()  # its own table: the LAN, no way elsewhere
    assert [r.split()[:3] for r in routes] == [[str(lan.subnet), "dev", "eth0"]], routes


@pytest.mark.slow
def test_lan_deployment_matches_inprocess_and_closed_form(lan_deployment, tmp_path):
    overrides = {"schedule": "synchronous"}
    post, summary = _run(lan_deployment, overrides, tmp_path)
    cfg, strategy, _ = run({**overrides, "dtype": "float64", "num-server-rounds": 3})
    assert summary["ledger-versions"] == strategy.ledger_versions
    for k, v in strategy.state.posterior.to_numpy().items():
        np.testing.assert_allclose(post[k], v, rtol=0, atol=1e-6 * max(1.0, float(np.abs(v).max())))
    expected = expected_posterior(cfg, summary["ledger-versions"])
    assert max_natural_diff(expected.from_numpy(post), expected) < 1e-6


@pytest.mark.slow
def test_a_partitioned_client_does_not_stop_the_run(lan_deployment, tmp_path):
    """Host 2's network goes down after round 1 while its SuperNode keeps running (its connection stays open and
    carries nothing: no error reaches either side, unlike a killed process). Rounds 2-4 time out on site-2 and
    apply site-0's and site-1's updates; the posterior is the closed form of the ledger reached. Once the cable is
    back, the node serves the next run without a restart (after TCP's retransmission backoff)."""
    dep = lan_deployment
    overrides = {"schedule": "synchronous", "num-server-rounds": 4, "round-timeout-s": 15}
    try:
        post, summary = run_with_fault_after_round_1(dep, overrides, tmp_path, lambda: dep.lan.set_link(2, False))
    finally:
        dep.lan.set_link(2, True)
    assert dep._alive(dep._proc("supernode", 2))  # never stopped
    assert_site_2_dropped_out(overrides, post, summary)
    # The node comes back by itself once its cable is in again, and serves the next run. Not at once: its
    # connection's unanswered segments wait for TCP's next retransmission, whose backoff grew during the outage
    # (Linux caps it at 120 s), so the run waits up to 300 s for the three clients.
    dep.wait_online(timeout=180)
    _, summary = _run(dep, {"num-server-rounds": 1, "round-timeout-s": 60, "wait-for-clients-s": 300},
                      tmp_path / "after")
    assert summary["ledger-versions"] == {"site-0": 1, "site-1": 1, "site-2": 1}


def test_up_refuses_netns_with_host_before_making_anything(tmp_path, capsys):
    from scripts.deploy import main

    assert main(["up", "--run-dir", str(tmp_path / "d"), "--netns", "--host", "192.0.2.7"]) == 2
    assert "leave out --host" in capsys.readouterr().err
    assert main(["up", "--run-dir", str(tmp_path / "d"), "--netns", "--nodes", "251"]) == 2
    assert "num_hosts must be in [1, 250]" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_up_netns_checks_ports_by_the_lan_rules(tmp_path, monkeypatch, capsys):
    """On a LAN the nodes' Runtime API ports are on their own hosts: they may equal the SuperLink's ports."""
    from scripts.deploy import main

    def refuse(self):
        raise NetnsError("not made in this test")

    monkeypatch.setattr(VirtualLan, "create", refuse)
    assert main(["up", "--run-dir", str(tmp_path / "d"), "--netns", "--nodes", "2", "--node-port-base", "9092"]) == 1
    assert "not made in this test" in capsys.readouterr().err  # past the checks, with 9092 for nodes and SuperLink
