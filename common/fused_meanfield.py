"""Fused parameter side of a mean-field local GVI step: scales, variances and ``D(q || cavity)`` in one pass.

Per coordinate, :class:`~common.variational.MeanFieldVariational` has a mean ``m`` and a raw scale ``r`` with
``sigma = softplus(r) + min_scale``; the step needs ``v = sigma^2`` (for the model's variance GEMMs) and the
divergence to the fixed mean-field cavity ``(mu_p, lambda_p)`` in the moment forms of
:class:`common.local_gvi.MeanFieldMomentDivergence` (KL and weighted KL, reverse KL, Alpha-Renyi).  In torch
that is about 20 element-wise kernels forward and 10 backward over every coordinate (2.2 ms per step for
the 159,010 coordinates of the 784-200-10 BNN with KL, 3.0 ms with Alpha-Renyi, one thread).  Here one C
pass computes ``v`` and the divergence's sum (per-coordinate terms in float32 with the same cancellation-free
``log1p`` forms, by Goldberg's rewrite on the vectorised ``logf``, and the same switch to the log of the variance
ratio itself where it is far from 1 (:func:`common.fast_math.log_ratio`); the sum in float64), and one backward pass turns the loss's gradient w.r.t. ``v`` plus the
divergence's analytic gradient into the gradients w.r.t. ``m`` and ``r``
(``d/dr = (g_v + g_D dD/dv) 2 sigma sigmoid(r)``).

float32 CPU tensors only, built by :class:`common.native.NativeLibrary`; elsewhere (float64, no compiler,
``PGVI_FUSED_KERNELS=0``) the caller keeps the torch path.  The Alpha-Renyi divergence's undefined region
(``1 + (1 - alpha)(lambda_p v - 1) <= 0``) is counted by the kernel and reported by the caller with the same
typed error as the torch path.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from common.native import NativeLibrary, run_parallel

KINDS = {"kl": 0, "reverse_kl": 1, "alpha_renyi": 2}

BLOCK = 4096  # elements per partial sum and per thread-chunk boundary (a multiple of every vector width)

_C_SOURCE = r"""
/* No contraction of a * b + c into one rounding anywhere below (fmaf where one is meant): the fused update's
   arithmetic must be the backward's followed by torch's Adam operation for operation, which a compiler's
   contraction choices would otherwise decide. */
#pragma GCC optimize ("fp-contract=off")
#pragma STDC FP_CONTRACT OFF
#include <stdlib.h>
#define BLOCK 4096
/* var[i] = (softplus(raw[i]) + min_scale)^2 and chain[i] = d var[i] / d raw[i] for i in [lo, hi) (lo a multiple of BLOCK); partial[b] = sum of the
   divergence's terms (without the factor c) over block b = [b BLOCK, (b + 1) BLOCK) in [lo, hi); returns the
   number of Alpha-Renyi coordinates outside the domain, or -1 if out of memory.  Every block but the array's last is a whole number
   of vectors, so the results do not depend on how [0, n) is split over threads.
   Each block runs in passes with one libm call each (exp, log of the softplus, log of the divergence's
   argument(s)), through BLOCK-sized buffers: a vector libm call clobbers every vector register, and one loop
   with three calls spilled and reloaded its whole state around each (2x slower on AVX2).  The arithmetic is
   the single loop's, operation for operation: log1p_f(x) = log(1 + x) x / ((1 + x) - 1). */
static inline float log1p_from(float x, float lg, float u) { /* lg = logf(u), u = 1 + x */
    float d = u - 1.0f;
    return d == 0.0f ? x : lg * (x / d);
}
/* log(r) for a ratio r with x = r - 1 as rounded: the log's argument is 1 + x (Goldberg's log1p) where |x| <= 1/2
   and r itself elsewhere, where x may have lost r's digits (r - 1 is -1 in float32 for r < 3e-8: the KL was inf) */
