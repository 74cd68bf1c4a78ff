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
their torch path.  :func:`run_chunks` splits a kernel call over ``torch.get_num_threads()`` Python threads
(ctypes releases the GIL during the call).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

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
"""


def disabled_by_environment() -> bool:
    return os.environ.get("PGVI_FUSED_KERNELS", "1").strip().lower() in ("0", "false", "no", "off")


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


def compile_library(name: str, source: str) -> Path:
    """Compile ``PRELUDE + source`` into the cache (if not there yet) and return the shared object's path."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set $CC, or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    full, flags = PRELUDE + source, compile_flags()
    key = hashlib.sha256(
        "\0".join([full, " ".join(flags), version, platform.machine(), _cpu_flags()]).encode()
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
            proc = subprocess.run([cc, *flags, str(src), "-o", str(out), "-lm"], capture_output=True, text=True,
                                  timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
            os.replace(out, so)
    return so


class NativeLibrary:
    """One C source, built and loaded on the first :meth:`get`; ``signatures`` maps each function to its
    ``(argtypes, restype)``; ``self_check(lib)`` raises ``RuntimeError`` if the built code misbehaves."""

    def __init__(self, name: str, source: str, signatures: dict[str, tuple[list[type], type | None]],
                 self_check: Callable[[ctypes.CDLL], None] | None = None) -> None:
        self.name, self.source, self.signatures, self.self_check = name, source, signatures, self_check
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def _load(self) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(compile_library(self.name, self.source)))
        for fn, (argtypes, restype) in self.signatures.items():
            f = getattr(lib, fn)
            f.argtypes, f.restype = argtypes, restype
        if self.self_check is not None:
            self.self_check(lib)
        return lib

    def get(self) -> ctypes.CDLL | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                if disabled_by_environment():
                    _LOG.info("%s kernels disabled by PGVI_FUSED_KERNELS", self.name)
                else:
                    try:
                        self._lib = self._load()
                    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as err:
                        _LOG.warning("%s kernels unavailable, using the torch path: %s", self.name, err)
            return self._lib


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


__all__ = ["FLAGS", "PRELUDE", "NativeLibrary", "cache_dir", "compile_flags", "compile_library",
           "disabled_by_environment", "run_chunks"]
