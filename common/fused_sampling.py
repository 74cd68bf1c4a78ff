"""Fused, vectorised sampling of a hidden layer's ReLU activations for the local reparameterisation.

In :meth:`common.models.BayesianMLP.output_local_reparam` a hidden layer with pre-activation moments
``mu, var`` of shape ``(R, H)`` is sampled ``S`` times: ``a = mu + sqrt(var) * eps`` with
``eps ~ N(0, I)`` of shape ``(S, R, H)``, then ``h = relu(a)`` and, for the next layer's variance GEMM,
``h^2``.  In torch that is one serial random-number pass (``normal_``: about 3.8 ns per number, 1.9 ms for
the 512,000 numbers of a 10 x 256 x 200 step) and about eight memory-bound passes over ``S R H`` floats in
the forward and backward passes.  :func:`sample_relu` does the forward in one pass and the backward
(ReLU mask, the sum over samples for ``mu`` and the ``eps``-weighted sum for the scale) in another, with a
counter-based generator that vectorises:

* ``eps`` of sample ``s`` comes from Philox4x32-10 (Salmon et al., SC 2011; the generator of JAX and of
  torch's CUDA backend) at the counters ``(b, s, 0, 0)`` under a 64-bit key, in tiles of 256 counters: number
  ``i = 1024 t + 256 j + c`` uses words ``2 (j div 2)`` and ``2 (j div 2) + 1`` of counter ``256 t + c``,
  turned into normals by the Box-Muller transform (cosine for even ``j``, sine for odd ``j``; radius from a
  23-bit uniform in ``[2^-24, 1 - 2^-24]``,
  angle from a 24-bit one), so ``|eps| <= sqrt(2 log 2^24) = 5.77``: the mass beyond is ``8e-9``;
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

from common.native import NativeLibrary, run_parallel

#: The generator: ``philox_normals`` and its constants (shared with :mod:`common.fused_head`).
PHILOX_SOURCE = r"""
#include <stdlib.h>
#define NB 256 /* Philox blocks (4 normals each) per tile */
#define TWO_PI 6.283185307179586f
#define U24 5.9604644775390625e-08f /* 2^-24 */
#define U23 1.1920928955078125e-07f /* 2^-23 */

/* Philox blocks per vector: one register of 32-bit lanes where the CPU has 512-bit vectors, else two 256-bit
   or four 128-bit registers' worth.  A number depends only on (key, stream, index), not on PV. */
#if defined(__AVX512F__)
#define PV 16
#else
#define PV 8
#endif
typedef uint32_t pv32 __attribute__((vector_size(4 * PV)));
typedef uint64_t pv64 __attribute__((vector_size(4 * PV)));

/* the 64-bit products a_i m of the 32-bit lanes of a: their high halves in *hi, their low halves (= a m) in *lo.
   Two widening multiplies of the even and the odd lanes (vpmuludq on x86-64) give both halves.  GCC writes the
   generic form below with 64-bit lanes (vpmullq, three uops on Intel) where the CPU has AVX-512 DQ, and as
   32-bit multiplies spelled out with AVX2 (4 ms instead of 0.5 ms per 512k normals), and it computes the low
   halves by one more multiply (vpmulld, two uops on Intel); on x86 the intrinsics below do neither (on an
   AVX-512 Xeon the Philox words of a BNN step took 9 % of it). */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline void mulhilo32(pv32 a, uint32_t m, pv32 *hi, pv32 *lo) {
    __m512i x = (__m512i)a, mm = _mm512_set1_epi32((int)m);
    __m512i even = _mm512_mul_epu32(x, mm), odd = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), mm);
    *hi = (pv32)_mm512_mask_blend_epi32((__mmask16)0xAAAA, _mm512_srli_epi64(even, 32), odd);
    *lo = (pv32)_mm512_mask_blend_epi32((__mmask16)0xAAAA, even, _mm512_slli_epi64(odd, 32));
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline void mulhilo32(pv32 a, uint32_t m, pv32 *hi, pv32 *lo) {
    __m256i x = (__m256i)a, mm = _mm256_set1_epi32((int)m);
    __m256i even = _mm256_mul_epu32(x, mm), odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), mm);
    *hi = (pv32)_mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
    *lo = (pv32)_mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
