"""Fused categorical head of the Bayesian MLP: the last hidden layer's sampling, the output layer, the logits'
sampling and the softmax loss, with their gradients, in one pass per row.

On the local-reparameterisation path (:meth:`common.models.BayesianMLP.output_local_reparam`) a step's
expected loss is, for the last hidden layer's pre-activation moments ``mu, var`` (``(R, H)``) and the output
layer's weight and bias means and variances ``W_mu, b_mu, W_var, b_var`` (``(C, H)``, ``(C,)``)::

    h   = relu(mu + sqrt(var) * eps_h)                      eps_h ~ N(0, I), (D, R, H)
    m   = h W_mu^T + b_mu,   v = h^2 W_var^T + b_var        (D, R, C)
    z   = m + sqrt(v) * eps_o                               eps_o ~ N(0, I), (D, R, C)
    sum over the D R rows of  w * L(z, y) / S

with ``L`` the negative log-likelihood ``-log softmax(z)_y`` or the generalised cross-entropy
``(1 - softmax(z)_y^delta) / delta`` (:mod:`common.losses`; ``w`` the loss weight of
:class:`~common.losses.ScaledLoss`).  Row ``r`` of draw ``d`` has label ``y[(d R + r) mod B]``: a network
with one hidden layer passes the ``B`` rows of its first layer's moments and ``D = S`` draws, a deeper one
the ``S B`` rows of its previous layer's samples and ``D = 1``.

In torch this is about twenty operators and autograd nodes per step, three ``(D, R, H)`` tensors written in the
forward and read back in the backward, two skinny GEMMs each way and a log-softmax over ``D R`` rows.  The
kernel below keeps a row's ``h`` in cache from the draw to the gradient: it writes only ``d/dmu, d/dvar``
(``(R, H)``) and the output layer's gradient, which the loss's own gradient makes available in the forward (the
loss is the end of the graph); the backward only scales them by the incoming gradient.

Noise: ``eps_h`` of draw ``d`` is stream ``d`` of the Philox generator of :mod:`common.fused_sampling` (the
numbers :func:`common.fused_sampling.sample_relu` would use for the same key), ``eps_o`` is stream
``d + 2^31``; the 64-bit key is one draw from the caller's ``torch.Generator``.  The loss therefore differs from
the torch path's (whose output noise comes from ``torch.randn``) by Monte Carlo noise only.  Rows are
processed in fixed blocks and the blocks' partial sums added in block order, so the result does not depend on
the number of threads.

float32 CPU tensors, at most :data:`MAX_CLASSES` classes, and the kernels built (:func:`applies_to`); anything
else takes the torch path.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from common import fused_sampling
from common.likelihoods import check_class_labels
from common.losses import GeneralisedCrossEntropy, Loss, NegativeLogLikelihood, ScaledLoss, _check_representable
from common.native import NativeLibrary, run_parallel

#: Most classes the kernel handles (its per-row arrays live on the stack).
MAX_CLASSES = 64
#: Rows per block: the unit of work of a thread and of the partial sums (so results do not depend on threads).
BLOCK_ROWS = 128
#: Stream offset of the output layer's noise (the hidden layer's draw ``d`` is stream ``d``).
OUTPUT_STREAM = 1 << 31

_C_SOURCE = fused_sampling.PHILOX_SOURCE + r"""
#include <stdlib.h>
#define MAXC 64
#if defined(__AVX512F__)
#define VL 16 /* floats per vector: one 512-bit register */
#else
#define VL 8  /* 256 bits (two NEON registers on arm64): 512-bit vectors split in two spilled on AVX2, 3x slower */
#endif
#define RG 4  /* rows processed together: four independent accumulators per output, one weight load for four rows */
typedef float vf __attribute__((vector_size(4 * VL), aligned(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL), aligned(4 * VL)));


/* lane_sums(a)[o] = the sum of a[o]'s VL lanes in lane order from 0.0f (what `s = 0; for (i) s += a[o][i]` gives,
   bit for bit, but for which of two NaNs survives) for the VL vectors a[0 .. VL): on x86 a VL x VL transpose in
   log2(VL) stages of two-source shuffles with constant masks, each swapping one bit of the row and lane index,
   then VL - 1 vector additions.  It replaces VL horizontal sums, each VL dependent scalar additions of extracted
   lanes (on an AVX-512 Xeon they were 28 % of the head's time). */
