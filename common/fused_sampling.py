"""Fused, vectorised sampling of a hidden layer's ReLU activations for the local reparameterisation.

In :meth:`common.models.BayesianMLP.output_local_reparam` a hidden layer with pre-activation moments
``mu, var`` of shape ``(R, H)`` is sampled ``S`` times: ``a = mu + sqrt(var) * eps`` with
``eps ~ N(0, I)`` of shape ``(S, R, H)``, then ``h = relu(a)`` and, for the next layer's variance GEMM,
``h^2``.  In torch that is one serial random-number pass (``normal_``: about 3.8 ns per number, 1.9 ms for
the 512,000 numbers of a 10 x 256 x 200 step) and about eight memory-bound passes over ``S R H`` floats in
the forward and backward passes.  :func:`sample_relu` does the forward in one pass and the backward
(ReLU mask, the sum over samples for ``mu`` and the ``eps``-weighted sum for the scale) in another, with a
counter-based generator that vectorises:

* ``eps`` number ``i`` of sample ``s`` is lane ``i mod 4`` of Philox4x32-10 (Salmon et al., SC 2011; the
  generator of JAX and of torch's CUDA backend) at counter ``(i div 4, s, 0, 0)`` under a 64-bit key,
  turned into normals by the Box-Muller transform on 24-bit uniforms (so ``|eps| <= 5.9``: the mass beyond is
  ``4e-9``);
* the key is drawn from the caller's ``torch.Generator`` (one draw per call), so a seeded generator gives
  the same samples whatever the number of threads.

The C source below is compiled on first use with the system C compiler (``-O3 -march=native``; ``$CC``,
else ``cc``/``gcc``) into a per-user cache (``$PGVI_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/pgvi-kernels``,
else ``~/.cache/pgvi-kernels``), keyed by a hash of the source, the flags, the compiler's version and the
CPU's flags, and loaded with :mod:`ctypes`.  Where there is no compiler, the build fails, or the cache
directory is not private to this user, :func:`available` is ``False`` (with one warning) and the model
keeps its torch path: the same distribution from torch's own generator, so results differ from the fused
path's by Monte Carlo noise only.  float32 CPU tensors only; anything else takes the torch path.
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
from pathlib import Path

import torch
from torch import Tensor

_LOG = logging.getLogger(__name__)

_C_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GLIBC__)
/* glibc's libmvec has vector variants of these; declaring them lets the loops below vectorise */
float logf(float) __attribute__((simd("notinbranch")));
float sinf(float) __attribute__((simd("notinbranch")));
float cosf(float) __attribute__((simd("notinbranch")));
#endif

#define NB 256 /* Philox blocks (4 normals each) per tile */
#define TWO_PI 6.283185307179586f
#define U24 5.9604644775390625e-08f /* 2^-24 */

/* z[0 .. 4 NB): the normals of Philox blocks b0 .. b0+NB-1 of stream s under key (k0, k1).  Always a whole
   tile: the vector loops then have no scalar remainder, whose libm results could differ from libmvec's in
   the last bit, so a number depends only on (key, stream, index), not on the length asked for. */
static void philox_normals(float *restrict z, uint32_t b0, uint32_t s, uint32_t k0, uint32_t k1) {
    const int64_t nb = NB;
    float ra[NB], ta[NB], rb[NB], tb[NB];
    #pragma omp simd
    for (int64_t b = 0; b < nb; b++) {
        uint32_t x0 = b0 + (uint32_t)b, x1 = s, x2 = 0, x3 = 0, kk0 = k0, kk1 = k1;
        for (int r = 0; r < 10; r++) {
            uint64_t p0 = (uint64_t)0xD2511F53u * x0, p1 = (uint64_t)0xCD9E8D57u * x2;
            uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1 ^ kk0, y1 = (uint32_t)p1;
            uint32_t y2 = (uint32_t)(p0 >> 32) ^ x3 ^ kk1, y3 = (uint32_t)p0;
            x0 = y0; x1 = y1; x2 = y2; x3 = y3;
            kk0 += 0x9E3779B9u; kk1 += 0xBB67AE85u;
        }
        ra[b] = ((float)(x0 >> 8) + 0.5f) * U24; /* in (0, 1): log is finite */
        ta[b] = (float)(x1 >> 8) * U24 * TWO_PI;
        rb[b] = ((float)(x2 >> 8) + 0.5f) * U24;
        tb[b] = (float)(x3 >> 8) * U24 * TWO_PI;
    }
    #pragma omp simd
    for (int64_t b = 0; b < nb; b++) { ra[b] = sqrtf(-2.0f * logf(ra[b])); rb[b] = sqrtf(-2.0f * logf(rb[b])); }
    #pragma omp simd
    for (int64_t b = 0; b < nb; b++) { z[4 * b] = ra[b] * cosf(ta[b]); z[4 * b + 2] = rb[b] * cosf(tb[b]); }
    #pragma omp simd
    for (int64_t b = 0; b < nb; b++) { z[4 * b + 1] = ra[b] * sinf(ta[b]); z[4 * b + 3] = rb[b] * sinf(tb[b]); }
}

/* standard normals of stream s: out[i] for i in [0, n) */
void pgvi_normals(float *out, int64_t n, uint32_t s, uint32_t k0, uint32_t k1) {
    float buf[4 * NB];
    for (int64_t t = 0; t < n; t += 4 * NB) {
        int64_t m = n - t < 4 * NB ? n - t : 4 * NB;
        philox_normals(buf, (uint32_t)(t / 4), s, k0, k1);
        memcpy(out + t, buf, sizeof(float) * m);
    }
}

/* for s in [s0, s1): eps[s] = normals of stream s, h[s] = relu(mu + sd * eps[s]), h2[s] = h[s]^2 (n = R H) */
void pgvi_relu_sample_fwd(const float *restrict mu, const float *restrict sd, int64_t n, int64_t s0, int64_t s1,
                          uint32_t k0, uint32_t k1, float *restrict eps, float *restrict h, float *restrict h2) {
    float buf[4 * NB];
    for (int64_t s = s0; s < s1; s++) {
        float *es = eps + s * n, *hs = h + s * n, *h2s = h2 + s * n;
        for (int64_t t = 0; t < n; t += 4 * NB) {
            int64_t m = n - t < 4 * NB ? n - t : 4 * NB;
            philox_normals(buf, (uint32_t)(t / 4), (uint32_t)s, k0, k1);
            #pragma omp simd
            for (int64_t i = 0; i < m; i++) {
                float e = buf[i];
                float a = mu[t + i] + sd[t + i] * e;
                a = a < 0.0f ? 0.0f : a; /* NaN stays NaN */
                es[t + i] = e; hs[t + i] = a; h2s[t + i] = a * a;
            }
        }
    }
}

/* rows [r0, r1) of dmu = sum_s g, dsd = sum_s g eps, g = (gh + 2 h gh2) [h > 0]; gh2 may be NULL */
void pgvi_relu_sample_bwd(const float *restrict gh, const float *restrict gh2, const float *restrict h,
                          const float *restrict eps, int64_t S, int64_t n_rows, int64_t H, int64_t r0, int64_t r1,
                          float *restrict dmu, float *restrict dsd) {
    int64_t n = n_rows * H, lo = r0 * H, m = (r1 - r0) * H;
    float *dm = dmu + lo, *dd = dsd + lo;
    memset(dm, 0, sizeof(float) * m);
    memset(dd, 0, sizeof(float) * m);
    for (int64_t s = 0; s < S; s++) {
        const float *g1 = gh + s * n + lo, *hs = h + s * n + lo, *es = eps + s * n + lo;
        if (gh2) {
            const float *g2 = gh2 + s * n + lo;
            #pragma omp simd
            for (int64_t i = 0; i < m; i++) {
                float g = hs[i] > 0.0f ? g1[i] + 2.0f * hs[i] * g2[i] : 0.0f;
                dm[i] += g; dd[i] += g * es[i];
            }
        } else {
            #pragma omp simd
            for (int64_t i = 0; i < m; i++) {
                float g = hs[i] > 0.0f ? g1[i] : 0.0f;
                dm[i] += g; dd[i] += g * es[i];
            }
        }
    }
}
"""

