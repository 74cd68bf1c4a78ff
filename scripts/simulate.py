"""Run the PGVI app in Flower's simulation engine (`flwr run . <conn>` with a managed local SuperLink).

Usage:
    python scripts/simulate.py --supernodes 3 [-c key=value ...] [--out runs/sim]

It creates a private FLWR_HOME under --out (so nothing touches ~/.flwr), writes a ``:local:`` connection on
private ports, runs ``flwr run . <conn> --stream --run-config <file>``, checks the run's final status with
``flwr ls`` (``flwr run`` exits 0 even when the ServerApp failed) and stops the managed SuperLink it started
(Flower leaves it running detached).  Importable: :func:`run_simulation` is what the tests use.

The status reported is always that of the run THIS invocation started (its id comes from the ``flwr run``
output); the SuperLink database in --out keeps earlier runs, which are never reported.  If the SuperLink
refused to start a run (e.g. an unknown run-config key), the script prints the server's message and exits 1.

One simulation at a time per --out directory: a second one on the same --out is refused while the first
runs (they would share FLWR_HOME, and the first to finish would stop the other's SuperLink).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLWR_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def write_run_config(path: Path, run_config: dict) -> Path:
    path.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in run_config.items()))
    tomllib.loads(path.read_text())  # fail here, not inside flwr, on a bad value
    return path


def _flwr_bin(name: str) -> str:
    cand = Path(sys.executable).with_name(name)
    return str(cand) if cand.exists() else name


def _pids_listening(port: int) -> list[int]:
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True).stdout
    return sorted({int(m) for m in re.findall(r"pid=(\d+)", out)})


def _pids_with_env(key: str, value: str) -> list[int]:
    """Processes whose environment has ``key=value`` (every process of one simulation shares its FLWR_HOME)."""
    needle = f"{key}={value}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _wait_healthy(port: int, timeout: float) -> bool:
    import urllib.request

    end = time.time() + timeout
    while time.time() < end:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(1.0)
    return False


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in _children(k)]


def stop_local_superlink(port: int, home: Path | None = None, timeout: float = 20.0) -> None:
    """Terminate the managed SuperLink listening on ``port``, everything it spawned and (if ``home`` is
    given) every other process of this simulation (found by its FLWR_HOME)."""
    pids = set(_pids_listening(port)) | set(_pids_with_env("FLWR_HOME", str(home)) if home else ())
    for pid in sorted(pids):
        family = [pid] + _children(pid)
        for p in family:
            try:
                os.kill(p, signal.SIGTERM)
            except ProcessLookupError:
                pass
        end = time.time() + timeout
        while time.time() < end and any(_alive(p) for p in family):
            time.sleep(0.2)
        for p in family:
            if _alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:  # exited between the check and the kill
                    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RUN_ID_PATTERNS = (re.compile(r"Successfully started run (\d+)"),
                    re.compile(r"Starting logstream for run_id `(\d+)`"))


def started_run_id(log_text: str) -> str | None:
    """The id of the run this ``flwr run`` started, from its output (``None``: it started none)."""
    text = _ANSI.sub("", log_text)
    ids = [m for pat in _RUN_ID_PATTERNS for m in pat.findall(text)]
    return ids[-1] if ids else None


def pick_run(runs: list[dict], log_text: str) -> dict:
    """This invocation's entry of ``flwr ls``: the run whose id the ``flwr run`` log shows, else ``{}``.

    FLWR_HOME (and its SuperLink database) persists between invocations, so ``flwr ls`` also lists earlier
    runs, in no guaranteed order.  A run whose id this invocation's log does not show is never picked (not
    even the only one listed: when the server refused to start a run, that is an earlier run).
    """
    started = started_run_id(log_text)
    if started is None:
        return {}
    return next((r for r in runs if str(r.get("run-id")) == started), {})


def server_message(log_text: str, max_lines: int = 12) -> str:
    """The error ``flwr run`` printed (Flower's boxed "Error" panel, else lines mentioning an error),
    e.g. ``[code: 15] Invalid run configuration.``; the log's last lines when there is none."""
    lines = [ln.rstrip() for ln in _ANSI.sub("", log_text).splitlines()]
    for i, ln in enumerate(lines):
        if ln.lstrip().startswith("╭") and "Error" in ln:
            body = []
            for inner in lines[i + 1:]:
                if inner.lstrip().startswith("╰"):
                    break
                body.append(inner.strip().strip("│").strip())
            return " ".join(b for b in body if b)
    hits = [ln.strip() for ln in lines if re.search(r"error|\[code: \d+\]|failed", ln, re.IGNORECASE)]
    return "\n".join((hits or [ln for ln in lines if ln.strip()])[-max_lines:])


def run_simulation(
    run_config: dict,
    num_supernodes: int,
    workdir: Path,
    num_cpus_per_client: float = 1.0,
    timeout: float = 1800.0,
    stream_to: Path | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> dict:
    """Run the app in simulation; returns ``{"status", "run_id", "out_dir", "log", "seconds"}``.

    ``preexec_fn`` runs in the ``flwr run`` child before it starts (e.g. joining a memory cgroup: the SuperLink,
    the simulation and Ray's processes it starts inherit that)."""
    workdir = Path(workdir).resolve()
    home = workdir / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    # one simulation per FLWR_HOME: a second one would share it, and the first to finish would stop the
    # other's SuperLink (stop_local_superlink ends every process of that FLWR_HOME). The lock dies with us.
    lock = open(home / ".simulate.lock", "a+")  # noqa: SIM115 - held until the end of the function
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        other = (home / ".simulate.lock").read_text().strip() or "?"
        raise RuntimeError(
            f"another simulation (pid {other}) is running with FLWR_HOME={home}; use a different --out/workdir"
        ) from None
    try:
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        return _run_simulation_locked(run_config, num_supernodes, workdir, home, num_cpus_per_client, timeout,
                                      stream_to, preexec_fn)
    finally:
        lock.close()


def _run_simulation_locked(run_config: dict, num_supernodes: int, workdir: Path, home: Path,
                           num_cpus_per_client: float, timeout: float, stream_to: Path | None,
                           preexec_fn: Callable[[], None] | None = None) -> dict:
    http_port, control_port = free_port(), free_port()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "pgvi-sim"\n[superlink.pgvi-sim]\naddress = ":local:"\n'
    )
    env = {**os.environ, **FLWR_ENV, "FLWR_HOME": str(home),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port), "FLWR_LOCAL_CONTROL_API_PORT": str(control_port)}
    out_root = workdir / "outputs"
    cfg = {**run_config, "output-dir": str(out_root)}
    cfg_file = write_run_config(workdir / "run_config.toml", cfg)
    log_path = stream_to or workdir / "flwr-run.log"
    cmd = [_flwr_bin("flwr"), "run", str(ROOT), "pgvi-sim", "--stream", "--run-config", str(cfg_file),
           "--federation-config", f"num-supernodes={num_supernodes} client-resources-num-cpus={num_cpus_per_client:g}"]
    t0 = time.time()
    try:
        # Flower gives its managed SuperLink a fixed 15 s to start; on a loaded machine that can fail: retry
        for attempt in range(3):
            with open(log_path, "w") as log:
                subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False,
                               preexec_fn=preexec_fn)
            if "Failed to start local SuperLink" not in Path(log_path).read_text():
                break
            # the detached SuperLink keeps starting; once it answers, `flwr run` finds and uses it
            _wait_healthy(http_port, timeout=180.0)
        ls = subprocess.run([_flwr_bin("flwr"), "ls", "pgvi-sim", "--format", "json"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    finally:
        stop_local_superlink(http_port, home)
    seconds = time.time() - t0
    runs = json.loads(ls.stdout).get("runs", []) if ls.stdout.strip().startswith("{") else []
    log_text = Path(log_path).read_text(errors="replace")
    run_id = started_run_id(log_text)
    if run_id is None:  # the server refused the run (or flwr failed before starting one): never an older run
        return {"status": "not-started", "status-details": server_message(log_text), "run_id": "",
                "out_dir": None, "log": log_path, "seconds": seconds}
    run = pick_run(runs, log_text)  # {} if `flwr ls` did not list it: status unknown
    return {"status": run.get("status", "unknown"), "status-details": run.get("status-details", ""), "run_id": run_id,
            "out_dir": out_root / f"run-{run_id}", "log": log_path, "seconds": seconds}


_PAIR = re.compile(r"""([^\s=]+)=('[^']*'|"[^"]*"|\S+)""")


def parse_overrides(item: str) -> dict:
    """One ``-c`` argument: space-separated ``key=value`` pairs with TOML values, as ``flwr run -c`` takes
    them (``'a=1 b=2 note="x y"'``).  ``ValueError`` names the bad override."""
    out: dict = {}
    pos = 0
    for m in _PAIR.finditer(item):
        if item[pos:m.start()].strip():
            break
        key, raw = m.group(1), m.group(2)
        try:
            out[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            raise ValueError(
                f"-c {item!r}: {key}={raw} is not a TOML value (strings need quotes, e.g. {key}='\"{raw}\"')"
            ) from None
        pos = m.end()
    if not out or item[pos:].strip():
        raise ValueError(f"-c {item!r}: expected space-separated key=value pairs, e.g. -c 'num-server-rounds=2 "
                         "schedule=\"sequential\"'")
    return out


def pyproject_run_config(overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """The run config of ``pyproject.toml``'s ``[tool.flwr.app.config]`` with ``-c`` overrides applied in order
    (each parsed by :func:`parse_overrides`; ``ValueError`` names a malformed one)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        run_config = dict(tomllib.load(f)["tool"]["flwr"]["app"]["config"])
    for item in overrides:
        run_config.update(parse_overrides(item))
    return run_config


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--supernodes", type=int, default=3)
    ap.add_argument("--cpus-per-client", type=float, default=1.0)
    ap.add_argument("-c", "--config", action="append", default=[],
                    help="run-config overrides: space-separated key=value pairs, TOML values (strings quoted)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "sim",
                    help="output dir; holds FLWR_HOME, so one simulation at a time per --out")
    args = ap.parse_args()
    try:
        run_config = pyproject_run_config(args.config)
    except ValueError as err:
        ap.error(str(err))
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "flwr-run.log"
    print(f"simulation: {args.supernodes} SuperNodes; log {log_path}", flush=True)
    # a SIGTERM must still run run_simulation's cleanup (Flower leaves its SuperLink running detached); the
    # handler is restored afterwards (the tests call main() inside the pytest process)
    old_handler = signal.signal(signal.SIGTERM, _interrupt)
    try:
        res = run_simulation(run_config, args.supernodes, args.out, args.cpus_per_client, stream_to=log_path)
    except RuntimeError as err:
        print(f"simulate.py: error: {err}", file=sys.stderr)
        sys.exit(1)
    finally:
        signal.signal(signal.SIGTERM, old_handler)
    if not res["run_id"]:
        print(f"simulate.py: no run was started: {res['status-details']} (log {log_path})", file=sys.stderr)
        sys.exit(1)
    for line in log_path.read_text().splitlines():
        if "PGVI" in line or "rror" in line:
            print(line, flush=True)
    print(f"status: {res['status']} {res['status-details']}; {res['seconds']:.1f}s; records: {res['out_dir']}")
    sys.exit(0 if res["status"] == "finished:completed" else 1)


if __name__ == "__main__":
    main()
