/* An fp32 linear, out [m, n] = x [m, k] . w^T (+ bias), over a weight packed once into panels of
   32 output columns: [n/32][k][32] floats, zero-padded to whole panels (engine/f32_linears.py).

   oneDNN's fp32 matmul, through torch's op, costs a primitive lookup and its own blocking per call
   and MKL's packed GEMM pads every weight's copy to at least 8 MB (2 GB for SmolLM2's 538 MB); a
   decode step's GEMMs are small (32-256 rows), so one panel of 32 columns at a time, 12 rows x 32
   columns of accumulators held in 24 vector registers, each weight row of the panel (128 bytes)
   read once per 12 rows from L1. Threads take whole panels.

   Arithmetic: each output is the fp32 sum of its k products in order of k (FMA: each product added
   exact, one rounding per step), then its bias added: a plain fp32 GEMM's error bound. */

#include <stdlib.h>

#include "common.h"

/* How far ahead of its loads a block prefetches the panel's weights (32 of its rows, 4 KB): the
   first row block of a panel streams it from memory, where the hardware prefetcher lagged. */
#define PREFETCH_FLOATS 1024
#define MR 12 /* rows a block: 24 accumulators of the 32 vector registers on AVX-512 */
/* Values of K a chunk: 96 KB of a panel, within L2. Chunks of 256 (32 KB, within L1) ran 6% slower
   at 256 rows (SmolLM2's linears swept, bench/RESULTS.md): the hardware streams a panel's rows
   into L1 well enough, and every chunk boundary stores and reloads the block's sums. */
#define KC 768

/* rows (1..MR) rows from x (row stride ldx) times kc rows of a panel ([kc][32]) into acc[rows][2],
   starting from acc's sums (`more`) or from zero. */
#define PANEL_ROWS(R)                                                                                    \
    static inline void panel_##R(const float *x, int64_t ldx, int64_t kc, const float *p, v16f *acc, int more) { \
        v16f c[R][2];                                                                                    \
        for (int r = 0; r < R; r++) {                                                                    \
            c[r][0] = more ? acc[2 * r] : (v16f){0};                                                     \
            c[r][1] = more ? acc[2 * r + 1] : (v16f){0};                                                 \
        }                                                                                                \
        for (int64_t kk = 0; kk < kc; kk++) {                                                            \
            __builtin_prefetch(p + kk * 32 + PREFETCH_FLOATS);                                           \
            __builtin_prefetch(p + kk * 32 + PREFETCH_FLOATS + 16);                                      \
            const v16f b0 = load16_f32(p + kk * 32), b1 = load16_f32(p + kk * 32 + 16);                  \
            for (int r = 0; r < R; r++) {                                                                \
                const float a = x[r * ldx + kk];                                                         \
                c[r][0] += a * b0;                                                                       \
                c[r][1] += a * b1;                                                                       \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < R; r++) acc[2 * r] = c[r][0], acc[2 * r + 1] = c[r][1];                      \
    }

PANEL_ROWS(1)
PANEL_ROWS(2)
PANEL_ROWS(3)
PANEL_ROWS(4)
PANEL_ROWS(5)
PANEL_ROWS(6)
PANEL_ROWS(7)
PANEL_ROWS(8)
PANEL_ROWS(9)
PANEL_ROWS(10)
PANEL_ROWS(11)
PANEL_ROWS(12)

static void panel(int rows, const float *x, int64_t ldx, int64_t kc, const float *p, v16f *acc, int more) {
    switch (rows) {
    case 1: panel_1(x, ldx, kc, p, acc, more); break;
    case 2: panel_2(x, ldx, kc, p, acc, more); break;
    case 3: panel_3(x, ldx, kc, p, acc, more); break;
    case 4: panel_4(x, ldx, kc, p, acc, more); break;
    case 5: panel_5(x, ldx, kc, p, acc, more); break;
    case 6: panel_6(x, ldx, kc, p, acc, more); break;
    case 7: panel_7(x, ldx, kc, p, acc, more); break;
    case 8: panel_8(x, ldx, kc, p, acc, more); break;
    case 9: panel_9(x, ldx, kc, p, acc, more); break;
    case 10: panel_10(x, ldx, kc, p, acc, more); break;
    case 11: panel_11(x, ldx, kc, p, acc, more); break;
    default: panel_12(x, ldx, kc, p, acc, more); break;
    }
}

