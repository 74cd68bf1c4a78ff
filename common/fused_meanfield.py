"""Fused parameter side of a mean-field local GVI step: scales, variances and ``D(q || cavity)`` in one pass.

Per coordinate, :class:`~common.variational.MeanFieldVariational` has a mean ``m`` and a raw scale ``r`` with
``sigma = softplus(r) + min_scale``; the step needs ``v = sigma^2`` (for the model's variance GEMMs) and the
divergence to the fixed mean-field cavity ``(mu_p, lambda_p)`` in the moment forms of
:class:`common.local_gvi.MeanFieldMomentDivergence` (KL and weighted KL, reverse KL, Alpha-Renyi).  In torch
that is about 20 element-wise kernels forward and 10 backward over every coordinate (2.2 ms per step for
the 159,010 coordinates of the 784-200-10 BNN with KL, 3.0 ms with Alpha-Renyi, one thread).  Here one C
pass computes ``v`` and the divergence's sum (per-coordinate terms in float32 with the same cancellation-free
``log1p`` forms, by Goldberg's rewrite on the vectorised ``logf``; the sum in float64), and one backward pass turns the loss's gradient w.r.t. ``v`` plus the
divergence's analytic gradient into the gradients w.r.t. ``m`` and ``r``
(``d/dr = (g_v + g_D dD/dv) 2 sigma sigmoid(r)``).

float32 CPU tensors only, built by :class:`common.native.NativeLibrary`; elsewhere (float64, no compiler,
``PGVI_FUSED_KERNELS=0``) the caller keeps the torch path.  The Alpha-Renyi divergence's undefined region
(``1 + (1 - alpha)(lambda_p v - 1) <= 0``) is counted by the kernel and reported by the caller with the same
typed error as the torch path.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from torch import Tensor

from common.native import NativeLibrary, run_parallel

KINDS = {"kl": 0, "reverse_kl": 1, "alpha_renyi": 2}

BLOCK = 4096  # elements per partial sum and per thread-chunk boundary (a multiple of every vector width)

_C_SOURCE = r"""
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
            for (int64_t i = 0; i < n; i++) { x1[i] = l_[i] * vr[i] - 1.0f; e1[i] = 1.0f + x1[i]; }
        } else if (kind == 1) {
            #pragma omp simd
            for (int64_t i = 0; i < n; i++) { x1[i] = 1.0f / (l_[i] * vr[i]) - 1.0f; e1[i] = 1.0f + x1[i]; }
        } else {
            #pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                float u = l_[i] * vr[i] - 1.0f;
                x1[i] = c1 * u; e1[i] = 1.0f + x1[i]; x2[i] = u; e2[i] = 1.0f + u;
            }
        }
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) t[i] = logf(e1[i]);
        if (kind == 2) {
            #pragma omp simd
            for (int64_t i = 0; i < n; i++) lg[i] = logf(e2[i]);
        }
        if (kind == 0) {
            #pragma omp simd reduction(+:acc)
            for (int64_t i = 0; i < n; i++) {
                float u = x1[i], d = lc[i] - m_[i];
                acc += (double)(u - log1p_from(u, t[i], e1[i]) + l_[i] * d * d);
            }
        } else if (kind == 1) {
            #pragma omp simd reduction(+:acc)
            for (int64_t i = 0; i < n; i++) {
                float w = x1[i], d = lc[i] - m_[i];
                acc += (double)(w - log1p_from(w, t[i], e1[i]) + d * d / vr[i]);
            }
        } else {
            #pragma omp simd reduction(+:acc, nbad)
            for (int64_t i = 0; i < n; i++) {
                float a = x1[i], u = x2[i], d = lc[i] - m_[i];
                nbad += (1.0f + a > 0.0f) ? 0 : 1;
                acc += (double)(l_[i] * d * d / (1.0f + a)
                                - (log1p_from(a, t[i], e1[i]) - c1 * log1p_from(u, lg[i], e2[i])) * inv_aa);
            }
        }
        partial[b0 / BLOCK] = acc;
    }
    free(buf);
    return nbad;
}