static inline int ratio_far(float x) { return !(fabsf(x) <= 0.5f); }
static inline float log_arg(float x, float r) { return ratio_far(x) ? r : 1.0f + x; }
static inline float log_ratio(float x, float lg, float e) { /* lg = logf(e), e = log_arg(x, r) */
    return ratio_far(x) ? lg : log1p_from(x, lg, e);
}
int64_t pgvi_mf_forward(const float *restrict loc, const float *restrict raw, const float *restrict mp,
                        const float *restrict lp, int64_t lo, int64_t hi, int kind, double alpha, float min_scale,
                        float *restrict var, float *restrict chain, double *restrict partial) {
    int64_t nbad = 0;
    float c1 = (float)(1.0 - alpha), inv_aa = kind == 2 ? (float)(1.0 / (alpha * (alpha - 1.0))) : 0.0f;
    /* six BLOCK buffers (96 kB) on the heap: threads may have small stacks (musl's default is 128 kB) */
    float *buf = (float *)malloc(sizeof(float) * 6 * BLOCK);
    if (!buf) return -1;
    float *t = buf, *lg = t + BLOCK, *x1 = lg + BLOCK, *e1 = x1 + BLOCK, *x2 = e1 + BLOCK, *e2 = x2 + BLOCK;
    for (int64_t b0 = lo; b0 < hi; b0 += BLOCK) {
        int64_t n = (b0 + BLOCK < hi ? b0 + BLOCK : hi) - b0;
        const float *rw = raw + b0, *l_ = lp + b0, *lc = loc + b0, *m_ = mp + b0;
        float *vr = var + b0, *chn = chain + b0;
        double acc = 0.0;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) t[i] = expf(-fabsf(rw[i]));
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) lg[i] = logf(1.0f + t[i]);
        /* s = softplus(x) + min_scale (Goldberg's log1p of t), ch = d(s^2)/dx = 2 s sigmoid(x) */
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float x = rw[i], t_ = t[i], u_ = 1.0f + t_;
            float s = (x > 0.0f ? x : 0.0f) + log1p_from(t_, lg[i], u_) + min_scale;
            chn[i] = 2.0f * s * (x > 0.0f ? 1.0f : t_) / u_;
            vr[i] = s * s;
        }
        /* the argument(s) of the divergence's log1p: one loop per kind (a branch inside would keep it scalar) */
        if (kind == 0) {
            #pragma omp simd
            for (int64_t i = 0; i < n; i++) { float r = l_[i] * vr[i]; x1[i] = r - 1.0f; e1[i] = log_arg(x1[i], r); }
        } else if (kind == 1) {
            #pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                float r = 1.0f / (l_[i] * vr[i]);
                x1[i] = r - 1.0f; e1[i] = log_arg(x1[i], r);
            }
        } else {
            #pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                float r = l_[i] * vr[i], u = r - 1.0f;
                x1[i] = c1 * u; e1[i] = 1.0f + x1[i]; x2[i] = u; e2[i] = log_arg(u, r);
            }
        }
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) t[i] = logf(e1[i]);
        if (kind == 2) {
            #pragma omp simd
            for (int64_t i = 0; i < n; i++) lg[i] = logf(e2[i]);
        }
        if (kind == 0) {
            /* lambda_p d d as common.local_gvi's moment form: lambda_p d overflows only where the term does (for
               |d| <= 1, |lambda_p d| <= lambda_p) */
            #pragma omp simd reduction(+:acc)
            for (int64_t i = 0; i < n; i++) {
                float u = x1[i], d = lc[i] - m_[i];
                acc += (double)(u - log_ratio(u, t[i], e1[i]) + l_[i] * d * d);
            }
        } else if (kind == 1) {
            /* d^2 / v as (d / v) d, as common.local_gvi's moment form: d d overflowed at |d| ~ 2e19 where the
               term is finite (v > 1) */
            #pragma omp simd reduction(+:acc)
            for (int64_t i = 0; i < n; i++) {
                float w = x1[i], d = lc[i] - m_[i];
                acc += (double)(w - log_ratio(w, t[i], e1[i]) + (d / vr[i]) * d);
            }
        } else {
            /* the mean term lambda_p d^2 / (1 + a) as (lam_pa d) d with lam_pa = (1 / (1 + a)) lambda_p, the
               operations of common.local_gvi's moment form and of mf_grads: lambda_p d d first overflowed float32
               at lambda_p ~ 1e20, d ~ 1e10 where the term is ~1e20 (a ~ lambda_p v).  (lam_pa d) d overflows only
               where the term does: for |d| <= 1, |lam_pa d| <= lam_pa */
            #pragma omp simd reduction(+:acc, nbad)
            for (int64_t i = 0; i < n; i++) {
                float a = x1[i], u = x2[i], d = lc[i] - m_[i], lam_pa = (1.0f / (1.0f + a)) * l_[i];
                nbad += (1.0f + a > 0.0f) ? 0 : 1;
                acc += (double)((lam_pa * d) * d
                                - (log1p_from(a, t[i], e1[i]) - c1 * log_ratio(u, lg[i], e2[i])) * inv_aa);
            }
        }
        partial[b0 / BLOCK] = acc;
    }
    free(buf);
    return nbad;
}

/* The backward's Alpha-Renyi constants c1 = 1 - alpha and 1 / alpha, formed in double and rounded once to float,
   as pgvi_mf_forward forms its c1: near alpha = 1, 1.0f - (float)alpha is 1 - alpha to only 6e-8 absolute
   (float32's spacing at 1), a relative error of 6e-8 / |1 - alpha| (5 % at alpha = 1 + 1e-6) in the gradient
   of the value the forward returned.  For an alpha that is a float32 number both forms give the same bits
   (one operation on floats, evaluated in double and rounded once, is correctly rounded). */
static inline void alpha_constants(int kind, double alpha, float *c1, float *inv_alpha) {
    *c1 = (float)(1.0 - alpha);
    *inv_alpha = kind == 2 ? (float)(1.0 / alpha) : 0.0f;
}

/* g_div dD/dm and (gvar + g_div dD/dv) chain at one coordinate (gvar: the loss's gradient w.r.t. v, 0 if none).
   Products of d go through the factor that keeps them in range, as pgvi_mf_forward's terms do: lambda_p d (KL),
   d / v (reverse KL), lam_pa d with lam_pa = lambda_p / (1 + a) (Alpha-Renyi; lambda_p d first overflowed at
   lambda_p ~ 1e30, d ~ 1e10 where the gradient is finite).  2 x is exact, so 2 (l d) is 2 l d's bits. */
static inline void mf_grads(float m, float v, float c, float mp, float l, float gvar, float g_div, int kind,
                            float c1, float inv_alpha, float *g_m, float *g_r) {
    float d = m - mp, dm, dv;
    if (kind == 0) {
        dm = 2.0f * (l * d);
        dv = l - 1.0f / v;
    } else if (kind == 1) {
        float iv = 1.0f / v, di = d * iv;
        dm = 2.0f * di;
        dv = (1.0f - iv / l - di * d) * iv;
    } else {
        float u = l * v - 1.0f, inv1a = 1.0f / (1.0f + c1 * u), lam_pa = inv1a * l, t = lam_pa * d;
        dm = 2.0f * t;
        dv = -c1 * t * t + (lam_pa - 1.0f / v) * inv_alpha; /* l / (1 + u) = 1 / v, without u's rounding */
    }
    *g_m = g_div * dm;
    *g_r = (gvar + g_div * dv) * c;
}

