"""A child memory cgroup for measuring (and optionally limiting) the memory a process tree is charged.

The kernel charges a cgroup for the anonymous memory of its processes and for every page-cache page they
bring in first (shared libraries, files read or written, tmpfs such as ``/dev/shm``), each page once however
many processes map it.  That is what a container's memory limit (``docker run --memory``) enforces, so it
answers "does this run fit in N MB" where a sum of RSS counts every shared library page once per process.

Pages already in the page cache stay charged to whoever brought them in; :func:`drop_page_cache` empties the
cache first so that the tree is charged for the libraries it loads, as a fresh container would be.

Both cgroup versions are handled: v2 (``memory.max``, ``memory.peak``, ``memory.events``) and v1's memory
controller (``memory.limit_in_bytes``, ``memory.max_usage_in_bytes``, ``memory.oom_control``).  Whether the
limit was reached is read off the peak: v1's ``memory.failcnt`` stayed 0 here (Linux 6.18) while a child was
OOM-killed at the limit.  Needs write
access to this process's memory cgroup (root here); :class:`CgroupUnavailable` says why not otherwise.

Use::

    with MemoryCgroup("pgvi-sim", limit_mb=2048) as cg:   # this process joins; children it starts inherit it
        subprocess.run(...)
    cg.report()   # peak, whether it reached the limit, OOM kills
    cg.remove()

or, keeping this process outside (under a limit, the OOM killer picks by RSS among the cgroup's processes,
whatever was charged where)::

    cg = MemoryCgroup("x", limit_mb=64).create()
    subprocess.run(..., preexec_fn=cg.join)
    cg.read(); cg.remove()
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MB = 1024 * 1024


class CgroupUnavailable(RuntimeError):
    """No writable memory cgroup for this process."""


@dataclass
class CgroupReport:
    version: int
    path: str
    limit_mb: float | None
    peak_mb: float
    oom_kills: int
    #: v1 only: the peak of memory + swap (``memory.memsw.max_usage_in_bytes``), when swap accounting is on
    peak_with_swap_mb: float | None = None

    @property
    def reached_limit(self) -> bool:
        """The peak came to within 1 MB of the limit: the kernel had to reclaim (page cache first) or kill."""
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


def drop_page_cache() -> None:
    """``sync`` then drop the clean page cache, dentries and inodes (root only; whole machine)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as err:
        raise CgroupUnavailable(f"cannot drop the page cache: {err}") from None


class MemoryCgroup:
    """A child of this process's memory cgroup, with an optional hard limit and no swap.

    Entering moves this process into it (the processes it starts from then on are born in it); leaving moves
    it back and reads the counters; :meth:`remove` deletes the cgroup (it must be empty: stop the tree first).
    Charges this process makes while inside are counted too (a few MB for a benchmark's sampler).
    """

    def __init__(self, name: str, limit_mb: float | None = None) -> None:
        if limit_mb is not None and not limit_mb > 0:
            raise ValueError(f"limit_mb must be > 0, got {limit_mb!r}")
        self.version, self.parent = _own_cgroup()
        self.path = self.parent / f"{name}-{secrets.token_hex(4)}"
        self.limit_mb = limit_mb
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
        counter = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        if not (self.path / counter).exists():  # v2: memory not in the parent's cgroup.subtree_control
            self.remove()
            raise CgroupUnavailable(f"{self.path} has no memory controller ({counter} missing)")
        try:
            if self.version == 1:
                if self.limit_mb is not None:
                    limit = str(int(self.limit_mb * MB))
                    self._write("memory.limit_in_bytes", limit)
                    if (self.path / "memory.memsw.limit_in_bytes").exists():  # no swapping around the limit
                        self._write("memory.memsw.limit_in_bytes", limit)
            else:
                if self.limit_mb is not None:
                    self._write("memory.max", str(int(self.limit_mb * MB)))
                if (self.path / "memory.swap.max").exists():
                    self._write("memory.swap.max", "0")
        except OSError as err:
            self.remove()
            raise CgroupUnavailable(f"cannot configure {self.path}: {err}") from None
        return self

    def join(self) -> None:
        """Move the calling process into the cgroup (also usable as a ``subprocess`` ``preexec_fn``)."""
        self._write("cgroup.procs", str(os.getpid()))

    def __enter__(self) -> MemoryCgroup:
        self.create()
        try:
            self.join()
        except OSError as err:
            self.remove()
            raise CgroupUnavailable(f"cannot join {self.path}: {err}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        (self.parent / "cgroup.procs").write_text(str(os.getpid()))
        self.read()

    def read(self) -> CgroupReport:
        """Read the counters now (also kept for :meth:`report`)."""
        self._report = self._read_report()
        return self._report

    def _read_report(self) -> CgroupReport:
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
            return CgroupReport(1, str(self.path), self.limit_mb, peak / MB, oom, None if memsw is None else memsw / MB)
        ev = self._events()
        peak = self._read_int("memory.peak")
        if peak is None:
            raise CgroupUnavailable("this kernel has no memory.peak (cgroup v2 needs Linux >= 5.19)")
        return CgroupReport(2, str(self.path), self.limit_mb, peak / MB, ev.get("oom_kill", 0))

    def report(self) -> CgroupReport:
        if self._report is None:
            raise RuntimeError("the cgroup's counters are read when the with-block is left (or by read())")
        return self._report

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
