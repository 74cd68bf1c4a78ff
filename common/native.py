"""Small C kernels compiled on first use and loaded with :mod:`ctypes` (no build step at install time).

A :class:`NativeLibrary` holds one C source and the signatures of its functions.  :meth:`NativeLibrary.get`
compiles it once per process with the system C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``) and
``-O3 -march=native -fno-math-errno -fno-trapping-math -fopenmp-simd`` (``-march`` from ``$PGVI_KERNEL_MARCH``
where set) into a per-user cache: ``$PGVI_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/pgvi-kernels``, else ``~/.cache/pgvi-kernels``.  The file name carries a hash of the source,
the flags, the compiler's version and the CPU's flags, so a changed source or another CPU model gets its own
build; concurrent builders each rename a complete file into place.  The cache must be a directory owned by
this user and writable by nobody else (a shared ``/tmp`` directory would let another user plant code).

Where there is no compiler, the build or the library's self-check fails, the cache is not private, or
``PGVI_FUSED_KERNELS=0`` is set, :meth:`~NativeLibrary.get` returns ``None`` (with one warning) and callers use
their torch path.

Threads.  Where torch's own intra-op threads are GNU OpenMP (``libgomp``, the Linux wheels), a library is built
with ``-fopenmp`` against that very runtime (``torch/lib/libgomp.so.1``, found among the process's mapped files),
so a kernel's ``#pragma omp parallel`` runs on the pool MKL's GEMMs and ATen already use: after a GEMM its
workers spin for a while, waiting for the next parallel region, and that region can now be ours.  With the
earlier Python thread pool (:func:`run_chunks`, still the fallback: another runtime, no ``libgomp``, or
``PGVI_KERNEL_OPENMP=0``) those spinning workers and the pool's threads competed for the cores: on 2 cores a local
epoch of the 784-200-10 BNN took 0.58-0.65 s instead of 0.44-0.45 s (docs/bench_core.md).  :func:`run_parallel`
picks the route; a kernel's result never depends on it (fixed blocks, fixed summation order).

Floating-point mode.  Flush-to-zero (:mod:`common.runtime`) is a property of each thread, and a pool thread has the
mode of the thread that created it: a kernel part run on a pool thread started before the caller switched the
mode (or inside a block that switched it) rounded subnormal numbers differently from the caller's part, so the
result depended on the thread count.  Every parallel driver therefore runs each of its parts in the calling
thread's mode (:data:`PRELUDE`'s ``pgvi_fp_mode``, ``pgvi_fp_enter``), and :func:`run_parallel` gives each Python
thread the caller's mode for its chunk.  :func:`sync_pool_fp_mode` sets the mode of torch's own pool the same
way (:func:`common.runtime.subnormals_flushed`).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from common.environment import env_flag

_LOG = logging.getLogger(__name__)

#: ``-fno-trapping-math`` lets GCC if-convert ``x < 0 ? 0 : x`` and the other float selects of the kernels into
#: vector blends; without it, on a CPU without AVX-512's masked compares (e.g. AVX2 only), those loops stayed
#: scalar (with the other AVX2 issues in docs/bench_core.md, 2026-11-24, a local epoch was 2-3x slower than
#: torch).  Values are unchanged (IEEE results, NaN and inf kept); only floating-point exception flags, which
#: nothing here reads, may differ.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd", "-fPIC", "-shared"]


def compile_flags() -> list[str]:
    """:data:`FLAGS` with ``-march=$PGVI_KERNEL_MARCH`` where that is set (e.g. ``x86-64-v3`` to build the AVX2
    code paths on an AVX-512 machine, as the tests do; or a fleet's lowest common CPU)."""
    march = os.environ.get("PGVI_KERNEL_MARCH", "").strip()
    return [f"-march={march}" if f.startswith("-march=") and march else f for f in FLAGS]

#: Prepended to every source: glibc's libmvec has vector variants of these functions on x86-64; declaring
#: them lets ``#pragma omp simd`` loops that call them vectorise (elsewhere the loops stay scalar).
PRELUDE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GLIBC__)
float logf(float) __attribute__((simd("notinbranch")));
float expf(float) __attribute__((simd("notinbranch")));
float sinf(float) __attribute__((simd("notinbranch")));
float cosf(float) __attribute__((simd("notinbranch")));
double log(double) __attribute__((simd("notinbranch")));
#endif
/* Part t of k of [lo, hi) in whole units of align (lo a multiple of align): [pgvi_split(t), pgvi_split(t + 1)),
   the split of common.native.run_chunks.  Parallel drivers loop over the parts under
   "omp parallel for num_threads(k)" (ignored, so serial, in a build without OpenMP). */
