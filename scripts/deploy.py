"""Run a real (multi-process) Flower 1.39 federation of the PGVI app on one host.

One SuperLink and N SuperNodes are started as separate OS processes on loopback, each
with its own ``FLWR_HOME`` and log file under a run directory. TLS is ON by default
(certificates are generated with ``scripts/pki.py`` unless ``--certs`` is given);
SuperNode authentication with ``--auth`` registers each node's public key with
``flwr supernode register`` before the nodes start. Plain-text gRPC/HTTP only with
``--insecure``, which prints a warning.

SuperNode ``k`` gets ``--port <node-port-base + k>`` and the node config
``partition-id=k num-partitions=N client-id="site-k" state-dir="<run-dir>/nodes/site-k/state"``,
then the shared ``node_config``, then node ``k``'s own entries from ``node_configs[k]`` (each merged
over the previous). ``restart_node(k, node_config=..., wipe_state=True)`` restarts one node with a
changed node config and/or an empty state dir (fault-injection experiments).
A Flower CLI config (``<run-dir>/homes/cli/config.toml``) gets a connection
(default name ``pgvi-deploy``) to the Control API.

CLI::

    python scripts/deploy.py up     --run-dir runs/deploy --nodes 3 [--auth] [--run -c 'num-server-rounds=2']
    python scripts/deploy.py run    --run-dir runs/deploy [-c 'k=v' ...]
    python scripts/deploy.py status --run-dir runs/deploy
    python scripts/deploy.py down   --run-dir runs/deploy

Python API (pytest)::

    with Deployment(2, run_dir=tmp_path, **free_port_kwargs(2)) as dep:
        dep.start(); dep.wait_online()
        result = dep.run_app({"num-server-rounds": 1})
        assert result.ok, result

``flwr run --stream`` exits 0 even when the run failed, so :meth:`Deployment.run_app`
reads the final status with ``flwr ls <conn> --run-id <id> --format json``.

SIGKILL gotcha with ``--auth`` (Flower 1.39): a registered SuperNode that was killed
stays ``online`` until its heartbeat expires (~40-60 s); restarting it before that
exits with Flower code 305 ("could not be activated"). :meth:`Deployment.restart_node`
waits for the old session to go offline and retries with backoff.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import tomli_w

try:  # works both as `python scripts/deploy.py` and as `import scripts.deploy`
    from scripts import pki
except ImportError:  # pragma: no cover - direct execution
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import pki  # type: ignore[no-redef]

__all__ = [
    "DEFAULT_CONNECTION",
    "Deployment",
    "DeploymentError",
    "FLOWER_BASE_ENV",
    "ProcInfo",
    "RunResult",
    "find_free_ports",
    "free_port_kwargs",
    "main",
    "port_is_free",
    "to_toml_config",
]

log = logging.getLogger("pgvi.deploy")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONNECTION = "pgvi-deploy"
MARKER_VAR = "PGVI_DEPLOY_ID"
STATE_FILE = "deployment.json"

#: Environment applied to every Flower process started here (notes §6).
FLOWER_BASE_ENV: dict[str, str] = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "PYTHONUNBUFFERED": "1",
    "NO_COLOR": "1",
}

#: Flower exit code of a SuperNode that could not connect/activate (notes §3, §4).
FLWR_EXIT_SUPERNODE_NOT_ACTIVATED = 305

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RUN_STARTED = re.compile(r"Successfully started run (\d+)")
_NODE_ID = re.compile(r"SuperNode ID: (\d+)")

INSECURE_BANNER = """
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
!!  INSECURE DEPLOYMENT: TLS is OFF. Model updates, node identities and the    !!
!!  Control API travel in plain text and any process that can reach the ports  !!
!!  can join the federation or submit runs. Use only for local debugging.      !!
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
"""


class DeploymentError(RuntimeError):
    """A Flower process failed to start, died, or a CLI call failed."""


@dataclasses.dataclass
class ProcInfo:
    """One OS process started by a :class:`Deployment` (leader of its process group)."""

    role: str  # "superlink" | "superexec-serverapp" | "supernode" | "superexec-clientapp" | "probe"
    index: int | None
    pid: int
    cmd: list[str]
    log_path: str
    started_at: float
    popen: subprocess.Popen | None = dataclasses.field(default=None, repr=False, compare=False)
    stopped: bool = False

    @property
    def name(self) -> str:
        return self.role if self.index is None else f"{self.role}-{self.index}"

    def to_json(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "popen"
        }


@dataclasses.dataclass(frozen=True)
class RunResult:
    """Outcome of one ``flwr run``: the SuperLink's final status, not the CLI's rc."""

    run_id: int | None
    status: str  # e.g. "finished:completed", "finished:failed", "running", "unknown"
    details: str
    returncode: int | None
    elapsed_s: float
    log_path: Path
    info: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed"


# --------------------------------------------------------------------------- helpers


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on ``host:port`` (bind test with SO_REUSEADDR)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def find_free_ports(n: int, host: str = "127.0.0.1", low: int = 20000, high: int = 60000) -> list[int]:
    """``n`` distinct currently-free TCP ports in ``[low, high)`` (random, not ephemeral)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = secrets.SystemRandom()
    ports: list[int] = []
    for _ in range(200 * n):
        p = rng.randrange(low, high)
        if p not in ports and port_is_free(p, host):
            ports.append(p)
            if len(ports) == n:
                return ports
    raise DeploymentError(f"could not find {n} free ports in [{low}, {high})")


def free_port_kwargs(num_nodes: int, host: str = "127.0.0.1") -> dict[str, Any]:
    """``Deployment`` keyword arguments with random free ports (for parallel tests)."""
    ports = find_free_ports(num_nodes + 2, host)
    return {"fleet_port": ports[0], "control_port": ports[1], "node_ports": ports[2:]}