/* gloc[i] = g_div dD/dm, graw[i] = (gvar[i] + g_div dD/dv) chain[i] for i in [lo, hi), with var and chain from
   pgvi_mf_forward; gvar may be NULL (no loss gradient w.r.t. v) */
void pgvi_mf_backward(const float *restrict loc, const float *restrict var, const float *restrict chain,
                      const float *restrict mp, const float *restrict lp, const float *restrict gvar, float g_div,
                      int64_t lo, int64_t hi, int kind, double alpha, float *restrict gloc, float *restrict graw) {
    float c1, inv_alpha;
    alpha_constants(kind, alpha, &c1, &inv_alpha);
    #pragma omp simd
    for (int64_t i = lo; i < hi; i++)
        mf_grads(loc[i], var[i], chain[i], mp[i], lp[i], gvar ? gvar[i] : 0.0f, g_div, kind, c1, inv_alpha, gloc + i,
                 graw + i);
}

/* One Adam update of p[i] with gradient g, in the arithmetic of torch's fused CPU kernel (_fused_adam_, float32,
   no weight decay, no AMSGrad) as this machine's torch build does it: its vector loop over a tensor's first
   n - n % W elements (W its vector width: 8 floats for AVX2, 16 for AVX-512) forms the second moment as
   fma(c2 g, g, beta2 v), its scalar tail over the last n % W as fma(v, beta2, (c2 g) g); the first moment is
   torch's lerp: m + w (g - m) for a weight w = 1 - beta1 < 0.5, else g - (g - m)(1 - w), each one fma.  Python
   checks once, against torch._fused_adam_ itself, that these forms and W reproduce it bit for bit
   (fused_meanfield.adam_vector_width) and keeps the autograd path where they do not.  h: w, beta2, c2 = 1 - beta2,
   eps; nss = -lr / (1 - beta1^t), bc2s = sqrt(1 - beta2^t). */
static inline void adam_update(float *restrict p, float *restrict m, float *restrict v, int64_t i, float g,
                               const float *restrict h, float nss, float bc2s, int tail) {
    float mi = h[0] < 0.5f ? fmaf(h[0], g - m[i], m[i]) : fmaf(h[0] - 1.0f, g - m[i], g);
    float vi = tail ? fmaf(v[i], h[1], (h[2] * g) * g) : fmaf(h[2] * g, g, v[i] * h[1]);
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] + (nss * mi) / (sqrtf(vi) / bc2s + h[3]);
}

/* pgvi_mf_backward followed by loc's gradient + gloss and Adam on loc and raw for i in [lo, hi), all with the
   arithmetic of torch's vector loop (tail = 0) or of its scalar tail (tail = 1) */
static inline void mf_adam_range(int64_t lo, int64_t hi, int tail, const float *restrict var,
                                 const float *restrict chain, const float *restrict mp, const float *restrict lp,
                                 const float *restrict gvar, const float *restrict gloss, float g_div, int kind,
                                 float c1, float inv_alpha, float *restrict loc, float *restrict raw,
                                 float *restrict ml, float *restrict vl, float *restrict mr, float *restrict vr,
                                 const float *restrict h, const float *restrict a) {
    #pragma omp simd
    for (int64_t i = lo; i < hi; i++) {
        float gm, gr;
        mf_grads(loc[i], var[i], chain[i], mp[i], lp[i], gvar ? gvar[i] : 0.0f, g_div, kind, c1, inv_alpha, &gm,
                 &gr);
        if (gloss) gm = gm + gloss[i];
        adam_update(loc, ml, vl, i, gm, h, a[0], a[1], tail);
        adam_update(raw, mr, vr, i, gr, h, a[2], a[3], tail);
    }
}

/* pgvi_mf_backward followed by loc's gradient + gloss (the loss's gradient w.r.t. loc; NULL: none) and Adam on
   loc and raw, for i in [lo, hi) of a tensor of n elements; a[0..3] = loc's -lr/bc1, sqrt(bc2), raw's; vw: the
   vector width of torch's Adam loop (the last n % vw elements of the tensor take its scalar tail's arithmetic) */
void pgvi_mf_backward_adam(const float *restrict var, const float *restrict chain, const float *restrict mp,
                           const float *restrict lp, const float *restrict gvar, const float *restrict gloss,
                           float g_div, int64_t lo, int64_t hi, int64_t n, int64_t vw, int kind, double alpha,
                           float *restrict loc, float *restrict raw, float *restrict ml, float *restrict vl,
                           float *restrict mr, float *restrict vr, const float *restrict h,
                           const float *restrict a) {
    float c1, inv_alpha;
    alpha_constants(kind, alpha, &c1, &inv_alpha);
    int64_t nv = n - n % vw;
    mf_adam_range(lo, hi < nv ? hi : nv, 0, var, chain, mp, lp, gvar, gloss, g_div, kind, c1, inv_alpha, loc, raw,
                  ml, vl, mr, vr, h, a);
    mf_adam_range(lo > nv ? lo : nv, hi, 1, var, chain, mp, lp, gvar, gloss, g_div, kind, c1, inv_alpha, loc, raw,
                  ml, vl, mr, vr, h, a);
}

/* Adam alone on p (gradient g) for n elements with vector width vw: the arithmetic of adam_update, for the
   one-time comparison with torch._fused_adam_ */
void pgvi_adam_only(const float *restrict g, int64_t n, int64_t vw, float *restrict p, float *restrict m,
                    float *restrict v, const float *restrict h, float nss, float bc2s) {
    int64_t nv = n - n % vw;
    for (int64_t i = 0; i < n; i++) adam_update(p, m, v, i, g[i], h, nss, bc2s, i >= nv);
}