/* x [m, k], w packed [ceil(n/32)][k][32], bias [n] or NULL: out [m, n], all fp32 and contiguous.
   K runs in chunks of KC (a chunk of a panel, 96 KB, stays in L2 while every row block reads it):
   each row block's sums are kept between chunks (stored and loaded exactly), so every output is
   still one sum in order of k. Returns 0, or -1 when out of memory. */
int f32_linear(const float *x, int64_t m, int64_t k, const float *w, int64_t n, const float *bias, float *out) {
    const int64_t panels = (n + 31) / 32, blocks = (m + MR - 1) / MR;
    int failed = 0;
    _Pragma("omp parallel if (m * n * k > 32768)") {
        v16f *sums = k > KC ? aligned_alloc(64, sizeof(v16f) * 2 * MR * (size_t)blocks) : NULL;
        if (k > KC && sums == NULL) failed = 1;
        _Pragma("omp for schedule(static)")
        for (int64_t np = 0; np < panels; np++) {
            if (k > KC && sums == NULL) continue;
            const float *p = w + np * k * 32;
            const int64_t n0 = np * 32, cols = n - n0 < 32 ? n - n0 : 32;
            float b[32] = {0};
            if (bias)
                for (int64_t j = 0; j < cols; j++) b[j] = bias[n0 + j];
            v16f one[2 * MR];
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                const int64_t kc = k - k0 < KC ? k - k0 : KC;
                for (int64_t blk = 0; blk < blocks; blk++) {
                    const int64_t m0 = blk * MR;
                    const int rows = m - m0 < MR ? (int)(m - m0) : MR;
                    v16f *acc = sums ? sums + blk * 2 * MR : one;
                    panel(rows, x + m0 * k + k0, k, kc, p + k0 * 32, acc, k0 > 0);
                    if (k0 + kc < k) continue;
                    for (int r = 0; r < rows; r++) {
                        float *o = out + (m0 + r) * n + n0;
                        if (cols == 32) {
                            store16_f32(o, acc[2 * r] + load16_f32(b));
                            store16_f32(o + 16, acc[2 * r + 1] + load16_f32(b + 16));
                        } else {
                            float v[32];
                            store16_f32(v, acc[2 * r] + load16_f32(b));
                            store16_f32(v + 16, acc[2 * r + 1] + load16_f32(b + 16));
                            for (int64_t j = 0; j < cols; j++) o[j] = v[j];
                        }
                    }
                }
            }
        }
        free(sums);
    }
    return failed ? -1 : 0;
}

/* The pack f32_linears.pack describes, in one pass: w [n, k] into panels [ceil(n/32)][k][32], the
   rows past n zero. A push derives it for every fp32 linear it changes (an adapter's merge: all of
   them), where torch's zero-fill, copy and transposing copy took three passes (~1.7 GB/s here).
   Each thread takes whole panels; a block of 16 values of K of the panel's 32 rows is read (32
   cache lines) and written as 16 rows of 32 floats. */
void f32_pack(const float *w, int64_t n, int64_t k, float *out) {
    const int64_t panels = (n + 31) / 32;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * k * 32;
        for (int64_t k0 = 0; k0 < k; k0 += 16) {
            const int64_t kb = k - k0 < 16 ? k - k0 : 16;
            for (int j = 0; j < 32; j++) {
                const int64_t row = p * 32 + j;
                const float *src = w + row * k + k0;
                if (row < n)
                    for (int64_t kk = 0; kk < kb; kk++) dst[(k0 + kk) * 32 + j] = src[kk];
                else
                    for (int64_t kk = 0; kk < kb; kk++) dst[(k0 + kk) * 32 + j] = 0.0f;
            }
        }
    }
}
