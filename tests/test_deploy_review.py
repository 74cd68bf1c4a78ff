"""Operator-facing fixes of scripts/deploy.py and scripts/pki.py (deploy review).

- The Control API (no credentials in Flower 1.39) binds ``--control-host`` (default 127.0.0.1), the
  Fleet API ``--host``; a non-loopback Control API warns.
- ``start_node``/``restart_node`` with process isolation never leave an old ``superexec-clientapp-k``
  running (fake ``flower-supernode``/``flower-superexec`` binaries: real processes, no Flower).
- The run directory and the directories ``deploy.py`` makes in it are 0700.
- IPv6 literals are bracketed in ``host:port``.
- ``pki.split_sans`` rejects invalid DNS names and ports, takes bracketed IP addresses.
"""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import pytest

from scripts import pki
from scripts.deploy import (
    CONTROL_API_EXPOSED_WARNING,
    Deployment,
    DeploymentError,
    ProcInfo,
    _build_parser,
    _hostport,
    _mkdir_private,
    free_port_kwargs,
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def _superlink_cmd(monkeypatch, dep: Deployment) -> list[str]:
    """The ``flower-superlink`` command ``dep`` would start (nothing is started)."""
    seen: list[list[str]] = []

    def fake_spawn(role, index, cmd, home, env=None):
        seen.append(cmd)
        return ProcInfo(role, index, 0, cmd, "", time.time())

    monkeypatch.setattr(dep, "_spawn", fake_spawn)
    monkeypatch.setattr(dep, "_wait_superlink_ready", lambda link, timeout: None)
    dep._start_superlink(1.0)
    return seen[0]


# ----------------------------------------------------------------------------- Control API bind address


def test_control_api_stays_on_loopback_when_the_fleet_api_is_public(tmp_path, monkeypatch):
    dep = Deployment(1, run_dir=tmp_path / "dep", insecure=True, host="10.1.2.3", **free_port_kwargs(1))
    assert dep.control_host == "127.0.0.1"
    cmd = _superlink_cmd(monkeypatch, dep)
    assert _arg(cmd, "--host") == "127.0.0.1"  # flower-superlink --host = the Control API's address
    assert _arg(cmd, "--fleet-api-address") == f"10.1.2.3:{dep.fleet_port}"
    dep._write_cli_config()
    assert f'address = "127.0.0.1:{dep.control_port}"' in (dep.cli_home / "config.toml").read_text()
    # up: --host alone does not move the Control API; --control-host does, and attach keeps it
    args = _build_parser().parse_args(["up", "--host", "10.1.2.3"])
    assert (args.host, args.control_host) == ("10.1.2.3", "127.0.0.1")
    assert _build_parser().parse_args(["up", "--control-host", "10.9.9.9"]).control_host == "10.9.9.9"
    dep2 = Deployment(1, run_dir=tmp_path / "dep2", insecure=True, control_host="10.9.9.9", **free_port_kwargs(1))
    (tmp_path / "dep2").mkdir()
    dep2._save_state()
    assert Deployment.attach(tmp_path / "dep2").control_host == "10.9.9.9"
    assert dep2.host_sans() == ["10.9.9.9"]  # the certificate must cover the CLI's address too


@pytest.mark.parametrize(("control_host", "warns"), [("127.0.0.1", False), ("::1", False), ("localhost", False),
                                                     ("0.0.0.0", True), ("192.0.2.4", True)])  # fmt: skip
def test_non_loopback_control_api_warns(tmp_path, monkeypatch, capsys, control_host, warns):
    dep = Deployment(1, run_dir=tmp_path / "dep", insecure=True, control_host=control_host, **free_port_kwargs(1))

    def stop_here() -> None:
        raise RuntimeError("stop before starting anything")

    monkeypatch.setattr(dep, "_prepare_pki", stop_here)
    with pytest.raises(RuntimeError, match="stop before"):
        dep.start()
    err = capsys.readouterr().err
    assert (CONTROL_API_EXPOSED_WARNING.format(host=control_host) in err) is warns


# ----------------------------------------------------------------------------- IPv6


def test_ipv6_host_is_bracketed(tmp_path, monkeypatch):
    from flwr.supercore.address import parse_address

    assert _hostport("::1", 27444) == "[::1]:27444"
    assert _hostport("[::1]", 27444) == "[::1]:27444"
    assert _hostport("127.0.0.1", 1) == "127.0.0.1:1"
    assert parse_address(_hostport("::1", 27444)) == ("::1", 27444, True)
    dep = Deployment(1, run_dir=tmp_path / "dep", insecure=True, host="::1", control_host="::1",
                     **free_port_kwargs(1))  # fmt: skip
    cmd = _superlink_cmd(monkeypatch, dep)
    assert _arg(cmd, "--fleet-api-address") == f"[::1]:{dep.fleet_port}"
    assert _arg(cmd, "--host") == "::1"
    dep._write_cli_config()
    assert f'address = "[::1]:{dep.control_port}"' in (dep.cli_home / "config.toml").read_text()


# ----------------------------------------------------------------------------- run dir permissions


def test_run_dir_and_its_subdirectories_are_private(tmp_path, monkeypatch):
    old = os.umask(0o022)
    try:
        dep = Deployment(1, run_dir=tmp_path / "dep", insecure=True, **free_port_kwargs(1))
        monkeypatch.setattr(dep, "_prepare_pki", lambda: (_ for _ in ()).throw(RuntimeError("stop")))
        with pytest.raises(RuntimeError):
            dep.start()
        assert _mode(dep.run_dir) == 0o700
        _superlink_cmd(monkeypatch, dep)
        assert _mode(dep.run_dir / "superlink") == 0o700  # state.db: stored messages, task tokens
        dep._write_cli_config()
        assert _mode(dep.cli_home) == 0o700
        dep.wipe_node_state(0)
        assert _mode(dep.node_state_dir(0)) == 0o700
        # an existing run dir is tightened too
        (tmp_path / "open").mkdir(mode=0o755)
        dep2 = Deployment(1, run_dir=tmp_path / "open", insecure=True, **free_port_kwargs(1))
        monkeypatch.setattr(dep2, "_prepare_pki", lambda: (_ for _ in ()).throw(RuntimeError("stop")))
        with pytest.raises(RuntimeError):
            dep2.start()
        assert _mode(dep2.run_dir) == 0o700
    finally:
        os.umask(old)


# ----------------------------------------------------------------------------- SuperExec leak on restart


def _fake_bins(tmp_path: Path, supernode_body: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("flower-supernode", supernode_body), ("flower-superexec", "exec sleep 120\n")):
        f = bin_dir / name
        f.write_text("#!/bin/sh\n" + body)
        f.chmod(0o755)
    return bin_dir


def _superexecs(dep: Deployment) -> list[int]:
    """Live processes of this deployment that are a (fake) SuperExec: the script itself, or the ``sleep`` it has
    exec'd (a SuperExec started a moment ago may not have reached its ``exec`` yet)."""
    return [pid for pid, cmd in dep.leftover_processes() if "sleep 120" in cmd or "flower-superexec" in cmd]


def test_start_node_stops_the_previous_superexec(tmp_path):
    """The SuperNode process crashes alone; starting it again must not leave its old SuperExec polling."""
    dep = Deployment(1, run_dir=tmp_path / "dep", insecure=True, isolation="process",
                     bin_dir=_fake_bins(tmp_path, "exec sleep 60\n"), **free_port_kwargs(1))  # fmt: skip
    try:
        dep.start_node(0)
        first = dep._proc("superexec-clientapp", 0)
        node = dep._proc("supernode", 0)
        os.killpg(node.pid, signal.SIGKILL)
        node.popen.wait(timeout=10)
        dep.start_node(0)
        assert first.popen.poll() is not None, "the old superexec-clientapp-0 is still running"
        second = dep._proc("superexec-clientapp", 0)
        assert second.pid != first.pid and dep._alive(second)
        assert _superexecs(dep) == [second.pid]
        assert _mode(dep.logs_dir) == 0o700 and _mode(dep.node_state_dir(0)) == 0o700
        dep.kill_node(0, signal.SIGTERM)
        assert _superexecs(dep) == []
    finally:
        dep.stop()
    assert dep.leftover_processes() == []


def test_restart_retries_do_not_pile_up_superexecs(tmp_path):
    """Every start attempt exits (like Flower's 305 while the old session is still online): each failed
    attempt's SuperExec is stopped, retried or not."""
    dep = Deployment(1, run_dir=tmp_path / "dep", insecure=True, isolation="process",
                     bin_dir=_fake_bins(tmp_path, "exit 1\n"), **free_port_kwargs(1))  # fmt: skip
    try:
        with pytest.raises(DeploymentError, match="exited"):
            dep.restart_node(0, timeout=5.0)
        assert _superexecs(dep) == [], "SuperExecs of failed start attempts left running"
    finally:
        dep.stop()
    assert dep.leftover_processes() == []


# ----------------------------------------------------------------------------- SANs


@pytest.mark.parametrize("bad", ["fl.example.org:9092", "bad_name!", "-x.example.org", "a..b", "[fl.example.org]",
                                 "[2001:db8::5]:9092", "x" * 64 + ".org", "foo.*.org", "bad name"])  # fmt: skip
def test_split_sans_rejects_invalid_names_naming_them(bad):
    with pytest.raises(ValueError, match="san: " + repr(bad).replace("[", r"\[").replace("*", r"\*")):
        pki.split_sans(["superlink", bad])


def test_split_sans_takes_valid_names_and_bracketed_ips():
    dns, ips = pki.split_sans(["superlink", "site-0", "*.example.org", "fl.example.org.", "[2001:db8::5]",
                               "[192.0.2.1]", "2001:db8::5", "10.0.0.1"])  # fmt: skip
    assert dns == ["superlink", "site-0", "*.example.org", "fl.example.org"]  # one trailing (root) dot dropped
    assert ips == ["2001:db8::5", "192.0.2.1", "10.0.0.1"]


def test_pki_cli_refuses_a_san_with_a_port(tmp_path):
    with pytest.raises(ValueError, match="port"):
        pki.ensure_pki(tmp_path / "certs", 1, ["fl.example.org:9092"])
    assert not (tmp_path / "certs" / "ca.key").exists()


def test_private_dirs_are_owner_only_down_to_every_created_parent(tmp_path):
    """``up`` makes nodes/site-k/state and homes/...: the parents it creates on the way are 0700 too (they were
    the umask's 0755: Path.mkdir gives ``mode`` to the last directory only); existing directories keep theirs."""
    tmp_path.chmod(0o755)
    deep = tmp_path / "run" / "nodes" / "site-0" / "state"
    _mkdir_private(deep)
    assert [_mode(p) for p in (deep, deep.parent, deep.parent.parent, tmp_path / "run")] == [0o700] * 4
    assert _mode(tmp_path) == 0o755
    _mkdir_private(deep)  # exists: no error


@pytest.mark.parametrize("args, says", [
    (["--nodes", "0"], "num_nodes must be >= 1"),
    (["--nodes", "1", "--node-config-for", "5", "torch-threads=1"], "node index k must be in [0, 1)"),
    (["--nodes", "1", "--poll-interval", "0"], "superexec_poll_interval must be in [0.01, 60]"),
    (["--nodes", "1", "--fleet-port", "8000", "--control-port", "8000"], "must all differ"),
])
def test_up_refuses_values_the_deployment_refuses_in_one_line_before_anything_starts(tmp_path, capsys, args, says):
    """Stop-30 review: these ended in a ValueError traceback (exit 1)."""
    from scripts import deploy
    run_dir = tmp_path / "run"
    assert deploy.main(["up", "--run-dir", str(run_dir), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deploy.py up: error: ") and says in err and "Traceback" not in err, err
    assert not (run_dir / "deployment.json").exists()


def test_warm_worker_refuses_torch_threads_below_one_at_parsing(capsys):
    from client import warm_worker
    with pytest.raises(SystemExit) as exc:
        warm_worker.build_parser().parse_args(["--socket", "/nonexistent/w.sock", "--torch-threads", "0"])
    assert exc.value.code == 2 and "--torch-threads: must be a whole number in [1, 1024]" in capsys.readouterr().err