#define LANES8(F, b) F(b, 0), F(b, 1), F(b, 2), F(b, 3), F(b, 4), F(b, 5), F(b, 6), F(b, 7)
#define LANES16(F, b) LANES8(F, b), F(b, 8), F(b, 9), F(b, 10), F(b, 11), F(b, 12), F(b, 13), F(b, 14), F(b, 15)
#if VL == 16
#define LANES LANES16
#else
#define LANES LANES8
#endif
#define SWAP_LO(b, j) (((j) & (b)) ? VL + ((j) ^ (b)) : (j))  /* lane j: a_i[j], or a_{i+b}[j - b] */
#define SWAP_HI(b, j) (((j) & (b)) ? VL + (j) : ((j) ^ (b)))  /* lane j: a_i[j + b], or a_{i+b}[j] */
#if defined(__clang__) /* the same two-source shuffle: clang takes the lane indices as arguments */
#define SHUFFLE2(x, y, F, b) __builtin_shufflevector(x, y, LANES(F, b))
#else
#define SHUFFLE2(x, y, F, b) __builtin_shuffle(x, y, (vi){LANES(F, b)})
#endif
#define TRANSPOSE_STAGE(t, b)                                                                                     \
    _Pragma("GCC unroll 16")                                                                                      \
    for (int i = 0; i < VL; i++)                                                                                  \
        if (!(i & (b))) {                                                                                         \
            vf lo_ = SHUFFLE2(t[i], t[i + (b)], SWAP_LO, b), hi_ = SHUFFLE2(t[i], t[i + (b)], SWAP_HI, b);        \
            t[i] = lo_; t[i + (b)] = hi_;                                                                         \
        }
/* PGVI_SCALAR_LANE_SUMS: the scalar form on x86 too (tests/test_kernel_isa.py compares the two builds) */
#if (defined(__AVX2__) || defined(__AVX512F__)) && !defined(PGVI_SCALAR_LANE_SUMS)
static inline vf lane_sums(const vf *restrict a) {
    vf t[VL];
    _Pragma("GCC unroll 16")
    for (int i = 0; i < VL; i++) t[i] = a[i];
#if VL == 16
    TRANSPOSE_STAGE(t, 8)
#endif
    TRANSPOSE_STAGE(t, 4)
    TRANSPOSE_STAGE(t, 2)
    TRANSPOSE_STAGE(t, 1)
    vf r = {0};
    _Pragma("GCC unroll 16")
    for (int l = 0; l < VL; l++) r += t[l];
    return r;
}
#else
/* elsewhere (arm64) GCC 12 writes those generic two-source shuffles of 256-bit vectors lane by lane: the scalar sums */
static inline vf lane_sums(const vf *restrict a) {
    vf r;
    for (int o = 0; o < VL; o++) {
        float s = 0.0f;
        for (int i = 0; i < VL; i++) s += a[o][i];
        r[o] = s;
    }
    return r;
}
#endif

/* G[c] += sum_k F[k CP + c] Xs[k] (rows c of a C x nv-vector weight gradient, F the group's RG x CP loss
   gradients, Xs its RG rows of h or h^2), two classes at a time: one load of Xs feeds two FMAs.  The sum over k
   keeps the order of a one-class loop; G has a zero padding row C when C is odd.  Macros, not functions: as
   inline functions GCC 12 scheduled them worse (the head 2.5 % slower, same results).  Both read C, CP and nv
   (the second also v and nw) from the enclosing scope. */
#define WEIGHT_GRADIENT_PAIRS(G, F, Xs)                                                                           \
    for (int64_t c = 0; c < C; c += 2) {                                                                          \
        const int two = c + 1 < C;                                                                                \
        float a0 = F[c], a1 = F[CP + c], a2 = F[2 * CP + c], a3 = F[3 * CP + c];                                  \
        float b0 = two ? F[c + 1] : 0.0f, b1 = two ? F[CP + c + 1] : 0.0f,                                        \
              b2 = two ? F[2 * CP + c + 1] : 0.0f, b3 = two ? F[3 * CP + c + 1] : 0.0f;                           \
        vf *ga = G + c * nv, *gb = G + (c + 1) * nv;                                                              \
        for (int64_t v = 0; v < nv; v++) {                                                                        \
            vf x0 = Xs[0][v], x1 = Xs[1][v], x2 = Xs[2][v], x3 = Xs[3][v];                                        \
            ga[v] += a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3;                                                       \
            gb[v] += b0 * x0 + b1 * x1 + b2 * x2 + b3 * x3;                                                       \
        }                                                                                                         \
    }

/* acc[k][t] += sum_c F[k CP + c] Wm[c nv + v + t] for the group's RG rows and the nw (1 or 2) column vectors
   v, v + 1 of the C x nv-vector weights Wm: d/dh's two products, one weight load for four FMAs */