static inline int64_t pgvi_split(int64_t lo, int64_t hi, int64_t align, int64_t t, int64_t k) {
    int64_t units = (hi - lo + align - 1) / align, b = lo + (units * t / k) * align;
    return b < hi ? b : hi;
}
/* The floating-point mode of common/runtime.py (flush-to-zero and denormals-are-zero: x86 MXCSR bits 15 and 6,
   arm64 FPCR.FZ) is a property of each thread, and a pool thread has the mode of the thread that created it, not
   the caller's.  A parallel driver therefore reads the calling thread's mode before its region
   (pgvi_fp_mode) and each part runs in it (pgvi_fp_enter, then pgvi_fp_enter(previous)): a kernel's result does
   not depend on how many threads ran it, nor on the mode the pool's threads happen to have.  The asm statements
   clobber memory, so no load of the kernel's data moves across a mode switch. */
#if defined(__x86_64__) || defined(__i386__)
#define PGVI_FP_BITS 0x8040u
typedef uint32_t pgvi_fpreg;
static inline pgvi_fpreg pgvi_fp_read(void) {
    uint32_t c;
    __asm__ __volatile__("stmxcsr %0" : "=m"(c) : : "memory");
    return c;
}
static inline void pgvi_fp_write(pgvi_fpreg c) { __asm__ __volatile__("ldmxcsr %0" : : "m"(c) : "memory"); }
#elif defined(__aarch64__)
#define PGVI_FP_BITS (1u << 24)
typedef uint64_t pgvi_fpreg;
static inline pgvi_fpreg pgvi_fp_read(void) {
    uint64_t c;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(c) : : "memory");
    return c;
}
static inline void pgvi_fp_write(pgvi_fpreg c) { __asm__ __volatile__("msr fpcr, %0" : : "r"(c) : "memory"); }
#else
#define PGVI_FP_BITS 0u
typedef uint32_t pgvi_fpreg;
static inline pgvi_fpreg pgvi_fp_read(void) { return 0; }
static inline void pgvi_fp_write(pgvi_fpreg c) { (void)c; }
#endif
/* this thread's mode bits */
static inline uint32_t pgvi_fp_mode(void) { return (uint32_t)(pgvi_fp_read() & PGVI_FP_BITS); }
/* set this thread's mode bits to m (bits of another thread of this process: never one the CPU lacks); returns
   the previous ones */
static inline uint32_t pgvi_fp_enter(uint32_t m) {
    pgvi_fpreg c = pgvi_fp_read();
    uint32_t was = (uint32_t)(c & PGVI_FP_BITS);
    if (was != m) pgvi_fp_write((c & ~(pgvi_fpreg)PGVI_FP_BITS) | m);
    return was;
}
/* for Python (every library has them, PRELUDE_SIGNATURES): the calling thread's mode bits; set them to m and
   return the previous ones */