def _toml_scalar(key: str, value: Any) -> Any:
    if isinstance(value, bool | int | float | str):
        return value
    raise TypeError(
        f"config value for {key!r} must be bool, int, float or str, got {type(value).__name__}"
    )


def to_toml_config(config: Mapping[str, Any]) -> str:
    """Serialise a flat ``{key: scalar}`` config to TOML (keys quoted, so ``a.b`` stays one key)."""
    lines = []
    for key, value in config.items():
        doc = tomli_w.dumps({"v": _toml_scalar(key, value)}).strip()
        lines.append(f"{json.dumps(str(key))} = {doc.split('=', 1)[1].strip()}")
    return "\n".join(lines) + "\n"


def _node_config_arg(config: Mapping[str, Any]) -> str:
    """``--node-config`` string; Flower parses it with ``(\\S+?)=("[^"]*"|\\S+)``."""
    parts = []
    for key, value in config.items():
        if not re.fullmatch(r"[A-Za-z0-9_\-]+", str(key)):
            raise ValueError(f"node-config key {key!r}: use letters, digits, '-' or '_'")
        value = _toml_scalar(key, value)
        if isinstance(value, str):
            if '"' in value or "\n" in value or "\\" in value:
                raise ValueError(f"node-config {key}={value!r}: no quotes/backslashes/newlines")
            parts.append(f'{key}="{value}"')
        elif isinstance(value, bool):
            parts.append(f"{key}={'true' if value else 'false'}")
        else:
            parts.append(f"{key}={value!r}")
    return " ".join(parts)