/* The parallel drivers, over T tensors in one call (a step's weights and biases: one call instead of one per
   tensor).  Tensor i has n[i] elements and the blocks [off[i], off[i + 1]) of one numbering of all the tensors'
   blocks; its arrays are at the addresses p[K i + 0 .. K - 1].  The global blocks [g0, g1) are split over nt
   OpenMP threads (pgvi_split); each thread runs the kernels on its blocks' parts of each tensor. */
static inline const float *fp(int64_t a) { return (const float *)(intptr_t)a; }
static inline float *wp(int64_t a) { return (float *)(intptr_t)a; }
/* the elements [e0, e1) of tensor i that lie in the global blocks [a, b); 0 if none */
static inline int tensor_part(const int64_t *n, const int64_t *off, int64_t i, int64_t a, int64_t b, int64_t *e0,
                              int64_t *e1) {
    int64_t lo = a > off[i] ? a : off[i], hi = b < off[i + 1] ? b : off[i + 1];
    if (lo >= hi) return 0;
    *e0 = (lo - off[i]) * BLOCK;
    *e1 = (hi - off[i]) * BLOCK < n[i] ? (hi - off[i]) * BLOCK : n[i];
    return 1;
}

/* p: loc, raw, mp, lp, var, chain (K = 6); partial[g] = block g's sum; bad[t T + i] += the Alpha-Renyi count of
   thread t's part of tensor i (a row per thread: no shared counter, with or without OpenMP).  Returns 1 if out
   of memory. */
int pgvi_mf_forward_many(int64_t T, const int64_t *restrict p, const int64_t *restrict n,
                         const int64_t *restrict off, int64_t g0, int64_t g1, int nt, int kind, double alpha,
                         float min_scale, double *restrict partial, int64_t *restrict bad) {
    int oom = 0;
    const uint32_t fpm = pgvi_fp_mode(); /* every part in the caller's floating-point mode (PRELUDE) */
    #pragma omp parallel for num_threads(nt) schedule(static) reduction(|:oom)
    for (int t = 0; t < nt; t++) {
        uint32_t fps = pgvi_fp_enter(fpm);
        int64_t a = pgvi_split(g0, g1, 1, t, nt), b = pgvi_split(g0, g1, 1, t + 1, nt);
        int64_t e0, e1;
        for (int64_t i = 0; i < T; i++) {
            if (!tensor_part(n, off, i, a, b, &e0, &e1)) continue;
            const int64_t *q = p + 6 * i;
            int64_t r = pgvi_mf_forward(fp(q[0]), fp(q[1]), fp(q[2]), fp(q[3]), e0, e1, kind, alpha, min_scale,
                                        wp(q[4]), wp(q[5]), partial + off[i]);
            if (r < 0) oom = 1; else bad[t * T + i] += r;
        }
        pgvi_fp_enter(fps);
    }
    return oom;
}

/* The drivers' loop: thread t of nt takes the global blocks pgvi_split gives it, and BODY runs for each tensor i
   with a part [e0, e1) in them (T, n, off, g0, g1, nt from the enclosing function), in the calling thread's
   floating-point mode (PRELUDE). */
#define PGVI_EACH_TENSOR_PART(BODY) \
    const uint32_t fpm_ = pgvi_fp_mode(); \
    _Pragma("omp parallel for num_threads(nt) schedule(static)") \
    for (int t = 0; t < nt; t++) { \
        uint32_t fps_ = pgvi_fp_enter(fpm_); \
        int64_t b0_ = pgvi_split(g0, g1, 1, t, nt), b1_ = pgvi_split(g0, g1, 1, t + 1, nt), e0, e1; \
        for (int64_t i = 0; i < T; i++) \
            if (tensor_part(n, off, i, b0_, b1_, &e0, &e1)) { BODY } \
        pgvi_fp_enter(fps_); \
    }

/* p: loc, var, chain, mp, lp, gvar (0: no loss gradient), gloc, graw (K = 8) */
void pgvi_mf_backward_many(int64_t T, const int64_t *restrict p, const int64_t *restrict n,
                           const int64_t *restrict off, float g_div, int64_t g0, int64_t g1, int nt, int kind,
                           double alpha) {
    PGVI_EACH_TENSOR_PART(
        const int64_t *q = p + 8 * i;
        pgvi_mf_backward(fp(q[0]), fp(q[1]), fp(q[2]), fp(q[3]), fp(q[4]), q[5] ? fp(q[5]) : NULL, g_div, e0, e1,
                         kind, alpha, wp(q[6]), wp(q[7]));
    )
}

/* p: var, chain, mp, lp, gvar (0: none), gloss (0: none), loc, raw, m_loc, v_loc, m_raw, v_raw (K = 12);
   a[4 i .. 4 i + 3]: tensor i's Adam step terms (see pgvi_mf_backward_adam); h: the shared Adam constants */
void pgvi_mf_backward_adam_many(int64_t T, const int64_t *restrict p, const int64_t *restrict n,
                                const int64_t *restrict off, float g_div, int64_t g0, int64_t g1, int nt, int kind,
                                double alpha, int64_t vw, const float *restrict h, const float *restrict a) {
    PGVI_EACH_TENSOR_PART(
        const int64_t *q = p + 12 * i;
        pgvi_mf_backward_adam(fp(q[0]), fp(q[1]), fp(q[2]), fp(q[3]), q[4] ? fp(q[4]) : NULL, q[5] ? fp(q[5]) : NULL,
                              g_div, e0, e1, n[i], vw, kind, alpha, wp(q[6]), wp(q[7]), wp(q[8]), wp(q[9]), wp(q[10]),
                              wp(q[11]), h, a + 4 * i);
    )
}

