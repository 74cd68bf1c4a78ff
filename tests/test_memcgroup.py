"""scripts/memcgroup.py: the kernel's charge of a process tree, and a hard limit (skipped without a writable
memory cgroup, e.g. not root)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scripts.memcgroup import CgroupUnavailable, MemoryCgroup

# touches every page of N MB of anonymous memory, then exits 0
ALLOCATE = "import sys; b = bytearray(int(sys.argv[1]) * 1024 * 1024); b[::4096] = b'x' * len(b[::4096])"


def _cgroup(limit_mb: float | None = None) -> MemoryCgroup:
    try:
        return MemoryCgroup("pgvi-test", limit_mb=limit_mb).create()
    except CgroupUnavailable as err:
        pytest.skip(f"no writable memory cgroup: {err}")


def _run(cg: MemoryCgroup, mb: int) -> int:
    """A child that joins ``cg`` before it starts Python (this process stays outside: under a limit the OOM
    killer would otherwise be free to pick the test runner)."""
    return subprocess.run([sys.executable, "-c", ALLOCATE, str(mb)], preexec_fn=cg.join, check=False).returncode


def test_peak_counts_a_childs_memory() -> None:
    cg = _cgroup()
    try:
        assert _run(cg, 96) == 0
        rep = cg.read()
    finally:
        assert cg.remove()
    assert rep.limit_mb is None and rep.oom_kills == 0 and not rep.reached_limit
    assert 96 <= rep.peak_mb < 96 + 200  # the child's 96 MB plus an interpreter
    assert not cg.path.exists()


def test_this_process_joins_and_returns_to_its_cgroup() -> None:
    before = open("/proc/self/cgroup").read()
    try:
        with MemoryCgroup("pgvi-test") as cg:
            assert open("/proc/self/cgroup").read() != before
            assert _run(cg, 32) == 0
    except CgroupUnavailable as err:
        pytest.skip(f"no writable memory cgroup: {err}")
    assert open("/proc/self/cgroup").read() == before
    assert cg.remove()
    assert cg.report().peak_mb >= 32


def test_a_child_over_the_limit_is_killed_and_counted() -> None:
    cg = _cgroup(limit_mb=64)
    try:
        rc_small = _run(cg, 8)
        rc_big = _run(cg, 256)
        rep = cg.read()
    finally:
        assert cg.remove()
    assert rc_small == 0
    assert rc_big != 0  # the OOM killer's SIGKILL (no swap to escape to)
    assert rep.oom_kills >= 1 and rep.reached_limit
    assert rep.peak_mb <= 64 + 1


def test_a_bad_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="limit_mb"):
        MemoryCgroup("pgvi-test", limit_mb=0)
