"""The real deployment with every SuperNode on a host of its own (``Deployment(lan=VirtualLan(3))``).

Each SuperNode (with its SuperExec) runs in a network namespace of its own, wired to the SuperLink's host by a
bridge: a LAN of three client machines and one server, with TLS and SuperNode authentication on, as
``deploy.py up --netns`` starts it. Unlike loopback, the nodes reach the SuperLink only at its LAN address (the
server certificate must name it), they cannot reach its Control API, all use the same Runtime API port, and a
node's network can fail without its process dying. Needs root and iproute2; skipped (with the reason) otherwise.

Also the LAN itself (``scripts/netns.py``): its addresses and names, and that it leaves nothing behind.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from common.config import parse_run_config
from scripts.deploy import Deployment, find_free_ports
from scripts.netns import NetnsError, VirtualLan, namespaces, unavailable_reason
from strategies.reference import expected_posterior, max_natural_diff
from tests.test_deployment import DEPLOY_RUN, _run
from tests.test_inprocess import run

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
    dep = Deployment(3, run_dir=tmp_path_factory.mktemp("deploy-lan"), lan=lan, owns_lan=True,
                     fleet_port=fleet, control_port=control)
    try:
        dep.start()
        dep.wait_online(timeout=180)
        yield dep
    finally:
        dep.stop()
        assert dep.leftover_processes() == []
        assert lan.leftovers() == []  # owns_lan: stop() removed the namespaces and the bridge


def _endpoint(text: str) -> tuple[str, str]:
    """``ss``'s ``addr:port`` (``[::ffff:10.0.0.2]:5`` for an IPv4 peer of a dual-stack socket) as (IPv4, port)."""
    addr, _, port = text.rpartition(":")
    return addr.strip("[]").removeprefix("::ffff:"), port


def _in_host(dep: Deployment, k: int, *cmd: str) -> str:
    assert dep.lan is not None
    return subprocess.run([*dep.lan.exec_prefix(k), *cmd], capture_output=True, text=True, timeout=30,
                          check=True).stdout


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
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(zip(("post", "summary"), _run(dep, overrides, tmp_path))))
    cut = False
    worker.start()
    try:
        deadline = time.time() + 600
        while worker.is_alive() and time.time() < deadline:
            rows = [json.loads(line) for f in tmp_path.glob("run-*/metrics.jsonl")
                    for line in f.read_text().splitlines() if line]
            if not cut and any(r["round"] >= 1 for r in rows):
                dep.lan.set_link(2, False)
                cut = True
            time.sleep(0.2)
        worker.join(timeout=60)
    finally:
        dep.lan.set_link(2, True)
    assert cut and "summary" in result, result
    assert dep.node_status(2) is not None and dep._alive(dep._proc("supernode", 2))  # never stopped
    versions = result["summary"]["ledger-versions"]
    assert versions["site-0"] == 4 and versions["site-1"] == 4
    assert 1 <= versions["site-2"] < 4
    cfg = parse_run_config({**DEPLOY_RUN, **overrides})
    expected = expected_posterior(cfg, versions)
    assert max_natural_diff(expected.from_numpy(result["post"]), expected) < 1e-6
    # The node comes back by itself once its cable is in again, and serves the next run. Not at once: its
    # connection's unanswered segments wait for TCP's next retransmission, whose backoff grew during the outage
    # (Linux caps it at 120 s), so the run waits up to 300 s for the three clients.
    dep.wait_online(timeout=180)
    _, summary = _run(dep, {"num-server-rounds": 1, "round-timeout-s": 60, "wait-for-clients-s": 300},
                      tmp_path / "after")
    assert summary["ledger-versions"] == {"site-0": 1, "site-1": 1, "site-2": 1}


def test_up_refuses_netns_with_host_before_making_anything(tmp_path, capsys):
    from scripts.deploy import main

    before = namespaces() if unavailable_reason() is None else []
    assert main(["up", "--run-dir", str(tmp_path / "d"), "--netns", "--host", "192.0.2.7"]) == 2
    assert "leave out --host" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    if unavailable_reason() is None:
        assert namespaces() == before
