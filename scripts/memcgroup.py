"""A child memory cgroup for measuring (and optionally limiting) the memory a process tree is charged.

The kernel charges a cgroup for the anonymous memory of its processes and for every page-cache page they
bring in first (shared libraries, files read or written, tmpfs such as ``/dev/shm``), each page once however
many processes map it.  That is what a container's memory limit (``docker run --memory``) enforces, so it
answers "does this run fit in N MB" where a sum of RSS counts every shared library page once per process.

Pages already in the page cache stay charged to whoever brought them in; :func:`drop_page_cache` empties the
cache first so that the tree is charged for the libraries it loads, as a fresh container would be.

cgroup v1's memory controller (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes``,
``memory.max_usage_in_bytes``, ``memory.oom_control``) and v2 (``memory.max``, ``memory.swap.max``,
``memory.peak``, ``memory.events``).  On v2 the child only gets a memory controller if this process's cgroup
delegates it (``cgroup.subtree_control``), which the kernel allows for a cgroup holding processes only at the
root, so under systemd or in most containers v2 gives :class:`CgroupUnavailable`; this was written and tested
on v1 (Linux 6.18).  There, after a child was OOM-killed at the limit, ``memory.failcnt`` and
``memory.memsw.failcnt`` both read 0, so whether the limit was reached is read off the peak.

Use, keeping this process outside (under a limit the OOM killer chooses among the cgroup's processes by
``oom_score``, i.e. resident memory and ``oom_score_adj``: Ray sets 1000 on its workers)::

    cg = MemoryCgroup("pgvi-sim", limit_mb=2048).create()
    try:
        subprocess.run(..., preexec_fn=cg.join)   # the child joins before it execs; its children inherit it
        report = cg.read()                        # peak, whether it reached the limit, OOM kills
    finally:
        cg.kill()                                 # whatever is left of the tree
        cg.remove()

or ``with MemoryCgroup(...) as cg:`` to move this process in (and back out at the end).
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MB = 1024 * 1024


class CgroupUnavailable(RuntimeError):
    """This process has no memory cgroup under which it may create a child with a memory controller."""


@dataclass
class CgroupReport:
    version: int
    path: str
    limit_mb: float | None
    peak_mb: float
    oom_kills: int
    #: the tree could not swap: swap limited with the memory (v1 ``memsw``, v2 ``swap.max``) or no swap at all
    no_swap: bool
    #: v1 only: the peak of memory + swap (``memory.memsw.max_usage_in_bytes``), when swap accounting is on
    peak_with_swap_mb: float | None = None

    @property
    def reached_limit(self) -> bool:
        """The peak came to within 1 MB of the limit (the kernel had to reclaim, or it killed)."""
        return self.limit_mb is not None and self.peak_mb >= self.limit_mb - 1


def _own_cgroup() -> tuple[int, Path]:
    """(version, directory) of this process's memory cgroup."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError as err:
        raise CgroupUnavailable(f"cannot read /proc/self/cgroup: {err}") from None
    for line in lines:  # v1: "4:memory:/path"
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return 1, CGROUP_ROOT / "memory" / path.lstrip("/")
    for line in lines:  # v2: "0::/path", with the memory controller available there
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            base = CGROUP_ROOT if (CGROUP_ROOT / "cgroup.controllers").exists() else CGROUP_ROOT / "unified"
            d = base / path.lstrip("/")
            try:
                if "memory" in (d / "cgroup.controllers").read_text().split():
                    return 2, d
            except OSError:
                break
    raise CgroupUnavailable("no memory controller in /proc/self/cgroup")


def _machine_has_swap() -> bool:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("SwapTotal:"):
                return int(line.split()[1]) > 0
    except (OSError, ValueError, IndexError):
        pass
    return True  # unknown: assume it has


