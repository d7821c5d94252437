/* Weight-only int8 on AVX2 without AVX512-BF16 (AMD Zen 3, Intel Haswell to Ice Lake): the int8 weights
   multiplied as integers, by activations rounded to int16, on VPMADDWD (16 products of int16 pairs a
   uop, summed in pairs into int32), where fp32 FMAs on widened weights do 8 a uop on the same pipes.
   w8_linear.c's AVX2 branch; its AVX512-BF16 one multiplies bf16 weights and activations instead.

   Arithmetic, per row of x: its bf16 values times 2^(14 - e), where 2^e <= the row's largest |x| <
   2^(e + 1), rounded to int16 (|v| < 2^15): every value within 2^7 of the largest is exact (a bf16 has 8
   significant bits), a smaller one is off by at most 2^(e - 15), 2^-15 of the row's largest. Each group
   of W8_GROUP values of K sums its int8 x int16 products exactly in int32 (< 16 x 127 x 2^15 = 2^26),
   converted to fp32 (rounded once) and times its column's scale added to the column's fp32 sum (one
   FMA, in K's order); the sum times 2^(e - 14) (exact) is the output, rounded once to bf16 or not. The
   weights are q x scale exactly (the AMX and AVX512-BF16 kernels round that to bf16 first: up to 2^-9 of
   each weight apart). Every output depends on its own row and column alone, whatever the batch, the
   block of rows or the thread: a row prefilled and decoded give the same bits. A row holding an inf or
   a NaN gives NaN outputs.

   Speed (whole models' linears swept, bench/w8_linears.py on a Zen 3's 2 cores, bench/RESULTS.md
   2026-12-06): 1.42-1.60x the bf16 engine's panels at 1-8 rows (half the bytes) and 1.26-1.51x at 32 (the
   products: VPMADDWD and its VPADDD ran 22 products a cycle in registers against the FMAs' 16). */
#ifndef ROLLOUT_NATIVE_W8_MADD_H
#define ROLLOUT_NATIVE_W8_MADD_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>

#include "common.h"
#include "w8_chunk.h"

#define MADD_ROWS 6 /* a block: 6 rows x 16 columns of int32 sums, two weight vectors, a broadcast, a product */
#define X_KEEP_BYTES (4 << 20) /* the quantized activations of a decode step kept per thread; a prefill's freed */

/* 8 bf16 values widened to fp32 (exact) */
static inline __m256 widen8(__m128i bf16) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16), 16)); }

/* Row x (k bf16 values) as int16 pairs into dst (every MADD_ROWS-th int32: the block's layout, pair j of
   the row at dst[j * MADD_ROWS]), k padded with zeros to pairs pairs; returns 2^(e - 14) (NaN for a row
   holding an inf or a NaN). */
static float quantize_row_i16(const uint16_t *x, int64_t k, int64_t pairs, int32_t *dst) {
    uint16_t top = 0;
    for (int64_t i = 0; i < k; i++) top = (x[i] & 0x7fff) > top ? (x[i] & 0x7fff) : top;
    if (top >= 0x7f80) {
        for (int64_t j = 0; j < pairs; j++) dst[j * MADD_ROWS] = 0;
        return NAN;
    }
    /* a subnormal top (exponent field 0) scales as 2^-126; 2^(14 - e) up to 2^140 as two exact factors */
    const int e = top == 0 ? 0 : (top >> 7 ? (top >> 7) - 127 : -126);
    const int up = 14 - e, half = up > 100 ? 64 : 0;
    const float s1 = ldexpf(1.0f, up - half), s2 = ldexpf(1.0f, half);
    const __m256 f1 = _mm256_set1_ps(s1), f2 = _mm256_set1_ps(s2);
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(x + i));
        const __m256 lo = widen8(_mm256_castsi256_si128(b)), hi = widen8(_mm256_extracti128_si256(b, 1));
        const __m256i ql = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(lo, f1), f2)); /* to nearest, ties even */
        const __m256i qh = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(hi, f1), f2));
        /* packs interleaves 128-bit lanes: the permute puts the 16 values back in order, 8 pairs */
        int32_t p[8];
        _mm256_storeu_si256((__m256i *)p, _mm256_permute4x64_epi64(_mm256_packs_epi32(ql, qh), 0xd8));
        for (int j = 0; j < 8; j++) dst[(i / 2 + j) * MADD_ROWS] = p[j];
    }
    int16_t tail[2] = {0, 0};
    for (; i < 2 * pairs; i++) {
        tail[i % 2] = i < k ? (int16_t)lrintf(bf16_to_f32(x[i]) * s1 * s2) : 0;
        if (i % 2) memcpy(&dst[i / 2 * MADD_ROWS], tail, sizeof tail);
    }
    return ldexpf(1.0f, -up);
}

/* rows (1..MADD_ROWS) rows of x (block layout: the rows' pairs interleaved) times one tile (16 columns,
   `tile` of each chunk's two) of a panel's kc_count chunks, into sums [rows][16] (fp32, the tile's columns
   in order). Always inlined with a constant row count, so the int32 sums stay in registers; the fp32 ones
   live in L1 (12 registers more than AVX2's 16). Both loops over a chunk unrolled: with the groups' loop
   rolled GCC's code ran 1.3-2.3x slower at 8-32 rows. */
