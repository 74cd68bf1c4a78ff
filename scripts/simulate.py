"""Run the PGVI app in Flower's simulation engine (`flwr run . <conn>` with a managed local SuperLink).

Usage:
    python scripts/simulate.py [--supernodes N] [-c key=value ...] [--out runs/sim]

It creates a private FLWR_HOME under --out (so nothing touches ~/.flwr), writes a ``:local:`` connection on
private ports, runs ``flwr run . <conn> --stream --run-config <file>``, checks the run's final status with
``flwr ls`` (``flwr run`` exits 0 even when the ServerApp failed) and stops the managed SuperLink it started
(Flower leaves it running detached) with everything it spawned.  The cleanup reads /proc only (no ``ss``/``ps``
needed) and runs before the status is reported; the exit code is the run's: 0 for finished:completed, else 1.
Importable: :func:`run_simulation` is what the tests use.

The number of SuperNodes defaults to the run config's num-clients (pyproject.toml, after the -c overrides):
Flower gives every SuperNode num-partitions = the number of SuperNodes, and a client whose num-partitions
differs from num-clients refuses to run.  The records go to <--out>/outputs/run-<id>: choose the directory with
--out; a -c output-dir=... is refused.

The status reported is always that of the run THIS invocation started (its id comes from the ``flwr run``
output); the SuperLink database in --out keeps earlier runs, which are never reported.  If the SuperLink
refused to start a run (e.g. an unknown run-config key), the script prints the server's message and exits 1.

Flower 1.39's ``flwr run`` gives the SuperLink it starts a fixed 15 s to answer and kills it after that.  When
that happened (a loaded machine), the script starts the same SuperLink itself, waits up to
--superlink-timeout seconds for it to answer and runs ``flwr run`` once more, which then uses it.

One simulation at a time per --out directory: a second one on the same --out is refused while the first
runs (they would share FLWR_HOME, and the first to finish would stop the other's SuperLink).

No time limit by default (a simulation of 1,000 clients may well run for hours); --timeout-s S stops a ``flwr run``
that has run S seconds: it is killed, the cleanup runs, and the script prints one error line and exits 1.  (The
limit is per ``flwr run``: when Flower's own SuperLink fails to start, the script starts one itself, waiting up to
--superlink-timeout, and runs ``flwr run`` once more with the same limit.)

Ctrl-C, SIGTERM and SIGHUP (terminal closed, ssh session dropped) stop the simulation like the end of a run does:
every process of it is stopped, then the script exits 130.  The cleanup itself ignores further stop signals (it
takes at most ~30 s: SIGTERM, up to 20 s for the processes to exit, then SIGKILL), so a second Ctrl-C or SIGTERM
cannot cut it short and leave a process that ignores SIGTERM running.  If the script itself is killed outright
(SIGKILL, the OOM killer), a small watcher it started first (:class:`_Reaper`) runs the same cleanup.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python scripts/simulate.py`: for scripts.stop_signals
    sys.path.insert(0, str(ROOT))
from scripts.arg_types import number_above  # noqa: E402
from scripts.lean_ray import joining_env, start_lean_ray_head  # noqa: E402
from scripts.remove_tree import remove_tree  # noqa: E402
from scripts.stop_signals import STOP_SIGNALS, raise_interrupt, signal_handlers  # noqa: E402

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


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


def _toml_string(s: str) -> str:
    """A TOML basic string holding ``s`` exactly: characters outside ASCII are written as they are (UTF-8),
    only the quote, the backslash and control characters are escaped (``json.dumps`` would write a character
    outside the BMP as a surrogate pair, ``"\\ud83d\\ude00"``, which TOML rejects)."""
    out = []
    for ch in s:
        code = ord(ch)
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04X}")
        elif 0xD800 <= code <= 0xDFFF:
            raise ValueError(f"{s!r} holds a lone surrogate (U+{code:04X}), which no TOML file can")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(v: object) -> str:
    """``v`` as a TOML value; ``ValueError`` unless it is a bool, int, float or str (the only run-config
    values Flower takes)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(int(v))
    if isinstance(v, float):
        return repr(float(v))  # (numpy 2's repr of its float64 would be "np.float64(...)")
    if isinstance(v, str):
        return _toml_string(v)
    raise ValueError(f"{v!r} is a {type(v).__name__}; a run-config value is a bool, int, float or string")