uint32_t pgvi_fp_get(void) { return pgvi_fp_mode(); }
uint32_t pgvi_fp_swap(uint32_t m) { return pgvi_fp_enter(m & PGVI_FP_BITS); }
"""

#: The signatures of :data:`PRELUDE`'s functions for Python, set on every library's handle.
PRELUDE_SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    "pgvi_fp_get": ([], ctypes.c_uint32),
    "pgvi_fp_swap": ([ctypes.c_uint32], ctypes.c_uint32),
}

#: ``pgvi_fp_sync_team(nt)``: every thread of the calling thread's OpenMP team of ``nt`` takes the calling thread's
#: mode; returns how many had another one (:func:`sync_pool_fp_mode`).
_FP_SOURCE = r"""
int pgvi_fp_sync_team(int nt) {
    uint32_t m = pgvi_fp_mode();
    int changed = 0;
    #pragma omp parallel num_threads(nt) reduction(+:changed)
    changed += pgvi_fp_enter(m) != m;
    return changed;
}
"""


def disabled_by_environment() -> bool:
    """``PGVI_FUSED_KERNELS=0`` (a switch: :func:`common.environment.env_flag`; a bad value is a ValueError)."""
    return not env_flag("PGVI_FUSED_KERNELS", True)


def openmp_disabled_by_environment() -> bool:
    """``PGVI_KERNEL_OPENMP=0``: the kernels' parallel loops on Python threads, not torch's OpenMP pool."""
    return not env_flag("PGVI_KERNEL_OPENMP", True)


def _compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    return None


def _private_dir(path: Path) -> bool:
    """``path`` exists (or was made), is a directory owned by this user and writable by nobody else."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not (st.st_mode & 0o022)


def cache_dir() -> Path:
    env = os.environ.get("PGVI_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pgvi-kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return platform.processor()


#: set in every child forked after this module was imported (see NativeLibrary.parallel_in_openmp)
_forked_child = False


def _mark_forked_child() -> None:
    global _forked_child
    _forked_child = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked_child)


def _choose_openmp_runtime(mapped: list[Path], torch_dir: Path) -> Path | None:
    """Of the ``libgomp`` files mapped into the process, the one torch runs on: the copy its wheel bundles (under
    ``torch/`` or the sibling ``torch.libs/``), else the only one mapped (a torch linked to the system's).  Other
    wheels bundle their own (scikit-learn's ``scikit_learn.libs/libgomp-<hash>.so``): with several mapped and
    none of them torch's, ``None``."""
    bundled = [p for p in mapped if torch_dir in p.parents or p.parent == torch_dir.parent / "torch.libs"]
    if bundled:
        return bundled[0]
    return mapped[0] if len(mapped) == 1 else None


@functools.cache
def _detected_openmp_runtime() -> Path | None:
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            mapped = dict.fromkeys(Path(path) for path in (line.split()[-1] for line in f if line.strip())
                                   if re.search(r"/libgomp[^/]*\.so[^/]*$", path))
    except OSError:
        return None
    return _choose_openmp_runtime([p for p in mapped if p.is_file()], Path(torch.__file__).resolve().parent)


def openmp_runtime() -> Path | None:
    """The GNU OpenMP runtime (``libgomp``) that torch's intra-op threads run on, as the path of the file mapped
    into this process, or ``None``: ATen's parallel backend is not OpenMP, torch's ``libgomp`` cannot be told
    apart (:func:`_choose_openmp_runtime`), none is mapped (another OpenMP runtime, or not Linux), or
    ``PGVI_KERNEL_OPENMP=0``.  Detected once per process."""
    if openmp_disabled_by_environment():
        return None
    return _detected_openmp_runtime()


def openmp_flags(runtime: Path) -> tuple[list[str], list[str]]:
    """``(compiler flags, linker inputs)`` that build a library on ``runtime``: its soname becomes the library's
    ``DT_NEEDED`` entry, which the dynamic loader resolves to the copy torch already loaded.  The linker inputs
    go after the source: with ``--as-needed`` (Debian's and Ubuntu's default) a library named before the objects
    that use it is dropped, and the symbols then come from ``-fopenmp``'s implicit ``-lgomp``, the system's."""
    return ["-fopenmp"], [str(runtime), f"-Wl,-rpath,{runtime.parent}"]