/* gloc[i] = g_div dD/dm, graw[i] = (gvar[i] + g_div dD/dv) chain[i] for i in [lo, hi), with var and chain from
   pgvi_mf_forward; gvar may be NULL (no loss gradient w.r.t. v) */
void pgvi_mf_backward(const float *restrict loc, const float *restrict var, const float *restrict chain,
                      const float *restrict mp, const float *restrict lp, const float *restrict gvar, float g_div,
                      int64_t lo, int64_t hi, int kind, float alpha, float *restrict gloc, float *restrict graw) {
    float c1 = 1.0f - alpha, inv_alpha = kind == 2 ? 1.0f / alpha : 0.0f;
    #pragma omp simd
    for (int64_t i = lo; i < hi; i++) {
        float v = var[i], l = lp[i], d = loc[i] - mp[i], dm, dv;
        if (kind == 0) {
            dm = 2.0f * l * d;
            dv = l - 1.0f / v;
        } else if (kind == 1) {
            float iv = 1.0f / v;
            dm = 2.0f * d * iv;
            dv = (1.0f - iv / l - d * d * iv) * iv;
        } else {
            float u = l * v - 1.0f, inv1a = 1.0f / (1.0f + c1 * u), t = l * d * inv1a;
            dm = 2.0f * t;
            dv = -c1 * t * t + l * (inv1a - 1.0f / (u + 1.0f)) * inv_alpha;
        }
        float gv = (gvar ? gvar[i] : 0.0f) + g_div * dv;
        gloc[i] = g_div * dm;
        graw[i] = gv * chain[i];
    }
}

/* The parallel drivers: [lo, hi) split over nt OpenMP threads in whole blocks (pgvi_split) */
int64_t pgvi_mf_forward_run(const float *restrict loc, const float *restrict raw, const float *restrict mp,
                            const float *restrict lp, int64_t lo, int64_t hi, int nt, int kind, double alpha,
                            float min_scale, float *restrict var, float *restrict chain, double *restrict partial) {
    int64_t nbad = 0;
    int oom = 0;
    #pragma omp parallel for num_threads(nt) schedule(static) reduction(+:nbad) reduction(|:oom)
    for (int t = 0; t < nt; t++) {
        int64_t a = pgvi_split(lo, hi, BLOCK, t, nt), b = pgvi_split(lo, hi, BLOCK, t + 1, nt);
        int64_t r = a < b ? pgvi_mf_forward(loc, raw, mp, lp, a, b, kind, alpha, min_scale, var, chain, partial) : 0;
        if (r < 0) oom = 1; else nbad += r;
    }
    return oom ? -1 : nbad;
}
void pgvi_mf_backward_run(const float *restrict loc, const float *restrict var, const float *restrict chain,
                          const float *restrict mp, const float *restrict lp, const float *restrict gvar, float g_div,
                          int64_t lo, int64_t hi, int nt, int kind, float alpha, float *restrict gloc,
                          float *restrict graw) {
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int t = 0; t < nt; t++)
        pgvi_mf_backward(loc, var, chain, mp, lp, gvar, g_div, pgvi_split(lo, hi, BLOCK, t, nt),
                         pgvi_split(lo, hi, BLOCK, t + 1, nt), kind, alpha, gloc, graw);
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
        "pgvi_mf_backward": ([_VP, _VP, _VP, _VP, _VP, _VP, _F32, _I64, _I64, _INT, _F32, _VP, _VP], None),
        "pgvi_mf_forward_run": ([_VP, _VP, _VP, _VP, _I64, _I64, _INT, _INT, _F64, _F32, _VP, _VP, _VP], _I64),
        "pgvi_mf_backward_run": ([_VP, _VP, _VP, _VP, _VP, _VP, _F32, _I64, _I64, _INT, _INT, _F32, _VP, _VP], None),
    },
    _self_check,
)


def available() -> bool:
    return _NATIVE.get() is not None