def write_run_config(path: Path, run_config: dict) -> Path:
    """Write ``run_config`` as the TOML file ``flwr run --run-config`` takes; ``ValueError`` names a key whose
    name or value TOML (or Flower) cannot take."""
    lines = []
    for k, v in run_config.items():
        if not isinstance(k, str) or not _BARE_KEY.fullmatch(k):
            raise ValueError(f"run config key {k!r}: a key is letters, digits, '-', '_' and '.'-separated parts")
        try:
            lines.append(f"{k} = {_toml_value(v)}\n")
        except ValueError as err:
            raise ValueError(f"run config {k}: {err}") from None
    path.write_text("".join(lines), encoding="utf-8")
    tomllib.loads(path.read_text(encoding="utf-8"))  # fail here, not inside flwr, on a bad value
    return path


def _flwr_bin(name: str) -> str:
    cand = Path(sys.executable).with_name(name)
    return str(cand) if cand.exists() else name


# Process discovery for the cleanup reads /proc directly: slim images have neither `ss` (iproute2) nor `ps`
# (procps), and a missing tool must not keep the cleanup from stopping anything.


def _proc_pids() -> list[int]:
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()]


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (``[state, ppid, ...]``), ``None`` if it is gone.
    The name is in parentheses and may hold spaces and parentheses itself: split after the last ``)``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 1:].split()


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes of the TCP sockets (IPv4 and IPv6) listening on ``port`` in this network namespace."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:  # e.g. no IPv6
            continue
        for row in rows:
            f = row.split()  # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port and f[9] != "0":  # 0A: LISTEN
                inodes.add(f[9])
    return inodes


def _pids_listening(port: int) -> list[int]:
    """Processes holding a TCP socket that listens on ``port`` (/proc/net/tcp{,6} and /proc/<pid>/fd)."""
    targets = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not targets:
        return []
    out = set()
    for pid in _proc_pids():
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in targets:
                    out.add(pid)
                    break
            except OSError:
                pass
    return sorted(out)


