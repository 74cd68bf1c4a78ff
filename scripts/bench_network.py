"""Speed and memory benchmark of the networked PGVI system (Flower 1.39), in one run.

Three parts, each selectable by a flag (no flag = all three), and a fourth on request:

``--network``  One deployment of real OS processes on loopback (``scripts.deploy.Deployment``: SuperLink + N
    SuperNodes, TLS, default ``subprocess`` isolation, node config ``torch-threads=1``), one PGVI run of the
    784-200-10 mean-field BNN on Fashion-MNIST (``num-clients = min-clients = N``, batch 256, 10 MC samples,
    ``evaluate-clients=false``).  Per round it splits the wall time into local compute and the rest:

    * round wall time: round ``r`` lasts from its start to the start of round ``r+1`` (the rows'
      ``started-at``, the ServerApp's clock); the last round ends at its row's ``recorded-at``.  A thread of
      this script polls ``metrics.jsonl`` every 0.05 s; for records without those keys (older versions) round
      ``r`` lasts ``t(row r) - t(row r-1)``, each row stamped with the file's mtime when one row was added since
      the last poll (the write time itself), else the poll time.  The rows' ``server-seconds-*`` (the
      ServerApp's wall time by phase) are printed too.
    * local compute: ``client-seconds-max`` of the row (the slowest client's ``client_step`` wall time);
      ``overhead = wall - client-seconds-max``.
    * where the overhead goes, from a sampler that reads ``/proc`` every 0.25 s for every process carrying the
      deployment's environment marker.  Only ``flwr-clientapp`` processes that loaded torch (peak RSS > 300 MB)
      count as having run the ClientApp; the others were started and stopped by Flower before loading it
      ("aborted").  ``dispatch`` = first ClientApp start (``/proc/<pid>/stat`` start time) minus round start;
      ``tail`` = round end minus the last ClientApp's CPU going idle; ``in-app`` = mean ClientApp lifetime
      (start to CPU idle) minus ``client-seconds-mean`` (imports, FAB install, data loading, reply encoding,
      state file); CPU seconds per process role (with ``--superexec preforked`` the ClientApps forked by the
      SuperExec's forkserver count as ``flwr-clientapp``, the forkserver and multiprocessing's resource tracker
      as ``flower-superexec``); the benchmark's own CPU (this process's threads, the sampler's included, and the
      ``ss`` children it waits for: ``RUSAGE_SELF`` + ``RUSAGE_CHILDREN``); the machine's busy CPU seconds
      (``/proc/stat``) minus ours minus the benchmark's = CPU used by other work on the shared machine.
    * bytes: ``reply-bytes / applied`` (ArrayRecord bytes counted by the strategy) against the raw float32
      payload ``2 * P * 4`` (eta1 and eta2 for each of the ``P`` parameters), and the TCP bytes the
      SuperNodes sent to the Fleet API per applied update (``ss -ti`` ``bytes_acked`` of their connections:
      TLS + gRPC + HTTP/2 framing, heartbeats and polls included).

``--simulation``  Flower's simulation engine (``scripts.simulate.run_simulation``) with 1,000 virtual
    SuperNodes: logistic regression on digits, ``fraction-train 0.05``, 3 rounds,
    ``num-clients = min-clients = 1000``, ``evaluate-clients=false``, ``wait-for-clients-s=900``.  Wall time
    and peak memory as the SUM of RSS (and of PSS) over the whole process tree (``flwr`` CLI, SuperLink,
    SuperExec, ``flwr-simulation``, Ray's GCS / raylet / workers), sampled from ``/proc`` every 0.5 s.  PSS
    splits a shared page among every process on the machine that maps it, inside the tree or not, so the PSS
    sum understates the tree when other processes map the same files (the same venv's torch); the figure that
    counts each page once is the cgroup's charge (``--sim-cgroup``, ``--sim-memory-limit-mb``).  A process
    belongs to the tree if its environment carries the marker this script sets (all of them inherit it), or if
    its parent belongs to it (one that scrubbed its environment); this process itself never does.

``--client-rss``  In a fresh subprocess: RSS after ``import torch``, after importing the ClientApp (flwr),
    after loading a Fashion-MNIST shard of 20,000 samples (``num-clients=3``), and the peak RSS during one
    client update (``common.client_update.client_step``, 784-200-10, batch 256, 10 MC samples, 1 local epoch;
    the peak is ``VmHWM`` after resetting it through ``/proc/self/clear_refs``), for (a) this venv and (b) a
    client-only venv under ``/tmp`` (``pip install torch==2.13.0`` = the CPU wheel on local disk, then
    ``pip install <repo>`` without extras), where torchvision and ray must not be importable.

``--latency``  (not part of the default run) Rounds of the conjugate Gaussian-location model (3 SuperNodes,
    local updates of milliseconds, TLS + auth, forked ClientApps, warm workers), 15 rounds per deployment, in
    alternating deployments of three variants: Flower's SuperNode with Flower's 1-s first retry of an object
    still arriving, Flower's SuperNode with a 0.05-s retry, and ``client/paced_supernode.py`` with a 0.05-s retry.
    Per variant: median / mean / p90 / max round wall time over rounds 2.. and the SuperNodes' CPU per round.

Run from the repository root::

    .venv/bin/python scripts/bench_network.py                  # all three parts (about 35 min on 2 shared cores)
    .venv/bin/python scripts/bench_network.py --network --rounds 2 --local-epochs 20
    .venv/bin/python scripts/bench_network.py --network --warm-workers   # a warm compute worker per node
    .venv/bin/python scripts/bench_network.py --network --superexec preforked  # ClientApps forked, not exec'd
    .venv/bin/python scripts/bench_network.py --client-rss --fresh-client-venv
    .venv-cpu/bin/python scripts/bench_network.py --simulation    # the simulation from another venv (CPU torch)

Every process it starts is stopped before it exits (``Deployment.__exit__``; ``run_simulation`` stops its
SuperLink, and leftovers carrying this run's marker are signalled by pid); it reports any it had to kill.
Results are printed as tables and written as JSON to ``<workdir>/bench_network.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from client.object_pulls import ENV_INITIAL_RETRY, check_initial_retry  # noqa: E402 (stdlib only; after the path)
from scripts.memcgroup import CgroupUnavailable, MemoryCgroup, drop_page_cache  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
MB = 1024.0 * 1024.0
BENCH_MARKER = "PGVI_BENCH_ID"

#: 784-200-10 BNN: 784*200 + 200 + 200*10 + 10 parameters.
BNN_PARAMS = 784 * 200 + 200 + 200 * 10 + 10
PAYLOAD_BYTES = 2 * BNN_PARAMS * 4  # eta1 + eta2, float32


def _boot_time() -> float:
    """Wall-clock time of boot, to sub-millisecond precision (``/proc/stat``'s ``btime`` is whole seconds, which put
    process start times up to a second early and so, with ClientApps starting within 0.1-0.3 s of a round's row,
    in the previous round)."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


BOOT_TIME = _boot_time()