_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-fPIC", "-shared"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_size = 0


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


def _cache_dir() -> Path:
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


def _build() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set $CC, or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\0".join([_C_SOURCE, " ".join(_FLAGS), version, platform.machine(), _cpu_flags()]).encode()
    ).hexdigest()[:20]
    cache = _cache_dir()
    if not _private_dir(cache):
        raise RuntimeError(f"kernel cache {cache} is not a directory private to this user")
    so = cache / f"pgvi_fused_{key}.so"
    if not so.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src = Path(tmp) / "pgvi_fused.c"
            src.write_text(_C_SOURCE, encoding="utf-8")
            out = Path(tmp) / so.name
            proc = subprocess.run([cc, *_FLAGS, str(src), "-o", str(out), "-lm"], capture_output=True, text=True,
                                  timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
            os.replace(out, so)  # atomic: concurrent builders each rename a complete file
    lib = ctypes.CDLL(str(so))
    i64, u32, vp = ctypes.c_int64, ctypes.c_uint32, ctypes.c_void_p
    lib.pgvi_normals.argtypes = [vp, i64, u32, u32, u32]
    lib.pgvi_normals.restype = None
    lib.pgvi_relu_sample_fwd.argtypes = [vp, vp, i64, i64, i64, u32, u32, vp, vp, vp]
    lib.pgvi_relu_sample_fwd.restype = None
    lib.pgvi_relu_sample_bwd.argtypes = [vp, vp, vp, vp, i64, i64, i64, i64, i64, vp, vp]
    lib.pgvi_relu_sample_bwd.restype = None
    # self-check: 4,096 normals of one stream are finite with mean ~ 0 and variance ~ 1
    z = torch.empty(4096)
    lib.pgvi_normals(z.data_ptr(), z.numel(), 0, 12345, 678)
    if not (bool(torch.isfinite(z).all()) and abs(float(z.mean())) < 0.1 and abs(float(z.var()) - 1.0) < 0.1):
        raise RuntimeError("the compiled generator failed its self-check")
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            if os.environ.get("PGVI_FUSED_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
                _LOG.info("fused sampling kernels disabled by PGVI_FUSED_KERNELS")
            else:
                try:
                    _lib = _build()
                except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                    _LOG.warning("fused sampling kernels unavailable, using torch's sampler: %s", err)
        return _lib


def available() -> bool:
    """``True`` if the compiled kernels are loaded (builds them on the first call)."""
    return _library() is not None


def applies_to(mu: Tensor) -> bool:
    """Whether :func:`sample_relu` can take tensors like ``mu`` (float32, CPU) and the kernels are built."""
    return mu.dtype == torch.float32 and mu.device.type == "cpu" and available()


def _run_chunks(fn, total: int, *args) -> None:  # type: ignore[no-untyped-def]
    """Call ``fn(*args, lo, hi)`` over ``[0, total)`` in ``torch.get_num_threads()`` chunks (ctypes releases
    the GIL, so the chunks run in parallel)."""
    global _pool, _pool_size
    k = max(1, min(torch.get_num_threads(), total))
    if k == 1:
        fn(*args, 0, total)
        return
    with _lock:
        if _pool is None or _pool_size != k:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=k, thread_name_prefix="pgvi-fused")
            _pool_size = k
        pool = _pool
    bounds = [total * i // k for i in range(k + 1)]
    for f in [pool.submit(fn, *args, bounds[i], bounds[i + 1]) for i in range(k)]:
        f.result()


def _key(generator: torch.Generator | None) -> tuple[int, int]:
    k = int(torch.randint(0, 2**62, (1,), generator=generator, dtype=torch.int64))
    return k & 0xFFFFFFFF, (k >> 32) & 0xFFFFFFFF


class _SampleReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mu: Tensor, sd: Tensor, n_samples: int, k0: int, k1: int):  # type: ignore[override]
        lib = _lib
        assert lib is not None
        mu, sd = mu.detach().contiguous(), sd.detach().contiguous()
        rows, width = mu.shape
        eps = torch.empty((n_samples, rows, width), dtype=mu.dtype)
        h = torch.empty_like(eps)
        h2 = torch.empty_like(eps)
        n = rows * width

        def fwd(s0: int, s1: int) -> None:
            lib.pgvi_relu_sample_fwd(mu.data_ptr(), sd.data_ptr(), n, s0, s1, k0, k1, eps.data_ptr(), h.data_ptr(),
                                     h2.data_ptr())

        _run_chunks(fwd, n_samples)
        ctx.save_for_backward(h, eps)
        ctx.mark_non_differentiable(eps)
        return h, h2, eps

    @staticmethod
    def backward(ctx, grad_h: Tensor | None, grad_h2: Tensor | None, _grad_eps: Tensor | None):  # type: ignore[override]
        lib = _lib
        assert lib is not None
        h, eps = ctx.saved_tensors
        n_samples, rows, width = h.shape
        if grad_h is None:
            grad_h = torch.zeros_like(h)
        gh = grad_h.contiguous()
        gh2 = None if grad_h2 is None else grad_h2.contiguous()
        dmu = torch.empty((rows, width), dtype=h.dtype)
        dsd = torch.empty_like(dmu)

        def bwd(r0: int, r1: int) -> None:
            lib.pgvi_relu_sample_bwd(gh.data_ptr(), None if gh2 is None else gh2.data_ptr(), h.data_ptr(),
                                     eps.data_ptr(), n_samples, rows, width, r0, r1, dmu.data_ptr(), dsd.data_ptr())

        _run_chunks(bwd, rows)
        return dmu, dsd, None, None, None


def sample_relu(
    mu: Tensor, sd: Tensor, n_samples: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(h, h^2, eps)`` with ``h = relu(mu + sd * eps)``, ``eps ~ N(0, I)`` of shape ``(n_samples, R, H)``
    for ``mu, sd`` of shape ``(R, H)`` (float32, CPU); differentiable w.r.t. ``mu`` and ``sd`` through ``h``
    and ``h^2`` (``eps`` is returned for tests and diagnostics).  Call only where :func:`applies_to` holds."""
    if mu.dim() != 2 or sd.shape != mu.shape:
        raise ValueError(f"sample_relu: mu and sd must be (R, H) of one shape, got {tuple(mu.shape)}, {tuple(sd.shape)}")
    if not applies_to(mu) or sd.dtype != mu.dtype:
        raise RuntimeError("sample_relu: needs float32 CPU tensors and the compiled kernels (see applies_to)")
    if n_samples < 1 or n_samples >= 2**32:
        raise ValueError(f"sample_relu: n_samples must be in [1, 2^32), got {n_samples}")
    if mu.numel() >= 2**34:
        raise ValueError("sample_relu: more than 2^34 elements per sample")
    k0, k1 = _key(generator)
    return _SampleReLU.apply(mu, sd, int(n_samples), k0, k1)


def standard_normal(n: int, stream: int, key: int) -> Tensor:
    """``n`` standard normals of the compiled generator's ``stream`` under the 64-bit ``key`` (for tests:
    the same numbers :func:`sample_relu` uses as ``eps`` of sample ``stream``)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("fused sampling kernels are not available")
    out = torch.empty(n, dtype=torch.float32)
    lib.pgvi_normals(out.data_ptr(), n, stream, key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF)
    return out


__all__ = ["applies_to", "available", "sample_relu", "standard_normal"]
