"""Per-process compute settings for the torch work of a client, a worker or a benchmark.

:func:`configure_compute` sets torch's intra-op thread count, flushes subnormal floats to zero, and, on glibc,
keeps freed heap memory in the process instead of returning it to the kernel after every minibatch step;
:func:`configure_threads` and :func:`subnormals_flushed` do the same for code that runs in a process it does not own.

Why the allocator: a BNN step allocates and frees a dozen tensors of a few MB (the ``S x B x H``
activations: 2 MB each for 10 x 256 x 200 floats).  glibc's malloc serves such blocks by ``mmap`` until its
dynamic threshold rises, and it returns free memory at the top of the heap to the kernel once it exceeds
``M_TRIM_THRESHOLD`` (twice the mmap threshold, a few MB).  Every step then touches fresh pages: about 1,500
minor page faults per step (86,000 to 130,000 per epoch of 79 steps), each a kernel trap plus zeroing 4 KB.
With the thresholds fixed at 32 MiB (mmap) and 256 MiB (trim) the steps reuse the same heap pages: 0 to 700
faults per epoch, and one epoch of ``scripts/bench_core.py``'s workload takes 0.91 CPU-s instead of 1.09 to
1.14 (one thread, same peak RSS 0.78 GB).  The cost: up to 256 MiB of freed memory may stay resident after
a large step (the peak RSS, which is what the edge-device budget counts, does not change).

Why flush subnormals to zero: as a BNN's predictions sharpen over the rounds, more of its softmax
probabilities, and the gradients that carry them, fall below float32's smallest normal number (1.2e-38).  On
x86 every arithmetic operation that takes or makes such a *subnormal* number can cost a microcode assist of a
hundred cycles or more.  In a 10-client Fashion-MNIST run of the 784-200-10 BNN (10 local epochs, one thread,
``docs/bench_network.md`` section 1o) a client's local update took 1.40, 1.60, 2.00, 2.26 and 2.44 s on average
in rounds 1-5 with IEEE gradual underflow, and 1.27-1.30 s in every round with flush-to-zero (FTZ) and
denormals-are-zero (DAZ) on; the final posteriors were bit for bit the same.  :func:`configure_compute` and
:func:`subnormals_flushed` therefore turn both on (``torch.set_flush_denormal``) unless
``PGVI_FLUSH_DENORMALS=0``.  What that changes: a float32 result below 1.2e-38 (float64: 2.2e-308) becomes 0, and
such an input counts as 0.  The core computes log-probabilities in log space (``log_softmax``,
``logsumexp``), so no loss, divergence or metric turns into ``-inf`` because a probability underflowed.

The mode is a property of each CPU thread (x86 ``MXCSR``; on arm64 torch sets the FPCR's flush-to-zero bit,
which has the same effect, though the x86 slowdown above need not apply there).  ``torch.set_flush_denormal``
sets it for the calling thread only, and a thread inherits it from the thread that creates it.  torch's intra-op
threads are started at the first parallel operation (and more when the thread count grows), not by
``torch.set_num_threads``, so :func:`configure_compute` sets the mode first; where the pool was started earlier,
its threads keep their old mode: :func:`configure_compute` checks them once per thread count (with more than one
thread) and logs one warning.  The compiled kernels (``common/native.py``) do not depend on the pool's mode: each
of their threads, OpenMP or Python, runs in the calling thread's.
:func:`configure_compute` is for processes that are ours (a warm worker, a benchmark, a script's ``main``).  A client
update can also run in someone else's process (an in-process Grid, a test, a library user's program): there
:func:`configure_threads` sets the threads and :func:`subnormals_flushed` turns the mode on for the update only,
in the calling thread and in torch's intra-op threads, and gives them the caller's mode back after.

The settings are idempotent and cheap; the allocator change is made once per process and is a no-op where
``mallopt`` is missing (macOS, Windows) or ignored (musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from common import native as _native  # at import, for its fork hook (see _sync_pool)
from common.environment import env_flag

_LOG = logging.getLogger(__name__)

#: glibc ``mallopt`` parameters (``<malloc.h>``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20

#: Set to 0 (or false/no/off) to keep IEEE gradual underflow in the compute processes (default: flush).
ENV_FLUSH_DENORMALS = "PGVI_FLUSH_DENORMALS"
#: float32 numbers whose product (1e-40) is subnormal: the probe of :func:`flush_denormals_active`.
_PROBE_A, _PROBE_B = 1e-30, 1e-10
#: elements of the pool probe: several of ATen's 32,768-element grains per thread, so every thread takes part
_POOL_PROBE_PER_THREAD = 1 << 17

_lock = threading.Lock()
_allocator_state: bool | None = None  # None: not tried yet; True: tuned; False: not available
_pool_checked: set[int] = set()  # thread counts whose pool was probed (once each per process)
_flush_unsupported = False  # set once torch.set_flush_denormal has had no effect


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


def flush_denormals_from_environment() -> bool:
    """``$PGVI_FLUSH_DENORMALS`` as a switch (default on); a value other than 0/1 (false/true, ...) raises."""
    return env_flag(ENV_FLUSH_DENORMALS, True)


def flush_denormals_active() -> bool:
    """Whether this thread flushes subnormal float results to zero (a float32 product of 1e-40 comes out 0)."""
    a = torch.tensor(_PROBE_A, dtype=torch.float32)
    return bool((a * _PROBE_B).item() == 0.0)


def set_flush_denormals(on: bool) -> bool:
    """Turn flush-to-zero and denormals-are-zero on or off for this thread (and the threads it starts later);
    ``True`` if the thread is now in the asked mode.  ``False`` where torch cannot set the mode on this CPU (x86
    without DAZ, and architectures other than x86 and arm); it is then not tried again, and logged once."""
    global _flush_unsupported
    if not isinstance(on, bool):
        raise ValueError(f"on must be a bool, got {on!r}")
    if not _flush_unsupported:
        torch.set_flush_denormal(on)
    if flush_denormals_active() == on:
        return True
    if not _flush_unsupported:
        _flush_unsupported = True
        _LOG.info("torch cannot switch flush-to-zero on this CPU: subnormal numbers keep IEEE gradual underflow")
    return False


def _pool_threads_keeping_subnormals(threads: int) -> int:
    """How many results of one parallel multiplication stayed subnormal (0 when every intra-op thread flushes)."""
    x = torch.full((threads * _POOL_PROBE_PER_THREAD,), _PROBE_A, dtype=torch.float32)
    return int(torch.count_nonzero(x * _PROBE_B))


def _check_threads(threads: object) -> None:
    from common.config import MAX_TORCH_THREADS

    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_TORCH_THREADS:
        raise ValueError(f"threads must be an integer in [1, {MAX_TORCH_THREADS}], got {threads!r}")


def configure_threads(threads: int) -> None:
    """Run torch with ``threads`` intra-op threads and tune the allocator (once per process); the floating-point
    mode is left as it is (code that runs in a process it does not own pairs this with :func:`subnormals_flushed`)."""
    _check_threads(threads)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    tune_allocator()


def configure_compute(threads: int, *, flush_denormals: bool | None = None) -> None:
    """For a process that is ours (a warm worker, a benchmark, a script): flush subnormals to zero from now
    on in this thread and the intra-op threads it starts, then :func:`configure_threads`.  ``flush_denormals=None``
    reads :data:`ENV_FLUSH_DENORMALS` (default on); see the module docstring."""
    _check_threads(threads)  # before the mode changes
    flush = _flush_setting(flush_denormals)
    if flush_denormals_active() != flush:
        set_flush_denormals(flush)
    configure_threads(threads)  # after the mode: the threads torch starts from here on inherit it
    if flush and threads > 1 and flush_denormals_active():
        _warn_if_pool_keeps_subnormals(threads)


@contextmanager
def subnormals_flushed(flush_denormals: bool | None = None) -> Iterator[bool]:
    """The mode of :func:`configure_compute` on this thread and its intra-op threads for the ``with`` block only,
    then the caller's mode again: for a client update that runs inside a process it does not own (an in-process
    Grid, a simulation actor, a library user's program).  Yields whether subnormals are flushed inside the block
    (in the calling thread).

    The mode is per thread and torch's intra-op threads keep the one they were created with (module docstring):
    a pool started before the block would compute its share of a parallel operation unflushed inside it, and one
    started inside the block would keep flushing after it, in the caller's later work.  So on the way in, with
    more than one intra-op thread, every pool thread takes the block's mode, and on the way out, where the block
    switched the mode, every one takes the caller's again (:func:`common.native.sync_pool_fp_mode`, one parallel
    region of ``max(threads on entry, threads on exit)``; libgomp then ends any pool thread beyond those).  What
    remains: a thread count raised and set back to 1 inside the block (no region is run with one thread, so a
    pool thread made inside may keep the block's mode), a forked child (see
    :meth:`common.native.NativeLibrary.parallel_in_openmp`), and builds without the compiled helper
    (``PGVI_FUSED_KERNELS=0``, no C compiler, torch not on GNU OpenMP), where pool threads keep their own mode.
    The compiled kernels do not depend on any of this: each of their threads runs in the caller's mode
    (:data:`common.native.PRELUDE`)."""
    flush = _flush_setting(flush_denormals)
    before = flush_denormals_active()
    threads_in = torch.get_num_threads()
    if before != flush:
        set_flush_denormals(flush)
    inside = flush_denormals_active()
    if threads_in > 1:
        _sync_pool(threads_in)
    try:
        yield inside
    finally:
        now = flush_denormals_active()
        if now != before:
            set_flush_denormals(before)
        if inside != before or now != before:  # the pool may hold threads in another mode than the caller's now
            _sync_pool(max(threads_in, torch.get_num_threads()))


def _sync_pool(threads: int) -> bool:
    """:func:`common.native.sync_pool_fp_mode` with more than one thread (its helper is built on first use).

    Skipped in a child forked after the parent's pool existed (a parallel region there hangs in libgomp): the
    fork hook that tells is :mod:`common.native`'s, which this module imports so that it is registered in every
    process that uses this one before it forks."""
    if threads < 2:
        return False
    return _native.sync_pool_fp_mode(threads)


def _flush_setting(flush_denormals: bool | None) -> bool:
    flush = flush_denormals_from_environment() if flush_denormals is None else flush_denormals
    if not isinstance(flush, bool):
        raise ValueError(f"flush_denormals must be a bool or None, got {flush_denormals!r}")
    return flush


def _warn_if_pool_keeps_subnormals(threads: int) -> None:
    with _lock:
        if threads in _pool_checked:
            return
        _pool_checked.add(threads)
    kept = _pool_threads_keeping_subnormals(threads)
    if kept:
        _LOG.warning(
            "flush-to-zero is on in this thread but not in all of torch's %d intra-op threads (%d probe results "
            "stayed subnormal): the pool was started before configure_compute; subnormal numbers may slow the "
            "local updates (common/runtime.py)", threads, kept)


__all__ = [
    "ENV_FLUSH_DENORMALS",
    "MMAP_THRESHOLD_BYTES",
    "TRIM_THRESHOLD_BYTES",
    "configure_compute",
    "configure_threads",
    "flush_denormals_active",
    "flush_denormals_from_environment",
    "set_flush_denormals",
    "subnormals_flushed",
    "tune_allocator",
]