def applies_to(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and available()


class _VarianceAndDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loc: Tensor, raw: Tensor, mean_p: Tensor, lam_p: Tensor, kind: int, alpha: float,  # type: ignore[override]
                c: float, min_scale: float) -> tuple[Tensor, Tensor, Tensor]:
        lib = _NATIVE.get()
        assert lib is not None
        loc, raw = loc.detach().contiguous(), raw.detach().contiguous()
        n = loc.numel()
        var = torch.empty_like(loc)
        chain = torch.empty_like(loc)  # d var / d raw, for the backward
        partial = np.zeros(-(-n // BLOCK), dtype=np.float64)
        bad = np.zeros(-(-n // BLOCK), dtype=np.int64)  # per chunk, indexed by the chunk's first block

        def fwd(lo: int, hi: int, nt: int) -> None:
            bad[lo // BLOCK] = lib.pgvi_mf_forward_run(loc.data_ptr(), raw.data_ptr(), mean_p.data_ptr(),
                                                       lam_p.data_ptr(), lo, hi, nt, kind, alpha, min_scale,
                                                       var.data_ptr(), chain.data_ptr(), partial.ctypes.data)

        if n:
            run_parallel(_NATIVE, fwd, n, align=BLOCK)
        total = float(np.sum(partial))  # fixed blocks, fixed order: the same sum for any thread count
        if (bad < 0).any():
            raise MemoryError("fused mean-field kernel: out of memory")
        n_bad = int(bad.sum())
        ctx.save_for_backward(loc, mean_p, lam_p, var)  # var is an output: saved with its version check
        ctx.chain = chain
        ctx.kind, ctx.alpha, ctx.c = kind, alpha, c
        ctx.set_materialize_grads(False)
        value = torch.tensor(c * total, dtype=loc.dtype)
        n_bad_t = torch.tensor(n_bad, dtype=torch.int64)
        ctx.mark_non_differentiable(n_bad_t)
        return var, value, n_bad_t

    @staticmethod
    def backward(ctx, g_var: Tensor | None, g_value: Tensor | None, _g_bad: Tensor | None):  # type: ignore[override]
        lib = _NATIVE.get()
        assert lib is not None
        loc, mean_p, lam_p, var = ctx.saved_tensors
        chain = ctx.chain
        gv = None if g_var is None else g_var.contiguous()
        g_div = 0.0 if g_value is None else float(g_value) * ctx.c
        g_loc = torch.empty_like(loc)
        g_raw = torch.empty_like(loc)

        def bwd(lo: int, hi: int, nt: int) -> None:
            lib.pgvi_mf_backward_run(loc.data_ptr(), var.data_ptr(), chain.data_ptr(), mean_p.data_ptr(),
                                     lam_p.data_ptr(), None if gv is None else gv.data_ptr(), g_div, lo, hi, nt,
                                     ctx.kind, ctx.alpha, g_loc.data_ptr(), g_raw.data_ptr())

        run_parallel(_NATIVE, bwd, loc.numel(), align=BLOCK)
        return g_loc, g_raw, None, None, None, None, None, None


def variance_and_divergence(loc: Tensor, raw: Tensor, mean_p: Tensor, lam_p: Tensor, kind: str, alpha: float,
                            c: float, min_scale: float) -> tuple[Tensor, Tensor, int]:
    """``(v, c * sum_i f_i, n_undefined)`` with ``v = (softplus(raw) + min_scale)^2`` and ``f_i`` the divergence's
    per-coordinate moment form (see :class:`common.local_gvi.MeanFieldMomentDivergence`); differentiable
    w.r.t. ``loc`` and ``raw``.  ``n_undefined`` counts Alpha-Renyi coordinates outside the domain (the value
    is then meaningless: the caller raises).  Call only where :func:`applies_to` holds for all four tensors."""
    if kind not in KINDS:
        raise ValueError(f"unknown moment divergence {kind!r}")
    tensors = (loc, raw, mean_p, lam_p)
    if any(t.shape != loc.shape for t in tensors) or not all(applies_to(t) for t in tensors):
        raise ValueError("variance_and_divergence: four float32 CPU tensors of one shape are needed")
    mean_p, lam_p = mean_p.detach().contiguous(), lam_p.detach().contiguous()
    var, value, bad = _VarianceAndDivergence.apply(loc, raw, mean_p, lam_p, KINDS[kind], float(alpha), float(c),
                                                   float(min_scale))
    return var, value, int(bad)


__all__ = ["KINDS", "applies_to", "available", "variance_and_divergence"]
