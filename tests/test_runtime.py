"""common.runtime: thread count, argument checks, and the allocator setting that stops per-step page faults."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.runtime import configure_compute

ROOT = Path(__file__).resolve().parent.parent


def test_configure_compute_sets_threads_and_checks_its_argument() -> None:
    before = torch.get_num_threads()
    try:
        configure_compute(2)
        assert torch.get_num_threads() == 2
        configure_compute(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    for bad in (0, -1, 1.5, True, "2", None):
        with pytest.raises(ValueError, match="threads"):
            configure_compute(bad)  # type: ignore[arg-type]


_FAULTS = """
import resource, sys, torch
torch.set_num_threads(1)
def faults():
    # the allocation pattern of a BNN step: several 2 MB activations alive at once, all freed at its end
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):
        eps = torch.randn(10, 256, 200)
        a = eps * 2.0
        h = torch.relu(a)
        h2 = h * h
        g = h2 + a
        del eps, a, h, h2, g
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
if sys.argv[1] == "tuned":
    from common.runtime import tune_allocator
    assert tune_allocator()
else:
    # glibc's initial mmap threshold (128 KiB), pinned: every 2 MB block is mmap-ed and unmapped again. Left
    # dynamic, glibc raises the threshold after the first frees and then trims the heap top or not depending on
    # the address-space layout (40 steps gave 0, 19,360 and 98,720 faults in three runs on this machine).
    import ctypes
    assert ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024) == 1
faults()  # warm-up: the first allocations fault in any case
print(faults())
"""


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="glibc only")
def test_tuned_allocator_stops_the_page_faults_of_repeated_steps() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = {}
    for mode in ("mmap", "tuned"):
        res = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, env=env,
                             timeout=300)
        assert res.returncode == 0, res.stderr
        out[mode] = [int(v) for v in res.stdout.split()]
    mmap_faults = out["mmap"][0]
    tuned_faults = out["tuned"][0]
    # mmap-ed blocks: every step faults its activations in again (~2,500 pages a step); tuned: the same heap
    # pages are reused
    assert mmap_faults > 40 * 2000, out
    assert tuned_faults < 1000, out