#define INPUT_GRADIENT_PAIR(acc, Wm, F)                                                                           \
    for (int64_t c = 0; c < C; c++) {                                                                             \
        const vf *w = Wm + c * nv + v;                                                                            \
        vf w0 = w[0], w1 = nw > 1 ? w[1] : w[0];                                                                  \
        float d0 = F[c], d1 = F[CP + c], d2 = F[2 * CP + c], d3 = F[3 * CP + c];                                  \
        acc[0][0] += d0 * w0; acc[1][0] += d1 * w0; acc[2][0] += d2 * w0; acc[3][0] += d3 * w0;                   \
        acc[0][1] += d0 * w1; acc[1][1] += d1 * w1; acc[2][1] += d2 * w1; acc[3][1] += d3 * w1;                   \
    }

/* The noise of rows [r0, r1) of one draw: normals [r0 W, r1 W) of stream s sit at buf[i - returned offset];
   whole tiles, as in pgvi_normals, so a number depends only on (key, stream, index). */
static int64_t fill_rows(float *buf, int64_t r0, int64_t r1, int64_t W, uint32_t s, uint32_t k0, uint32_t k1) {
    const int64_t T = 4 * NB;
    int64_t t0 = (r0 * W) / T, t1 = (r1 * W + T - 1) / T;
    for (int64_t t = t0; t < t1; t++) philox_normals(buf + (t - t0) * T, (uint32_t)(t * NB), s, k0, k1);
    return t0 * T;
}

/* Rows [r0, r1) of the hidden moments (mu, sd: R x H), all D draws.  Returns 0, 1 (out of memory) or 2 (a label
   outside [0, C)).  loss_out: this block's sum of the per-row losses (unscaled).  With want_grad: rows [r0, r1)
   of dmu and dvar (w.r.t. mu and var = sd^2), and this block's partial output-layer gradients dwm, dwv (C x H),
   dbm, dbv (C), all scaled by gscale (= weight / S).  Weights, activations and weight gradients are held in
   copies padded to a multiple of VL with zeros, so every vector loop is whole. */