def _pids_with_env(key: str, value: str) -> list[int]:
    """Processes whose environment has ``key=value`` (every process of one simulation shares its FLWR_HOME)."""
    needle = os.fsencode(f"{key}={value}")  # as the environment holds it: a path need not be valid UTF-8
    out = []
    for pid in _proc_pids():
        if pid != os.getpid():
            try:
                if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    out.append(pid)
            except OSError:
                pass
    return out


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children, grandchildren, ...), from the parent ids in /proc/<pid>/stat."""
    kids: dict[int, list[int]] = {}
    for p in _proc_pids():
        fields = _stat_fields(p)
        if fields and len(fields) > 1:
            kids.setdefault(int(fields[1]), []).append(p)
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), ()):
            if k not in out and k != pid:
                out.append(k)
                todo.append(k)
    return out


def _wait_healthy(port: int, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    """Whether the SuperLink on ``port`` answers ``/health`` within ``timeout`` s (``False`` at once when
    ``proc``, the process that should answer, has exited).  Never through an HTTP proxy."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    end = time.monotonic() + timeout
    while True:
        try:
            with opener.open(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        if (proc is not None and proc.poll() is not None) or time.monotonic() >= end:
            return False
        time.sleep(0.2)


def _stderr(line: str) -> None:
    """Print ``line`` to stderr; never raises (after SIGHUP the terminal may be gone: writing to it fails with
    EIO, which must not cut a cleanup short)."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def _warn(msg: str) -> None:
    _stderr(f"simulate.py: warning: {msg}")


class SimulationTimeout(RuntimeError):
    """The simulation did not finish within the time it was given (its processes were stopped)."""


def stop_local_superlink(port: int | None, home: Path | None = None, timeout: float = 20.0) -> None:
    """Terminate the managed SuperLink listening on ``port`` (``None``: no lookup by port), everything it spawned
    and (if ``home`` is given) every other process of this simulation (found by its FLWR_HOME): SIGTERM, then
    SIGKILL for what still runs after ``timeout`` s.  Each lookup is on its own: one that fails (warned) never keeps
    the others from running, nor anything found from being stopped."""
    pids: set[int] = set()
    lookups: list[tuple[str, Callable[[], list[int]]]] = []
    if port is not None:
        lookups.append(("listening on port", lambda: _pids_listening(port)))
    if home is not None:
        lookups.append(("of FLWR_HOME", lambda: _pids_with_env("FLWR_HOME", str(home))))
    for what, lookup in lookups:
        try:
            pids |= set(lookup())
        except Exception as err:  # noqa: BLE001 - the other lookups and the kills must still run
            _warn(f"cleanup: could not list the processes {what}: {type(err).__name__}: {err}")
    family: list[int] = []
    for pid in sorted(pids):
        try:
            kin = [pid, *_children(pid)]
        except Exception as err:  # noqa: BLE001
            _warn(f"cleanup: could not list the children of {pid}: {type(err).__name__}: {err}")
            kin = [pid]
        family += [p for p in kin if p not in family and p != os.getpid()]
    _terminate(family, timeout)


def _terminate(pids: list[int], timeout: float) -> None:
    """SIGTERM ``pids``, then SIGKILL those that still run after ``timeout`` s."""
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
        except PermissionError as err:
            _warn(f"cleanup: cannot stop process {p}: {err}")
    _wait_gone(pids, timeout)
    killed = []
    for p in pids:
        if _alive(p):
            try:
                os.kill(p, signal.SIGKILL)
                killed.append(p)
            except (ProcessLookupError, PermissionError):  # exited between the check and the kill / not ours
                pass
    _wait_gone(killed, 5.0)  # SIGKILL is not instant: until they are gone, they still hold and write files


def _wait_gone(pids: list[int], timeout: float) -> None:
    """Until none of ``pids`` is alive, at most ``timeout`` s."""
    end = time.time() + timeout
    while time.time() < end and any(_alive(p) for p in pids):
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


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


#: the log of `flwr run` in the script's directory (rewritten by each run); a copy goes into the run's records
RUN_LOG = "flwr-run.log"
SUPERLINK_START_TIMEOUT = 180.0  # s for the SuperLink this script starts after Flower's own did not answer
#: Environment variable whose value marks the processes of one simulation's lean Ray head (``lean_ray=True``).
LEAN_RAY_MARKER = "PGVI_LEAN_RAY_HEAD"


@dataclass(frozen=True)
class LeanHead:
    """A lean Ray head started for one simulation: its processes carry ``LEAN_RAY_MARKER=marker``."""

    marker: str
    temp_dir: Path
_FLOWER_START_FAILED = "Failed to start local SuperLink"


def run_simulation(
    run_config: dict,
    num_supernodes: int,
    workdir: Path,
    num_cpus_per_client: float = 1.0,
    timeout: float | None = None,
    stream_to: Path | None = None,
    preexec_fn: Callable[[], None] | None = None,
    superlink_timeout: float = SUPERLINK_START_TIMEOUT,
    lean_ray: bool = False,
) -> dict:
    """Run the app in simulation; returns ``{"status", "run_id", "out_dir", "log", "seconds"}``.

    The records go to ``workdir/outputs/run-<id>`` (``run_config``'s ``output-dir`` is replaced).
    ``timeout``: seconds each ``flwr run`` may take (``None``: no limit); past it, ``flwr run`` is killed, every
    process of the simulation stopped, and :class:`SimulationTimeout` raised.
    ``preexec_fn`` runs in the ``flwr run`` child before it starts (e.g. joining a memory cgroup: the SuperLink,
    the simulation and Ray's processes it starts inherit that), and in the SuperLink this function starts itself
    if Flower's did not answer within Flower's 15 s; that one gets ``superlink_timeout`` s to answer.
    ``lean_ray``: run the simulation on a private Ray head without the processes a single-host simulation does
    not use (``scripts/lean_ray.py``; about 260 MB less resident memory), started before ``flwr run`` (with
    ``preexec_fn`` too) and stopped with the rest; :class:`~scripts.lean_ray.LeanRayError` if it cannot start."""
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
                                      stream_to, preexec_fn, superlink_timeout, lean_ray, lock.fileno())
    finally:
        lock.close()


def _superlink_cmd(home: Path, http_port: int, control_port: int) -> list[str]:
    """The SuperLink Flower 1.39's ``flwr run`` starts for a ``:local:`` connection (cli/local_superlink.py
    ``_start_local_superlink``), on this simulation's private loopback ports and in its FLWR_HOME."""
    runtime = home / "local-superlink"
    runtime.mkdir(parents=True, exist_ok=True)
    return [_flwr_bin("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
            "--control-api-address", f"127.0.0.1:{control_port}", "--host", "127.0.0.1", "--port", str(http_port),
            "--log-file", str(runtime / "superlink.log"), "--log-rotation-interval-hours", "24",
            "--log-rotation-backup-count", "7", "--database", str(runtime / "state.db")]


def _start_superlink(env: dict, home: Path, http_port: int, control_port: int,
                     preexec_fn: Callable[[], None] | None) -> subprocess.Popen:
    cmd = _superlink_cmd(home, http_port, control_port)
    with open(home / "local-superlink" / "superlink-simulate.out", "ab") as out:
        # its own session like Flower's (a Ctrl-C in the terminal reaches this script, whose cleanup stops it)
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=preexec_fn)


def _cleanup(http_port: int, home: Path, own: subprocess.Popen | None, ray_head: LeanHead | None = None,
             reaper: _Reaper | None = None) -> None:
    """Stop every process of this simulation, then dismiss ``reaper``; never raises (a failure is warned about: the
    caller reports the run's own result either way).  Ctrl-C, SIGTERM and SIGHUP are ignored while it runs (in the
    main thread): a second one would otherwise raise out of the wait for the processes to exit and skip the SIGKILL
    of those that ignore SIGTERM, and one between the cleanup and the reaper's dismissal would end this process and
    make the reaper run the cleanup again."""
    with signal_handlers(signal.SIG_IGN, (signal.SIGINT, *STOP_SIGNALS)):
        try:
            _stop_everything(http_port, home, own, ray_head)
        finally:
            if reaper is not None:
                reaper.dismiss()


#: Seconds the lean Ray head's processes get to exit after SIGTERM before SIGKILL (Ray's GCS server ignores
#: SIGTERM for longer than the run has any use for it: the head and its state are this run's alone).
LEAN_RAY_STOP_GRACE_S = 2.0


def _stop_everything(http_port: int | None, home: Path, own: subprocess.Popen | None,
                     ray_head: LeanHead | None) -> None:
    if ray_head is not None:  # first, with its short grace (the FLWR_HOME scan below would give it 20 s)
        try:
            # with their descendants, listed before any is signalled: Ray's agents and workers (the raylet's
            # children) may not show the marker (a process title written over the environment), and once the
            # raylet is gone they are init's
            head = _pids_with_env(LEAN_RAY_MARKER, ray_head.marker)
            family = list(dict.fromkeys([*head, *(c for p in head for c in _children(p))]))
            _terminate([p for p in family if p != os.getpid()], LEAN_RAY_STOP_GRACE_S)
        except Exception as err:  # noqa: BLE001
            _warn(f"cleanup: could not stop the lean Ray head: {type(err).__name__}: {err}")
    try:
        stop_local_superlink(http_port, home)
    except Exception as err:  # noqa: BLE001
        _warn(f"cleanup failed: {type(err).__name__}: {err}")
    if own is not None:  # the SuperLink started here: make sure it is gone, and reap it
        try:
            if own.poll() is None:
                own.kill()
            own.wait(timeout=10)
        except Exception as err:  # noqa: BLE001
            _warn(f"cleanup: SuperLink {own.pid}: {type(err).__name__}: {err}")
    try:
        end = time.time() + 2.0
        while (left := [p for p in _pids_with_env("FLWR_HOME", str(home)) if _alive(p)]) and time.time() < end:
            time.sleep(0.1)
        if left:
            _warn(f"cleanup: processes {left} of FLWR_HOME={home} still run")
    except Exception as err:  # noqa: BLE001
        _warn(f"cleanup: could not check for leftover processes: {type(err).__name__}: {err}")
    if ray_head is not None:  # last: the Ray driver in the SuperLink's processes writes its logs into the head's
        _remove_tree(ray_head.temp_dir)  # session dir until it stops, and a file it makes mid-rmtree keeps the dir


def _remove_tree(path: Path) -> None:
    """:func:`remove_tree`, a failure warned about instead of raised (the cleanup never raises)."""
    try:
        remove_tree(path)
    except OSError as err:
        _warn(f"cleanup: could not remove {path}: {type(err).__name__}: {err}")


#: The reaper's waiting stage (see :class:`_Reaper`), a POSIX shell: about 1 MB resident instead of the ~20 MB of an
#: interpreter that has imported this module, for the whole length of the simulation.  Each line read is one more
#: argument of the cleanup (hex-encoded bytes: any path, also one with a newline or not valid UTF-8); ``done`` ends
#: it; end of file runs the cleanup.
_REAPER_SH = """trap '' INT TERM HUP
while IFS= read -r line; do
  [ "$line" = done ] && exit 0
  set -- "$@" "$line"
done
exec "$0" -S -I -B "$SIMULATE_PY" --reap "$@"
"""


class _Reaper:
    """A watcher that stops the simulation's processes if this process dies without running its own cleanup.

    Flower's SuperLink and a lean Ray head run detached from this process, so a ``kill -9`` of it (or the kernel's OOM
    killer) used to leave them running.  The reaper is ``/bin/sh`` (:data:`_REAPER_SH`) in a session of its own, with
    Ctrl-C, SIGTERM and SIGHUP ignored (this process's own cleanup handles those), reading a pipe from this process:
    the arguments ``--home=...``, ``--lock-fd=N``, ``--head=MARKER:DIR`` (the lean Ray head, once it is being started)
    and ``--port=N`` (the SuperLink's HTTP port, once it is final: before, a port lookup could find another program),
    and ``done`` after this process's own cleanup, when it exits.  End of file without ``done`` means this process
    died: the shell then runs ``simulate.py --reap`` with those arguments, which runs the same cleanup
    (:func:`_stop_everything`).  It holds the FLWR_HOME lock too (writing its own pid into it), so a new simulation on
    the same ``--out`` is refused until that cleanup has finished."""

    def __init__(self, home: Path, lock_fd: int | None = None) -> None:
        env = {**os.environ, "SIMULATE_PY": str(Path(__file__).resolve())}
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                ["/bin/sh", "-c", _REAPER_SH, sys.executable], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                start_new_session=True, env=env, pass_fds=() if lock_fd is None else (lock_fd,))
        except OSError as err:  # e.g. an image without /bin/sh: the simulation runs, only this safety net is missing
            _warn(f"no reaper ({type(err).__name__}: {err}): if this script is killed outright (SIGKILL), its "
                  "SuperLink and Ray processes keep running")
            self.proc = None
        self.tell(f"--home={home}")
        if lock_fd is not None:
            self.tell(f"--lock-fd={lock_fd}")

    def tell(self, arg: str) -> None:
        """Send the reaper one argument of its cleanup (a reaper that is gone is warned about, not raised)."""
        try:
            if self.proc is not None and self.proc.stdin is not None:
                self.proc.stdin.write(os.fsencode(arg).hex().encode() + b"\n")
                self.proc.stdin.flush()
        except (OSError, ValueError) as err:  # the reaper is gone (a broken pipe)
            _warn(f"the reaper stopped listening ({type(err).__name__}: {err}): if this script is killed outright, "
                  "its SuperLink and Ray processes keep running")

    def dismiss(self) -> None:
        """This process has cleaned up: the reaper exits without doing anything (waited for, up to 10 s)."""
        if self.proc is None:
            return
        try:  # writes "done", closes the pipe, waits (a reaper that is gone: the broken pipe is ignored)
            self.proc.communicate(b"done\n", timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _reap(argv: list[str]) -> int:
    """``simulate.py --reap HEX...``: the cleanup of a simulation whose ``simulate.py`` died (:class:`_Reaper`).  Each
    argument is the hex of one of ``--home=H [--lock-fd=N] [--head=MARKER:DIR] [--port=N]``."""
    ap = argparse.ArgumentParser(prog="simulate.py --reap")
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--lock-fd", type=int, default=None)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--head", default=None)
    args = ap.parse_args([os.fsdecode(bytes.fromhex(a)) for a in argv])
    if args.lock_fd is not None:  # the lock now names this process (a second simulation's refusal says who holds it)
        with contextlib.suppress(OSError):
            os.ftruncate(args.lock_fd, 0)
            os.pwrite(args.lock_fd, f"{os.getpid()}\n".encode(), 0)
    head = None
    if args.head:
        marker, _, temp_dir = args.head.partition(":")
        head = LeanHead(marker, Path(temp_dir))
    _warn(f"the simulation's process died without stopping its processes (FLWR_HOME={args.home}); stopping them")
    _stop_everything(args.port, args.home, None, head)
    return 0


def _superlink_ports_env(http_port: int, control_port: int) -> dict[str, str]:
    """The variables that give the SuperLink `flwr run` starts on a ``:local:`` connection its two ports."""
    return {"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port), "FLWR_LOCAL_CONTROL_API_PORT": str(control_port)}


def _ray_tmpdir() -> str | None:
    """``RAY_TMPDIR`` (created if missing), where Ray's own head keeps its sessions; None: the system's temp dir."""
    path = os.environ.get("RAY_TMPDIR")
    if not path:
        return None
    os.makedirs(path, exist_ok=True)
    return path


def _run_simulation_locked(run_config: dict, num_supernodes: int, workdir: Path, home: Path,
                           num_cpus_per_client: float, timeout: float | None, stream_to: Path | None,
                           preexec_fn: Callable[[], None] | None = None,
                           superlink_timeout: float = SUPERLINK_START_TIMEOUT, lean_ray: bool = False,
                           lock_fd: int | None = None) -> dict:
    http_port, control_port = free_port(), free_port()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "pgvi-sim"\n[superlink.pgvi-sim]\naddress = ":local:"\n'
    )
    env = {**os.environ, **FLWR_ENV, "FLWR_HOME": str(home),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           **_superlink_ports_env(http_port, control_port)}
    out_root = workdir / "outputs"
    cfg = {**run_config, "output-dir": str(out_root)}
    cfg_file = write_run_config(workdir / "run_config.toml", cfg)
    log_path = Path(stream_to or workdir / RUN_LOG)
    cmd = [_flwr_bin("flwr"), "run", str(ROOT), "pgvi-sim", "--stream", "--run-config", str(cfg_file),
           "--federation-config", f"num-supernodes={num_supernodes} client-resources-num-cpus={num_cpus_per_client:g}"]
    t0 = time.time()
    own: subprocess.Popen | None = None  # the SuperLink started here, if Flower's did not start
    failure = ""  # why the SuperLink started here did not answer
    ls = None
    ray_head: LeanHead | None = None
    reaper = _Reaper(home, lock_fd)
    try:
        if lean_ray:
            # (under RAY_TMPDIR, as Ray's own head, else the system's temp dir; not workdir: Ray's socket paths must
            # stay under 108 bytes)
            ray_head = LeanHead(secrets.token_hex(8), Path(tempfile.mkdtemp(prefix="pgvi-ray-", dir=_ray_tmpdir())))
            reaper.tell(f"--head={ray_head.marker}:{ray_head.temp_dir}")
            # without the simulation's FLWR_HOME: the stop of a SuperLink Flower gave up on (below) ends every
            # process of FLWR_HOME, and the second `flwr run` needs the head; in ROOT, where `flwr run` starts
            # the SuperLink and so Flower's own head and workers, so that relative paths resolve alike
            head_env = {k: v for k, v in env.items() if k != "FLWR_HOME"}
            address = start_lean_ray_head({**head_env, LEAN_RAY_MARKER: ray_head.marker}, free_port(), free_port(),
                                          ray_head.temp_dir, cwd=ROOT, preexec_fn=preexec_fn)
            env["RAY_ADDRESS"] = address  # Flower's ray.init() joins it instead of starting a head
            env = joining_env(env, ray_head.temp_dir)  # with the head's token: it refuses every RPC without it
            # the SuperLink's ports afresh, now that the head has bound its own (kernel-chosen) ones: picked before
            # it, they stay free until `flwr run` starts the SuperLink seconds later, and the head could take them
            http_port, control_port = free_port(), free_port()
            env.update(_superlink_ports_env(http_port, control_port))
        reaper.tell(f"--port={http_port}")  # final now: the SuperLink `flwr run` starts listens on it
        for attempt in range(2):
            with open(log_path, "w") as log:
                try:
                    subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                   check=False, preexec_fn=preexec_fn)
                except subprocess.TimeoutExpired:  # subprocess.run has killed `flwr run`; _cleanup stops the rest
                    raise SimulationTimeout(
                        f"the simulation did not finish within {timeout:g} s; `flwr run` was killed "
                        f"and the simulation's processes stopped (log {log_path})"
                    ) from None
            if attempt == 1 or _FLOWER_START_FAILED not in log_path.read_text(errors="replace"):
                break
            # Flower 1.39's `flwr run` waits a fixed 15 s for the SuperLink it starts and then KILLS it
            # (cli/local_superlink.py `_start_local_superlink`: process.kill()), so nothing is left starting. Start
            # the same SuperLink here, wait for its /health with our own timeout, and run `flwr run` again: it
            # finds a SuperLink answering on the connection's port and uses it instead of starting its own.
            _warn(f"Flower's SuperLink did not answer within Flower's 15 s; starting it here (up to "
                  f"{superlink_timeout:g} s) and running `flwr run` again")
            stop_local_superlink(http_port, home, timeout=10.0)  # whatever the killed SuperLink had spawned
            own = _start_superlink(env, home, http_port, control_port, preexec_fn)
            if not _wait_healthy(http_port, superlink_timeout, own):
                failure = ("Flower's SuperLink did not answer within 15 s, and the one simulate.py then started "
                           + (f"exited with code {own.returncode}" if own.poll() is not None
                              else f"did not answer /health within {superlink_timeout:g} s")
                           + f" (log {home / 'local-superlink' / 'superlink.log'})")
                with open(log_path, "a") as log:
                    log.write(f"\nsimulate.py: {failure}\n")
                break
        if started_run_id(log_path.read_text(errors="replace")) is not None:
            # (only then: on a `:local:` connection with no SuperLink answering, `flwr ls` would start one)
            try:
                ls = subprocess.run([_flwr_bin("flwr"), "ls", "pgvi-sim", "--format", "json"], cwd=ROOT, env=env,
                                    capture_output=True, text=True, timeout=120)
            except subprocess.TimeoutExpired:  # the status is then reported as "unknown"
                _warn("`flwr ls` did not answer within 120 s: the run's final status is unknown")
    finally:
        _cleanup(http_port, home, own, ray_head, reaper)
    seconds = time.time() - t0
    ls_out = ls.stdout if ls is not None and isinstance(ls.stdout, str) else ""
    runs = json.loads(ls_out).get("runs", []) if ls_out.strip().startswith("{") else []
    log_text = log_path.read_text(errors="replace")
    run_id = started_run_id(log_text)
    if run_id is None:  # the server refused the run (or flwr failed before starting one): never an older run
        details = "\n".join(m for m in (failure, server_message(log_text)) if m)
        return {"status": "not-started", "status-details": details, "run_id": "",
                "out_dir": None, "log": log_path, "seconds": seconds}
    run = pick_run(runs, log_text)  # {} if `flwr ls` did not list it: status unknown
    out_dir = out_root / f"run-{run_id}"
    if out_dir.is_dir():  # the run's own copy of the log, beside its records (the next run rewrites log_path)
        shutil.copyfile(log_path, out_dir / RUN_LOG)
    return {"status": run.get("status", "unknown"), "status-details": run.get("status-details", ""), "run_id": run_id,
            "out_dir": out_dir, "log": log_path, "seconds": seconds}


