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

The C source below is built on first use by :class:`common.native.NativeLibrary` (system C compiler, per-user
cache).  Where it cannot be built, :func:`available` is ``False`` (with one warning) and the model keeps its
torch path: the same distribution from torch's own generator, so results differ from the fused
path's by Monte Carlo noise only.  float32 CPU tensors only; anything else takes the torch path.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from common.native import NativeLibrary, run_chunks

_C_SOURCE = r"""
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

def _self_check(lib: ctypes.CDLL) -> None:
    """4,096 normals of one stream are finite with mean ~ 0 and variance ~ 1."""
    z = torch.empty(4096)
    lib.pgvi_normals(z.data_ptr(), z.numel(), 0, 12345, 678)
    if not (bool(torch.isfinite(z).all()) and abs(float(z.mean())) < 0.1 and abs(float(z.var()) - 1.0) < 0.1):
        raise RuntimeError("the compiled generator failed its self-check")


_I64, _U32, _VP = ctypes.c_int64, ctypes.c_uint32, ctypes.c_void_p
_NATIVE = NativeLibrary(
    "sampling",
    _C_SOURCE,
    {
        "pgvi_normals": ([_VP, _I64, _U32, _U32, _U32], None),
        "pgvi_relu_sample_fwd": ([_VP, _VP, _I64, _I64, _I64, _U32, _U32, _VP, _VP, _VP], None),
        "pgvi_relu_sample_bwd": ([_VP, _VP, _VP, _VP, _I64, _I64, _I64, _I64, _I64, _VP, _VP], None),
    },
    _self_check,
)


def available() -> bool:
    """``True`` if the compiled kernels are loaded (builds them on the first call)."""
    return _NATIVE.get() is not None


def applies_to(mu: Tensor) -> bool:
    """Whether :func:`sample_relu` can take tensors like ``mu`` (float32, CPU) and the kernels are built."""
    return mu.dtype == torch.float32 and mu.device.type == "cpu" and available()


def _key(generator: torch.Generator | None) -> tuple[int, int]:
    k = int(torch.randint(0, 2**62, (1,), generator=generator, dtype=torch.int64))
    return k & 0xFFFFFFFF, (k >> 32) & 0xFFFFFFFF


class _SampleReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mu: Tensor, sd: Tensor, n_samples: int, k0: int, k1: int):  # type: ignore[override]
        lib = _NATIVE.get()
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

        run_chunks(fwd, n_samples)
        ctx.save_for_backward(h, eps)
        ctx.mark_non_differentiable(eps)
        ctx.set_materialize_grads(False)  # no (S, R, H) zero tensors for the outputs that get no gradient
        return h, h2, eps

    @staticmethod
    def backward(ctx, grad_h: Tensor | None, grad_h2: Tensor | None, _grad_eps: Tensor | None):  # type: ignore[override]
        lib = _NATIVE.get()
        assert lib is not None
        h, eps = ctx.saved_tensors
        n_samples, rows, width = h.shape
        if grad_h is None and grad_h2 is None:
            return None, None, None, None, None
        gh = torch.zeros_like(h) if grad_h is None else grad_h.contiguous()
        gh2 = None if grad_h2 is None else grad_h2.contiguous()
        dmu = torch.empty((rows, width), dtype=h.dtype)
        dsd = torch.empty_like(dmu)

        def bwd(r0: int, r1: int) -> None:
            lib.pgvi_relu_sample_bwd(gh.data_ptr(), None if gh2 is None else gh2.data_ptr(), h.data_ptr(),
                                     eps.data_ptr(), n_samples, rows, width, r0, r1, dmu.data_ptr(), dsd.data_ptr())

        run_chunks(bwd, rows)
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
    lib = _NATIVE.get()
    if lib is None:
        raise RuntimeError("fused sampling kernels are not available")
    out = torch.empty(n, dtype=torch.float32)
    lib.pgvi_normals(out.data_ptr(), n, stream, key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF)
    return out


__all__ = ["applies_to", "available", "sample_relu", "standard_normal"]