int pgvi_head_block(const float *restrict mu, const float *restrict sd, int64_t R, int64_t H,
                    const float *restrict wm, const float *restrict bm, const float *restrict wv,
                    const float *restrict bv, int64_t C, const int64_t *restrict y, int64_t B, int64_t D,
                    uint32_t k0, uint32_t k1, float delta, float gscale, int want_grad, int64_t r0, int64_t r1,
                    double *restrict loss_out, float *restrict dmu, float *restrict dvar, float *restrict dwm,
                    float *restrict dwv, float *restrict dbm, float *restrict dbv) {
    const int64_t T = 4 * NB, nv = (H + VL - 1) / VL, Hp = nv * VL;
    int64_t nh = ((r1 * H + T - 1) / T - (r0 * H) / T) * T, no = ((r1 * C + T - 1) / T - (r0 * C) / T) * T;
    const int64_t C2 = (C + 1) / 2 * 2; /* class rows padded to pairs */
    const int64_t nacc = (8 * C + VL - 1) / VL * VL; /* the logits' partial sums, padded to whole lane_sums */
    size_t nws = sizeof(float) * (size_t)(4 * C2 * Hp + 2 * RG * Hp + nacc * VL);
    float *eh = (float *)malloc(sizeof(float) * nh), *eo = (float *)malloc(sizeof(float) * no);
    float *ws = (float *)aligned_alloc(4 * VL, nws);
    if (!eh || !eo || !ws) { free(eh); free(eo); free(ws); return 1; }
    memset(ws, 0, nws);
    float *wmp = ws, *wvp = wmp + C2 * Hp, *dwp = wvp + C2 * Hp, *dwq = dwp + C2 * Hp, *hk = dwq + C2 * Hp,
          *h2k = hk + RG * Hp;
    vf *ACC = (vf *)(h2k + RG * Hp);
    for (int64_t c = 0; c < C; c++) {
        memcpy(wmp + c * Hp, wm + c * H, sizeof(float) * H);
        memcpy(wvp + c * Hp, wv + c * H, sizeof(float) * H);
    }
    const vf *W = (const vf *)wmp, *U = (const vf *)wvp;
    vf *DW = (vf *)dwp, *DU = (vf *)dwq;
    const vf *X[RG], *X2[RG];
    for (int k = 0; k < RG; k++) { X[k] = (const vf *)(hk + k * Hp); X2[k] = (const vf *)(h2k + k * Hp); }
    const int64_t CP = (C + VL - 1) / VL * VL; /* class slots per row */
    float M[RG * MAXC], V[RG * MAXC], O[RG * MAXC], Z[RG * MAXC], S[RG * MAXC], P[RG * MAXC], DM[RG * MAXC],
          DV[RG * MAXC], PAD[RG * MAXC];
    for (int64_t i = 0; i < RG * CP; i++) {
        int in = i % CP < C;
        M[i] = 0.0f; V[i] = 1.0f; O[i] = 0.0f; PAD[i] = in ? 0.0f : -INFINITY;
    }
    double loss = 0.0;
    int status = 0;
    if (want_grad) {
        memset(dmu + r0 * H, 0, sizeof(float) * (r1 - r0) * H);
        memset(dvar + r0 * H, 0, sizeof(float) * (r1 - r0) * H); /* holds d/dsd until the end */
        memset(dbm, 0, sizeof(float) * C); memset(dbv, 0, sizeof(float) * C);
    }
    for (int64_t d = 0; d < D && !status; d++) {
        int64_t bh = fill_rows(eh, r0, r1, H, (uint32_t)d, k0, k1);
        int64_t bo = fill_rows(eo, r0, r1, C, (uint32_t)d | 0x80000000u, k0, k1);
        for (int64_t r = r0; r < r1 && !status; r += RG) {
            int nr = r1 - r < RG ? (int)(r1 - r) : RG;
            for (int k = 0; k < RG; k++) {
                float *hr = hk + k * Hp, *h2r = h2k + k * Hp;
                if (k >= nr) { memset(hr, 0, sizeof(float) * H); memset(h2r, 0, sizeof(float) * H); continue; }
                const float *e = eh + ((r + k) * H - bh), *mur = mu + (r + k) * H, *sdr = sd + (r + k) * H;
                #pragma omp simd
                for (int64_t j = 0; j < H; j++) {
                    float a = mur[j] + sdr[j] * e[j];
                    a = a < 0.0f ? 0.0f : a; /* NaN stays NaN */
                    hr[j] = a; h2r[j] = a * a;
                }
            }
            for (int64_t c = 0; c < C; c++) { /* logits' means and scales, four rows at a time */
                vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
                const vf *w = W + c * nv, *u = U + c * nv;
                for (int64_t v = 0; v < nv; v++) {
                    a0 += w[v] * X[0][v]; a1 += w[v] * X[1][v]; a2 += w[v] * X[2][v]; a3 += w[v] * X[3][v];
                    b0 += u[v] * X2[0][v]; b1 += u[v] * X2[1][v]; b2 += u[v] * X2[2][v]; b3 += u[v] * X2[3][v];
                }
                vf *o = ACC + 8 * c; /* outputs 8c + k: row k's mean (k < 4) or variance (k - 4) sum */
                o[0] = a0; o[1] = a1; o[2] = a2; o[3] = a3; o[4] = b0; o[5] = b1; o[6] = b2; o[7] = b3;
            }
            for (int64_t ch = 0; ch < 8 * C; ch += VL) { /* ACC's vectors past 8 C stay zero */
                vf sums = lane_sums(ACC + ch);
                for (int64_t o = ch; o < ch + VL && o < 8 * C; o++) {
                    int64_t c = o >> 3, k = o & 7;
                    if (k < 4) M[k * CP + c] = bm[c] + sums[o - ch];
                    else V[(k - 4) * CP + c] = bv[c] + sums[o - ch];
                }
            }
            /* rows k >= nr (the last group of a block whose row count is not a multiple of RG) hold no data: their
               variance would be bv alone, and an exactly zero output-bias variance made sqrt 0 and their gradient
               0 * 0 / 0 = NaN, summed into every d/dw_var and d/db_var; give them variance 1 like the class pads */
            for (int k = nr; k < RG; k++)
                for (int64_t c = 0; c < C; c++) V[k * CP + c] = 1.0f;
            /* logits, softmax and the loss's gradient in the group's RG x CP slots: class slots c >= C have
               mean 0, variance 1, noise 0 and logit -inf (probability 0, gradient 0); rows k >= nr get factor 0 */
            for (int k = 0; k < RG; k++) {
                const float *eoc = eo + ((r + (k < nr ? k : 0)) * C - bo);
                for (int64_t c = 0; c < C; c++) O[k * CP + c] = k < nr ? eoc[c] : 0.0f;
            }
            #pragma omp simd
            for (int64_t i = 0; i < RG * CP; i++) {
                float sv = sqrtf(V[i]);
                Z[i] = M[i] + sv * O[i] + PAD[i]; /* PAD: 0, or -inf in class slots c >= C */
                S[i] = sv;
            }
            float zmax[RG], fac[RG], fay[RG];
            int64_t ys[RG];
            for (int k = 0; k < RG; k++) {
                ys[k] = k < nr ? y[(d * R + r + k) % B] : 0;
                if (ys[k] < 0 || ys[k] >= C) status = 2;
                float zm = -INFINITY;
                for (int64_t c = 0; c < C; c++) zm = Z[k * CP + c] > zm ? Z[k * CP + c] : zm; /* NaN: skipped here, */
                zmax[k] = zm;                                                         /* propagates below */
            }
            if (status) break;
            for (int k = 0; k < RG; k++) {
                float zm = zmax[k];
                #pragma omp simd
                for (int64_t c = 0; c < CP; c++) P[k * CP + c] = expf(Z[k * CP + c] - zm);
            }
            for (int k = 0; k < RG; k++) {
                fac[k] = 0.0f; fay[k] = 0.0f;
                if (k >= nr) continue;
                float se = 0.0f;
                for (int64_t c = 0; c < C; c++) se += P[k * CP + c];
                float lpy = Z[k * CP + ys[k]] - (zmax[k] + logf(se)); /* log softmax(z)_y; NaN in, NaN out */
                loss += delta > 0.0f ? -expm1f(delta * lpy) / delta : -lpy;
                /* dL/dz_c = A (softmax_c - [c = y]), A = gscale p_y^delta (delta = 0: the NLL) */
                fay[k] = gscale * (delta > 0.0f ? expf(delta * lpy) : 1.0f);
                fac[k] = fay[k] / se;
            }
            if (!want_grad) continue;
            for (int k = 0; k < RG; k++) {
                float f = fac[k], fy = fay[k];
                int64_t yk = ys[k];
                #pragma omp simd
                for (int64_t c = 0; c < CP; c++) {
                    int64_t i = k * CP + c;
                    float g = f * P[i] - (c == yk ? fy : 0.0f);
                    DM[i] = g;
                    DV[i] = g * O[i] * 0.5f / S[i];
                }
            }
            for (int64_t c = 0; c < C; c++) {
                dbm[c] += (DM[c] + DM[CP + c]) + (DM[2 * CP + c] + DM[3 * CP + c]);
                dbv[c] += (DV[c] + DV[CP + c]) + (DV[2 * CP + c] + DV[3 * CP + c]);
            }
            if (!want_grad || status) continue;
            /* the output layer's weight gradients, then d/dh, in separate loops (together they needed more than
               AVX2's sixteen vector registers and spilled).  Each works on a 2 x 4 tile: two classes (weight
               gradients) or two column vectors (d/dh) of the four rows, so a vector load feeds two FMAs instead of
               one; every sum keeps the order of the one-class / one-column loops it replaces, so the results are
               bit for bit theirs for finite values (2.75 -> 2.58 ms per 256 x 10 rows on a Zen 3).  The mean and
               variance halves run as separate passes, each tile's eight accumulators and factors in registers. */
            WEIGHT_GRADIENT_PAIRS(DW, DM, X)
            WEIGHT_GRADIENT_PAIRS(DU, DV, X2)
            for (int64_t v = 0; v < nv; v += 2) { /* d/dh, two column vectors at a time: eight FMAs per six loads */
                const int64_t nw = v + 1 < nv ? 2 : 1;
                vf g[RG][2] = {{{0}}}, q[RG][2] = {{{0}}};
                INPUT_GRADIENT_PAIR(g, W, DM)
                INPUT_GRADIENT_PAIR(q, U, DV)
                for (int64_t t = 0; t < nw; t++) {
                    int64_t j0 = (v + t) * VL, m = H - j0 < VL ? H - j0 : VL;
                    for (int k = 0; k < nr; k++) {
                        vf x = X[k][v + t];
                        vf gk = g[k][t] + 2.0f * x * q[k][t];
                        vi keep = x > 0.0f; /* ReLU mask; NaN -> no gradient */
                        vf gm = (vf)((vi)gk & keep);
                        const float *e = eh + ((r + k) * H - bh) + j0;
                        float *dmr = dmu + (r + k) * H + j0, *dsr = dvar + (r + k) * H + j0;
                        for (int64_t i = 0; i < m; i++) { dmr[i] += gm[i]; dsr[i] += gm[i] * e[i]; }
                    }
                }
            }
        }
    }
    if (want_grad && !status) {
        for (int64_t rr = r0; rr < r1; rr++) { /* d/dvar = d/dsd / (2 sd) */
            float *dsr = dvar + rr * H;
            const float *sdr = sd + rr * H;
            #pragma omp simd
            for (int64_t j = 0; j < H; j++) dsr[j] = dsr[j] * 0.5f / sdr[j];
        }
        for (int64_t c = 0; c < C; c++) {
            memcpy(dwm + c * H, dwp + c * Hp, sizeof(float) * H);
            memcpy(dwv + c * H, dwq + c * Hp, sizeof(float) * H);
        }
    }
    *loss_out = loss;
    free(eh); free(eo); free(ws);
    return status;
}