def uptime_line() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def machine_busy_cpu_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores; /proc/stat minus idle and iowait)."""
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    v = [int(x) for x in f]
    total = sum(v[:8])  # user nice system idle iowait irq softirq steal
    return (total - v[3] - v[4]) / CLK_TCK


# ================================================================================================ /proc sampler
@dataclass
class ProcRecord:
    pid: int
    start: float  # epoch seconds
    role: str
    cmd: str
    first_seen: float
    last_seen: float
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (t, cpu seconds, rss bytes)
    rss_peak: int = 0
    pss_peak: int = 0

    @property
    def cpu_last(self) -> float:
        return self.samples[-1][1] if self.samples else 0.0

    @property
    def active_end(self) -> float:
        """Time of the first sample at which the process had used (almost) all of its CPU time."""
        last = self.cpu_last
        for ts, cpu, _ in self.samples:
            if cpu >= last - 0.05:
                return ts
        return self.last_seen

    def cpu_at(self, t: float) -> float:
        """CPU seconds at time ``t`` (last sample at or before ``t``; 0 before the process existed)."""
        best = 0.0
        for ts, cpu, _ in self.samples:
            if ts > t:
                break
            best = cpu
        return best


#: ``python -c`` code of multiprocessing's helper processes -> provisional role (resolved by :func:`_proc_role`).
_MP_HELPERS = {
    "from multiprocessing.forkserver import main": "mp-forkserver",
    "from multiprocessing.resource_tracker import main": "mp-resource-tracker",
}


def _proc_role(cmd: list[str], ppid: int) -> str:
    """:func:`_role`, with multiprocessing's helpers attributed by their parent: a child forked by a forkserver
    (same command line as the forkserver, whose child it is) is a ClientApp of ``client/preforked_superexec.py``
    -> ``flwr-clientapp``; the forkserver and the resource tracker count under the process that started them
    (the SuperExec)."""
    role = _role(cmd)
    if role not in _MP_HELPERS.values():
        return role
    try:
        parent = [c for c in Path(f"/proc/{ppid}/cmdline").read_bytes().decode(errors="replace").split("\0") if c]
    except OSError:
        return role
    parent_role = _role(parent)
    if parent_role == "mp-forkserver":
        return "flwr-clientapp"
    return role if parent_role in _MP_HELPERS.values() or parent_role == "?" else parent_role


def _role(cmd: list[str]) -> str:
    joined = " ".join(cmd)
    if not cmd:
        return "?"
    if cmd[0].startswith("ray::"):
        return "ray-worker"
    # the program itself (cmd[0], or the script python runs), before any substring of the arguments: the
    # raylet's arguments name default_worker.py and the dashboard agent's name the raylet
    if os.path.basename(cmd[0]) == "raylet":
        return "ray-raylet"
    if os.path.basename(cmd[0]) == "gcs_server":
        return "ray-gcs"
    if "client.warm_worker" in cmd[:4]:
        return "warm-worker"
    if "client.preforked_superexec" in cmd[:4]:  # `python -m client.preforked_superexec`: the node's SuperExec
        return "flower-superexec"
    if "client.paced_supernode" in cmd[:4]:  # `python -m client.paced_supernode`: the SuperNode
        return "flower-supernode"
    if "-c" in cmd[:6] and cmd.index("-c") + 1 < len(cmd):  # multiprocessing's helpers: `python [flags] -c CODE`
        code = cmd[cmd.index("-c") + 1]
        for helper, role in _MP_HELPERS.items():
            if code.startswith(helper):
                return role
    for arg in cmd[:3]:
        base = os.path.basename(arg)
        if base in ("flower-superlink", "flower-supernode", "flower-superexec", "flwr-serverapp",
                    "flwr-clientapp", "flwr-simulation", "flwr"):
            return base
        if base == "default_worker.py":
            return "ray-worker"
        if arg.endswith("/runtime_env/agent/main.py"):
            return "ray-runtime_env_agent"
        if arg.endswith("/dashboard/agent.py"):
            return "ray-dashboard_agent"
    if "default_worker.py" in joined:
        return "ray-worker"
    if "raylet" in joined:
        return "ray-raylet"
    if "gcs_server" in joined:
        return "ray-gcs"
    if "ray" in joined:
        m = re.search(r"([\w\-]+)\.py", joined)
        return f"ray-{m.group(1)}" if m else "ray-other"
    return os.path.basename(cmd[0])


class ProcTreeSampler:
    """Samples CPU time and RSS (optionally PSS) of a process tree from /proc in a background thread.

    A process belongs to the tree if its environment carries ``marker_var=marker`` or its parent belongs to
    it; ``exclude`` pids (this benchmark itself) never do.  ``on_tick(t)`` runs after each scan.

    Each scan also records the CPU seconds of this (the benchmark's) process: its threads, this sampler's
    included (``RUSAGE_SELF``), and the children it has waited for (``RUSAGE_CHILDREN``: the ``ss`` calls of
    ``on_tick``).  A member this process started and has reaped would count there as well as in the tree; the
    deployment's processes are reaped only after the run (``Deployment.stop``, ``flwr run`` when the run is
    over), so inside the rounds that is the benchmark's own work only.
    """

    def __init__(self, marker_var: str, marker: str, interval: float, *, pss: bool = False,
                 exclude: Iterable[int] = (), on_tick: Callable[[float], None] | None = None) -> None:
        self.marker_var, self.marker = marker_var.encode(), marker.encode()
        self.interval = interval
        self.pss = pss
        self.exclude = set(exclude)
        self.on_tick = on_tick
        self.procs: dict[tuple[int, int], ProcRecord] = {}
        self._has_marker: dict[tuple[int, int], bool] = {}
        # command lines of this process and the excluded ones: a child between fork and exec still shows them
        self._own_cmdlines = {c for c in (self._cmdline(pid) for pid in {os.getpid(), *self.exclude}) if c}
        self.own_cpu: list[tuple[float, float]] = []  # (t, CPU s of this process and the children it reaped)
        self.timeline: list[tuple[float, int, int, int]] = []  # (t, sum rss, sum pss, number of processes)
        self.machine_cpu: list[tuple[float, float]] = []
        self.peak_rss = 0
        self.peak_rss_t = 0.0
        self.peak_rss_parts: dict[str, list[float]] = {}
        self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="proc-sampler", daemon=True)

    # ---------------------------------------------------------------------------------------- reading /proc
    @staticmethod
    def _cmdline(pid: int) -> bytes | None:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None

    def _marked(self, pid: int, key: tuple[int, int]) -> bool:
        """Whether the process carries the marker, cached per (pid, start time) once it has its own program.

        A child of this benchmark (or of an excluded process) is, between fork and exec, still the parent's image
        with the parent's initial environment, which has no marker (``os.environ`` changes reach only the
        children): a "no" read then is not cached, or the process, once exec'd with the marker (``flwr run``
        started with a ``preexec_fn``), would never be counted."""
        cached = self._has_marker.get(key)
        if cached is not None:
            return cached
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return False
        found = (self.marker_var + b"=" + self.marker) in env.split(b"\0")
        if found or self._cmdline(pid) not in self._own_cmdlines:
            self._has_marker[key] = found
        return found

    @staticmethod
    def own_cpu_s() -> float:
        """CPU seconds of this process (all threads) and of the children it has waited for."""
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    @staticmethod
    def _pss(pid: int) -> int:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def scan(self) -> None:
        t = time.time()
        stats: dict[int, tuple[int, int, float, int, str]] = {}  # pid -> (ppid, starttime ticks, cpu, rss, state)
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                raw = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            rest = raw.rsplit(")", 1)[1].split()
            state, ppid = rest[0], int(rest[1])
            if state == "Z":
                continue
            cpu = (int(rest[11]) + int(rest[12])) / CLK_TCK
            stats[pid] = (ppid, int(rest[19]), cpu, int(rest[21]) * PAGE_SIZE, state)
        members: set[int] = set()
        for pid, (ppid, start, *_rest) in stats.items():
            if pid not in self.exclude and self._marked(pid, (pid, start)):
                members.add(pid)
        changed = True
        while changed:  # children of members (a process that scrubbed its environment)
            changed = False
            for pid, (ppid, *_r) in stats.items():
                if pid not in members and pid not in self.exclude and ppid in members:
                    members.add(pid)
                    changed = True
        total_rss = total_pss = 0
        parts: dict[str, list[float]] = {}
        for pid in members:
            ppid, start, cpu, rss, _ = stats[pid]
            key = (pid, start)
            rec = self.procs.get(key)
            if rec is None:
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
                except OSError:
                    continue
                cmd = [c for c in cmd if c]
                rec = ProcRecord(pid, BOOT_TIME + start / CLK_TCK, _proc_role(cmd, ppid), " ".join(cmd)[:300], t, t)
                self.procs[key] = rec
            elif rec.role in ("python", "python3", "python3.11", "?") or rec.role.startswith("ray"):  # renamed since
                with contextlib.suppress(OSError):
                    cmd = [c for c in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if c]
                    if cmd:  # an exiting process has an empty cmdline: keep the role it had
                        rec.role, rec.cmd = _proc_role(cmd, ppid), " ".join(cmd)[:300]
            rec.last_seen = t
            rec.samples.append((t, cpu, rss))
            rec.rss_peak = max(rec.rss_peak, rss)
            total_rss += rss
            p = parts.setdefault(rec.role, [0, 0.0])
            p[0] += 1
            p[1] += rss / MB
            if self.pss:
                pss = self._pss(pid)
                rec.pss_peak = max(rec.pss_peak, pss)
                total_pss += pss
        self.timeline.append((t, total_rss, total_pss, len(members)))
        self.machine_cpu.append((t, machine_busy_cpu_s()))
        self.own_cpu.append((t, self.own_cpu_s()))
        if total_rss > self.peak_rss:
            self.peak_rss, self.peak_rss_t, self.peak_rss_parts = total_rss, t, parts
        self.peak_pss = max(self.peak_pss, total_pss)
        if self.on_tick is not None:
            self.on_tick(t)

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.scan()
            except Exception as err:  # never let the sampler kill the benchmark
                print(f"[sampler] scan failed: {type(err).__name__}: {err}", file=sys.stderr)
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def start(self) -> ProcTreeSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    # ---------------------------------------------------------------------------------------- windows
    def cpu_by_role(self, t0: float, t1: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for rec in self.procs.values():
            d = rec.cpu_at(t1) - rec.cpu_at(t0)
            if d > 0:
                out[rec.role] = out.get(rec.role, 0.0) + d
        return out

    @staticmethod
    def _series_between(series: list[tuple[float, float]], t0: float, t1: float) -> float:
        def at(t: float) -> float:
            best = series[0][1] if series else 0.0
            for ts, v in series:
                if ts > t:
                    break
                best = v
            return best

        return at(t1) - at(t0)

    def machine_cpu_between(self, t0: float, t1: float) -> float:
        return self._series_between(self.machine_cpu, t0, t1)

    def own_cpu_between(self, t0: float, t1: float) -> float:
        """CPU seconds of the benchmark process itself (and of the children it reaped) between the samples."""
        return self._series_between(self.own_cpu, t0, t1)

    def cpu_split(self, t0: float, t1: float) -> dict[str, Any]:
        """The machine's busy CPU seconds between ``t0`` and ``t1``: the tree's by role, the benchmark's own, the
        rest ("other work": other processes on the shared machine)."""
        by_role = self.cpu_by_role(t0, t1)
        ours = sum(by_role.values())
        machine = self.machine_cpu_between(t0, t1)
        bench = self.own_cpu_between(t0, t1)
        return {"cpu-s-by-role": by_role, "cpu-s-ours": ours, "cpu-s-benchmark": bench, "cpu-s-machine": machine,
                "cpu-s-other-work": machine - ours - bench}

    def alive_members(self) -> list[tuple[int, str]]:
        """Members of the tree still alive now (for the leftover check)."""
        out = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid in self.exclude:
                continue
            try:
                rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if rest[0] != "Z" and self._marked(pid, (pid, int(rest[19]))):
                with contextlib.suppress(OSError):
                    out.append((pid, Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]))
        return out


def kill_leftovers(sampler: ProcTreeSampler) -> list[tuple[int, str]]:
    """SIGTERM, then SIGKILL, the processes (by pid) that still carry this run's marker."""
    left = sampler.alive_members()
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = sampler.alive_members()
        if not alive:
            break
        for pid, _ in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.time() + wait_s
        while sampler.alive_members() and time.time() < end:
            time.sleep(0.2)
    return left