/* on arm64 the generic form became eight scalar multiplies: umull / umull2 and the odd halves (uzp2) instead */
static inline void mulhilo32(pv32 a, uint32_t m, pv32 *hi, pv32 *lo) {
    pv32 r;
    for (int h = 0; h < PV / 4; h++) {
        uint32x4_t x;
        memcpy(&x, (const char *)&a + 16 * h, 16);
        uint64x2_t l = vmull_n_u32(vget_low_u32(x), m), u = vmull_high_n_u32(x, m);
        uint32x4_t res = vuzp2q_u32(vreinterpretq_u32_u64(l), vreinterpretq_u32_u64(u));
        memcpy((char *)&r + 16 * h, &res, 16);
    }
    *hi = r;
    *lo = a * m;
}
#else
static inline void mulhilo32(pv32 a, uint32_t m, pv32 *hi, pv32 *lo) {
    const pv64 low = (pv64){0} + 0xFFFFFFFFull, mm = (pv64){0} + (uint64_t)m;
    pv64 even = ((pv64)a & low) * mm, odd = ((pv64)a >> 32) * mm;
    *hi = (pv32)((even >> 32) | (odd & ~low));
    *lo = a * m;
}
#endif

/* Philox4x32-10 (Salmon et al. 2011) of the NB counters (b0 + b, s, 0, 0), b < NB, under key (k0, k1):
   word j of block b in w[j NB + b] */
static void philox_tile(uint32_t *restrict w, uint32_t b0, uint32_t s, uint32_t k0, uint32_t k1) {
    pv32 iota;
    for (int i = 0; i < PV; i++) iota[i] = (uint32_t)i;
    for (int64_t b = 0; b < NB; b += PV) {
        pv32 x0 = iota + (b0 + (uint32_t)b), x1 = (pv32){0} + s, x2 = (pv32){0}, x3 = (pv32){0};
        uint32_t kk0 = k0, kk1 = k1;
        for (int r = 0; r < 10; r++) {
            pv32 hi0, lo0, hi1, lo1;
            mulhilo32(x0, 0xD2511F53u, &hi0, &lo0);
            mulhilo32(x2, 0xCD9E8D57u, &hi1, &lo1);
            x0 = hi1 ^ x1 ^ kk0; x1 = lo1; x2 = hi0 ^ x3 ^ kk1; x3 = lo0;
            kk0 += 0x9E3779B9u; kk1 += 0xBB67AE85u;
        }
        memcpy(w + b, &x0, sizeof x0); memcpy(w + NB + b, &x1, sizeof x1);
        memcpy(w + 2 * NB + b, &x2, sizeof x2); memcpy(w + 3 * NB + b, &x3, sizeof x3);
    }
}

/* the raw words of one tile (for the known-answer test) */
void pgvi_philox_raw(uint32_t *w, uint32_t b0, uint32_t s, uint32_t k0, uint32_t k1) { philox_tile(w, b0, s, k0, k1); }

/* z[0 .. 4 NB): the normals of Philox blocks b0 .. b0+NB-1 of stream s under key (k0, k1): z[j NB + b] comes from
   words 2 (j / 2) and 2 (j / 2) + 1 of block b (cos for even j, sin for odd j).  Always a whole tile: the vector
   loops then have no scalar remainder, whose libm results could differ from libmvec's in the last bit, so a
   number depends only on (key, stream, index), not on the length asked for. */