_PAIR = re.compile(r"""([^\s=]+)=('[^']*'|"[^"]*"|\S+)""")
_NOT_SCALAR = ((list, "a TOML array"), (dict, "a TOML inline table"),
               ((datetime.date, datetime.time), "a TOML date/time"))  # datetime.datetime is a datetime.date


def parse_overrides(item: str) -> dict:
    """One ``-c`` argument: space-separated ``key=value`` pairs with TOML values, as ``flwr run -c`` takes
    them (``'a=1 b=2 note="x y"'``).  ``ValueError`` names the bad override: not ``key=value``, a value that is
    no TOML, or one that is no run-config value (a run config holds only bools, ints, floats and strings;
    ``flwr run -c`` refuses arrays and dates and would flatten an inline table into ``key.sub`` keys)."""
    out: dict = {}
    pos = 0
    for m in _PAIR.finditer(item):
        if item[pos:m.start()].strip():
            break
        key, raw = m.group(1), m.group(2)
        if not _BARE_KEY.fullmatch(key):
            raise ValueError(f"-c {item!r}: {key!r} is not a run-config key (letters, digits, '-', '_', '.')")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            raise ValueError(
                f"-c {item!r}: {key}={raw} is not a TOML value (strings need quotes, e.g. {key}='\"{raw}\"')"
            ) from None
        for types, kind in _NOT_SCALAR:
            if isinstance(value, types):
                raise ValueError(f"-c {item!r}: {key}={raw} is {kind}; a run-config value is a bool, an int, a "
                                 f"float or a quoted string (e.g. {key}='\"{raw}\"' if {key} takes a string)")
        out[key] = value
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