/* The parallel driver: blocks [b0, b1) of block_rows rows, over nt OpenMP threads; block i writes status[i],
   losses[i] and (with want_grad) its partial output-layer gradients at dwm + i C H, dwv + i C H, dbm + i C, dbv + i C */
void pgvi_head_run(const float *restrict mu, const float *restrict sd, int64_t R, int64_t H,
                   const float *restrict wm, const float *restrict bm, const float *restrict wv,
                   const float *restrict bv, int64_t C, const int64_t *restrict y, int64_t B, int64_t D,
                   uint32_t k0, uint32_t k1, float delta, float gscale, int want_grad, int64_t block_rows,
                   int64_t b0, int64_t b1, int nt, double *restrict losses, int *restrict status,
                   float *restrict dmu, float *restrict dvar, float *restrict dwm, float *restrict dwv,
                   float *restrict dbm, float *restrict dbv) {
    const uint32_t fpm = pgvi_fp_mode(); /* every block in the caller's floating-point mode (PRELUDE) */
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t i = b0; i < b1; i++) {
        uint32_t fps = pgvi_fp_enter(fpm);
        int64_t r0 = i * block_rows, r1 = r0 + block_rows < R ? r0 + block_rows : R;
        status[i] = pgvi_head_block(mu, sd, R, H, wm, bm, wv, bv, C, y, B, D, k0, k1, delta, gscale, want_grad, r0,
                                    r1, losses + i, dmu, dvar, want_grad ? dwm + i * C * H : NULL,
                                    want_grad ? dwv + i * C * H : NULL, want_grad ? dbm + i * C : NULL,
                                    want_grad ? dbv + i * C : NULL);
        pgvi_fp_enter(fps);
    }
}
"""

_I64, _U32, _VP, _F, _I = ctypes.c_int64, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_NATIVE = NativeLibrary(
    "head",
    _C_SOURCE,
    {
        "pgvi_head_run": ([_VP, _VP, _I64, _I64, _VP, _VP, _VP, _VP, _I64, _VP, _I64, _I64, _U32, _U32, _F, _F,
                           _I, _I64, _I64, _I64, _I, _VP, _VP, _VP, _VP, _VP, _VP, _VP, _VP], None),
    },
)


def available() -> bool:
    """``True`` if the kernel is loaded (builds it on the first call)."""
    return fused_sampling.available() and _NATIVE.get() is not None


def applies_to(w: Tensor) -> bool:
    """Whether the kernel can take parameters like ``w`` (float32, CPU) and is built."""
    return w.dtype == torch.float32 and w.device.type == "cpu" and available()


def loss_spec(loss: Loss) -> tuple[float, float] | None:
    """``(delta, weight)`` of the losses the kernel computes: ``nll`` is ``(0, 1)``, ``gce(delta)`` is
    ``(delta, 1)``, either wrapped in :class:`~common.losses.ScaledLoss` ``(w)`` has weight ``w``; ``None`` for
    any other loss (it takes the torch path)."""
    weight = 1.0
    if isinstance(loss, ScaledLoss):
        loss, weight = loss.base, loss.weight
    if type(loss) is NegativeLogLikelihood:
        return 0.0, weight
    if type(loss) is GeneralisedCrossEntropy:
        return loss.delta, weight
    return None


#: float32's smallest normal number and largest finite one: the range a GCE delta must lie in (:func:`_check_delta`)
_F32_TINY, _F32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


def _check_delta(delta: float) -> None:
    """``ValueError`` unless the GCE's ``delta`` (0: the NLL) is a normal float32 number, with the torch path's
    message (:class:`common.losses.GeneralisedCrossEntropy`).  The kernel takes ``delta`` as a C ``float``: below
    float32's normal range it becomes a subnormal or 0, and the kernel's ``delta > 0`` test then returned the NLL
    (or, subnormal, an NLL off by rounding) where the torch path refuses the loss.  Two comparisons per call."""
    if delta != 0.0 and not _F32_TINY <= abs(delta) <= _F32_MAX:
        _check_representable("gce", "delta", delta, torch.float32, delta)
        raise ValueError(f"gce: delta={delta:g} is not representable in torch.float32")  # if the above did not


def _kernel_labels(y: Tensor, classes: int, batch: int) -> Tensor:
    """The labels as the kernel reads them, a ``(batch,)`` int64 tensor, refused as the torch path
    (:class:`common.likelihoods.CategoricalOutput`) refuses them: any shape with ``batch`` elements (e.g. a
    ``(batch, 1)`` column) is taken in row order, any other count is a ``ValueError``; so are a bool or complex
    dtype and a floating label that is not an integer (``0.6`` or ``-0.5``, which the ``long()`` cast turned
    into class 0), with :func:`~common.likelihoods.check_class_labels`' message.  An integer label outside
    ``[0, classes)`` is refused by the kernel itself, and then with that message too (a ``ValueError``, as on the
    torch path; it was an ``IndexError``).

    Cost on the per-step path: Python checks for integer labels; for floating ones (a caller that keeps ``0.``/
    ``1.`` labels in float) one comparison with their ``long()`` cast, which the kernel needs anyway."""
    if y.numel() != batch:
        raise ValueError(f"fused head: {y.numel()} label(s) of shape {tuple(y.shape)} for a batch of {batch} "
                         f"points; expected labels of shape ({batch},)")
    flat = y if y.dim() == 1 else y.reshape(-1)
    if flat.dtype == torch.int64:
        return flat
    if flat.dtype == torch.bool or flat.is_complex():
        check_class_labels(flat, classes, "fused head")  # raises: not class indices
    labels = flat.long()
    if flat.is_floating_point() and bool((labels != flat).any()):  # NaN and +-inf included
        check_class_labels(flat, classes, "fused head")  # raises with the torch path's message
        raise ValueError(f"fused head: labels must be integer-valued class indices in [0, {classes}), "
                         f"got dtype {flat.dtype}")  # if the above did not
    return labels


def loss_and_gradients(mu: Tensor, sd: Tensor, w_mean: Tensor, b_mean: Tensor, w_var: Tensor, b_var: Tensor,
                       y: Tensor, n_draws: int, delta: float, gscale: float, k0: int, k1: int, want_grad: bool
                       ) -> tuple[float, tuple[Tensor, ...] | None]:
    """The kernel on contiguous, detached float32 tensors (no checks, no autograd; ``sd`` = the standard
    deviations): ``(sum of the per-row losses, unscaled; gradients or None)``, the gradients
    ``(d/dmu, d/dvar, d/dw_mean, d/db_mean, d/dw_var, d/db_var)`` of ``gscale`` times that sum.  The labels
    ``y`` are int64.  :class:`_CategoricalHead` and :mod:`common.explicit_step` both run it.  The one check:
    ``delta`` must be 0 or a normal float32 number (:func:`_check_delta`; the torch path's ``ValueError``)."""
    _check_delta(delta)
    lib = _NATIVE.get()
    assert lib is not None
    rows, width = mu.shape
    classes = w_mean.shape[0]
    nb = -(-rows // BLOCK_ROWS)
    losses = (ctypes.c_double * nb)()
    status = (ctypes.c_int * nb)()
    outs: tuple[int | None, ...] = (None,) * 6
    if want_grad:
        dmu, dvar = torch.empty_like(mu), torch.empty_like(mu)
        dwm, dwv = torch.empty((nb, classes, width), dtype=mu.dtype), torch.empty((nb, classes, width), dtype=mu.dtype)
        dbm, dbv = torch.empty((nb, classes), dtype=mu.dtype), torch.empty((nb, classes), dtype=mu.dtype)
        outs = tuple(t.data_ptr() for t in (dmu, dvar, dwm, dwv, dbm, dbv))
    args = (mu.data_ptr(), sd.data_ptr(), rows, width, w_mean.data_ptr(), b_mean.data_ptr(), w_var.data_ptr(),
            b_var.data_ptr(), classes, y.data_ptr(), y.shape[0], n_draws, k0, k1, delta, gscale, int(want_grad),
            BLOCK_ROWS)
    run_parallel(_NATIVE, lambda b0, b1, nt: lib.pgvi_head_run(*args, b0, b1, nt, losses, status, *outs), nb)
    if any(s == 1 for s in status):
        raise MemoryError("fused head: out of memory")
    if any(s == 2 for s in status):  # the kernel's own range check: the torch path's error, as its other checks
        check_class_labels(y, classes, "fused head")
        raise ValueError(f"fused head: a label is outside [0, {classes})")  # if the above did not
    total = 0.0
    for v in losses:  # block order: independent of the thread count
        total += v
    if not want_grad:
        return total, None
    if nb > 1:
        dwm, dwv, dbm, dbv = dwm.sum(0), dwv.sum(0), dbm.sum(0), dbv.sum(0)
    else:
        dwm, dwv, dbm, dbv = dwm[0], dwv[0], dbm[0], dbv[0]
    return total, (dmu, dvar, dwm, dbm, dwv, dbv)


class _CategoricalHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mu: Tensor, var: Tensor, w_mean: Tensor, b_mean: Tensor, w_var: Tensor, b_var: Tensor,  # type: ignore[override]
                y: Tensor, n_samples: int, n_draws: int, delta: float, weight: float, k0: int, k1: int,
                want: bool) -> Tensor:
        c = lambda t: t.detach().contiguous()  # noqa: E731
        total, grads = loss_and_gradients(c(mu), c(var).sqrt(), c(w_mean), c(b_mean), c(w_var), c(b_var), c(y),
                                          n_draws, delta, weight / n_samples, k0, k1, want)
        ctx.grads = grads
        return torch.tensor(total * weight / n_samples, dtype=mu.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("fused head: backward called twice (or without gradients)")
        need = ctx.needs_input_grad
        out = [g.mul_(grad) if need[i] else None for i, g in enumerate(grads)]
        return (*out, None, None, None, None, None, None, None, None)


def expected_loss(mu: Tensor, var: Tensor, w_mean: Tensor, b_mean: Tensor, w_var: Tensor, b_var: Tensor,
                  y: Tensor, n_samples: int, n_draws: int, loss: Loss,
                  generator: torch.Generator | None = None) -> Tensor:
    """``sum over the n_draws R rows of w L(z, y) / n_samples`` (see the module docstring) as a scalar tensor,
    differentiable w.r.t. ``mu, var`` (``(R, H)``) and the output layer's ``w_mean, b_mean, w_var, b_var``.
    ``y``: the ``B = R n_draws / n_samples`` labels of the batch (the torch path's count: one per point), of any
    shape with ``B`` elements (e.g. ``(B, 1)``), integer or integer-valued floating (:func:`_kernel_labels`).
    Call only where :func:`applies_to` holds and :func:`loss_spec` is not ``None``."""
    spec = loss_spec(loss)
    if spec is None:
        raise ValueError(f"fused head: loss {loss!r} is not one the kernel computes (see loss_spec)")
    if mu.dim() != 2 or var.shape != mu.shape:
        raise ValueError(f"fused head: mu and var must be (R, H) of one shape, got {tuple(mu.shape)}, "
                         f"{tuple(var.shape)}")
    rows, width = mu.shape
    if rows == 0:
        raise ValueError("fused head: no rows (an empty batch has no expected loss to differentiate)")
    classes = w_mean.shape[0] if w_mean.dim() == 2 else -1
    if (w_mean.shape != (classes, width) or w_var.shape != w_mean.shape or b_mean.shape != (classes,)
            or b_var.shape != (classes,)):
        raise ValueError(f"fused head: weights must be (C, {width}) and biases (C,), got {tuple(w_mean.shape)}, "
                         f"{tuple(b_mean.shape)}, {tuple(w_var.shape)}, {tuple(b_var.shape)}")
    if not 1 <= classes <= MAX_CLASSES:
        raise ValueError(f"fused head: 1 to {MAX_CLASSES} classes, got {classes}")
    if not all(applies_to(t) for t in (mu, var, w_mean, b_mean, w_var, b_var)):
        raise RuntimeError("fused head: needs float32 CPU tensors and the compiled kernels (see applies_to)")
    if not 1 <= n_draws < OUTPUT_STREAM or n_samples < 1:
        raise ValueError(f"fused head: n_draws must be in [1, 2^31) and n_samples >= 1, got {n_draws}, {n_samples}")
    if (rows * n_draws) % n_samples:
        raise ValueError(f"fused head: {rows} x {n_draws} rows are not n_samples = {n_samples} draws of a batch "
                         f"(labels of shape {tuple(y.shape)})")
    labels = _kernel_labels(y, classes, rows * n_draws // n_samples)
    if mu.numel() >= 2**34:
        raise ValueError("fused head: more than 2^34 elements per draw")
    k0, k1 = fused_sampling.draw_key(generator)  # one key per call, as the sampler draws it
    delta, weight = spec
    want = torch.is_grad_enabled() and any(t.requires_grad for t in (mu, var, w_mean, b_mean, w_var, b_var))
    return _CategoricalHead.apply(mu, var, w_mean, b_mean, w_var, b_var, labels, int(n_samples), int(n_draws),
                                  float(delta), float(weight), k0, k1, want)


__all__ = ["BLOCK_ROWS", "MAX_CLASSES", "OUTPUT_STREAM", "applies_to", "available", "expected_loss",
           "loss_and_gradients", "loss_spec"]