static void philox_normals(float *restrict z, uint32_t b0, uint32_t s, uint32_t k0, uint32_t k1) {
    const int64_t nb = NB;
    uint32_t w[4 * NB];
    float ra[NB], ta[NB], rb[NB], tb[NB];
    philox_tile(w, b0, s, k0, k1);
    #pragma omp simd
    for (int64_t b = 0; b < nb; b++) {
        /* (k + 1/2) 2^-23 for a 23-bit k: exact in float, in [2^-24, 1 - 2^-24], so log < 0 is finite */
        ra[b] = ((float)(int32_t)(w[b] >> 9) + 0.5f) * U23;
        ta[b] = (float)(int32_t)(w[NB + b] >> 8) * U24 * TWO_PI;
        rb[b] = ((float)(int32_t)(w[2 * NB + b] >> 9) + 0.5f) * U23;
        tb[b] = (float)(int32_t)(w[3 * NB + b] >> 8) * U24 * TWO_PI;
    }
    #pragma omp simd
    for (int64_t b = 0; b < nb; b++) { ra[b] = sqrtf(-2.0f * logf(ra[b])); rb[b] = sqrtf(-2.0f * logf(rb[b])); }
    #pragma omp simd
    for (int64_t b = 0; b < nb; b++) { z[b] = ra[b] * cosf(ta[b]); z[2 * NB + b] = rb[b] * cosf(tb[b]); }
    #pragma omp simd
    for (int64_t b = 0; b < nb; b++) { z[NB + b] = ra[b] * sinf(ta[b]); z[3 * NB + b] = rb[b] * sinf(tb[b]); }
}

"""

_C_SOURCE = PHILOX_SOURCE + r"""
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

/* The same as pgvi_relu_sample_bwd, with the gradients w.r.t. h and h^2 formed here from the next layer's
   moment gradients gm, gv ((S R) x C) and weights wm, wv (C x H): g_h = gm wm, g_h2 = gv wv (for a narrow next
   layer this saves writing and re-reading two (S R) x H matrices) */
int pgvi_relu_sample_bwd_linear(const float *restrict gm, const float *restrict gv, const float *restrict wm,
                                 const float *restrict wv, int64_t C, const float *restrict h,
                                 const float *restrict eps, int64_t S, int64_t n_rows, int64_t H, int64_t r0,
                                 int64_t r1, float *restrict dmu, float *restrict dsd) {
    float *g1 = (float *)malloc(sizeof(float) * (H > 0 ? H : 1)), *g2 = (float *)malloc(sizeof(float) * (H > 0 ? H : 1));
    if (!g1 || !g2) { free(g1); free(g2); return 1; }
    memset(dmu + r0 * H, 0, sizeof(float) * (r1 - r0) * H);
    memset(dsd + r0 * H, 0, sizeof(float) * (r1 - r0) * H);
    for (int64_t s = 0; s < S; s++) {
        for (int64_t r = r0; r < r1; r++) {
            int64_t row = s * n_rows + r;
            const float *gmr = gm + row * C, *gvr = gv + row * C;
            #pragma omp simd
            for (int64_t j = 0; j < H; j++) { g1[j] = 0.0f; g2[j] = 0.0f; }
            for (int64_t c = 0; c < C; c++) {
                float a = gmr[c], b = gvr[c];
                const float *wmc = wm + c * H, *wvc = wv + c * H;
                #pragma omp simd
                for (int64_t j = 0; j < H; j++) { g1[j] += a * wmc[j]; g2[j] += b * wvc[j]; }
            }
            const float *hr = h + row * H, *er = eps + row * H;
            float *dm = dmu + r * H, *dd = dsd + r * H;
            #pragma omp simd
            for (int64_t j = 0; j < H; j++) {
                float g = hr[j] > 0.0f ? g1[j] + 2.0f * hr[j] * g2[j] : 0.0f;
                dm[j] += g; dd[j] += g * er[j];
            }
        }
    }
    free(g1);
    free(g2);
    return 0;
}