/* pgvi_mf_backward_adam_many followed, block by block, by pgvi_mf_forward_many at the updated parameters: each
   block's loc and raw are still in cache when the next step's variances, chains and divergence terms are formed
   from them.  The same arithmetic as the two calls one after the other (the forward of a block reads only that
   block), so the same bits.  p: as pgvi_mf_backward_adam_many's (K = 12; var and chain are read, then
   overwritten); partial, bad, min_scale: as pgvi_mf_forward_many's.  Returns 1 if out of memory. */
int pgvi_mf_adam_forward_many(int64_t T, const int64_t *restrict p, const int64_t *restrict n,
                              const int64_t *restrict off, float g_div, int64_t g0, int64_t g1, int nt, int kind,
                              double alpha, int64_t vw, const float *restrict h, const float *restrict a,
                              float min_scale, double *restrict partial, int64_t *restrict bad) {
    int oom = 0;
    const uint32_t fpm = pgvi_fp_mode(); /* every part in the caller's floating-point mode (PRELUDE) */
    #pragma omp parallel for num_threads(nt) schedule(static) reduction(|:oom)
    for (int t = 0; t < nt; t++) {
        uint32_t fps = pgvi_fp_enter(fpm);
        int64_t b0_ = pgvi_split(g0, g1, 1, t, nt), b1_ = pgvi_split(g0, g1, 1, t + 1, nt), e0, e1;
        for (int64_t i = 0; i < T; i++) {
            if (!tensor_part(n, off, i, b0_, b1_, &e0, &e1)) continue;
            const int64_t *q = p + 12 * i;
            for (int64_t lo = e0; lo < e1; lo += BLOCK) {
                int64_t hi = lo + BLOCK < e1 ? lo + BLOCK : e1;
                pgvi_mf_backward_adam(fp(q[0]), fp(q[1]), fp(q[2]), fp(q[3]), q[4] ? fp(q[4]) : NULL,
                                      q[5] ? fp(q[5]) : NULL, g_div, lo, hi, n[i], vw, kind, alpha, wp(q[6]), wp(q[7]),
                                      wp(q[8]), wp(q[9]), wp(q[10]), wp(q[11]), h, a + 4 * i);
                int64_t r = pgvi_mf_forward(fp(q[6]), fp(q[7]), fp(q[2]), fp(q[3]), lo, hi, kind, alpha, min_scale,
                                            wp(q[0]), wp(q[1]), partial + off[i]);
                if (r < 0) oom = 1; else bad[t * T + i] += r;
            }
        }
        pgvi_fp_enter(fps);
    }
    return oom;
}
"""

_I64, _F32, _F64, _INT, _VP = ctypes.c_int64, ctypes.c_float, ctypes.c_double, ctypes.c_int, ctypes.c_void_p


def _self_check(lib: ctypes.CDLL) -> None:
    """KL of N(0, sigma^2) from N(0, 1) at sigma = softplus(0) = log 2 against the closed form."""
    z = torch.zeros(64)
    lam = torch.ones(64)
    var = torch.empty(64)
    partial = torch.zeros(1, dtype=torch.float64)
    chain = torch.empty(64)
    lib.pgvi_mf_forward(z.data_ptr(), z.data_ptr(), z.data_ptr(), lam.data_ptr(), 0, 64, 0, 1.0, 0.0, var.data_ptr(),
                        chain.data_ptr(), partial.data_ptr())
    total = float(partial[0])
    v = 0.6931471805599453**2
    want = 64 * (v - 1.0 - torch.log(torch.tensor(v, dtype=torch.float64)).item())
    if not (abs(total - want) < 1e-5 * abs(want) and abs(float(var[0]) - v) < 1e-6):
        raise RuntimeError("the compiled mean-field kernel failed its self-check")


_NATIVE = NativeLibrary(
    "meanfield",
    _C_SOURCE,
    {
        "pgvi_mf_forward": ([_VP, _VP, _VP, _VP, _I64, _I64, _INT, _F64, _F32, _VP, _VP, _VP], _I64),
        "pgvi_mf_forward_many": ([_I64, _VP, _VP, _VP, _I64, _I64, _INT, _INT, _F64, _F32, _VP, _VP], _INT),
        "pgvi_mf_backward_many": ([_I64, _VP, _VP, _VP, _F32, _I64, _I64, _INT, _INT, _F64], None),
        "pgvi_mf_backward_adam_many": ([_I64, _VP, _VP, _VP, _F32, _I64, _I64, _INT, _INT, _F64, _I64, _VP, _VP],
                                       None),
        "pgvi_mf_adam_forward_many": ([_I64, _VP, _VP, _VP, _F32, _I64, _I64, _INT, _INT, _F64, _I64, _VP, _VP,
                                       _F32, _VP, _VP], _INT),
        "pgvi_adam_only": ([_VP, _I64, _I64, _VP, _VP, _VP, _VP, _F32, _F32], None),
    },
    _self_check,
)


def available() -> bool:
    return _NATIVE.get() is not None


def applies_to(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and available()


def blocks(tensors: list[Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Element counts and the global block numbering's offsets (``off[i]`` = the first block of tensor ``i``)."""
    n = np.array([t.numel() for t in tensors], dtype=np.int64)
    off = np.zeros(len(tensors) + 1, dtype=np.int64)
    np.cumsum(-(-n // BLOCK), out=off[1:])
    return n, off


@dataclass
class MomentPass:
    """What the forward pass leaves for the backward: the inputs, the variances and ``d var / d raw``, and
    the block numbering (see :func:`forward`)."""

    locs: list[Tensor]
    variances: list[Tensor]
    chains: list[Tensor]
    mean_ps: list[Tensor]
    lam_ps: list[Tensor]
    n: np.ndarray
    off: np.ndarray


def forward(locs: list[Tensor], raws: list[Tensor], mean_ps: list[Tensor], lam_ps: list[Tensor], kind: int,
            alpha: float, min_scale: float, numbering: tuple[np.ndarray, np.ndarray] | None = None,
            out: tuple[list[Tensor], list[Tensor]] | None = None) -> tuple[MomentPass, float, np.ndarray]:
    """One C call over T tensors (contiguous float32, detached): ``(state, sum_i sum_j f_ij, undefined counts
    per tensor)``, the variances in ``state.variances``.  No autograd: :class:`_VariancesAndDivergence` and
    :mod:`common.explicit_step` both run it.  A caller that repeats the call on tensors of fixed shapes may pass
    their :func:`blocks` and reuse buffers for the variances and the chains (``out``: two lists of contiguous
    float32 tensors shaped like ``locs``)."""
    lib = _NATIVE.get()
    assert lib is not None
    t_count = len(locs)
    n, off = blocks(locs) if numbering is None else numbering
    if out is None:
        variances = [torch.empty_like(loc) for loc in locs]
        chains = [torch.empty_like(loc) for loc in locs]  # d var / d raw, for the backward
    else:
        variances, chains = out
    ptrs = np.array([t.data_ptr() for i in range(t_count)
                     for t in (locs[i], raws[i], mean_ps[i], lam_ps[i], variances[i], chains[i])], dtype=np.int64)
    total, bad = _divergence_sums(
        t_count, int(off[-1]),
        lambda g0, g1, nt, partial, counts: lib.pgvi_mf_forward_many(
            t_count, ptrs.ctypes.data, n.ctypes.data, off.ctypes.data, g0, g1, nt, kind, alpha, min_scale,
            partial, counts))
    return MomentPass(locs, variances, chains, mean_ps, lam_ps, n, off), total, bad


def _divergence_sums(t_count: int, n_blocks: int, driver: Callable[[int, int, int, int, int], int]
                     ) -> tuple[float, np.ndarray]:
    """Run a driver that forms the divergence's block sums, ``driver(g0, g1, threads, partial, counts) -> oom``
    (``partial``, ``counts``: addresses of the float64 block sums and of a ``(threads, T)`` int64 array of
    Alpha-Renyi counts), over the ``n_blocks`` blocks: ``(the sum, the undefined counts per tensor)``."""
    partial = np.zeros(n_blocks, dtype=np.float64)
    counts: list[np.ndarray] = []  # one (threads, T) array of Alpha-Renyi counts per driver call
    oom = [0]

    def run(g0: int, g1: int, nt: int) -> None:
        bad = np.zeros((nt, t_count), dtype=np.int64)
        counts.append(bad)
        if driver(g0, g1, nt, partial.ctypes.data, bad.ctypes.data):
            oom[0] = 1

    if n_blocks:
        run_parallel(_NATIVE, run, n_blocks)
    if oom[0]:
        raise MemoryError("fused mean-field kernel: out of memory")
    total = float(np.sum(partial))  # fixed blocks, fixed order: the same sum for any thread count
    return total, sum((c.sum(axis=0) for c in counts), np.zeros(t_count, dtype=np.int64))


def backward(state: MomentPass, g_vars: list[Tensor | None], g_div: float, kind: int, alpha: float
             ) -> tuple[list[Tensor], list[Tensor]]:
    """The gradients w.r.t. the locs and the raw scales, given the loss's gradients w.r.t. the variances
    (``None``: none) and ``g_div`` = the gradient w.r.t. the divergence's sum (already times ``c``)."""
    lib = _NATIVE.get()
    assert lib is not None
    t_count = len(state.locs)
    g_vars = [None if g is None else g.contiguous() for g in g_vars]
    g_locs = [torch.empty_like(loc) for loc in state.locs]
    g_raws = [torch.empty_like(loc) for loc in state.locs]
    ptrs = np.array([0 if t is None else t.data_ptr() for i in range(t_count)
                     for t in (state.locs[i], state.variances[i], state.chains[i], state.mean_ps[i], state.lam_ps[i],
                               g_vars[i], g_locs[i], g_raws[i])], dtype=np.int64)

    def bwd(g0: int, g1: int, nt: int) -> None:
        lib.pgvi_mf_backward_many(t_count, ptrs.ctypes.data, state.n.ctypes.data, state.off.ctypes.data, g_div, g0,
                                  g1, nt, kind, alpha)

    if state.off[-1]:
        run_parallel(_NATIVE, bwd, int(state.off[-1]))
    return g_locs, g_raws


def check_adam_operands(locs: list[Tensor], raws: list[Tensor], loc_states: Sequence[tuple],
                        raw_states: Sequence[tuple]) -> None:
    """Raise ``ValueError`` unless every raw scale and Adam state is a contiguous float32 tensor shaped like
    its loc (what :func:`backward_adam` writes through raw pointers).  ``loc_states[i]``, ``raw_states[i]``
    start with ``(exp_avg, exp_avg_sq)``: :meth:`common.adam.Adam.adam_states` or ``advance``'s terms."""
    for i, loc in enumerate(locs):
        for t in (raws[i], loc_states[i][0], loc_states[i][1], raw_states[i][0], raw_states[i][1]):
            if t.shape != loc.shape or not t.is_contiguous() or t.dtype != torch.float32:
                raise ValueError("backward_adam: raws and Adam states must be contiguous float32 like the locs")


#: The vector widths of torch's CPU Adam loop tried by :func:`adam_vector_width` (AVX2 and NEON: 8, AVX-512: 16).
_ADAM_WIDTHS = (8, 16, 4)


@functools.cache
def adam_vector_width(beta1: float, beta2: float, eps: float) -> int | None:
    """The vector width ``W`` with which the fused update reproduces this process's ``torch._fused_adam_`` bit for
    bit for Adam's ``beta1, beta2, eps``, or ``None`` if no width does (another torch
    build, e.g. ``ATEN_CPU_CAPABILITY=default`` whose vector loop rounds each operation apart): checked once per
    process and hyperparameters, over three steps on every tensor size from 1 to 40 and one of 1000, with gradients
    over six orders of magnitude.  The explicit step keeps the autograd path where this is ``None``."""
    from common.adam import Adam

    lib = _NATIVE.get()
    if lib is None or not hasattr(torch, "_fused_adam_"):
        return None
    g = torch.Generator().manual_seed(12345)
    sizes = [*range(1, 41), 1000]
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    grads = [[torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 3, (n,), generator=g).float() for n in sizes]
             for _ in range(3)]
    reference = Adam([(params, 1e-2)], betas=(beta1, beta2), eps=eps)
    counter = Adam([([torch.nn.Parameter(p.detach().clone()) for p in params], 1e-2)], betas=(beta1, beta2), eps=eps)
    if not reference.fused_applies(params):
        return None
    candidates = {w: [p.detach().clone() for p in params] for w in _ADAM_WIDTHS}
    states = {w: [(torch.zeros(n), torch.zeros(n)) for n in sizes] for w in _ADAM_WIDTHS}
    h = np.array(reference.constants(), dtype=np.float32)
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr
        reference.step()
        terms = counter.advance(counter.groups[0][0])
        for w in _ADAM_WIDTHS:
            for n, p, (m, v), gr, t in zip(sizes, candidates[w], states[w], step_grads, terms):
                lib.pgvi_adam_only(gr.data_ptr(), n, w, p.data_ptr(), m.data_ptr(), v.data_ptr(), h.ctypes.data,
                                   t[2], t[3])
    for w in _ADAM_WIDTHS:
        if all(torch.equal(c, p.detach()) and torch.equal(m, reference.exp_avg[id(p)])
               and torch.equal(v, reference.exp_avg_sq[id(p)])
               for c, (m, v), p in zip(candidates[w], states[w], params)):
            return w
    return None


def backward_adam(state: MomentPass, raws: list[Tensor], g_vars: list[Tensor | None], g_locs: list[Tensor | None],
                  g_div: float, kind: int, alpha: float, adam: tuple[float, float, float, float],
                  loc_terms: list[tuple[Tensor, Tensor, float, float]],
                  raw_terms: list[tuple[Tensor, Tensor, float, float]], vector_width: int,
                  validate: bool = True, forward_min_scale: float | None = None) -> tuple[float, np.ndarray] | None:
    """:func:`backward` and one Adam step in one pass, in place: the gradient w.r.t. ``state.locs[i]`` (which
    must be the parameters' own storage) is the divergence's plus ``g_locs[i]`` (the loss's; ``None``: none),
    the gradient w.r.t. ``raws[i]`` is :func:`backward`'s, and each parameter, its ``exp_avg`` and
    ``exp_avg_sq`` are updated as torch's fused Adam kernel would (``adam`` = :meth:`common.adam.Adam.constants`,
    the terms from :meth:`common.adam.Adam.advance` for the locs and the raws, ``vector_width`` from
    :func:`adam_vector_width` for the optimiser's hyperparameters).  The result is bit-identical to
    :func:`backward`, adding ``g_locs`` in torch and ``Adam.step`` (tests/test_fused_update.py).
    ``validate=False`` skips the checks of the operands (:func:`check_adam_operands`, the gradients' shapes and
    types) for a caller that made them itself.

    With ``forward_min_scale`` (the scales' floor), each block of the parameters is then passed through
    :func:`forward` while it is still in cache: ``state.variances`` and ``state.chains`` then hold the updated
    parameters' (the next step's :func:`forward` without its pass over memory) and the call returns
    :func:`forward`'s ``(total, undefined counts)``, the same bits as calling it next."""
    lib = _NATIVE.get()
    assert lib is not None
    t_count = len(state.locs)
    g_vars = [None if g is None else g.contiguous() for g in g_vars]
    g_locs = [None if g is None else g.contiguous() for g in g_locs]
    if validate:
        check_adam_operands(state.locs, raws, loc_terms, raw_terms)
        for loc, gv, gl in zip(state.locs, g_vars, g_locs):
            if any(g is not None and (g.shape != loc.shape or g.dtype != torch.float32) for g in (gv, gl)):
                raise ValueError("backward_adam: the loss's gradients must be float32 and shaped like the locs")
        if vector_width not in _ADAM_WIDTHS:
            raise ValueError(f"backward_adam: vector width must be one of {_ADAM_WIDTHS}, got {vector_width!r}")
    ptrs = np.array([0 if t is None else t.data_ptr() for i in range(t_count)
                     for t in (state.variances[i], state.chains[i], state.mean_ps[i], state.lam_ps[i], g_vars[i],
                               g_locs[i], state.locs[i], raws[i], loc_terms[i][0], loc_terms[i][1],
                               raw_terms[i][0], raw_terms[i][1])], dtype=np.int64)
    consts = np.array(adam, dtype=np.float32)  # float(double), as torch's kernel narrows them
    terms = np.array([(lt[2], lt[3], rt[2], rt[3]) for lt, rt in zip(loc_terms, raw_terms)], dtype=np.float32)

    if forward_min_scale is None:
        def upd(g0: int, g1: int, nt: int) -> None:
            lib.pgvi_mf_backward_adam_many(t_count, ptrs.ctypes.data, state.n.ctypes.data, state.off.ctypes.data,
                                           g_div, g0, g1, nt, kind, alpha, vector_width, consts.ctypes.data,
                                           terms.ctypes.data)

        if state.off[-1]:
            run_parallel(_NATIVE, upd, int(state.off[-1]))
        return None
    return _divergence_sums(
        t_count, int(state.off[-1]),
        lambda g0, g1, nt, partial, counts: lib.pgvi_mf_adam_forward_many(
            t_count, ptrs.ctypes.data, state.n.ctypes.data, state.off.ctypes.data, g_div, g0, g1, nt, kind, alpha,
            vector_width, consts.ctypes.data, terms.ctypes.data, forward_min_scale, partial, counts))


class _VariancesAndDivergence(torch.autograd.Function):
    """``(v_1 .. v_T, c sum_i sum_j f_ij, n_undefined per tensor)`` for T (loc, raw) pairs in one C call each way."""

    @staticmethod
    def forward(ctx, spec: tuple, *tensors: Tensor):  # type: ignore[override]
        kind, alpha, c, min_scale, mean_ps, lam_ps = spec
        t_count = len(mean_ps)
        locs = [t.detach().contiguous() for t in tensors[:t_count]]
        raws = [t.detach().contiguous() for t in tensors[t_count:]]
        state, total, bad = forward(locs, raws, mean_ps, lam_ps, kind, alpha, min_scale)
        # the cavity's tensors too: modified in place before the backward, they would give wrong gradients
        ctx.save_for_backward(*locs, *state.variances, *mean_ps, *lam_ps)
        ctx.chains, ctx.n, ctx.off = state.chains, state.n, state.off
        ctx.kind, ctx.alpha, ctx.c = kind, alpha, c
        ctx.set_materialize_grads(False)
        value = torch.tensor(c * total, dtype=locs[0].dtype)
        n_bad = torch.from_numpy(np.ascontiguousarray(bad))
        ctx.mark_non_differentiable(n_bad)
        return (*state.variances, value, n_bad)

    @staticmethod
    def backward(ctx, *grads: Tensor | None):  # type: ignore[override]
        saved = ctx.saved_tensors
        t_count = len(saved) // 4
        state = MomentPass(list(saved[:t_count]), list(saved[t_count:2 * t_count]), ctx.chains,
                           list(saved[2 * t_count:3 * t_count]), list(saved[3 * t_count:]), ctx.n, ctx.off)
        g_value = grads[t_count]
        g_div = 0.0 if g_value is None else float(g_value) * ctx.c
        g_locs, g_raws = backward(state, list(grads[:t_count]), g_div, ctx.kind, ctx.alpha)
        return (None, *g_locs, *g_raws)


def variances_and_divergence(locs: list[Tensor], raws: list[Tensor], mean_ps: list[Tensor], lam_ps: list[Tensor],
                             kind: str, alpha: float, c: float, min_scale: float
                             ) -> tuple[list[Tensor], Tensor, list[int]]:
    """For T tensors at once (one C call forward and one backward, whatever T):
    ``([v_1 .. v_T], c * sum_i sum_j f_ij, [n_undefined_1 .. n_undefined_T])`` with ``v_i = (softplus(raws[i]) +
    min_scale)^2`` and ``f_ij`` the divergence's per-coordinate moment form (see
    :class:`common.local_gvi.MeanFieldMomentDivergence`); differentiable w.r.t. ``locs`` and ``raws``.
    ``n_undefined_i`` counts tensor ``i``'s Alpha-Renyi coordinates outside the domain (the value is then
    meaningless: the caller raises).  The sum runs over fixed blocks in a fixed order, so it does not depend on
    the number of threads.  Call only where :func:`applies_to` holds for every tensor."""
    if kind not in KINDS:
        raise ValueError(f"unknown moment divergence {kind!r}")
    t_count = len(locs)
    if t_count == 0 or not (len(raws) == len(mean_ps) == len(lam_ps) == t_count):
        raise ValueError("variances_and_divergence: one raw scale, cavity mean and precision per mean")
    for group in zip(locs, raws, mean_ps, lam_ps):
        if any(t.shape != group[0].shape for t in group) or not all(applies_to(t) for t in group):
            raise ValueError("variances_and_divergence: four float32 CPU tensors of one shape per parameter")
    mean_ps = [t.detach().contiguous() for t in mean_ps]
    lam_ps = [t.detach().contiguous() for t in lam_ps]
    out = _VariancesAndDivergence.apply((KINDS[kind], float(alpha), float(c), float(min_scale), mean_ps, lam_ps),
                                        *locs, *raws)
    return list(out[:t_count]), out[t_count], [int(b) for b in out[t_count + 1]]


def variance_and_divergence(loc: Tensor, raw: Tensor, mean_p: Tensor, lam_p: Tensor, kind: str, alpha: float,
                            c: float, min_scale: float) -> tuple[Tensor, Tensor, int]:
    """:func:`variances_and_divergence` of one tensor: ``(v, c * sum_i f_i, n_undefined)``."""
    variances, value, bad = variances_and_divergence([loc], [raw], [mean_p], [lam_p], kind, alpha, c, min_scale)
    return variances[0], value, bad[0]


__all__ = ["KINDS", "applies_to", "available", "variance_and_divergence", "variances_and_divergence"]
