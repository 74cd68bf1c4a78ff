"""Per-process compute settings for the torch work of a client, a worker or a benchmark.

:func:`configure_compute` sets torch's intra-op thread count and, on glibc, keeps freed heap memory in the
process instead of returning it to the kernel after every minibatch step.

Why the allocator: a BNN step allocates and frees a dozen tensors of a few MB (the ``S x B x H``
activations: 2 MB each for 10 x 256 x 200 floats).  glibc's malloc serves such blocks by ``mmap`` until its
dynamic threshold rises, and it returns free memory at the top of the heap to the kernel once it exceeds
``M_TRIM_THRESHOLD`` (twice the mmap threshold, a few MB).  Every step then touches fresh pages: about 1,500
minor page faults per step (86,000 to 130,000 per epoch of 79 steps), each a kernel trap plus zeroing 4 KB.
With the thresholds fixed at 32 MiB (mmap) and 256 MiB (trim) the steps reuse the same heap pages: 0 to 700
faults per epoch, and one epoch of ``scripts/bench_core.py``'s workload takes 0.91 CPU-s instead of 1.09 to
1.14 (one thread, same peak RSS 0.78 GB).  The cost: up to 256 MiB of freed memory may stay resident after
a large step (the peak RSS, which is what the edge-device budget counts, does not change).

Both settings are idempotent and cheap; the allocator change is made once per process and is a no-op where
``mallopt`` is missing (macOS, Windows) or ignored (musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

import torch

_LOG = logging.getLogger(__name__)

#: glibc ``mallopt`` parameters (``<malloc.h>``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20

_lock = threading.Lock()
_allocator_state: bool | None = None  # None: not tried yet; True: tuned; False: not available


def tune_allocator() -> bool:
    """Fix glibc's mmap and trim thresholds (see the module docstring); ``True`` if they were set.

    Called once per process by :func:`configure_compute`; later calls return the first call's outcome.
    """
    global _allocator_state
    with _lock:
        if _allocator_state is None:
            _allocator_state = _mallopt_thresholds()
        return _allocator_state


def _mallopt_thresholds() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        _LOG.debug("mallopt not available: keeping the allocator's defaults")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        _LOG.debug("mallopt refused the thresholds: keeping the allocator's defaults")
    return ok


def configure_compute(threads: int) -> None:
    """Run torch with ``threads`` intra-op threads and tune the allocator (once per process)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    tune_allocator()


__all__ = ["MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "configure_compute", "tune_allocator"]