/* The parallel drivers, over nt OpenMP threads: samples [s0, s1), rows [r0, r1) (pgvi_split); every part in the
   calling thread's floating-point mode (PRELUDE) */
void pgvi_relu_sample_fwd_run(const float *restrict mu, const float *restrict sd, int64_t n, int64_t s0, int64_t s1,
                              int nt, uint32_t k0, uint32_t k1, float *restrict eps, float *restrict h,
                              float *restrict h2) {
    const uint32_t fpm = pgvi_fp_mode();
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int t = 0; t < nt; t++) {
        uint32_t fps = pgvi_fp_enter(fpm);
        pgvi_relu_sample_fwd(mu, sd, n, pgvi_split(s0, s1, 1, t, nt), pgvi_split(s0, s1, 1, t + 1, nt), k0, k1, eps, h,
                             h2);
        pgvi_fp_enter(fps);
    }
}
void pgvi_relu_sample_bwd_run(const float *restrict gh, const float *restrict gh2, const float *restrict h,
                              const float *restrict eps, int64_t S, int64_t n_rows, int64_t H, int64_t r0, int64_t r1,
                              int nt, float *restrict dmu, float *restrict dsd) {
    const uint32_t fpm = pgvi_fp_mode();
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int t = 0; t < nt; t++) {
        uint32_t fps = pgvi_fp_enter(fpm);
        pgvi_relu_sample_bwd(gh, gh2, h, eps, S, n_rows, H, pgvi_split(r0, r1, 1, t, nt), pgvi_split(r0, r1, 1, t + 1, nt),
                             dmu, dsd);
        pgvi_fp_enter(fps);
    }
}
int pgvi_relu_sample_bwd_linear_run(const float *restrict gm, const float *restrict gv, const float *restrict wm,
                                    const float *restrict wv, int64_t C, const float *restrict h,
                                    const float *restrict eps, int64_t S, int64_t n_rows, int64_t H, int64_t r0,
                                    int64_t r1, int nt, float *restrict dmu, float *restrict dsd) {
    int oom = 0;
    const uint32_t fpm = pgvi_fp_mode();
    #pragma omp parallel for num_threads(nt) schedule(static) reduction(|:oom)
    for (int t = 0; t < nt; t++) {
        uint32_t fps = pgvi_fp_enter(fpm);
        oom |= pgvi_relu_sample_bwd_linear(gm, gv, wm, wv, C, h, eps, S, n_rows, H, pgvi_split(r0, r1, 1, t, nt),
                                           pgvi_split(r0, r1, 1, t + 1, nt), dmu, dsd);
        pgvi_fp_enter(fps);
    }
    return oom;
}
"""


def _self_check(lib: ctypes.CDLL) -> None:
    """4,096 normals of one stream are finite with mean ~ 0 and variance ~ 1."""
    z = torch.empty(4096)
    lib.pgvi_normals(z.data_ptr(), z.numel(), 0, 12345, 678)
    if not (bool(torch.isfinite(z).all()) and abs(float(z.mean())) < 0.1 and abs(float(z.var()) - 1.0) < 0.1):
        raise RuntimeError("the compiled generator failed its self-check")


_I64, _U32, _VP, _INT = ctypes.c_int64, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int
_NATIVE = NativeLibrary(
    "sampling",
    _C_SOURCE,
    {
        "pgvi_normals": ([_VP, _I64, _U32, _U32, _U32], None),
        "pgvi_philox_raw": ([_VP, _U32, _U32, _U32, _U32], None),
        "pgvi_relu_sample_fwd_run": ([_VP, _VP, _I64, _I64, _I64, _INT, _U32, _U32, _VP, _VP, _VP], None),
        "pgvi_relu_sample_bwd_run": ([_VP, _VP, _VP, _VP, _I64, _I64, _I64, _I64, _I64, _INT, _VP, _VP], None),
        "pgvi_relu_sample_bwd_linear_run": ([_VP, _VP, _VP, _VP, _I64, _VP, _VP, _I64, _I64, _I64, _I64, _I64, _INT,
                                             _VP, _VP], ctypes.c_int),
    },
    _self_check,
)


def available() -> bool:
    """``True`` if the compiled kernels are loaded (builds them on the first call)."""
    return _NATIVE.get() is not None


def applies_to(mu: Tensor) -> bool:
    """Whether :func:`sample_relu` can take tensors like ``mu`` (float32, CPU) and the kernels are built."""
    return mu.dtype == torch.float32 and mu.device.type == "cpu" and available()


def _split_key(key: int) -> tuple[int, int]:
    """The kernel's two 32-bit key words of a 64-bit key."""
    return key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF


def draw_key(generator: torch.Generator | None) -> tuple[int, int]:
    """The 64-bit Philox key of one kernel call, as two 32-bit words: one draw from ``generator``."""
    return _split_key(int(torch.randint(0, 2**62, (1,), generator=generator, dtype=torch.int64)))


def _draw(mu: Tensor, sd: Tensor, n_samples: int, k0: int, k1: int) -> tuple[Tensor, Tensor, Tensor]:
    """The forward kernel: ``(h, h^2, eps)``, each ``(n_samples, R, H)``, split over threads by sample."""
    lib = _NATIVE.get()
    assert lib is not None
    mu, sd = mu.detach().contiguous(), sd.detach().contiguous()
    rows, width = mu.shape
    eps = torch.empty((n_samples, rows, width), dtype=mu.dtype)
    h = torch.empty_like(eps)
    h2 = torch.empty_like(eps)
    n = rows * width

    def fwd(s0: int, s1: int, nt: int) -> None:
        lib.pgvi_relu_sample_fwd_run(mu.data_ptr(), sd.data_ptr(), n, s0, s1, nt, k0, k1, eps.data_ptr(),
                                     h.data_ptr(), h2.data_ptr())

    run_parallel(_NATIVE, fwd, n_samples)
    return h, h2, eps


def _grads_from_h(h: Tensor, eps: Tensor, gh: Tensor, gh2: Tensor | None) -> tuple[Tensor, Tensor]:
    """The backward kernel given the gradients w.r.t. ``h`` and (optionally) ``h^2``: ``(d/dmu, d/dsd)``, each
    ``(R, H)``, split over threads by row."""
    lib = _NATIVE.get()
    assert lib is not None
    n_samples, rows, width = h.shape
    dmu = torch.empty((rows, width), dtype=h.dtype)
    dsd = torch.empty_like(dmu)

    def bwd(r0: int, r1: int, nt: int) -> None:
        lib.pgvi_relu_sample_bwd_run(gh.data_ptr(), None if gh2 is None else gh2.data_ptr(), h.data_ptr(),
                                     eps.data_ptr(), n_samples, rows, width, r0, r1, nt, dmu.data_ptr(),
                                     dsd.data_ptr())

    run_parallel(_NATIVE, bwd, rows)
    return dmu, dsd


class _SampleReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mu: Tensor, sd: Tensor, n_samples: int, k0: int, k1: int):  # type: ignore[override]
        h, h2, eps = _draw(mu, sd, n_samples, k0, k1)
        ctx.save_for_backward(h, eps)
        ctx.mark_non_differentiable(eps)
        ctx.set_materialize_grads(False)  # no (S, R, H) zero tensors for the outputs that get no gradient
        return h, h2, eps

    @staticmethod
    def backward(ctx, grad_h: Tensor | None, grad_h2: Tensor | None, _grad_eps: Tensor | None):  # type: ignore[override]
        h, eps = ctx.saved_tensors
        if grad_h is None and grad_h2 is None:
            return None, None, None, None, None
        gh = torch.zeros_like(h) if grad_h is None else grad_h.contiguous()
        gh2 = None if grad_h2 is None else grad_h2.contiguous()
        dmu, dsd = _grads_from_h(h, eps, gh, gh2)
        return dmu, dsd, None, None, None