# ================================================================================================ metrics.jsonl
class RowWatcher:
    """Polls ``<out_dir>/run-*/metrics.jsonl`` and stamps each new row with the time it appeared."""

    def __init__(self, out_dir: Path, interval: float = 0.05) -> None:
        self.out_dir = out_dir
        self.interval = interval
        self.rows: list[tuple[float, dict[str, float]]] = []
        self.path: Path | None = None
        self._consumed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="row-watcher", daemon=True)

    def poll(self) -> None:
        if self.path is None:
            found = sorted(self.out_dir.glob("run-*/metrics.jsonl"))
            if not found:
                return
            self.path = found[-1]
        try:
            mtime = self.path.stat().st_mtime
            data = self.path.read_bytes()
        except OSError:
            return
        t = time.time()
        if len(data) < self._consumed:  # truncated (RoundRecorder re-created it)
            self._consumed, self.rows = 0, []
        chunk = data[self._consumed:]
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        lines = [ln for ln in chunk[: end + 1].splitlines() if ln.strip()]
        for i, line in enumerate(lines):
            row = json.loads(line)
            if "recorded-at" in row:  # the ServerApp's own stamp (same machine, same clock)
                self.rows.append((float(row["recorded-at"]), row))
                continue
            # the file's mtime is the write time of its last row (this thread may see it late under load)
            self.rows.append((min(t, mtime) if i == len(lines) - 1 else t, row))
        self._consumed += end + 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self.poll()
            self._stop.wait(self.interval)

    def start(self) -> RowWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.poll()


# ================================================================================================ TCP bytes
class WireCounter:
    """Per-connection TCP ``bytes_acked`` of the Fleet API port, from ``ss -ti`` (sampled on each tick).

    On loopback both ends of every connection are in this namespace: a node's socket counts what the node sent (its
    ``bytes_acked``), the SuperLink's what the SuperLink sent. With ``prefix`` (``ip netns exec <server host>``, the
    ``--netns`` LAN) only the SuperLink's ends are visible: they count both directions, ``bytes_acked`` sent and
    ``bytes_received`` received."""

    def __init__(self, port: int, prefix: Sequence[str] = ()) -> None:
        self.port = port
        self.prefix = list(prefix)
        self.series: dict[tuple[str, str, str], list[tuple[float, int]]] = {}  # (direction, local, peer)

    def sample(self, t: float) -> None:
        out = subprocess.run(
            [*self.prefix, "ss", "-tinH", "state", "established", f"( sport = :{self.port} or dport = :{self.port} )"],
            capture_output=True, text=True, timeout=10,
        ).stdout
        lines = out.splitlines()
        i = 0
        while i < len(lines):
            head = lines[i].split()
            info = lines[i + 1] if i + 1 < len(lines) else ""
            i += 2
            if len(head) < 4:
                continue
            local, peer = head[-2], head[-1]
            m = re.search(r"bytes_acked:(\d+)", info)
            acked = int(m.group(1)) if m else 0
            direction = "node->link" if peer.endswith(f":{self.port}") else "link->node"
            self.series.setdefault((direction, local, peer), []).append((t, acked))
            if self.prefix and direction == "link->node":  # the node's end is on its own host: count it here
                m = re.search(r"bytes_received:(\d+)", info)
                self.series.setdefault(("node->link", local, peer), []).append((t, int(m.group(1)) if m else 0))

    def between(self, direction: str, t0: float, t1: float) -> int:
        total = 0
        for (d, _, _), pts in self.series.items():
            if d != direction:
                continue
            v0 = v1 = 0
            for ts, v in pts:
                if ts <= t0:
                    v0 = v
                if ts <= t1:
                    v1 = v
            total += max(0, v1 - v0)
        return total