def _read_environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def _pids_with_marker(token: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose environment carries ``MARKER_VAR=token``."""
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid == me:
            continue
        env = _read_environ(pid)
        if env and env.get(MARKER_VAR) == token:
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[-1].split()[0] != "Z":
                found.append(pid)
    return sorted(found)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def _tail(path: str | Path, n: int = 30) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(_ANSI.sub("", line) for line in lines[-n:])


def _parse_json_output(text: str) -> Any:
    """The JSON document printed by ``flwr ... --format json`` (ignores any other lines)."""
    text = _ANSI.sub("", text)
    start = text.find("{")
    while start != -1:
        try:
            return json.JSONDecoder().raw_decode(text[start:])[0]
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    raise DeploymentError(f"no JSON in flwr output:\n{text[-2000:]}")


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


# --------------------------------------------------------------------------- deployment


class Deployment:
    """A SuperLink plus ``num_nodes`` SuperNodes as separate processes (context manager).

    Parameters
    ----------
    num_nodes:
        Number of SuperNodes (partition ids ``0..N-1``, client ids ``site-k``).
    run_dir:
        Directory for logs, per-process ``FLWR_HOME`` s, the SuperLink database, the
        generated certificates and node state dirs. Default ``runs/deploy``.
    app_dir:
        The Flower app (directory with ``pyproject.toml``). Default: this repository.
    certs_dir:
        Existing PKI (``ca.crt``, ``server.pem``, ``server.key``, ``keys/site-k.key|.pub``)
        as written by ``scripts/pki.py``. Default: generate one in ``run_dir/certs``.
    insecure:
        Disable TLS (warns loudly). Incompatible with ``auth``.
    auth:
        Enable SuperNode authentication and register every node key before starting.
    host:
        Bind address of the SuperLink's Fleet and Control APIs.
    fleet_port, control_port, node_port_base, node_ports:
        Ports. ``node_ports`` (one per node) overrides ``node_port_base + k``.
    isolation:
        ``"subprocess"`` (SuperLink/SuperNodes spawn their own SuperExec) or
        ``"process"`` (separate ``flower-superexec`` processes, like the Docker layout).
    node_config:
        Extra node-config entries for every node (e.g. ``{"torch-threads": 1}``).
    node_configs:
        Per-node entries ``{k: {...}}`` merged over ``node_config`` for node ``k`` only
        (e.g. ``{1: {"fault": "nan@2"}}``); see :meth:`node_config_for`, :meth:`set_node_config`.
    superexec_poll_interval:
        ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` for all processes (Flower default 1 s).
    env:
        Extra environment for every process.
    """

    def __init__(
        self,
        num_nodes: int = 3,
        *,
        run_dir: str | os.PathLike[str] | None = None,
        app_dir: str | os.PathLike[str] = REPO_ROOT,
        certs_dir: str | os.PathLike[str] | None = None,
        insecure: bool = False,
        auth: bool = False,
        host: str = "127.0.0.1",
        fleet_port: int = 9092,
        control_port: int = 8000,
        node_port_base: int = 9094,
        node_ports: Sequence[int] | None = None,
        isolation: str = "subprocess",
        connection: str = DEFAULT_CONNECTION,
        node_config: Mapping[str, Any] | None = None,
        node_configs: Mapping[int, Mapping[str, Any]] | None = None,
        superexec_poll_interval: float | None = 0.1,
        env: Mapping[str, str] | None = None,
        bin_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if auth and insecure:
            raise ValueError("auth=True requires TLS: SuperNode authentication cannot be insecure")
        if isolation not in ("subprocess", "process"):
            raise ValueError(f"isolation must be 'subprocess' or 'process', got {isolation!r}")
        if node_ports is not None and len(node_ports) != num_nodes:
            raise ValueError(f"node_ports needs {num_nodes} entries, got {len(node_ports)}")
        if superexec_poll_interval is not None and not 0.01 <= superexec_poll_interval <= 60:
            raise ValueError(
                f"superexec_poll_interval must be in [0.01, 60] (Flower's range), got {superexec_poll_interval}"
            )
        reserved = set(node_ports or [node_port_base + k for k in range(num_nodes)])
        if len(reserved | {fleet_port, control_port}) != num_nodes + 2:
            raise ValueError("fleet_port, control_port and the node ports must all differ")

        self.num_nodes = num_nodes
        self.run_dir = Path(run_dir or REPO_ROOT / "runs" / "deploy").resolve()
        self.app_dir = Path(app_dir).resolve()
        self.certs_dir = Path(certs_dir).resolve() if certs_dir else None
        self.insecure = insecure
        self.auth = auth
        self.host = host
        self.fleet_port = fleet_port
        self.control_port = control_port
        self.node_ports = list(node_ports) if node_ports is not None else [
            node_port_base + k for k in range(num_nodes)
        ]
        self.isolation = isolation
        self.connection = connection
        self.node_config = dict(node_config or {})
        self.node_configs: dict[int, dict[str, Any]] = {}
        for k, cfg in (node_configs or {}).items():
            self.set_node_config(int(k), cfg)
        self.superexec_poll_interval = superexec_poll_interval
        self.extra_env = dict(env or {})
        self.bin_dir = Path(bin_dir) if bin_dir else Path(sys.executable).parent
        self.token = secrets.token_hex(8)
        self.procs: list[ProcInfo] = []
        self.node_ids: dict[int, str] = {}  # k -> node id (registered id with auth)
        self._killed_hard: set[int] = set()
        self._started = False
        self._run_counter = 0
        self.pki: pki.PkiFiles | None = None

    # ----------------------------------------------------------------- paths/env

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def cli_home(self) -> Path:
        return self.run_dir / "homes" / "cli"

    @property
    def ca_cert(self) -> Path | None:
        return None if self.insecure or self.pki is None else self.pki.ca_cert

    def node_name(self, k: int) -> str:
        return pki.node_key_name(k)

    def node_state_dir(self, k: int) -> Path:
        return self.run_dir / "nodes" / self.node_name(k) / "state"

    def _check_index(self, k: int) -> None:
        if not 0 <= k < self.num_nodes:
            raise ValueError(f"node index k must be in [0, {self.num_nodes}), got {k}")

    def node_config_for(self, k: int) -> dict[str, Any]:
        """The node config SuperNode ``k`` is started with: defaults < shared < per-node entries."""
        self._check_index(k)
        return {
            "partition-id": k,
            "num-partitions": self.num_nodes,
            "client-id": self.node_name(k),
            "state-dir": str(self.node_state_dir(k)),
            **self.node_config,
            **self.node_configs.get(k, {}),
        }

    def set_node_config(self, k: int, config: Mapping[str, Any] | None) -> None:
        """Replace node ``k``'s own node-config entries (``None`` or ``{}``: none); used at its next start."""
        self._check_index(k)
        cfg = dict(config or {})
        _node_config_arg(cfg)  # validate keys/values now, not at the next start
        if cfg:
            self.node_configs[k] = cfg
        else:
            self.node_configs.pop(k, None)

    def wipe_node_state(self, k: int) -> None:
        """Empty node ``k``'s state dir (the ClientApp's durable state). Only while no message runs on it."""
        state_dir = self.node_state_dir(k)
        if state_dir.exists():
            shutil.rmtree(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)

    def node_key(self, k: int) -> tuple[Path, Path]:
        """(private, public) OpenSSH key paths of node ``k``."""
        assert self.pki is not None
        base = self.pki.out_dir / "keys" / self.node_name(k)
        return base.with_suffix(".key"), base.with_suffix(".pub")

    def node_runtime_cert(self, k: int) -> tuple[Path, Path]:
        """(certificate, key) of node ``k``'s Runtime API (used with ``isolation='process'``)."""
        assert self.pki is not None
        base = self.pki.out_dir / "runtime" / self.node_name(k)
        return base.with_suffix(".pem"), base.with_suffix(".key")

    def _bin(self, name: str) -> str:
        cand = self.bin_dir / name
        if cand.exists():
            return str(cand)
        found = shutil.which(name)
        if not found:
            raise DeploymentError(f"{name} not found in {self.bin_dir} or PATH")
        return found

    def _env(self, home: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update(FLOWER_BASE_ENV)
        env["FLWR_HOME"] = str(home)
        env[MARKER_VAR] = self.token
        # SuperNode/SuperLink spawn `flower-superexec`, `flwr-clientapp` ... from PATH.
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        if self.superexec_poll_interval is not None:
            env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(self.superexec_poll_interval)
        env.update(self.extra_env)
        home.mkdir(parents=True, exist_ok=True)
        return env

    # ----------------------------------------------------------------- process control

    def _spawn(self, role: str, index: int | None, cmd: list[str], home: Path) -> ProcInfo:
        name = role if index is None else f"{role}-{index}"
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.logs_dir / f"{name}.log"
        with open(log_path, "ab") as fh:
            fh.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} $ {' '.join(cmd)}\n".encode())
            fh.flush()
            popen = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=self._env(home),
                cwd=str(self.run_dir),
                start_new_session=True,  # own process group: killpg reaches its children
            )
        info = ProcInfo(role, index, popen.pid, cmd, str(log_path), time.time(), popen)
        self.procs = [p for p in self.procs if not (p.role == role and p.index == index)]
        self.procs.append(info)
        self._save_state()
        log.info("started %s (pid %d), log %s", name, popen.pid, log_path)
        return info

    def _proc(self, role: str, index: int | None = None) -> ProcInfo | None:
        for p in self.procs:
            if p.role == role and p.index == index:
                return p
        return None

    def _alive(self, p: ProcInfo) -> bool:
        if p.popen is not None:
            return p.popen.poll() is None
        env = _read_environ(p.pid)
        return bool(env) and env.get(MARKER_VAR) == self.token

    def _returncode(self, p: ProcInfo) -> int | None:
        return p.popen.poll() if p.popen is not None else None

    def _signal_group(self, p: ProcInfo, sig: int) -> None:
        if not self._alive(p):
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:  # pragma: no cover
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)

    def _wait_exit(self, procs: Iterable[ProcInfo], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        procs = list(procs)
        while time.monotonic() < deadline:
            if not any(self._alive(p) for p in procs):
                return True
            time.sleep(0.1)
        return not any(self._alive(p) for p in procs)

    def _terminate(self, procs: Sequence[ProcInfo], grace: float = 10.0) -> None:
        for p in procs:
            self._signal_group(p, signal.SIGTERM)
        if not self._wait_exit(procs, grace):
            for p in procs:
                if self._alive(p):
                    log.warning("%s (pid %d) ignored SIGTERM; sending SIGKILL", p.name, p.pid)
                    self._signal_group(p, signal.SIGKILL)
            self._wait_exit(procs, 5.0)
        for p in procs:
            p.stopped = True
            if p.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(timeout=1)

    def leftover_processes(self) -> list[tuple[int, str]]:
        """Live processes (pid, cmdline) carrying this deployment's marker, incl. grandchildren."""
        return [(pid, _cmdline(pid)) for pid in _pids_with_marker(self.token)]

    # ----------------------------------------------------------------- CLI calls

    def flwr(self, *args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run the ``flwr`` CLI with this deployment's ``FLWR_HOME``."""
        cmd = [self._bin("flwr"), *args]
        try:
            res = subprocess.run(
                cmd,
                env=self._env(self.cli_home),
                cwd=str(self.run_dir),
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as err:
            raise DeploymentError(f"timeout after {timeout}s: {' '.join(cmd)}") from err
        if check and res.returncode != 0:
            raise DeploymentError(
                f"`{' '.join(cmd)}` failed (rc={res.returncode}):\n{_ANSI.sub('', res.stdout + res.stderr)[-3000:]}"
            )
        return res

    def flwr_json(self, *args: str, timeout: float = 60.0) -> Any:
        res = self.flwr(*args, "--format", "json", timeout=timeout, check=False)
        data = _parse_json_output(res.stdout + "\n" + res.stderr)
        if not data.get("success", False):
            raise DeploymentError(f"`flwr {' '.join(args)}` failed: {data}")
        return data

    def list_nodes(self) -> list[dict[str, Any]]:
        """``flwr supernode ls --format json`` rows (``node-id`` is a string)."""
        return list(self.flwr_json("supernode", "ls", self.connection)["nodes"])

    def list_runs(self) -> list[dict[str, Any]]:
        return list(self.flwr_json("ls", self.connection)["runs"])

    def run_info(self, run_id: int) -> dict[str, Any]:
        runs = self.flwr_json("ls", self.connection, "--run-id", str(run_id))["runs"]
        if not runs:
            raise DeploymentError(f"run {run_id} not found")
        return dict(runs[0])

    def register_node_key(self, public_key: Path, name: str) -> str:
        """``flwr supernode register`` ; returns the node id assigned by the SuperLink."""
        data = self.flwr_json("supernode", "register", str(public_key), self.connection, "--name", name)
        return str(data["node-id"])

    # ----------------------------------------------------------------- start

    def _prepare_pki(self) -> None:
        if self.insecure:
            self.pki = None
            return
        if self.certs_dir is None:
            self.pki = pki.ensure_pki(self.run_dir / "certs", self.num_nodes, log=log.info)
            return
        files = pki.PkiFiles(
            out_dir=self.certs_dir,
            ca_cert=self.certs_dir / "ca.crt",
            ca_key=self.certs_dir / "ca.key",
            server_cert=self.certs_dir / "server.pem",
            server_key=self.certs_dir / "server.key",
            node_keys=(),
        )
        self.pki = files
        need = [files.ca_cert, files.server_cert, files.server_key]
        if self.auth:
            need += [p for k in range(self.num_nodes) for p in self.node_key(k)]
        if self.isolation == "process":
            need += [p for k in range(self.num_nodes) for p in self.node_runtime_cert(k)]
        missing = [str(p) for p in need if not p.exists()]
        if missing:
            raise DeploymentError(
                f"missing PKI files {missing}; create them with "
                f"`python scripts/pki.py --out {self.certs_dir} --supernodes {self.num_nodes}`"
            )

    def _write_cli_config(self) -> Path:
        conn: dict[str, Any] = {"address": f"{_connect_host(self.host)}:{self.control_port}"}
        if self.insecure:
            conn["insecure"] = True
        else:
            assert self.ca_cert is not None
            conn["root-certificates"] = str(self.ca_cert)
        doc = {"superlink": {"default": self.connection, self.connection: conn}}
        self.cli_home.mkdir(parents=True, exist_ok=True)
        path = self.cli_home / "config.toml"
        path.write_text(tomli_w.dumps(doc))
        return path

    def _tls_server_args(self) -> list[str]:
        if self.insecure:
            return ["--insecure"]
        assert self.pki is not None
        return [
            "--ssl-ca-certfile", str(self.pki.ca_cert),
            "--ssl-certfile", str(self.pki.server_cert),
            "--ssl-keyfile", str(self.pki.server_key),
        ]  # fmt: skip

    def _tls_client_args(self) -> list[str]:
        return ["--insecure"] if self.insecure else ["--root-certificates", str(self.ca_cert)]

    def start(self, timeout: float = 90.0) -> None:
        """Start the SuperLink, register keys (auth), start all SuperNodes. Does not wait online."""
        if self._started:
            raise DeploymentError("deployment already started")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.insecure:
            print(INSECURE_BANNER, file=sys.stderr)
            log.warning("INSECURE deployment: TLS disabled")
        busy = [p for p in [self.fleet_port, self.control_port, *self.node_ports] if not port_is_free(p, "127.0.0.1")]
        if busy:
            raise DeploymentError(f"ports already in use: {busy}")
        self._started = True
        try:
            self._prepare_pki()
            self._write_cli_config()
            self._start_superlink(timeout)
            if self.auth:
                # One `flwr` CLI call costs seconds: register all keys concurrently.
                with ThreadPoolExecutor(max_workers=min(4, self.num_nodes)) as pool:
                    ids = list(pool.map(
                        lambda k: self.register_node_key(self.node_key(k)[1], self.node_name(k)),
                        range(self.num_nodes),
                    ))  # fmt: skip
                for k, nid in enumerate(ids):
                    self.node_ids[k] = nid
                    log.info("registered %s as node %s", self.node_name(k), nid)
                self._save_state()
            for k in range(self.num_nodes):
                self.start_node(k)
        except BaseException:
            self.stop()
            raise

    def _start_superlink(self, timeout: float) -> None:
        db = self.run_dir / "superlink" / "state.db"
        db.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            self._bin("flower-superlink"),
            *self._tls_server_args(),
            "--host", self.host,
            "--port", str(self.control_port),
            "--fleet-api-address", f"{self.host}:{self.fleet_port}",
            "--database", str(db),
            "--isolation", self.isolation,
            "--disable-runtime-dependency-installation",
        ]  # fmt: skip
        if self.auth:
            cmd.append("--enable-supernode-auth")
        link = self._spawn("superlink", None, cmd, self.run_dir / "homes" / "superlink")
        self._wait_superlink_ready(link, timeout)
        if self.isolation == "process":
            self._spawn(
                "superexec-serverapp",
                None,
                [
                    self._bin("flower-superexec"),
                    *self._tls_client_args(),
                    "--runtime-api-address", f"{_connect_host(self.host)}:{self.control_port}",
                ],  # fmt: skip
                self.run_dir / "homes" / "superexec-serverapp",
            )

    def _wait_superlink_ready(self, link: ProcInfo, timeout: float) -> None:
        host = _connect_host(self.host)
        scheme = "http" if self.insecure else "https"
        ctx = None if self.insecure else ssl.create_default_context(cafile=str(self.ca_cert))
        url = f"{scheme}://{host}:{self.control_port}/health"
        deadline = time.monotonic() + timeout
        health_ok = False
        while time.monotonic() < deadline:
            if not self._alive(link):
                raise DeploymentError(
                    f"SuperLink exited (rc={self._returncode(link)}):\n{_tail(link.log_path)}"
                )
            if not health_ok:
                try:
                    with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
                        health_ok = resp.status == 200
                except (urllib.error.URLError, OSError, ssl.SSLError):
                    pass
            if health_ok:
                with contextlib.suppress(OSError), socket.create_connection((host, self.fleet_port), timeout=1):
                    return
            time.sleep(0.25)
        raise DeploymentError(f"SuperLink not ready after {timeout}s:\n{_tail(link.log_path)}")

    def start_node(self, k: int, *, private_key: Path | None = None) -> ProcInfo:
        """Start SuperNode ``k`` (and its SuperExec with ``isolation='process'``)."""
        self._check_index(k)
        old = self._proc("supernode", k)
        if old is not None and self._alive(old):
            raise DeploymentError(f"supernode-{k} is still running (pid {old.pid})")
        port = self.node_ports[k]
        self.node_state_dir(k).mkdir(parents=True, exist_ok=True)
        node_cfg = self.node_config_for(k)
        cmd = [
            self._bin("flower-supernode"),
            *self._tls_client_args(),
            "--superlink", f"{_connect_host(self.host)}:{self.fleet_port}",
            "--host", "127.0.0.1",
            "--port", str(port),
            "--isolation", self.isolation,
            "--node-config", _node_config_arg(node_cfg),
        ]  # fmt: skip
        if self.auth or private_key is not None:
            key = private_key or self.node_key(k)[0]
            cmd += ["--auth-supernode-private-key", str(key)]
        if self.isolation == "process" and not self.insecure:
            # the separate SuperExec reaches this node's Runtime API over TLS (Docker layout)
            rt_cert, rt_key = self.node_runtime_cert(k)
            cmd += ["--ssl-ca-certfile", str(self.ca_cert),
                    "--ssl-certfile", str(rt_cert), "--ssl-keyfile", str(rt_key)]  # fmt: skip
        info = self._spawn("supernode", k, cmd, self.run_dir / "homes" / self.node_name(k))
        if self.isolation == "process":
            self._spawn(
                "superexec-clientapp",
                k,
                [self._bin("flower-superexec"), *self._tls_client_args(),
                 "--runtime-api-address", f"127.0.0.1:{port}"],  # fmt: skip
                self.run_dir / "homes" / f"{self.node_name(k)}-superexec",
            )
        return info

    def spawn_probe_node(self, private_key: Path, *, port: int, name: str = "probe") -> ProcInfo:
        """Start an extra SuperNode with ``private_key`` (not counted; e.g. an unregistered key)."""
        cmd = [
            self._bin("flower-supernode"),
            *self._tls_client_args(),
            "--superlink", f"{_connect_host(self.host)}:{self.fleet_port}",
            "--host", "127.0.0.1",
            "--port", str(port),
            "--auth-supernode-private-key", str(private_key),
            "--max-retries", "2",
            "--node-config", _node_config_arg({"client-id": name}),
        ]  # fmt: skip
        return self._spawn("probe", None, cmd, self.run_dir / "homes" / name)

    def wait_process_exit(self, info: ProcInfo, timeout: float) -> int | None:
        """Wait for a process started here to exit; returns its rc (None on timeout)."""
        if info.popen is None:
            raise DeploymentError("can only wait for processes started in this Python process")
        try:
            return info.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def node_id_from_log(self, k: int) -> str | None:
        """Last ``SuperNode ID: <id>`` that node ``k`` logged since its latest start."""
        p = self._proc("supernode", k)
        if p is None:
            return None
        try:
            text = Path(p.log_path).read_text(errors="replace")
        except OSError:
            return None
        text = text.rsplit("===== ", 1)[-1]  # only the latest start
        ids = _NODE_ID.findall(_ANSI.sub("", text))
        return ids[-1] if ids else None

    # ----------------------------------------------------------------- online checks

    def _check_nodes_alive(self) -> None:
        for k in range(self.num_nodes):
            p = self._proc("supernode", k)
            if p is not None and not p.stopped and not self._alive(p):
                raise DeploymentError(
                    f"supernode-{k} exited (rc={self._returncode(p)}):\n{_tail(p.log_path)}"
                )

    def wait_online(self, timeout: float = 90.0, nodes: Iterable[int] | None = None) -> list[dict[str, Any]]:
        """Block until every node in ``nodes`` (default: all) is ``online`` at the SuperLink.

        A node is identified by its registered id (auth) or by the ``SuperNode ID`` it
        logged since its latest start, so a stale session of a killed node never counts.
        Returns the final ``flwr supernode ls`` rows.
        """
        want = list(range(self.num_nodes)) if nodes is None else list(nodes)
        deadline = time.monotonic() + timeout
        rows: list[dict[str, Any]] = []
        while True:
            self._check_nodes_alive()
            # Cheap gate first: each node logs "SuperNode ID: <id>" once it is connected;
            # only then ask the SuperLink (each `flwr` CLI call costs seconds).
            ids = {}
            for k in want:
                logged = self.node_id_from_log(k)
                if logged is None:
                    continue
                if self.auth and k in self.node_ids and logged != self.node_ids[k]:
                    raise DeploymentError(
                        f"supernode-{k} logged id {logged}, registered id is {self.node_ids[k]}"
                    )
                ids[k] = logged
            if len(ids) == len(want):
                with contextlib.suppress(DeploymentError):
                    rows = self.list_nodes()
                online = {r["node-id"] for r in rows if r.get("status") == "online"}
                if all(ids[k] in online for k in want):
                    if not self.auth:
                        self.node_ids.update(ids)
                        self._save_state()
                    return rows
            if time.monotonic() > deadline:
                raise DeploymentError(
                    f"nodes {want} not all online after {timeout}s; ids={ids}, ls={rows}"
                )
            time.sleep(1.0)

    def node_status(self, k: int) -> str | None:
        nid = self.node_ids.get(k)
        if nid is None:
            return None
        for row in self.list_nodes():
            if row["node-id"] == nid:
                return str(row["status"])
        return None

    # ----------------------------------------------------------------- faults

    def kill_node(self, k: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) to SuperNode ``k``'s process group (and its SuperExec)."""
        procs = [p for p in (self._proc("supernode", k), self._proc("superexec-clientapp", k)) if p]
        if not procs:
            raise DeploymentError(f"supernode-{k} was never started")
        for p in procs:
            self._signal_group(p, sig)
        self._wait_exit(procs, 15.0)
        for p in procs:
            p.stopped = True
            if p.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(timeout=1)
        if sig == signal.SIGKILL:
            self._killed_hard.add(k)
        self._save_state()
        log.info("node %d stopped with signal %d", k, sig)

    _KEEP: Any = object()

    def restart_node(
        self,
        k: int,
        timeout: float = 150.0,
        wait: bool = True,
        *,
        node_config: Mapping[str, Any] | None = _KEEP,
        wipe_state: bool = False,
    ) -> None:
        """(Re)start SuperNode ``k``, handling the SIGKILL re-activation gotcha (notes §4).

        With ``auth`` and a node that was SIGKILLed, wait until the SuperLink marks the
        old session offline (<= ~60 s), then start; a start that still exits with
        Flower code 305 is retried with backoff until ``timeout``.

        ``node_config`` (if given) replaces node ``k``'s own entries (:meth:`set_node_config`;
        ``None``/``{}`` drops them); ``wipe_state`` empties its state dir once it has stopped.
        """
        p = self._proc("supernode", k)
        if p is not None and self._alive(p):
            self.kill_node(k, signal.SIGTERM)
        if node_config is not self._KEEP:
            self.set_node_config(k, node_config)
        if wipe_state:
            self.wipe_node_state(k)
        deadline = time.monotonic() + timeout
        if self.auth and k in self._killed_hard:
            while self.node_status(k) == "online":
                if time.monotonic() > deadline:
                    raise DeploymentError(f"node {k} stayed online after SIGKILL for {timeout}s")
                time.sleep(2.0)
        backoff = 2.0
        while True:
            info = self.start_node(k)
            if not wait:
                self._killed_hard.discard(k)
                return
            try:
                self.wait_online(timeout=max(1.0, min(60.0, deadline - time.monotonic())), nodes=[k])
                self._killed_hard.discard(k)
                return
            except DeploymentError:
                rc = self._returncode(info)
                if rc is None or time.monotonic() + backoff > deadline:
                    raise
                log.info("supernode-%d exited rc=%s on restart; retry in %.0fs", k, rc, backoff)
                info.stopped = True
                time.sleep(backoff)
                backoff = min(backoff * 2, 20.0)

    # ----------------------------------------------------------------- runs

    def run_app(
        self,
        run_config: Mapping[str, Any] | None = None,
        *,
        run_config_args: Sequence[str] = (),
        timeout: float = 1800.0,
        stream: bool = True,
    ) -> RunResult:
        """``flwr run <app> <conn> --stream`` and the run's final status from ``flwr ls``.

        ``run_config`` is written to a TOML file (no shell quoting issues);
        ``run_config_args`` are raw ``-c`` strings (``'k=v k2="s"'``) passed through.
        Flower forbids combining a TOML file with ``k=v`` pairs, so give one or the other.
        """
        if run_config and run_config_args:
            raise ValueError("give run_config (dict) or run_config_args (-c strings), not both")
        self._run_counter += 1
        n = self._run_counter
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.logs_dir / f"flwr-run-{n}.log"
        cmd = [self._bin("flwr"), "run", str(self.app_dir), self.connection]
        if stream:
            cmd.append("--stream")
        if run_config:
            cfg_path = self.run_dir / f"run-config-{n}.toml"
            cfg_path.write_text(to_toml_config(run_config))
            cmd += ["--run-config", str(cfg_path)]
        for arg in run_config_args:
            cmd += ["--run-config", arg]
        t0 = time.monotonic()
        with open(log_path, "wb") as fh:
            fh.write(f"$ {' '.join(cmd)}\n".encode())
            fh.flush()
            popen = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=self._env(self.cli_home),
                cwd=str(self.app_dir),
                start_new_session=True,
            )
            rc: int | None
            try:
                rc = popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = None
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
        text = _ANSI.sub("", Path(log_path).read_text(errors="replace"))
        ids = _RUN_STARTED.findall(text)
        run_id = int(ids[-1]) if ids else None
        if run_id is None:
            return RunResult(None, "not-started", text[-3000:], rc, time.monotonic() - t0, log_path)
        if rc is None:
            log.warning("run %d timed out after %.0fs; stopping it", run_id, timeout)
            self.flwr("stop", str(run_id), self.connection, check=False)
        info: dict[str, Any] = {}
        status = "unknown"
        wait_until = time.monotonic() + (30.0 if stream else timeout)
        while True:
            with contextlib.suppress(DeploymentError):
                info = self.run_info(run_id)
                status = str(info.get("status", "unknown"))
            if status.startswith("finished") or time.monotonic() > wait_until:
                break
            time.sleep(1.0)
        return RunResult(
            run_id,
            status,
            str(info.get("status-details", "")),
            rc,
            time.monotonic() - t0,
            log_path,
            info,
        )

    # ----------------------------------------------------------------- stop/state

    def stop(self, grace: float = 10.0) -> list[tuple[int, str]]:
        """Stop every process this deployment started; returns leftovers killed by marker.

        Order: SuperExecs and SuperNodes first (SIGTERM to each process group, SIGKILL
        after ``grace``), then the SuperLink; finally any process still carrying this
        deployment's environment marker (grandchildren that left the group) is SIGKILLed.
        """
        node_side = [p for p in self.procs if p.role != "superlink" and p.role != "superexec-serverapp"]
        link_side = [p for p in self.procs if p.role == "superexec-serverapp"]
        link_side += [p for p in self.procs if p.role == "superlink"]
        self._terminate(node_side, grace)
        self._terminate(link_side, grace)
        # Processes that left the group (the SuperLink starts its SuperExec in a new
        # session) but carry this deployment's marker: SIGTERM, then SIGKILL.
        leftovers = self.leftover_processes()
        for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            remaining = self.leftover_processes()
            if not remaining:
                break
            for pid, cmd in remaining:
                log.info("signal %d to leftover pid %d: %s", sig, pid, cmd)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while self.leftover_processes() and time.monotonic() < deadline:
                time.sleep(0.1)
        self._started = False
        try:
            self._save_state()
        except OSError as err:  # never let bookkeeping hide the shutdown
            log.warning("could not save state: %s", err)
        return leftovers

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _state(self) -> dict[str, Any]:
        return {
            "token": self.token,
            "num_nodes": self.num_nodes,
            "run_dir": str(self.run_dir),
            "app_dir": str(self.app_dir),
            "certs_dir": str(self.certs_dir) if self.certs_dir else None,
            "pki_dir": str(self.pki.out_dir) if self.pki else None,
            "insecure": self.insecure,
            "auth": self.auth,
            "host": self.host,
            "fleet_port": self.fleet_port,
            "control_port": self.control_port,
            "node_ports": self.node_ports,
            "isolation": self.isolation,
            "connection": self.connection,
            "node_config": self.node_config,
            "node_configs": {str(k): v for k, v in self.node_configs.items()},
            "superexec_poll_interval": self.superexec_poll_interval,
            "env": self.extra_env,
            "bin_dir": str(self.bin_dir),
            "node_ids": {str(k): v for k, v in self.node_ids.items()},
            "killed_hard": sorted(self._killed_hard),
            "run_counter": self._run_counter,
            "started": self._started,
            "procs": [p.to_json() for p in self.procs],
        }

    def _save_state(self) -> None:
        if not self.run_dir.exists():
            return
        tmp = self.run_dir / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(self._state(), indent=2))
        os.replace(tmp, self.run_dir / STATE_FILE)

    @classmethod
    def attach(cls, run_dir: str | os.PathLike[str]) -> Deployment:
        """Re-open a deployment started by another process (``deploy.py up``)."""
        path = Path(run_dir).resolve() / STATE_FILE
        if not path.exists():
            raise DeploymentError(f"no deployment state in {path}")
        st = json.loads(path.read_text())
        dep = cls(
            st["num_nodes"],
            run_dir=st["run_dir"],
            app_dir=st["app_dir"],
            certs_dir=st["certs_dir"],
            insecure=st["insecure"],
            auth=st["auth"],
            host=st["host"],
            fleet_port=st["fleet_port"],
            control_port=st["control_port"],
            node_ports=st["node_ports"],
            isolation=st["isolation"],
            connection=st["connection"],
            node_config=st["node_config"],
            node_configs={int(k): v for k, v in st.get("node_configs", {}).items()},
            superexec_poll_interval=st["superexec_poll_interval"],
            env=st["env"],
            bin_dir=st["bin_dir"],
        )
        dep.token = st["token"]
        dep.node_ids = {int(k): v for k, v in st["node_ids"].items()}
        dep._killed_hard = set(st.get("killed_hard", []))
        dep._run_counter = st.get("run_counter", 0)
        dep._started = st["started"]
        if st.get("pki_dir"):
            d = Path(st["pki_dir"])
            dep.pki = pki.PkiFiles(d, d / "ca.crt", d / "ca.key", d / "server.pem", d / "server.key", ())
        for pj in st["procs"]:
            dep.procs.append(ProcInfo(**pj))
        return dep

    def process_table(self) -> list[dict[str, Any]]:
        return [
            {"name": p.name, "pid": p.pid, "alive": self._alive(p), "log": p.log_path}
            for p in self.procs
        ]


# --------------------------------------------------------------------------- CLI


def _add_common(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "deploy",
                    help="directory for logs, state, certificates (default runs/deploy)")  # fmt: skip


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deploy.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start SuperLink + N SuperNodes, wait until all are online")
    _add_common(up)
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--app", type=Path, default=REPO_ROOT, help="Flower app dir (default: repo)")
    up.add_argument("--certs", type=Path, default=None,
                    help="PKI dir from scripts/pki.py (default: generate in RUN_DIR/certs)")  # fmt: skip
    up.add_argument("--auth", action="store_true", help="SuperNode authentication (register keys)")
    up.add_argument("--insecure", action="store_true", help="DISABLE TLS (debugging only)")
    up.add_argument("--host", default="127.0.0.1", help="SuperLink bind address")
    up.add_argument("--fleet-port", type=int, default=9092)
    up.add_argument("--control-port", type=int, default=8000)
    up.add_argument("--node-port-base", type=int, default=9094)
    up.add_argument("--isolation", choices=("subprocess", "process"), default="subprocess")
    up.add_argument("--connection", default=DEFAULT_CONNECTION)
    up.add_argument("--node-config", action="append", default=[], metavar="KEY=VALUE",
                    help="extra node config for every node, e.g. torch-threads=1 (repeatable)")  # fmt: skip
    up.add_argument("--node-config-for", nargs=2, action="append", default=[], metavar=("K", "KEY=VALUE"),
                    help="node config for node K only, merged over --node-config (repeatable)")  # fmt: skip
    up.add_argument("--poll-interval", type=float, default=0.1,
                    help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL (s)")  # fmt: skip
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait until online")
    up.add_argument("--run", action="store_true", help="then run the app (flwr run --stream)")
    up.add_argument("-c", "--run-config", action="append", default=[], help="passed to flwr run")
    up.add_argument("--run-timeout", type=float, default=3600.0)
    up.add_argument("--down-after", action="store_true", help="stop everything after --run")
    up.add_argument("--foreground", action="store_true", help="stay attached; Ctrl-C stops all")

    run = sub.add_parser("run", help="run the app on a deployment started with `up`")
    _add_common(run)
    run.add_argument("-c", "--run-config", action="append", default=[], help="passed to flwr run")
    run.add_argument("--timeout", type=float, default=3600.0)

    down = sub.add_parser("down", help="stop every process of a deployment")
    _add_common(down)

    status = sub.add_parser("status", help="processes, nodes and runs (JSON)")
    _add_common(status)
    return parser


def _parse_kv(items: Sequence[str]) -> dict[str, Any]:
    import tomllib

    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--node-config expects KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw  # bare string
    return out


def _parse_per_node(items: Sequence[Sequence[str]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for k, kv in items:
        try:
            idx = int(k)
        except ValueError:
            raise SystemExit(f"--node-config-for expects a node index, got {k!r}") from None
        out.setdefault(idx, {}).update(_parse_kv([kv]))
    return out


def _print_result(res: RunResult) -> None:
    print(json.dumps({
        "run-id": res.run_id, "status": res.status, "status-details": res.details,
        "flwr-run-rc": res.returncode, "elapsed-s": round(res.elapsed_s, 1), "log": str(res.log_path),
    }, indent=2))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose or args.command == "up" else logging.WARNING,
        format="%(asctime)s deploy %(levelname)s %(message)s",
    )
    if args.command == "up":
        dep = Deployment(
            args.nodes,
            run_dir=args.run_dir,
            app_dir=args.app,
            certs_dir=args.certs,
            insecure=args.insecure,
            auth=args.auth,
            host=args.host,
            fleet_port=args.fleet_port,
            control_port=args.control_port,
            node_port_base=args.node_port_base,
            isolation=args.isolation,
            connection=args.connection,
            node_config=_parse_kv(args.node_config),
            node_configs=_parse_per_node(args.node_config_for),
            superexec_poll_interval=args.poll_interval,
        )
        old = Path(args.run_dir).resolve() / STATE_FILE
        if old.exists():
            prev = Deployment.attach(args.run_dir)
            if any(p["alive"] for p in prev.process_table()):
                print(f"a deployment is already running in {args.run_dir}; `deploy.py down` first",
                      file=sys.stderr)  # fmt: skip
                return 2
        try:
            dep.start()
            dep.wait_online(timeout=args.timeout)
        except BaseException:
            dep.stop()
            raise
        print(f"{dep.num_nodes} SuperNodes online; FLWR_HOME={dep.cli_home} connection={dep.connection}")
        print(f"  FLWR_HOME={dep.cli_home} flwr supernode ls {dep.connection}")
        rc = 0
        if args.run:
            res = dep.run_app(run_config_args=args.run_config, timeout=args.run_timeout)
            _print_result(res)
            rc = 0 if res.ok else 1
        if args.foreground:
            print("running; Ctrl-C stops all processes")
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
        if args.foreground or args.down_after:
            dep.stop()
        return rc
    dep = Deployment.attach(args.run_dir)
    if args.command == "run":
        res = dep.run_app(run_config_args=args.run_config, timeout=args.timeout)
        _print_result(res)
        return 0 if res.ok else 1
    if args.command == "down":
        leftovers = dep.stop()
        remaining = dep.leftover_processes()
        print(json.dumps({"stopped": [p.name for p in dep.procs], "leftovers-killed": leftovers,
                          "remaining": remaining}))  # fmt: skip
        return 0 if not remaining else 1
    if args.command == "status":
        out: dict[str, Any] = {"processes": dep.process_table()}
        try:
            out["nodes"] = dep.list_nodes()
            out["runs"] = dep.list_runs()
        except DeploymentError as err:
            out["error"] = str(err)
        print(json.dumps(out, indent=2))
        return 0
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