def _check(mu: Tensor, sd: Tensor, n_samples: int, what: str) -> None:
    if mu.dim() != 2 or sd.shape != mu.shape:
        raise ValueError(f"{what}: mu and sd must be (R, H) of one shape, got {tuple(mu.shape)}, {tuple(sd.shape)}")
    if not applies_to(mu) or sd.dtype != mu.dtype:
        raise RuntimeError(f"{what}: needs float32 CPU tensors and the compiled kernels (see applies_to)")
    if n_samples < 1 or n_samples >= 2**32:
        raise ValueError(f"{what}: n_samples must be in [1, 2^32), got {n_samples}")
    if mu.numel() >= 2**34:
        raise ValueError(f"{what}: more than 2^34 elements per sample")


def sample_relu(
    mu: Tensor, sd: Tensor, n_samples: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(h, h^2, eps)`` with ``h = relu(mu + sd * eps)``, ``eps ~ N(0, I)`` of shape ``(n_samples, R, H)``
    for ``mu, sd`` of shape ``(R, H)`` (float32, CPU); differentiable w.r.t. ``mu`` and ``sd`` through ``h``
    and ``h^2`` (``eps`` is returned for tests and diagnostics).  Call only where :func:`applies_to` holds."""
    _check(mu, sd, n_samples, "sample_relu")
    k0, k1 = draw_key(generator)
    return _SampleReLU.apply(mu, sd, int(n_samples), k0, k1)


#: Widest next layer whose input gradients the backward kernel forms itself (wider: two torch GEMMs).
MAX_FOLDED_WIDTH = 32


class _SampleReLULinear(torch.autograd.Function):
    """``(mu', var')`` of the next layer: ``h W_mu^T + b_mu`` and ``h^2 W_var^T + b_var`` with ``h`` from
    :class:`_SampleReLU`'s forward; the backward forms ``d/dh`` and ``d/dh^2`` inside the kernel."""

    @staticmethod
    def forward(ctx, mu: Tensor, sd: Tensor, w_mean: Tensor, b_mean: Tensor, w_var: Tensor, b_var: Tensor,  # type: ignore[override]
                n_samples: int, k0: int, k1: int) -> tuple[Tensor, Tensor]:
        h, h2, eps = _draw(mu, sd, n_samples, k0, k1)
        rows, width = mu.shape
        hf, h2f = h.view(n_samples * rows, width), h2.view(n_samples * rows, width)
        w_mean, w_var = w_mean.detach(), w_var.detach()
        mu_next = torch.addmm(b_mean.detach(), hf, w_mean.t())
        var_next = torch.addmm(b_var.detach(), h2f, w_var.t())
        ctx.save_for_backward(h, h2, eps, w_mean, w_var)
        ctx.set_materialize_grads(False)
        return mu_next, var_next

    @staticmethod
    def backward(ctx, g_mu: Tensor | None, g_var: Tensor | None):  # type: ignore[override]
        lib = _NATIVE.get()
        assert lib is not None
        h, h2, eps, w_mean, w_var = ctx.saved_tensors
        n_samples, rows, width = h.shape
        out = w_mean.shape[0]
        if g_mu is None and g_var is None:
            return (None,) * 9
        g_mu = torch.zeros((n_samples * rows, out), dtype=h.dtype) if g_mu is None else g_mu.contiguous()
        g_var = torch.zeros((n_samples * rows, out), dtype=h.dtype) if g_var is None else g_var.contiguous()
        hf, h2f = h.view(n_samples * rows, width), h2.view(n_samples * rows, width)
        need = ctx.needs_input_grad
        d_wm = torch.mm(g_mu.t(), hf) if need[2] else None
        d_bm = g_mu.sum(0) if need[3] else None
        d_wv = torch.mm(g_var.t(), h2f) if need[4] else None
        d_bv = g_var.sum(0) if need[5] else None
        d_mu = d_sd = None
        if (need[0] or need[1]) and out > MAX_FOLDED_WIDTH:  # wide next layer: d/dh, d/dh^2 by torch GEMMs
            d_mu, d_sd = _grads_from_h(h, eps, torch.mm(g_mu, w_mean), torch.mm(g_var, w_var))
        elif need[0] or need[1]:
            d_mu = torch.empty((rows, width), dtype=h.dtype)
            d_sd = torch.empty_like(d_mu)
            wm, wv = w_mean.contiguous(), w_var.contiguous()

            def bwd(r0: int, r1: int, nt: int) -> None:
                if lib.pgvi_relu_sample_bwd_linear_run(g_mu.data_ptr(), g_var.data_ptr(), wm.data_ptr(),
                                                       wv.data_ptr(), out, h.data_ptr(), eps.data_ptr(), n_samples,
                                                       rows, width, r0, r1, nt, d_mu.data_ptr(), d_sd.data_ptr()):
                    raise MemoryError("fused sampling backward: out of memory")

            run_parallel(_NATIVE, bwd, rows)
        return d_mu, d_sd, d_wm, d_bm, d_wv, d_bv, None, None, None


def sample_relu_linear(
    mu: Tensor, sd: Tensor, w_mean: Tensor, b_mean: Tensor, w_var: Tensor, b_var: Tensor, n_samples: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """The next layer's pre-activation moments ``(h W_mu^T + b_mu, h^2 W_var^T + b_var)``, each of shape
    ``(n_samples R, out)``, for ``h`` the output of :func:`sample_relu` (the same draws for the same
    generator state); differentiable w.r.t. all six tensors.  Call only where :func:`applies_to` holds."""
    _check(mu, sd, n_samples, "sample_relu_linear")
    out = w_mean.shape[0] if w_mean.dim() == 2 else -1
    if (w_mean.shape != (out, mu.shape[1]) or w_var.shape != w_mean.shape or b_mean.shape != (out,)
            or b_var.shape != (out,)):
        raise ValueError(f"sample_relu_linear: weights must be (out, {mu.shape[1]}) and biases (out,), got "
                         f"{tuple(w_mean.shape)}, {tuple(b_mean.shape)}, {tuple(w_var.shape)}, {tuple(b_var.shape)}")
    k0, k1 = draw_key(generator)
    return _SampleReLULinear.apply(mu, sd, w_mean, b_mean, w_var, b_var, int(n_samples), k0, k1)


def philox_words(block0: int, stream: int, key: int) -> Tensor:
    """The raw Philox4x32-10 output of the 256 counters ``(block0 + c, stream, 0, 0)`` under ``key``: an
    int64 tensor ``(4, 256)`` holding word ``j`` of counter ``c`` at ``[j, c]`` (for the known-answer test)."""
    lib = _NATIVE.get()
    if lib is None:
        raise RuntimeError("fused sampling kernels are not available")
    out = torch.empty(4 * 256, dtype=torch.int32)
    lib.pgvi_philox_raw(out.data_ptr(), block0, stream, *_split_key(key))
    return out.view(4, 256).to(torch.int64) & 0xFFFFFFFF


def standard_normal(n: int, stream: int, key: int) -> Tensor:
    """``n`` standard normals of the compiled generator's ``stream`` under the 64-bit ``key`` (for tests:
    the same numbers :func:`sample_relu` uses as ``eps`` of sample ``stream``)."""
    lib = _NATIVE.get()
    if lib is None:
        raise RuntimeError("fused sampling kernels are not available")
    out = torch.empty(n, dtype=torch.float32)
    lib.pgvi_normals(out.data_ptr(), n, stream, *_split_key(key))
    return out


__all__ = ["MAX_FOLDED_WIDTH", "PHILOX_SOURCE", "philox_words", "applies_to", "available", "draw_key", "sample_relu",
           "sample_relu_linear", "standard_normal"]