def report_lines(res: dict, log_path: Path) -> list[str]:
    """What the script prints of a finished run: the log's PGVI lines and ERROR lines (the log level: a traceback's
    "...Error: ..." line is not one), then the status, the time and the records' directory ("none written" if the
    run wrote none, e.g. a run config refused before round 1)."""
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if "PGVI" in line or "ERROR" in line]
    records = res["out_dir"] if res["out_dir"] and Path(res["out_dir"]).is_dir() else "none written"
    return [*lines, f"status: {res['status']} {res['status-details']}; {res['seconds']:.1f}s; records: {records}"]


def refuse_output_dir(overrides: list[str] | tuple[str, ...], records: str) -> None:
    """``ValueError`` if a ``-c`` override sets ``output-dir``: a script that chooses where the records go (with
    --out; ``records`` says where) would otherwise write them elsewhere than the run config it records says."""
    for item in overrides:
        if "output-dir" in parse_overrides(item):
            raise ValueError(f"-c {item!r}: output-dir is not taken here: the records go to {records}; choose the "
                             "directory with --out")


def main() -> None:
    if sys.argv[1:2] == ["--reap"]:  # the reaper's cleanup (:class:`_Reaper`), not a simulation
        sys.exit(_reap(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--supernodes", type=int, default=None,
                    help="number of SuperNodes (virtual clients); default: the run config's num-clients, after "
                         "the -c overrides (a client refuses to run when the two differ)")
    ap.add_argument("--cpus-per-client", type=float, default=1.0)
    ap.add_argument("-c", "--config", action="append", default=[],
                    help="run-config overrides: space-separated key=value pairs, TOML values (strings quoted); "
                         "bools, ints, floats and strings only; not output-dir (use --out)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "sim",
                    help="output dir: the records go to OUT/outputs/run-<id>; it holds FLWR_HOME, so one "
                         "simulation at a time per --out")
    ap.add_argument("--superlink-timeout", type=float, default=SUPERLINK_START_TIMEOUT,
                    help="seconds the SuperLink this script starts, if Flower's own did not answer within "
                         "Flower's fixed 15 s, gets to answer (default %(default)g)")
    ap.add_argument("--timeout-s", type=number_above(hint=" (leave it out for no limit)"), default=None,
                    help="stop the simulation when a `flwr run` has run this many seconds (each of at most two "
                         "attempts, see above): its processes are stopped and the script exits 1 (default: no limit)")
    ap.add_argument("--lean-ray", action="store_true",
                    help="run on a private Ray head without Ray's autoscaler monitor, log monitor, Ray Client "
                         "server and dashboard API server, which a one-host simulation does not use (about 260 MB "
                         "less memory; scripts/lean_ray.py)")
    args = ap.parse_args()
    try:
        run_config = pyproject_run_config(args.config)
        refuse_output_dir(args.config, f"<--out>/outputs/run-<id> (--out is now {args.out})")
    except ValueError as err:
        ap.error(str(err))
    clients = run_config.get("num-clients")
    if args.supernodes is None:
        if isinstance(clients, bool) or not isinstance(clients, int) or clients < 1:
            ap.error(f"num-clients={clients!r} is not a positive integer: cannot take --supernodes from it")
        args.supernodes = clients
    elif args.supernodes != clients:
        _warn(f"--supernodes {args.supernodes} differs from num-clients={clients!r}: every client will refuse "
              f"its node config (num-partitions={args.supernodes}); leave --supernodes out to follow num-clients")
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / RUN_LOG
    print(f"simulation: {args.supernodes} SuperNodes; log {log_path}", flush=True)
    # SIGTERM and SIGHUP (terminal closed, ssh dropped) act like Ctrl-C: run_simulation's cleanup runs (Flower
    # leaves its SuperLink running detached); the handlers are restored afterwards (the tests call main() inside
    # the pytest process)
    try:
        with signal_handlers(raise_interrupt, STOP_SIGNALS):
            res = run_simulation(run_config, args.supernodes, args.out, args.cpus_per_client, timeout=args.timeout_s,
                                 stream_to=log_path, superlink_timeout=args.superlink_timeout, lean_ray=args.lean_ray)
    except (RuntimeError, ValueError) as err:  # also SimulationTimeout
        _stderr(f"simulate.py: error: {err}")
        sys.exit(1)
    except KeyboardInterrupt as err:
        _stderr(f"simulate.py: interrupted ({err or 'Ctrl-C'}); the simulation's processes were stopped "
                f"(log {log_path})")
        sys.exit(130)
    # run_simulation has stopped the simulation's processes (or warned that it could not): report the run
    if not res["run_id"]:
        print(f"simulate.py: no run was started: {res['status-details']} (log {log_path})", file=sys.stderr)
        sys.exit(1)
    print("\n".join(report_lines(res, log_path)), flush=True)
    sys.exit(0 if res["status"] == "finished:completed" else 1)


if __name__ == "__main__":
    main()