# ================================================================================================ tables
def table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) < 1e5 else f"{v:,.0f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    sep = "-+-".join("-" * w for w in widths)
    out = [" | ".join(h.rjust(w) for h, w in zip(headers, widths)), sep]
    out += [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def pyproject_config() -> dict[str, Any]:
    from scripts.simulate import pyproject_run_config

    return pyproject_run_config()


# ================================================================================================ part 1
def worst_of_rounds(per_round: list[dict[str, Any]], key: str) -> tuple[float, list[int]]:
    """The largest ``key`` over the rounds, and the rounds without a value (NaN: no applied update, so no
    ``client-seconds-max`` and no bytes per update).  Python's ``max`` would skip a NaN unless it came first."""
    missing = [int(p["round"]) for p in per_round if math.isnan(p[key])]
    values = [p[key] for p in per_round if not math.isnan(p[key])]
    return (max(values) if values else float("nan")), missing


def judge_rounds(per_round: list[dict[str, Any]], wire_up: float) -> tuple[dict[str, Any], list[str]]:
    """Part 1's verdicts and their lines: the worst round's overhead <= 10 %, the wire over the run <= 1.05 x the
    payload per applied update.  A round without data (no applied update) makes both MISSED, naming the round:
    a target is not met on rounds that were not measured."""
    ovh, ovh_missing = worst_of_rounds(per_round, "overhead-frac")
    ratio, bytes_missing = worst_of_rounds(per_round, "bytes-per-update")
    ratio /= PAYLOAD_BYTES

    def no_data(rounds: list[int]) -> str:
        if not rounds:
            return ""
        return (f" (no data for round{'s' if len(rounds) > 1 else ''} {', '.join(map(str, rounds))}: no applied "
                "update)")

    ovh_ok = not ovh_missing and ovh <= 0.10
    bytes_ok = not bytes_missing and wire_up <= 1.05
    targets = {"overhead<=10%": ovh_ok, "bytes<=1.05x": bytes_ok, "worst-overhead-frac": ovh,
               "wire-run-bytes-ratio": wire_up, "worst-arrayrecord-ratio": ratio,
               "rounds-without-overhead": ovh_missing, "rounds-without-bytes": bytes_missing}
    lines = [
        f"target overhead <= 10 % of the round: worst round {100 * ovh:.1f} %{no_data(ovh_missing)} -> "
        f"{verdict(ovh_ok)}",
        f"target bytes sent per update <= 1.05 x payload: {wire_up:.4f} x on the wire over the run (the Delta's "
        f"ArrayRecord alone: {ratio:.4f} x){no_data(bytes_missing)} -> {verdict(bytes_ok)}",
    ]
    return targets, lines


def _count(paths: Iterable[Path], needle: str) -> int:
    return sum(p.read_text(errors="replace").count(needle) for p in paths)


def bench_network(args: argparse.Namespace) -> dict[str, Any]:
    from scripts.deploy import Deployment, free_port_kwargs

    wd = args.workdir / "network"
    shutil.rmtree(wd, ignore_errors=True)
    out_dir = wd / "outputs"
    out_dir.mkdir(parents=True)
    run_config: dict[str, Any] = {
        "model": "bnn", "hidden": "200", "dtype": "float32", "dataset": "fashion_mnist",
        "num-clients": args.clients, "min-clients": args.clients, "fraction-train": 1.0,
        "local-epochs": args.local_epochs, "batch-size": 256, "mc-samples": 10, "evaluate-clients": False,
        "num-server-rounds": args.rounds, "eval-samples": args.eval_samples,
        "round-timeout-s": args.round_timeout, "wait-for-clients-s": args.round_timeout, "output-dir": str(out_dir),
    }  # fmt: skip
    if args.object_pull_retry is not None:  # the ServerApp's; the nodes' comes from the environment below
        run_config["object-pull-retry-s"] = args.object_pull_retry
    if not args.pipeline_evaluation:
        run_config["pipeline-evaluation"] = False
    where = "a virtual LAN, each node on a host of its own (--netns)" if args.netns else "loopback"
    print(f"\n=== part 1: {args.clients}-client BNN rounds over TLS on {where} ===", flush=True)
    print(f"run config overrides: {json.dumps(run_config)}", flush=True)
    up0 = uptime_line()
    print(f"uptime before: {up0}", flush=True)
    ports = free_port_kwargs(args.clients)
    t_setup = time.time()
    result: dict[str, Any] = {"run-config": run_config, "uptime-before": up0, "superlink-db": args.superlink_db}

    class BenchDeployment(Deployment):
        """``Deployment`` unchanged, except (``--superlink-db memory``) the SuperLink's ``--database``."""

        def _spawn(self, role, index, cmd, home, **kw):  # type: ignore[no-untyped-def]
            if role == "superlink" and args.superlink_db == "memory":
                i = cmd.index("--database")
                cmd = [*cmd[: i + 1], ":flwr-in-memory:", *cmd[i + 2:]]
            return super()._spawn(role, index, cmd, home, **kw)

    extra: dict[str, Any] = {} if args.poll_interval is None else {"superexec_poll_interval": args.poll_interval}
    if args.object_pull_retry is not None:
        extra["env"] = {ENV_INITIAL_RETRY: str(args.object_pull_retry)}
    isolation = args.isolation or ("process" if args.superexec == "preforked" else "subprocess")
    result.update({"isolation": isolation, "superexec": args.superexec, "supernode": args.supernode,
                   "netns": args.netns})
    if args.netns:  # made when the deployment starts; its stop() removes it (owns_lan)
        from scripts.netns import VirtualLan

        extra.update(lan=VirtualLan(args.clients), owns_lan=True)
    with BenchDeployment(args.clients, run_dir=wd / "deploy", node_config={"torch-threads": 1}, **ports,
                         warm_workers=args.warm_workers, isolation=isolation, superexec=args.superexec,
                         supernode=args.supernode, **extra) as dep:
        if dep.lan is not None:
            dep.lan.create()
        dep.start()
        dep.wait_online(timeout=600)
        result["setup-seconds"] = time.time() - t_setup
        print(f"{args.clients} SuperNodes online after {result['setup-seconds']:.1f}s (TLS on, isolation "
              f"{dep.isolation}, SuperExec {dep.superexec}, SuperNode {dep.supernode}, "
              f"warm compute workers {'ON' if dep.warm_workers else 'off'}, "
              f"node config torch-threads=1, FLWR_SUPEREXEC_TASK_POLL_INTERVAL="
              f"{dep.superexec_poll_interval}, SuperLink --database "
              f"{':flwr-in-memory:' if args.superlink_db == 'memory' else dep.run_dir / 'superlink' / 'state.db'})",
              flush=True)
        wire = WireCounter(ports["fleet_port"], dep._on_server())
        tick = {"n": 0}

        def on_tick(t: float) -> None:
            tick["n"] += 1
            if tick["n"] % 2 == 0:
                with contextlib.suppress(Exception):
                    wire.sample(t)

        sampler = ProcTreeSampler("PGVI_DEPLOY_ID", dep.token, 0.25, exclude={os.getpid()}, on_tick=on_tick)
        sampler.scan()
        wire.sample(time.time())
        watcher = RowWatcher(out_dir).start()
        sampler.start()
        t_run = time.time()
        res = dep.run_app(run_config, timeout=args.run_timeout)
        sampler.stop()
        watcher.stop()
        t_wire_end = time.time()
        wire.sample(t_wire_end)  # every byte of the run is acked by now (the run has finished)
        result.update({"status": res.status, "details": res.details, "run-id": res.run_id,
                       "run-seconds": time.time() - t_run, "log": str(res.log_path)})
    leftovers = dep.leftover_processes()
    result["leftover-processes"] = leftovers
    logs = dep.logs_dir
    result["superlink-db-locked-errors"] = _count(logs.glob("superlink*.log"), "database is locked")
    result["supernode-failed-sends"] = _count(logs.glob("supernode-*.log"), "Failed to send message")
    result["supernode-failed-receives"] = _count(logs.glob("supernode-*.log"), "Failed to receive message")
    print(f"SuperLink 'database is locked' errors: {result['superlink-db-locked-errors']}; SuperNode messages "
          f"lost: {result['supernode-failed-sends']} replies ('Failed to send message'), "
          f"{result['supernode-failed-receives']} instructions ('Failed to receive message')", flush=True)
    result["uptime-after"] = uptime_line()
    print(f"run {res.run_id}: {res.status} {res.details} in {result['run-seconds']:.1f}s; "
          f"processes left after stop(): {len(leftovers)}", flush=True)
    if not res.ok:
        print(Path(res.log_path).read_text(errors="replace")[-4000:])
        result["ok"] = False
        return result

    rows = watcher.rows
    t_row = {int(r["round"]): t for t, r in rows}
    row = {int(r["round"]): r for _, r in rows}
    clientapps = sorted((p for p in sampler.procs.values() if p.role == "flwr-clientapp"), key=lambda p: p.start)
    # round r spans [start of r, start of r+1): the rows' started-at (the ServerApp's clock; with
    # pipeline-evaluation a row is written after the next round's messages went out, so row times would put
    # those ClientApps in the earlier round); the last round ends at its row; older records: row to row
    bound = {rnd: float(row[rnd]["started-at"]) if "started-at" in row.get(rnd, {}) else t_row[rnd - 1]
             for rnd in range(1, args.rounds + 1)}
    bound[args.rounds + 1] = t_row[args.rounds]
    # with pipeline-evaluation, rounds 1..R-1 end when the next one starts and their server evaluation runs during
    # the next round; only the last round's row waits for its evaluation: leave that out, as for the others
    last_eval = float(row[args.rounds].get("server-seconds-evaluate", 0.0)) if args.pipeline_evaluation else 0.0
    bound[args.rounds + 1] -= last_eval
    result["last-round-evaluation-excluded-s"] = last_eval
    per_round = []
    for rnd in range(1, args.rounds + 1):
        t0, t1 = bound[rnd], bound[rnd + 1]
        r = row[rnd]
        wall = t1 - t0
        cs_max, cs_mean = r.get("client-seconds-max", float("nan")), r.get("client-seconds-mean", float("nan"))
        started = [p for p in clientapps if t0 < p.start <= t1]
        if args.warm_workers:  # the ClientApp never loads torch: it waits on its worker, so it ends at exit
            apps = started
            end = {p.pid: p.last_seen for p in apps}
        else:
            apps = [p for p in started if p.rss_peak > 300 * MB]  # loaded torch: ran the ClientApp
            end = {p.pid: p.active_end for p in apps}
        life = [end[p.pid] - p.start for p in apps]
        cpu_split = sampler.cpu_split(t0, t1)
        applied = r.get("applied", 0.0)
        sent = r.get("sent", 0.0)
        per_round.append({
            "round": rnd, "wall-s": wall, "client-seconds-max": cs_max, "client-seconds-mean": cs_mean,
            "overhead-s": wall - cs_max, "overhead-frac": (wall - cs_max) / wall,
            "sent": sent, "applied": applied, "reply-bytes": r.get("reply-bytes", 0.0),
            "bytes-per-update": r.get("reply-bytes", 0.0) / applied if applied else float("nan"),
            "wire-node->link-per-update": wire.between("node->link", t0, t1) / applied if applied else float("nan"),
            "wire-link->node-per-message": wire.between("link->node", t0, t1) / sent if sent else float("nan"),
            "clientapps": len(apps), "clientapps-without-torch": len(started) - len(apps),
            "clientapp-linger-max-s": max((p.last_seen - p.active_end for p in apps), default=float("nan")),
            "dispatch-s": (apps[0].start - t0) if apps else float("nan"),
            "tail-s": (t1 - max(end.values())) if apps else float("nan"),
            "clientapp-life-mean-s": sum(life) / len(life) if life else float("nan"),
            "clientapp-life-max-s": max(life) if life else float("nan"),
            "in-app-non-step-mean-s": (sum(life) / len(life) - cs_mean) if life else float("nan"),
            "clientapp-rss-peak-mb": max((p.rss_peak for p in apps), default=0) / MB,
            **cpu_split, "test-accuracy": r.get("test-accuracy", float("nan")),
            "server-seconds": {k.removeprefix("server-seconds-"): v for k, v in r.items()
                               if k.startswith("server-seconds-")},
        })  # fmt: skip
    result["rounds"] = per_round
    # the wire over the whole run (TLS, gRPC and HTTP/2 framing, heartbeats and polls included): per round, replies
    # arriving within a sampling tick of a round boundary land in the neighbouring round
    applied_all = sum(p["applied"] for p in per_round)
    sent_all = sum(p["sent"] for p in per_round)
    # the whole run: from round 1's start to the sample taken after the run finished. Ending at the last row (as
    # until 2026-11-27) lost the last replies' bytes when no sample fell between them and the row (0.99 x once)
    t_first, t_last = bound[1], t_wire_end
    result["wire-run"] = {
        "node->link-per-update": wire.between("node->link", t_first, t_last) / applied_all if applied_all else float("nan"),
        "link->node-per-message": wire.between("link->node", t_first, t_last) / sent_all if sent_all else float("nan"),
    }
    result["row-times"] = {r: t - t_row[0] for r, t in t_row.items()}
    result["round-starts"] = {r: t - t_row[0] for r, t in bound.items()}
    result["clientapp-processes"] = [
        {"pid": p.pid, "start": p.start - t_row[0], "active-end": p.active_end - t_row[0], "last-seen": p.last_seen - t_row[0],
         "cpu-s": p.cpu_last, "rss-peak-mb": p.rss_peak / MB} for p in clientapps
    ]  # times relative to round 0's row
    result["payload-bytes"] = PAYLOAD_BYTES
    result["ok"] = True
    cores = os.cpu_count() or 1

    print("\nper-round wall time split (seconds; round r = start of round r+1 - start of round r, the rows' started-at; "
          "the last round ends at its row" + (f", minus its server evaluation ({last_eval:.2f} s), which the other "
                                              "rounds overlap with the next round" if last_eval else "") + "):")
    print(table(
        ["round", "wall", "cli-s max", "cli-s mean", "overhead", "ovh %", "dispatch", "in-app", "tail", "app life max"],
        [[p["round"], p["wall-s"], p["client-seconds-max"], p["client-seconds-mean"], p["overhead-s"],
          100 * p["overhead-frac"], p["dispatch-s"], p["in-app-non-step-mean-s"], p["tail-s"],
          p["clientapp-life-max-s"]] for p in per_round],
    ))  # fmt: skip
    phases = [k for k in ("push", "wait", "apply", "evaluate") if any(k in p["server-seconds"] for p in per_round)]
    if phases:
        print("\nthe ServerApp's wall time by phase (seconds; the rows' server-seconds-*; wait = from the push until "
              "the last reply is in):")
        print(table(["round", *phases], [[p["round"], *[p["server-seconds"].get(k, float("nan")) for k in phases]]
                                        for p in per_round]))
    print("\nbytes per update (payload = 2 x 159,010 x 4 = 1,272,080 B):")
    print(table(
        ["round", "sent", "applied", "reply B/update", "x payload", "TCP node->link B/update", "x payload",
         "TCP link->node B/msg"],
        [[p["round"], int(p["sent"]), int(p["applied"]), p["bytes-per-update"], p["bytes-per-update"] / PAYLOAD_BYTES,
          p["wire-node->link-per-update"], p["wire-node->link-per-update"] / PAYLOAD_BYTES,
          p["wire-link->node-per-message"]] for p in per_round],
    ))  # fmt: skip
    roles = sorted({k for p in per_round for k in p["cpu-s-by-role"]})
    print(f"\nCPU seconds per round by process role ({cores} cores; 'benchmark' = this script's process, its "
          f"/proc sampler and its `ss` calls; 'other work' = machine busy CPU minus ours minus the benchmark's):")
    print(table(
        ["round", *roles, "ours", "benchmark", "other work", "machine", "machine cap"],
        [[p["round"], *[p["cpu-s-by-role"].get(k, 0.0) for k in roles], p["cpu-s-ours"], p["cpu-s-benchmark"],
          p["cpu-s-other-work"], p["cpu-s-machine"], cores * p["wall-s"]] for p in per_round],
    ))  # fmt: skip
    if args.warm_workers:
        print("\nflwr-clientapp processes per round (warm workers: every started ClientApp counts as 'ran'; its "
              "life is start -> exit, most of it waiting for its worker)")
    else:
        print("\nflwr-clientapp processes per round: 'ran' = imported torch and ran the ClientApp; 'aborted' = "
              "started but never loaded the app (RSS < 300 MB)")
    print(table(["round", "ran", "aborted", "life mean (start->CPU idle)", "life max", "linger after CPU idle max",
                 "CPU s mean"],
                [[p["round"], p["clientapps"], p["clientapps-without-torch"], p["clientapp-life-mean-s"],
                  p["clientapp-life-max-s"], p["clientapp-linger-max-s"],
                  p["cpu-s-by-role"].get("flwr-clientapp", 0.0) / max(1, p["clientapps"])] for p in per_round]))
    print(f"\nClientApp process peak RSS in the deployment: "
          f"{max(p['clientapp-rss-peak-mb'] for p in per_round):.0f} MB (one flwr-clientapp per train message)")
    wire_up = result["wire-run"]["node->link-per-update"] / PAYLOAD_BYTES
    wire_down = result["wire-run"]["link->node-per-message"] / PAYLOAD_BYTES
    print(f"\nthe wire over the whole run (TCP bytes_acked of the SuperNodes' Fleet connections: TLS, gRPC, HTTP/2, "
          f"heartbeats and polls included): node->link {wire_up:.4f} x payload per applied update, link->node "
          f"{wire_down:.4f} x payload per message sent")
    targets, lines = judge_rounds(per_round, wire_up)
    result["targets"] = targets
    for line in lines:
        print(line)
    print(f"uptime after: {result['uptime-after']}", flush=True)
    return result


# ================================================================================================ part 4
#: (SuperNode, first object retry s, SuperExec task poll s), in the order run.
LATENCY_VARIANTS: list[tuple[str, float, float]] = [
    ("flower", 1.0, 0.1),
    ("flower", 0.05, 0.1),
    ("paced", 0.05, 0.1),
    ("paced", 0.05, 1.0),
]


def bench_latency(args: argparse.Namespace) -> dict[str, Any]:
    """Rounds with (almost) no compute: what a synchronous round costs in Flower's transport alone.  Variants, in
    alternating deployments of the same run (``LATENCY_VARIANTS``): Flower's SuperNode with Flower's 1 s first
    retry of an object not there yet (``client/object_pulls.py``, in the forked ClientApps and the ServerApp);
    Flower's SuperNode with a 0.05 s first retry; ``client/paced_supernode.py`` with a 0.05 s first retry (also
    in the SuperNode), with the SuperExecs' task poll of 0.1 s (``Deployment``'s default) and of 1 s (Flower's)."""
    import statistics

    from scripts.deploy import Deployment, free_port_kwargs

    wd = args.workdir / "latency"
    shutil.rmtree(wd, ignore_errors=True)
    n = args.latency_clients
    base: dict[str, Any] = {
        "model": "gaussian_location", "dataset": "synthetic_gaussian_location", "family": "full_covariance",
        "loss": "nll", "divergence": "kl", "num-clients": n, "min-clients": n, "evaluate-clients": False,
        "num-server-rounds": args.latency_rounds, "wait-for-clients-s": 600.0, "round-timeout-s": 120.0,
    }  # fmt: skip
    variants = LATENCY_VARIANTS
    print(f"\n=== part 4: round latency, {n} SuperNodes, conjugate Gaussian location (local update of "
          f"milliseconds), {args.latency_rounds} rounds, {args.latency_repeats} deployment(s) per variant ===")
    print(f"run config: {json.dumps(base)}; TLS + SuperNode auth, isolation process, SuperExec preforked, "
          "warm compute workers, torch-threads=1 (Deployment's defaults otherwise)", flush=True)
    result: dict[str, Any] = {"run-config": base, "uptime-before": uptime_line(), "runs": []}

    def label(sn: str, retry: float, poll: float) -> str:
        return f"{sn} / {retry:g} s / poll {poll:g} s"

    rounds: dict[str, list[float]] = {label(*v): [] for v in variants}
    cpu_per_round: dict[str, list[float]] = {k: [] for k in rounds}
    exec_cpu_per_round: dict[str, list[float]] = {k: [] for k in rounds}
    for rep in range(args.latency_repeats):
        for sn, retry, poll in variants:
            key = label(sn, retry, poll)
            tag = f"{sn}-{retry:g}-{poll:g}-{rep}"
            out_dir = wd / tag / "outputs"
            out_dir.mkdir(parents=True)
            with Deployment(n, run_dir=wd / tag / "deploy", isolation="process", superexec="preforked",
                            warm_workers=True, supernode=sn, superexec_poll_interval=poll,
                            node_config={"torch-threads": 1}, env={ENV_INITIAL_RETRY: str(retry)},
                            **free_port_kwargs(n)) as dep:  # fmt: skip
                dep.start()
                dep.wait_online(timeout=600)
                sampler = ProcTreeSampler("PGVI_DEPLOY_ID", dep.token, 0.25, exclude={os.getpid()})
                sampler.scan()
                watcher = RowWatcher(out_dir).start()
                sampler.start()
                res = dep.run_app({**base, "object-pull-retry-s": retry, "output-dir": str(out_dir)},
                                  timeout=args.run_timeout)
                sampler.stop()
                watcher.stop()
            leftovers = dep.leftover_processes()
            t = [t for t, _ in watcher.rows]
            walls = [b - a for a, b in zip(t, t[1:])]
            t_from, t_to = (t[1], t[-1]) if len(t) > 2 else (float("nan"), float("nan"))
            cpu = sampler.cpu_by_role(t_from, t_to)  # rounds 2.. (round 1 includes the first forks)
            secs = t_to - t_from
            run = {"supernode": sn, "object-pull-retry-s": retry, "task-poll-s": poll,
                   "repeat": rep, "status": res.status, "ok": res.ok, "round-walls-s": walls,
                   "leftover-processes": leftovers, "cpu-s-by-role-rounds-2-on": cpu, "seconds-rounds-2-on": secs}
            result["runs"].append(run)
            if not res.ok or len(walls) != args.latency_rounds:
                print(f"{key} #{rep}: run {res.status} {res.details}, {len(walls)} rounds recorded; log "
                      f"{res.log_path}", flush=True)
                result["ok"] = False
                continue
            rounds[key].extend(walls[1:])
            cpu_per_round[key].append(cpu.get("flower-supernode", 0.0) / (len(walls) - 1) / n)
            # the nodes' SuperExecs and their forkservers (the ServerApp's SuperExec is one more process)
            exec_cpu_per_round[key].append(cpu.get("flower-superexec", 0.0) / (len(walls) - 1) / n)
            print(f"{key:>15} #{rep}: rounds 2-{args.latency_rounds} median {statistics.median(walls[1:]):.2f} s "
                  f"(min {min(walls[1:]):.2f}, max {max(walls[1:]):.2f}); round 1 {walls[0]:.2f} s; SuperNode CPU "
                  f"{1000 * cpu_per_round[key][-1]:.0f} ms, SuperExec CPU {1000 * exec_cpu_per_round[key][-1]:.0f} ms "
                  f"per round and node; processes left: {len(leftovers)}", flush=True)
    rows = []
    for sn, w in rounds.items():
        if w:
            q = statistics.quantiles(w, n=10) if len(w) > 1 else [w[0]] * 9
            rows.append([sn, len(w), statistics.median(w), statistics.fmean(w), q[8], max(w),
                         1000 * statistics.fmean(cpu_per_round[sn]), 1000 * statistics.fmean(exec_cpu_per_round[sn])])
    print("\nround wall time over rounds 2.. of every deployment (seconds):")
    print(table(["SuperNode / first object retry / task poll", "rounds", "median", "mean", "p90", "max",
                 "SuperNode CPU ms/round each", "SuperExec CPU ms/round each"], rows))
    result["summary"] = {r[0]: dict(zip(("rounds", "median-s", "mean-s", "p90-s", "max-s", "supernode-cpu-ms-per-round",
                                         "superexec-cpu-ms-per-round"), r[1:])) for r in rows}  # fmt: skip
    result["uptime-after"] = uptime_line()
    print(f"uptime after: {result['uptime-after']}", flush=True)
    result.setdefault("ok", True)
    return result


# ================================================================================================ part 2
def _torch_build() -> str:
    """torch version and CUDA build of this interpreter's torch, read from ``torch/version.py`` (no import)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "not installed"
    text = (Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text()
    ver = re.search(r"^__version__\W*=\W*'([^']+)'", text, re.M)
    cuda = re.search(r"^cuda\b[^=]*=\s*(\S+)", text, re.M)
    return f"{ver.group(1) if ver else '?'} (cuda {cuda.group(1).strip(chr(39)) if cuda else '?'})"


def bench_simulation(args: argparse.Namespace) -> dict[str, Any]:
    from scripts.simulate import run_simulation

    wd = args.workdir / "simulation"
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    run_config: dict[str, Any] = {
        "model": "logistic_regression", "dataset": "digits", "num-clients": args.sim_clients,
        "min-clients": args.sim_min_clients, "fraction-train": args.sim_fraction,
        "num-server-rounds": args.sim_rounds, "evaluate-clients": False, "wait-for-clients-s": 900.0,
        "round-timeout-s": 7200.0,
    }  # fmt: skip
    print(f"\n=== part 2: simulation with {args.sim_clients} virtual clients ===", flush=True)
    print(f"run config overrides: {json.dumps(run_config)}", flush=True)
    torch_build = _torch_build()
    print(f"simulation venv: {Path(sys.executable).parent.parent} (flwr, the SuperLink, flwr-simulation and Ray's "
          f"workers all run from it); torch {torch_build}", flush=True)
    print("Ray head: " + ("simulate.py's lean head (scripts/lean_ray.py), started before `flwr run`" if args.sim_lean_ray
                          else "the one Flower's ray.init starts in flwr-simulation"), flush=True)
    up0 = uptime_line()
    print(f"uptime before: {up0}", flush=True)
    token = secrets.token_hex(8)
    old = os.environ.get(BENCH_MARKER)
    os.environ[BENCH_MARKER] = token  # inherited by flwr, the SuperLink, SuperExec, Ray and its workers
    cgroup = None
    if args.sim_cgroup:
        if args.drop_caches:
            drop_page_cache()
            print("page cache dropped (sync; drop_caches=3): the tree is charged for the files it loads", flush=True)
        # the `flwr run` child joins it before it starts; this process stays outside (and out of the OOM killer's
        # choice under a limit)
        cgroup = MemoryCgroup("pgvi-sim", limit_mb=args.sim_memory_limit_mb).create()
        print(f"memory cgroup v{cgroup.version} {cgroup.path}, limit "
              f"{'none' if args.sim_memory_limit_mb is None else f'{args.sim_memory_limit_mb:,.0f} MB'}, "
              f"{'no swap' if cgroup.no_swap else 'swap NOT limited'}", flush=True)
    sampler = ProcTreeSampler(BENCH_MARKER, token, 0.5, pss=True, exclude={os.getpid()})
    watcher = RowWatcher(wd / "outputs").start()
    sampler.start()
    try:
        res = run_simulation(run_config, args.sim_clients, wd, num_cpus_per_client=args.sim_cpus_per_client,
                             timeout=args.run_timeout, preexec_fn=None if cgroup is None else cgroup.join,
                             lean_ray=args.sim_lean_ray)
    finally:
        sampler.stop()
        watcher.stop()
        if old is None:
            os.environ.pop(BENCH_MARKER, None)
        else:
            os.environ[BENCH_MARKER] = old
        leftovers = kill_leftovers(sampler)
        if cgroup is not None:
            cgroup.read()
            if (n := cgroup.kill()):
                print(f"[cgroup] {n} process(es) of the tree were still in {cgroup.path}: killed", file=sys.stderr)
            if not cgroup.remove():
                print(f"[cgroup] {cgroup.path} still has processes; left in place", file=sys.stderr)
    up1 = uptime_line()
    rows = watcher.rows
    t_row = {int(r["round"]): t for t, r in rows}
    first = min((p.start for p in sampler.procs.values()), default=float("nan"))
    by_role: dict[str, list[float]] = {}
    for p in sampler.procs.values():
        agg = by_role.setdefault(p.role, [0, 0.0, 0.0, 0.0])
        agg[0] += 1
        agg[1] = max(agg[1], p.rss_peak / MB)
        agg[2] += p.cpu_last
        agg[3] = max(agg[3], p.pss_peak / MB)
    result = {
        "run-config": run_config, "python": sys.executable, "torch": torch_build, "lean-ray": args.sim_lean_ray, "status": res["status"], "details": res.get("status-details", ""),
        "seconds": res["seconds"], "peak-rss-sum-mb": sampler.peak_rss / MB, "peak-pss-sum-mb": sampler.peak_pss / MB,
        "peak-composition": sampler.peak_rss_parts, "roles": by_role, "processes": len(sampler.procs),
        "rounds": [{"round": int(r["round"]), "t": t - first, "sent": r.get("sent"), "applied": r.get("applied"),
                    "test-accuracy": r.get("test-accuracy")} for t, r in rows],
        "leftover-processes": leftovers, "uptime-before": up0, "uptime-after": up1,
    }  # fmt: skip
    print(f"status {res['status']} {res.get('status-details', '')}; wall {res['seconds']:.1f}s "
          f"(flwr run start to SuperLink stopped); {len(sampler.procs)} processes seen; "
          f"leftovers killed: {len(leftovers)}", flush=True)
    print("\nrounds (t = seconds since the first process of the tree started):")
    prev = None
    rr = []
    for item in result["rounds"]:
        rr.append([item["round"], item["t"], (item["t"] - prev) if prev is not None else float("nan"),
                   int(item["sent"] or 0), int(item["applied"] or 0), item["test-accuracy"] or float("nan")])
        prev = item["t"]
    print(table(["round", "t", "round wall", "sent", "applied", "test acc"], rr))
    print("\nprocesses by role (peak RSS of one process, CPU seconds summed over the role's processes):")
    print(table(["role", "processes", "max RSS MB", "max PSS MB", "CPU s"],
                [[k, int(v[0]), v[1], v[3], v[2]] for k, v in sorted(by_role.items(), key=lambda kv: -kv[1][1])]))
    print(f"\nat the peak ({sampler.peak_rss_t - first:.0f}s): "
          + ", ".join(f"{k} x{int(v[0])} {v[1]:.0f} MB" for k, v in sorted(sampler.peak_rss_parts.items(), key=lambda kv: -kv[1][1])))
    completed = res["status"] == "finished:completed"
    result["ok"] = completed  # the exit code: 1 when the simulation did not complete (or was OOM-killed, below)
    ok = completed and sampler.peak_rss / MB <= 2048
    limited = args.sim_memory_limit_mb is not None
    # PSS shares each page among every process on the machine that maps it, the tree's or not
    pss_label = f"sum of PSS, shared pages split with processes outside the tree too: {sampler.peak_pss / MB:,.0f} MB"
    if limited:  # the kernel evicts mapped pages to stay under the limit: the RSS/PSS sums are not the run's own
        result["targets"] = {}
        print(f"peak memory, sum of RSS over the process tree: {sampler.peak_rss / MB:,.0f} MB ({pss_label}); "
              "under a memory limit, not judged against the target")
    else:
        result["targets"] = {"peak-rss-sum<=2GB": ok,
                             "peak-pss-sum<=2GB": completed and sampler.peak_pss / MB <= 2048}
        print(f"peak memory, sum of RSS over the process tree: {sampler.peak_rss / MB:,.0f} MB "
              f"({pss_label}); target <= 2,048 MB (RSS sum) -> {verdict(ok)}"
              + ("" if completed else f" (the run did not complete: status {res['status']})"))
    if cgroup is not None:
        cg = cgroup.report()
        result["cgroup"] = dataclasses.asdict(cg)
        fits = completed and cg.oom_kills == 0
        result["ok"] = fits  # an OOM kill in the tree fails the run even if Ray's retries let it finish
        if cg.limit_mb is not None:
            result["targets"]["completes-under-cgroup-limit"] = fits
        print(f"memory cgroup v{cg.version} (each page charged once, page cache included"
              f"{', cache dropped first' if args.drop_caches else ''}): peak {cg.peak_mb:,.0f} MB"
              + ("" if cg.peak_with_swap_mb is None else f" (with swap {cg.peak_with_swap_mb:,.0f} MB)")
              + f"; limit {'none' if cg.limit_mb is None else f'{cg.limit_mb:,.0f} MB'}"
              + ("" if cg.limit_mb is None else f" ({'reached' if cg.reached_limit else 'not reached'})")
              + f"; OOM kills {cg.oom_kills}"
              + ("" if cg.limit_mb is None else f" -> the run {'completed' if fits else 'did NOT complete'} under it"))
    if 0 < t_row.get(0, 0):
        print(f"time to round 0 (all {args.sim_clients} clients identified): {t_row[0] - first:.1f}s")
    print(f"uptime after: {up1}", flush=True)
    return result


# ================================================================================================ part 3
PROBE = r'''
import importlib.util, json, os, sys, time
args = json.loads(sys.argv[1])
def mem():
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("VmRSS", "VmHWM"):
                d[k] = int(v.split()[0]) * 1024
    return d
marks = [("python started", mem(), 0.0)]
t = time.perf_counter()
import torch
marks.append(("import torch", mem(), time.perf_counter() - t))
torch.set_num_threads(args["threads"])
t = time.perf_counter()
import client.app as capp
marks.append(("import client.app (flwr, pydantic, common)", mem(), time.perf_counter() - t))
from common.config import parse_run_config
from common.problem import build_problem, client_shard
from common.client_update import client_step
from common.runtime import subnormals_flushed
t = time.perf_counter()
cfg = parse_run_config(args["run_config"])
shard = client_shard(cfg, 0)
problem = build_problem(cfg)
x, y = problem.tensors(shard.x_train, shard.y_train)
marks.append((f"FMNIST shard of {len(y)} + problem", mem(), time.perf_counter() - t))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
before = mem()["VmRSS"]
t = time.perf_counter()
with subnormals_flushed():  # the floating-point mode of a client's update (client/pgvi_client.py)
    res = client_step(problem, problem.prior, problem.prior.zeros_like(), x, y, cfg.rho(), step_seed=1)
step_s = time.perf_counter() - t
after = mem()
marks.append(("after client_step", after, step_s))
# the ClientApp's own path on a small slice: PGVIClient.fit returns a Delta
from common.client_state import ClientState
from common.problem import ArraysSplit
small = ArraysSplit(shard.x_train[:512], shard.y_train[:512], shard.x_test[:64], shard.y_test[:64], shard.num_classes)
cli = capp.PGVIClient(problem, small, "probe", ClientState())
names = cli.names
post = problem.prior.to_numpy()
delta, n, metrics = cli.fit([post[k] for k in names], {"site-version": 0, "posterior-version": 0, "server-round": 1})
import flwr
def importable(name):
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None  # not a namespace dir such as Ray's /tmp/ray
out = {
    "marks": marks, "rss-before-step": before, "peak-during-step": after["VmHWM"], "step-seconds": step_s,
    "epochs": res.metrics.get("epochs"), "shard": len(y), "fit-status": metrics.get("status"), "fit-arrays": len(delta),
    "torch": torch.__version__, "torch-cuda": torch.version.cuda, "flwr": flwr.__version__ if hasattr(flwr, "__version__") else "?",
    "torchvision-importable": importable("torchvision"),
    "ray-importable": importable("ray"),
    "client.app file": capp.__file__, "threads": torch.get_num_threads(),
}
print("PROBE-JSON " + json.dumps(out))
'''


def _probe_config() -> dict[str, Any]:
    cfg = pyproject_config()
    cfg.update({"model": "bnn", "hidden": "200", "dtype": "float32", "dataset": "fashion_mnist",
                "num-clients": 3, "min-clients": 1, "partitioner": "iid", "local-epochs": 1, "batch-size": 256,
                "mc-samples": 10, "evaluate-clients": False})  # fmt: skip
    return cfg


def run_probe(python: str, cwd: Path, pythonpath: str | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    arg = json.dumps({"threads": 1, "run_config": _probe_config()})
    proc = subprocess.run([python, "-c", PROBE, arg], cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE-JSON "):
            return json.loads(line[len("PROBE-JSON "):])
    raise RuntimeError(f"probe failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def ensure_client_venv(venv: Path, torch_spec: str, fresh: bool) -> dict[str, Any]:
    """A client-only venv: ``pip install <torch_spec>`` (CPU wheel on local disk), then ``pip install <repo>``."""
    info: dict[str, Any] = {"venv": str(venv), "commands": []}
    if fresh and venv.exists():
        shutil.rmtree(venv)
    py = venv / "bin" / "python"
    base = getattr(sys, "_base_executable", None) or shutil.which("python3.11") or "python3"

    def run(cmd: list[str]) -> str:
        t = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp", timeout=3600)
        tail = [ln for ln in p.stdout.splitlines() if ln.startswith(("Successfully", "Requirement already"))]
        info["commands"].append({"cmd": " ".join(cmd), "rc": p.returncode, "seconds": round(time.time() - t, 1),
                                 "result": tail[-1][:300] if tail else ""})  # fmt: skip
        if p.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
        return p.stdout

    if not py.exists():
        run([base, "-m", "venv", str(venv)])
    have = subprocess.run([str(py), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    if have.returncode != 0 or not have.stdout.strip().startswith(torch_spec.split("==")[-1]):
        run([str(py), "-m", "pip", "install", torch_spec])
    run([str(py), "-m", "pip", "install", str(ROOT)])
    run([str(py), "-m", "pip", "install", "--no-deps", "--force-reinstall", str(ROOT)])  # this tree's code
    info["size-mb"] = int(subprocess.run(["du", "-sm", str(venv)], capture_output=True, text=True).stdout.split()[0])
    sn = subprocess.run([str(venv / "bin" / "flower-supernode"), "--version"], capture_output=True, text=True)
    info["flower-supernode --version"] = (sn.stdout + sn.stderr).strip().splitlines()[0][:200]
    return info


def bench_client_rss(args: argparse.Namespace) -> dict[str, Any]:
    print("\n=== part 3: client process RSS (fresh subprocess per install) ===", flush=True)
    up0 = uptime_line()
    print(f"uptime before: {up0}", flush=True)
    venv_info = ensure_client_venv(args.client_venv, args.torch_cpu_spec, args.fresh_client_venv)
    for c in venv_info["commands"]:
        print(f"  $ {c['cmd']}  -> rc {c['rc']}, {c['seconds']}s  {c['result']}")
    print(f"  client venv size: {venv_info['size-mb']:,} MB; {venv_info['flower-supernode --version']}")
    empty = args.workdir / "probe-cwd"  # an empty cwd: `python -c` puts it first on sys.path
    shutil.rmtree(empty, ignore_errors=True)
    empty.mkdir(parents=True)
    results = {
        "a: this venv": run_probe(str(ROOT / ".venv" / "bin" / "python"), ROOT, str(ROOT)),
        "b: client-only venv": run_probe(str(args.client_venv / "bin" / "python"), empty, None),
    }
    main_venv_mb = int(subprocess.run(["du", "-sm", str(ROOT / ".venv")], capture_output=True, text=True).stdout.split()[0])
    labels = [m[0] for m in results["a: this venv"]["marks"]]
    rows = []
    for i, label in enumerate(labels):
        rows.append([label, *[r["marks"][i][1]["VmRSS"] / MB for r in results.values()]])
    rows.append(["peak during client_step (VmHWM)", *[r["peak-during-step"] / MB for r in results.values()]])
    rows.append(["update adds (peak - RSS before step)",
                 *[(r["peak-during-step"] - r["rss-before-step"]) / MB for r in results.values()]])
    rows.append(["peak - RSS after import torch",
                 *[(r["peak-during-step"] - r["marks"][1][1]["VmRSS"]) / MB for r in results.values()]])
    print("\nRSS in MB (one fresh process each; torch threads 1):")
    print(table(["stage", *results], rows))
    print(table(["", *results], [
        ["torch", *[f"{r['torch']} (cuda {r['torch-cuda']})" for r in results.values()]],
        ["shard / epochs / step s", *[f"{r['shard']} / {r['epochs']:.0f} / {r['step-seconds']:.1f}" for r in results.values()]],
        ["PGVIClient.fit on 512 samples", *[f"{r['fit-status']}, {r['fit-arrays']} arrays" for r in results.values()]],
        ["torchvision importable", *[str(r["torchvision-importable"]) for r in results.values()]],
        ["ray importable", *[str(r["ray-importable"]) for r in results.values()]],
        ["client.app loaded from", *[r["client.app file"] for r in results.values()]],
        ["venv size MB", str(main_venv_mb), str(venv_info["size-mb"])],
    ]))  # fmt: skip
    adds = {k: (r["peak-during-step"] - r["rss-before-step"]) / MB for k, r in results.items()}
    b = results["b: client-only venv"]
    targets = {"update-adds<=300MB": all(v <= 300 for v in adds.values()),
               "client-only-without-torchvision": not b["torchvision-importable"] and not b["ray-importable"]
               and b["fit-status"] == "ok"}  # fmt: skip
    print("target: the BNN update adds <= 300 MB: "
          + ", ".join(f"{k} {v:.0f} MB" for k, v in adds.items()) + f" -> {verdict(targets['update-adds<=300MB'])}")
    print("target: client-only install works without torchvision (and without ray): "
          f"{verdict(targets['client-only-without-torchvision'])}")
    up1 = uptime_line()
    print(f"uptime after: {up1}", flush=True)
    return {"venv": venv_info, "probes": results, "main-venv-mb": main_venv_mb, "targets": targets,
            "uptime-before": up0, "uptime-after": up1}


# ================================================================================================ main
def _exit_on_sigterm(signum: int, frame: object) -> None:  # noqa: ARG001
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one-shot: the cleanup that follows runs to its end
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--network", action="store_true", help="part 1: BNN rounds in the loopback deployment")
    ap.add_argument("--netns", action="store_true",
                    help="part 1 on a virtual LAN: the SuperLink and each SuperNode on a host of its own, network "
                         "namespaces (scripts/netns.py; root), instead of loopback")
    ap.add_argument("--simulation", action="store_true", help="part 2: 1,000-client simulation memory")
    ap.add_argument("--client-rss", action="store_true", help="part 3: client process RSS, two installs")
    ap.add_argument("--latency", action="store_true",
                    help="part 4: round latency without compute, Flower's SuperNode against the paced one")
    ap.add_argument("--latency-clients", type=int, default=3)
    ap.add_argument("--latency-rounds", type=int, default=15)
    ap.add_argument("--latency-repeats", type=int, default=2, help="deployments per SuperNode kind (alternating)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/pgvi-bench-network"))
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--local-epochs", type=int, default=10)
    ap.add_argument("--eval-samples", type=int, default=20, help="server-side test evaluation MC samples")
    ap.add_argument("--round-timeout", type=float, default=1800.0, help="run config round-timeout-s and wait-for-clients-s (part 1)")
    ap.add_argument("--superlink-db", choices=("file", "memory"), default="file",
                    help="part 1: SuperLink state in Deployment's SQLite file (default) or :flwr-in-memory:")
    ap.add_argument("--poll-interval", type=float, default=None,
                    help="part 1: FLWR_SUPEREXEC_TASK_POLL_INTERVAL (default: Deployment's, 0.1 s)")
    ap.add_argument("--warm-workers", action="store_true",
                    help="part 1 with a warm compute worker per SuperNode (Deployment(warm_workers=True))")
    ap.add_argument("--isolation", choices=("subprocess", "process"), default=None,
                    help="part 1: Deployment isolation (default subprocess; process with --superexec preforked)")
    ap.add_argument("--superexec", choices=("flower", "preforked"), default="flower",
                    help="part 1: the nodes' SuperExec (Deployment(superexec=...)); preforked = "
                         "client/preforked_superexec.py, ClientApps forked from a warm forkserver (implies "
                         "--isolation process)")
    ap.add_argument("--supernode", choices=("flower", "paced"), default="flower",
                    help="part 1: the SuperNodes (Deployment(supernode=...)); paced = client/paced_supernode.py, "
                         "pulling again 0.1 s after a reply instead of 3 s")
    ap.add_argument("--no-pipeline-evaluation", dest="pipeline_evaluation", action="store_false",
                    help="part 1: run config pipeline-evaluation=false (round r's server evaluation before round r+1's "
                         "messages are sent, instead of during round r+1)")
    ap.add_argument("--object-pull-retry", type=float, default=None,
                    help="part 1: first retry (s) of a message object still arriving, in the ServerApp (run config "
                         "object-pull-retry-s) and in the nodes' paced SuperNode / forked ClientApps (PGVI_OBJECT_PULL_RETRY_S; "
                         "Flower's own SuperNode and SuperExec keep 1 s); default: the project's 0.05 s; 1.0 = "
                         "Flower's")
    ap.add_argument("--sim-clients", type=int, default=1000)
    ap.add_argument("--sim-min-clients", type=int, default=1000)
    ap.add_argument("--sim-fraction", type=float, default=0.05)
    ap.add_argument("--sim-rounds", type=int, default=3)
    ap.add_argument("--sim-cgroup", action="store_true",
                    help="part 2: also run the tree in a child memory cgroup and print the kernel's peak charge "
                         "(scripts/memcgroup.py; needs write access to this process's memory cgroup)")
    ap.add_argument("--sim-memory-limit-mb", type=float, default=None, metavar="MB",
                    help="part 2: run the tree under this hard memory limit (a cgroup, no swap) and report "
                         "whether it completes; implies --sim-cgroup")
    ap.add_argument("--drop-caches", action="store_true",
                    help="part 2 with a cgroup: sync and drop the machine's page cache first (root), so that the "
                         "tree is charged for the libraries it loads")
    ap.add_argument("--sim-cpus-per-client", type=float, default=1.0,
                    help="Ray CPUs per ClientApp actor: 1 = one actor per core; 2 on this machine = one actor")
    ap.add_argument("--sim-lean-ray", action="store_true",
                    help="part 2: run on simulate.py's lean Ray head (--lean-ray; scripts/lean_ray.py), whose "
                         "processes are counted in the tree like those of the head Flower's ray.init starts")
    ap.add_argument("--client-venv", type=Path, default=Path("/tmp/pgvi-client-venv"))
    ap.add_argument("--fresh-client-venv", action="store_true", help="delete and re-create the client venv")
    ap.add_argument("--torch-cpu-spec", default="torch==2.13.0")
    ap.add_argument("--run-timeout", type=float, default=4 * 3600.0)
    args = ap.parse_args(argv)
    if args.latency_rounds < 2:
        ap.error("--latency-rounds must be at least 2 (round 1 is left out of the statistics)")
    if args.object_pull_retry is not None:
        try:
            check_initial_retry(args.object_pull_retry, "--object-pull-retry")
        except ValueError as err:
            ap.error(str(err))
    if args.superexec == "preforked" and args.isolation == "subprocess":
        ap.error("--superexec preforked needs --isolation process")
    if str(args.client_venv.resolve()).startswith(str(ROOT)):
        ap.error("--client-venv must be outside the repository")
    parts = [p for p in ("client_rss", "network", "simulation", "latency") if getattr(args, p)] or [
        "client_rss", "network", "simulation"]
    if args.sim_lean_ray and "simulation" not in parts:
        ap.error("--sim-lean-ray applies to part 2 (--simulation)")
    args.sim_cgroup = args.sim_cgroup or args.sim_memory_limit_mb is not None  # a limit implies the cgroup
    if args.sim_cgroup:
        if "simulation" not in parts:
            ap.error("--sim-cgroup / --sim-memory-limit-mb apply to part 2 (--simulation)")
        try:  # now, not after the parts before it: a bad limit or no usable cgroup is an error before any run
            MemoryCgroup("pgvi-probe", limit_mb=args.sim_memory_limit_mb).create().remove()
        except (ValueError, OSError, CgroupUnavailable) as err:
            ap.error(f"memory cgroup: {err}")
    elif args.drop_caches:
        ap.error("--drop-caches only applies with --sim-cgroup or --sim-memory-limit-mb")
    # `kill <pid>` (or `timeout`) unwinds like Ctrl-C, once: the parts' finally blocks stop the deployment or the
    # simulation's SuperLink and kill what is left of the tree (a second SIGTERM during that cleanup is ignored)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run_parts(args, parts)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_parts(args: argparse.Namespace, parts: list[str]) -> int:
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"bench_network: parts {parts}; {os.cpu_count()} cores; python {sys.version.split()[0]}; "
          f"workdir {args.workdir}", flush=True)
    print(f"uptime: {uptime_line()}", flush=True)
    out: dict[str, Any] = {"argv": sys.argv, "cores": os.cpu_count()}
    t0 = time.time()
    for part in parts:
        fn = {"network": bench_network, "simulation": bench_simulation, "client_rss": bench_client_rss,
              "latency": bench_latency}[part]
        out[part] = fn(args)
    out["seconds"] = time.time() - t0
    path = args.workdir / "bench_network.json"
    path.write_text(json.dumps(out, indent=2, default=str))
    print(f"\nall parts done in {out['seconds']:.0f}s; JSON: {path}")
    print("targets: " + json.dumps({p: out[p].get("targets") for p in parts}, default=str))
    return 0 if all(out[p].get("ok", True) for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