ALWAYS_INLINE void madd_block(const int32_t *x, int rows, int64_t kc_count, const uint8_t *wb, int tile,
                              float (*sums)[16]) {
    float f[MADD_ROWS][16] __attribute__((aligned(32))) = {{0}}; /* the sums' columns in w0's and w1's order */
    for (int64_t kc = 0; kc < kc_count; kc++) {
        const uint8_t *chunk = wb + kc * W8_CHUNK_BYTES;
        const int8_t *q = (const int8_t *)(chunk + W8_SCALE_BYTES) + 512 * tile;
        const uint16_t *scales = (const uint16_t *)chunk + 16 * tile;
        const int32_t *xk = x + kc * 16 * MADD_ROWS;
        _Pragma("GCC unroll 2") for (int g = 0; g < W8_GROUPS; g++) {
            __m256i a[MADD_ROWS][2];
            for (int r = 0; r < rows; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
            _Pragma("GCC unroll 8") for (int pp = 0; pp < W8_ROWS_PER_GROUP; pp++) {
                const int p = g * W8_ROWS_PER_GROUP + pp;
                /* a tile row: 16 columns' pairs of K, sign-extended in lanes (VPMOVSXBW crosses lanes, and ran
                   1.3 cycles a uop): columns 0-3 and 8-11 in w0, 4-7 and 12-15 in w1 */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * p));
                const __m256i sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), v);
                const __m256i w0 = _mm256_unpacklo_epi8(v, sign), w1 = _mm256_unpackhi_epi8(v, sign);
                for (int r = 0; r < rows; r++) {
                    const __m256i xv = _mm256_set1_epi32(xk[p * MADD_ROWS + r]);
                    a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(w0, xv));
                    a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(w1, xv));
                    /* GCC otherwise reassociated the sums: every product first, spilled, then a tree */
                    __asm__("" : "+x"(a[r][0]), "+x"(a[r][1]));
                }
            }
            /* the group's scales (bf16, exact in fp32) in the sums' column order */
            const __m256 s0 = widen8(_mm_loadu_si128((const __m128i *)(scales + 32 * g)));
            const __m256 s1 = widen8(_mm_loadu_si128((const __m128i *)(scales + 32 * g + 8)));
            const __m256 t0 = _mm256_permute2f128_ps(s0, s1, 0x20), t1 = _mm256_permute2f128_ps(s0, s1, 0x31);
            for (int r = 0; r < rows; r++) {
                _mm256_store_ps(f[r], _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][0]), t0, _mm256_load_ps(f[r])));
                _mm256_store_ps(f[r] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][1]), t1, _mm256_load_ps(f[r] + 8)));
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const __m256 lo = _mm256_load_ps(f[r]), hi = _mm256_load_ps(f[r] + 8);
        _mm256_storeu_ps(sums[r], _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(sums[r] + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
}

static void madd_rows(const int32_t *x, int rows, int64_t kc_count, const uint8_t *wb, int tile, float (*sums)[16]) {
    switch (rows) {
    case 1: madd_block(x, 1, kc_count, wb, tile, sums); break;
    case 2: madd_block(x, 2, kc_count, wb, tile, sums); break;
    case 3: madd_block(x, 3, kc_count, wb, tile, sums); break;
    case 4: madd_block(x, 4, kc_count, wb, tile, sums); break;
    case 5: madd_block(x, 5, kc_count, wb, tile, sums); break;
    default: madd_block(x, MADD_ROWS, kc_count, wb, tile, sums); break;
    }
}

static int w8_linear(const uint16_t *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, uint16_t *out_bf16,
                     float *out_f32) {
    if (m == 0 || n == 0) return 0;
    const int64_t kc_count = (k + 31) / 32, pairs = kc_count * 16, blocks = (m + MADD_ROWS - 1) / MADD_ROWS;
    const int64_t bytes = blocks * pairs * MADD_ROWS * (int64_t)sizeof(int32_t) + m * (int64_t)sizeof(float);
    int32_t *xq = bytes <= X_KEEP_BYTES ? thread_buffer(bytes) : malloc((size_t)bytes);
    if (xq == NULL) return -1;
    float *row_scale = (float *)(xq + blocks * pairs * MADD_ROWS);
    for (int64_t r = 0; r < m; r++)
        row_scale[r] = quantize_row_i16(x + r * k, k, pairs, xq + r / MADD_ROWS * pairs * MADD_ROWS + r % MADD_ROWS);
    const int64_t panels = (n + 31) / 32;
#pragma omp parallel for schedule(static) if (m * n * k > 65536)
    for (int64_t np = 0; np < panels; np++) {
        const uint8_t *wb = w + np * kc_count * W8_CHUNK_BYTES;
        for (int tile = 0; tile < 2; tile++) {
            const int64_t col = np * 32 + 16 * tile, cols = n - col < 16 ? n - col : 16;
            if (cols <= 0) break;
            for (int64_t blk = 0; blk < blocks; blk++) {
                const int64_t m0 = blk * MADD_ROWS;
                const int rows = m - m0 < MADD_ROWS ? (int)(m - m0) : MADD_ROWS;
                float sums[MADD_ROWS][16];
                madd_rows(xq + blk * pairs * MADD_ROWS, rows, kc_count, wb, tile, sums);
                for (int r = 0; r < rows; r++) {
                    const int64_t at = (m0 + r) * n + col;
                    const v16f v = load16_f32(sums[r]) * row_scale[m0 + r];
                    if (cols == 16 && out_f32) store16_f32(out_f32 + at, v);
                    else if (cols == 16) store16_bf16(out_bf16 + at, v);
                    else
                        for (int64_t c = 0; c < cols; c++) {
                            if (out_f32) out_f32[at + c] = v[c];
                            else out_bf16[at + c] = f32_to_bf16(v[c]);
                        }
                }
            }
        }
    }
    if (bytes > X_KEEP_BYTES) free(xq);
    return 0;
}

#endif