def drop_page_cache() -> None:
    """``sync`` then drop the clean page cache, dentries and inodes (root only; whole machine)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as err:
        raise CgroupUnavailable(f"cannot drop the page cache: {err}") from None


class MemoryCgroup:
    """A child of this process's memory cgroup, with an optional hard limit, without swap where the kernel lets
    the cgroup forbid it.

    :meth:`create` makes it (:class:`CgroupUnavailable` if it cannot be made at all, e.g. not root; any other
    failure while configuring it is an ``OSError``), :meth:`join` moves the calling process in (use it as a
    ``subprocess`` ``preexec_fn``), :meth:`read` reads the counters, :meth:`kill` SIGKILLs its processes,
    :meth:`remove` deletes it once empty.  As a context manager it creates the cgroup and moves this process in,
    and on leaving moves it back and reads the counters (this process's own charges while inside count too).
    """

    def __init__(self, name: str, limit_mb: float | None = None) -> None:
        if limit_mb is not None and not (isinstance(limit_mb, (int, float)) and math.isfinite(limit_mb)
                                         and limit_mb > 0):
            raise ValueError(f"limit_mb must be a finite number > 0, got {limit_mb!r}")
        self.version, self.parent = _own_cgroup()
        self.path = self.parent / f"{name}-{secrets.token_hex(4)}"
        self.limit_mb = limit_mb
        self.no_swap = not _machine_has_swap()
        self._report: CgroupReport | None = None

    # ------------------------------------------------------------------------------------------ files
    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def _read_int(self, name: str) -> int | None:
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _events(self) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in (ln.split() for ln in (self.path / "memory.events").read_text().splitlines())}
        except OSError:
            return {}

    # ------------------------------------------------------------------------------------------ life
    def create(self) -> MemoryCgroup:
        """Make and configure the cgroup without joining it (see :meth:`join`)."""
        try:
            self.path.mkdir()
        except OSError as err:
            raise CgroupUnavailable(f"cannot create {self.path}: {err}") from None
        needed = ("memory.usage_in_bytes", "memory.max_usage_in_bytes") if self.version == 1 else (
            "memory.current", "memory.peak")
        missing = [f for f in needed if not (self.path / f).exists()]
        if missing:  # v2: memory not delegated by the parent's cgroup.subtree_control, or a kernel before 5.19
            self.remove()
            raise CgroupUnavailable(f"{self.path} has no {', '.join(missing)} (the memory controller is not "
                                    "delegated to it, or the kernel is too old)")
        try:
            if self.version == 1:
                if self.limit_mb is not None:  # memory first: on a fresh cgroup both start unlimited (mem <= memsw)
                    limit = str(int(self.limit_mb * MB))
                    self._write("memory.limit_in_bytes", limit)
                    if (self.path / "memory.memsw.limit_in_bytes").exists():
                        self._write("memory.memsw.limit_in_bytes", limit)
                        self.no_swap = True
            else:
                if self.limit_mb is not None:
                    self._write("memory.max", str(int(self.limit_mb * MB)))
                if (self.path / "memory.swap.max").exists():
                    self._write("memory.swap.max", "0")
                    self.no_swap = True
        except OSError:
            self.remove()
            raise
        return self

    def join(self) -> None:
        """Move the calling process into the cgroup (also usable as a ``subprocess`` ``preexec_fn``)."""
        self._write("cgroup.procs", str(os.getpid()))

    def __enter__(self) -> MemoryCgroup:
        self.create()
        try:
            self.join()
        except OSError:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            (self.parent / "cgroup.procs").write_text(str(os.getpid()))
        finally:
            self.read()

    def read(self) -> CgroupReport:
        """Read the counters now (also kept for :meth:`report`)."""
        if self.version == 1:
            peak = self._read_int("memory.max_usage_in_bytes") or 0
            memsw = self._read_int("memory.memsw.max_usage_in_bytes")
            oom = 0
            try:
                for ln in (self.path / "memory.oom_control").read_text().splitlines():
                    if ln.startswith("oom_kill "):
                        oom = int(ln.split()[1])
            except OSError:
                pass
            self._report = CgroupReport(1, str(self.path), self.limit_mb, peak / MB, oom, self.no_swap,
                                        None if memsw is None else memsw / MB)
        else:
            self._report = CgroupReport(2, str(self.path), self.limit_mb, (self._read_int("memory.peak") or 0) / MB,
                                        self._events().get("oom_kill", 0), self.no_swap)
        return self._report

    def report(self) -> CgroupReport:
        if self._report is None:
            raise RuntimeError("the cgroup's counters are read by read() (or on leaving the with-block)")
        return self._report

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def kill(self) -> int:
        """SIGKILL every process still in the cgroup (never this one); how many were signalled."""
        n = 0
        for pid in self.pids():
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                    n += 1
                except ProcessLookupError:
                    pass
        return n

    def remove(self, wait_s: float = 10.0) -> bool:
        """Delete the cgroup once its last process has gone (True), or give up after ``wait_s`` (False)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.2)
