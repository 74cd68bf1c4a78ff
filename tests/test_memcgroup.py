"""scripts/memcgroup.py: the kernel's charge of a process tree, and a hard limit.

Skipped only where no child memory cgroup can be made at all (not root, v2 without delegation); any failure
after that (configuring the limit, joining, reading) fails the test."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator

import pytest

from scripts.memcgroup import CgroupUnavailable, MemoryCgroup

# touches every page of N MB of anonymous memory, then exits 0
ALLOCATE = "import sys; b = bytearray(int(sys.argv[1]) * 1024 * 1024); b[::4096] = b'x' * len(b[::4096])"


@pytest.fixture
def make_cgroup() -> Iterator:
    made: list[MemoryCgroup] = []

    def make(limit_mb: float | None = None) -> MemoryCgroup:
        try:
            cg = MemoryCgroup("pgvi-test", limit_mb=limit_mb)
            cg.create()
        except CgroupUnavailable as err:
            pytest.skip(f"no child memory cgroup here: {err}")
        made.append(cg)
        return cg

    yield make
    for cg in made:  # also after a failed assertion; never masks it
        cg.kill()
        cg.remove()


def _run(cg: MemoryCgroup, mb: int) -> int:
    """A child that joins ``cg`` before it starts Python (this process stays outside the limit)."""
    return subprocess.run([sys.executable, "-c", ALLOCATE, str(mb)], preexec_fn=cg.join, check=False).returncode


def test_peak_counts_a_childs_memory(make_cgroup) -> None:
    cg = make_cgroup()
    assert _run(cg, 96) == 0
    rep = cg.read()
    assert rep.limit_mb is None and rep.oom_kills == 0 and not rep.reached_limit
    assert 96 <= rep.peak_mb < 96 + 200  # the child's 96 MB plus an interpreter
    assert cg.pids() == []
    assert cg.remove() and not cg.path.exists()


def test_this_process_joins_and_returns_to_its_cgroup(make_cgroup) -> None:
    before = open("/proc/self/cgroup").read()
    probe = make_cgroup()  # skips here if no cgroup can be made; the with-block's own one is cleaned up below
    probe.remove()
    cg = MemoryCgroup("pgvi-test")
    try:
        with cg:
            assert open("/proc/self/cgroup").read() != before
            assert _run(cg, 32) == 0
        assert open("/proc/self/cgroup").read() == before
        assert cg.report().peak_mb >= 32
    finally:
        cg.remove()
    assert not cg.path.exists()


def test_a_child_over_the_limit_is_killed_and_counted(make_cgroup) -> None:
    cg = make_cgroup(limit_mb=64)
    assert _run(cg, 8) == 0
    assert _run(cg, 256) != 0  # the OOM killer's SIGKILL (swap is limited with the memory, or there is none)
    rep = cg.read()
    assert rep.no_swap and rep.oom_kills >= 1 and rep.reached_limit
    assert rep.peak_mb <= 64 + 1


def test_kill_stops_what_is_left_in_the_cgroup(make_cgroup) -> None:
    cg = make_cgroup()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=cg.join)
    try:
        assert cg.pids() == [child.pid]
        assert cg.kill() == 1
        assert child.wait(timeout=10) == -9
        assert cg.remove()
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("limit", [0, -1, math.nan, math.inf])
def test_a_bad_limit_is_refused(limit: float) -> None:
    with pytest.raises(ValueError, match="limit_mb"):
        MemoryCgroup("pgvi-test", limit_mb=limit)