def compile_library(name: str, source: str, extra_flags: list[str] | None = None,
                    link_inputs: list[str] | None = None) -> Path:
    """Compile ``PRELUDE + source`` into the cache (if not there yet) and return the shared object's path;
    ``extra_flags`` go before the source, ``link_inputs`` after it."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set $CC, or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    full, flags = PRELUDE + source, compile_flags() + list(extra_flags or [])
    after = list(link_inputs or [])
    key = hashlib.sha256(
        "\0".join([full, " ".join(flags + after), version, platform.machine(), _cpu_flags()]).encode()
    ).hexdigest()[:20]
    cache = cache_dir()
    if not _private_dir(cache):
        raise RuntimeError(f"kernel cache {cache} is not a directory private to this user")
    so = cache / f"pgvi_{name}_{key}.so"
    if not so.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src = Path(tmp) / f"pgvi_{name}.c"
            src.write_text(full, encoding="utf-8")
            out = Path(tmp) / so.name
            proc = subprocess.run([cc, *flags, str(src), *after, "-o", str(out), "-lm"], capture_output=True, text=True,
                                  timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
            os.replace(out, so)
    return so


class NativeLibrary:
    """One C source, built and loaded on the first :meth:`get`; ``signatures`` maps each function to its
    ``(argtypes, restype)``; ``self_check(lib)`` raises ``RuntimeError`` if the built code misbehaves."""

    def __init__(self, name: str, source: str, signatures: dict[str, tuple[list[type], type | None]],
                 self_check: Callable[[ctypes.CDLL], None] | None = None, *,
                 fallback: str = "using the torch path") -> None:
        self.name, self.source, self.signatures, self.self_check = name, source, signatures, self_check
        self.fallback = fallback  # what callers do without the library, for the warning
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        #: the loaded build runs its ``omp parallel`` regions on torch's OpenMP pool (see the module docstring)
        self.openmp = False

    def _load_build(self, extra_flags: list[str], link_inputs: list[str]) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(compile_library(self.name, self.source, extra_flags, link_inputs)))
        for fn, (argtypes, restype) in {**PRELUDE_SIGNATURES, **self.signatures}.items():
            f = getattr(lib, fn)
            f.argtypes, f.restype = argtypes, restype
        if self.self_check is not None:
            self.self_check(lib)
        return lib

    def _load(self) -> ctypes.CDLL:
        runtime = openmp_runtime()
        if runtime is not None:
            try:
                lib = self._load_build(*openmp_flags(runtime))
                self.openmp = True
                return lib
            except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as err:
                _LOG.info("%s kernels: no OpenMP build on %s (%s); Python threads instead", self.name, runtime, err)
        return self._load_build([], [])

    def get(self) -> ctypes.CDLL | None:
        with self._lock:
            if not self._tried:
                off = disabled_by_environment()  # a bad value raises here, and again on the next call
                self._tried = True
                if off:
                    _LOG.info("%s kernels disabled by PGVI_FUSED_KERNELS", self.name)
                else:
                    try:
                        self._lib = self._load()
                    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as err:
                        _LOG.warning("%s kernels unavailable, %s: %s", self.name, self.fallback, err)
            return self._lib

    def parallel_in_openmp(self) -> bool:
        """Whether :func:`run_parallel` may hand all threads to the build's OpenMP regions: an OpenMP build, not
        in a forked child.  In a child forked from a process whose libgomp pool exists (torch's GEMMs create it,
        so do our kernels), the pool's threads are the parent's and do not exist in the child: its first region
        with more than one thread hangs (torch's own GEMMs there too).  Whether the parent created the pool does
        not matter, nor whether the parent or the child loaded the kernels: every child forked after this
        module's import uses Python threads, each running the driver with one thread."""
        return self.openmp and not _forked_child


_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_key = (0, 0)  # (size, pid): a forked child (e.g. a Ray worker) must not reuse its parent's pool


def run_chunks(fn: Callable[[int, int], None], total: int, align: int = 1) -> None:
    """Call ``fn(lo, hi)`` over a split of ``[0, total)`` into at most ``torch.get_num_threads()`` parts whose
    inner boundaries are multiples of ``align``, in parallel threads when there is more than one part.

    The pool is keyed by the thread count and the process id only (a forked child builds its own), and an
    old pool is left to the garbage collector rather than shut down under a concurrent caller."""
    global _pool, _pool_key
    threads = torch.get_num_threads()
    blocks = -(-total // align)  # ceil
    k = max(1, min(threads, blocks))
    if k == 1:
        fn(0, total)
        return
    with _pool_lock:
        key = (threads, os.getpid())
        if _pool is None or _pool_key != key:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pgvi-native")
            _pool_key = key
        pool = _pool
    bounds = [min(total, (blocks * i // k) * align) for i in range(k)] + [total]
    for f in [pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(k)]:
        f.result()


_FP_MODE = NativeLibrary("fpmode", _FP_SOURCE, {"pgvi_fp_sync_team": ([ctypes.c_int], ctypes.c_int)},
                         fallback="the floating-point mode of torch's intra-op threads is not set")


def sync_pool_fp_mode(threads: int) -> bool:
    """Give every thread of the calling thread's OpenMP pool (torch's intra-op threads, where they are GNU OpenMP:
    see the module docstring) the calling thread's flush-to-zero mode, by one parallel region of ``threads``
    threads on that pool.  ``True`` if done; ``False`` where it cannot be: fewer than two threads, no OpenMP
    build, or a forked child (whose first region on the parent's pool would hang: see
    :meth:`NativeLibrary.parallel_in_openmp`).

    The region's team is the calling thread and ``threads - 1`` pool threads: libgomp reuses the pool's threads
    for it, creates missing ones (which inherit the caller's mode) and ends those beyond the team, so afterwards
    every pool thread of this caller is in its mode (checked in tests/test_fused_review.py)."""
    if threads < 2:
        return False
    lib = _FP_MODE.get()
    if lib is None or not _FP_MODE.parallel_in_openmp():
        return False
    lib.pgvi_fp_sync_team(threads)
    return True


def run_parallel(library: NativeLibrary, call: Callable[[int, int, int], None], total: int, align: int = 1) -> None:
    """Run a kernel's parallel driver ``call(lo, hi, threads)`` over ``[0, total)``: the driver splits its range
    into ``threads`` parts with :c:func:`pgvi_split` (inner bounds multiples of ``align``) under an
    ``omp parallel for``.  An OpenMP build gets one call with ``torch.get_num_threads()``; any other build gets
    :func:`run_chunks`' Python threads, each calling the driver on its chunk with one thread.

    Either way every part runs in the calling thread's floating-point mode (flush-to-zero or not): the OpenMP
    drivers set it in each of their threads (:data:`PRELUDE`); here each Python thread takes it for its chunk
    and gets its own back after (a pool thread keeps the mode of the thread that created it, which need not be
    this caller's)."""
    threads = torch.get_num_threads()
    if library.parallel_in_openmp():
        call(0, total, max(1, min(threads, -(-total // align))))
        return
    # one chunk runs on the caller: no switch (and a stand-in for a library, in tests, has no helpers)
    fp = library.get() if threads > 1 and total > align and isinstance(library, NativeLibrary) else None
    if fp is None:
        run_chunks(lambda lo, hi: call(lo, hi, 1), total, align)
        return
    mode = fp.pgvi_fp_get()

    def part(lo: int, hi: int) -> None:
        previous = fp.pgvi_fp_swap(mode)
        try:
            call(lo, hi, 1)
        finally:
            fp.pgvi_fp_swap(previous)

    run_chunks(part, total, align)


__all__ = ["FLAGS", "PRELUDE", "PRELUDE_SIGNATURES", "NativeLibrary", "cache_dir", "compile_flags",
           "compile_library", "disabled_by_environment", "openmp_disabled_by_environment", "openmp_flags",
           "openmp_runtime", "run_chunks", "run_parallel", "sync_pool_fp_mode"]
