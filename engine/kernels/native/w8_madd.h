/* Weight-only int8 without AMX tiles (w8_linear.c): the int8 weights multiplied as integers, by activations
   rounded to int16. With AVX512-VNNI (AMD Zen 4 and 5, Intel Ice Lake and later) on VPDPWSSD: 32 int16
   products and their sum a 512-bit instruction, at VDPBF16PS's rate (bench/dot_rates.py), with no widening
   of the weights to bf16 (a VPMOVSXBW a tile row, where widening to bf16 took 9 instructions); on AVX2
   alone (AMD Zen 3, Intel Haswell and later) on VPMADDWD: 16 products a uop, where fp32 FMAs on widened
   weights do 8.

   Arithmetic, per row of x: its bf16 values times 2^(14 - e), where 2^e <= the row's largest |x| <
   2^(e + 1), rounded to int16 (|v| < 2^15): every value within 2^7 of the largest is exact (a bf16 has 8
   significant bits), a smaller one is off by at most 2^(e - 15), 2^-15 of the row's largest. Each group
   of W8_GROUP values of K sums its int8 x int16 products exactly in int32 (< 16 x 127 x 2^15 = 2^26),
   converted to fp32 (rounded once) and times its column's scale added to the column's fp32 sum (one
   FMA, in K's order); the sum times 2^(e - 14) (exact) is the output, rounded once to bf16 or not. The
   weights are q x scale exactly (the AMX kernel rounds that to bf16 first: up to 2^-9 of each weight
   apart). The same sums in the same order on AVX-512 and AVX2, whatever the blocking: the same bits on
   both. Every output depends on its own row and column alone, whatever the batch, the block of rows or
   the thread: a row prefilled and decoded give the same bits. A row holding an inf or a NaN gives NaN
   outputs.

   Speed (whole models' linears swept, 2 cores, bench/RESULTS.md): on a Zen 3 (2026-12-06, bench/w8_linears.py)
   1.42-1.60x the bf16 engine's panels at 1-8 rows (half the bytes) and 1.26-1.51x at 32 (the products:
   VPMADDWD and its VPADDD ran 22 products a cycle in registers against the FMAs' 16); on a Zen 4
   (2026-12-07, Llama-3.2-1B's linears alternated with the kernel before) 1.16-1.32x the bf16-widening
   kernel it replaced at 8 rows, 0.98x at 32, 0.91-0.97x at 1-2 (both bound by memory there), and in the
   engine 1.10-1.16x its tokens/s at 8 sequences, 1.05-1.07x at 32. */
#ifndef ROLLOUT_NATIVE_W8_MADD_H
#define ROLLOUT_NATIVE_W8_MADD_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>

#include "common.h"
#include "w8_chunk.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MADD512 1
#define MADD_ROWS 12 /* a block: 12 rows x 32 columns of int32 sums and two weight vectors, of 32 registers */
#define MADD_COLS 32 /* columns a pass over the weights: a chunk's two tiles, or one (madd_tile_block) */
#define MADD_SPLIT_ROWS 2 /* up to this many rows: two int32 sums a tile, so fewer wait on the last product */
/* The weight stream fetched into L2 this many chunks ahead (the bf16-widening kernel before this one, on a
   Zen 4: 15.8 GB/s of int8 at 1 row with no prefetch, 34.0 at 8 chunks ahead). This kernel spends less
   time a chunk, so its fetches need to start further ahead: 16 chunks ran Llama-3.2-1B's and Qwen3-1.7B's
   linears 1.01-1.12x faster than 8 at 1-4 rows, alike at 8-32; 4 ahead, none, into L1, or spread over the
   chunk's rows ran slower (bench/RESULTS.md, 2026-12-07) */
#define MADD_PREFETCH_CHUNKS 16
#else
#define MADD_ROWS 6 /* a block: 6 rows x 16 columns of int32 sums, two weight vectors, a broadcast, a product */
#define MADD_COLS 16 /* one tile */
#endif
#define X_KEEP_BYTES (4 << 20) /* the quantized activations of a decode step kept per thread; a prefill's freed */

/* switch (rows) calling MADD(R) with R a constant (1..MADD_ROWS) in each case, so the compiler keeps every
   int32 sum of a block in a register */
#define MADD_UP_TO_5                                                                                          \
    case 1: MADD(1); break; case 2: MADD(2); break; case 3: MADD(3); break; case 4: MADD(4); break;           \
    case 5: MADD(5); break;
#ifdef MADD512
#define MADD_BY_ROWS(rows)                                                                                    \
    switch (rows) {                                                                                           \
    MADD_UP_TO_5                                                                                              \
    case 6: MADD(6); break; case 7: MADD(7); break; case 8: MADD(8); break; case 9: MADD(9); break;           \
    case 10: MADD(10); break; case 11: MADD(11); break; default: MADD(12); break;                            \
    }
#else
#define MADD_BY_ROWS(rows) switch (rows) { MADD_UP_TO_5 default: MADD(6); break; }
#endif

/* 8 bf16 values widened to fp32 (exact) */
static inline __m256 widen8(__m128i bf16) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16), 16)); }

/* Row x (k bf16 values) as int16 pairs into dst (every `stride`-th int32, stride the rows of its block: the
   block's layout, pair j of the row at dst[j * stride]), k padded with zeros to pairs pairs; returns
   2^(e - 14) (NaN for a row holding an inf or a NaN). */
static float quantize_row_i16(const uint16_t *x, int64_t k, int64_t pairs, int32_t *dst, int stride) {
    uint16_t top = 0;
    for (int64_t i = 0; i < k; i++) top = (x[i] & 0x7fff) > top ? (x[i] & 0x7fff) : top;
    if (top >= 0x7f80) {
        for (int64_t j = 0; j < pairs; j++) dst[j * stride] = 0;
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
        for (int j = 0; j < 8; j++) dst[(i / 2 + j) * stride] = p[j];
    }
    int16_t tail[2] = {0, 0};
    for (; i < 2 * pairs; i++) {
        tail[i % 2] = i < k ? (int16_t)lrintf(bf16_to_f32(x[i]) * s1 * s2) : 0;
        if (i % 2) memcpy(&dst[i / 2 * stride], tail, sizeof tail);
    }
    return ldexpf(1.0f, -up);
}

#ifdef MADD512
/* rows (1..MADD_ROWS) rows of x (block layout: the rows' pairs interleaved) times both tiles (32 columns)
   of a panel's kc_count chunks, into sums [rows][32] (fp32, the columns in order): AVX-512's VPDPWSSD does
   VPMADDWD's 32 products and their VPADDD in one instruction, and a tile row sign-extends in order with one
   VPMOVSXBW. The same sums, in the same order, as the AVX2 block: the same bits. For a call of one block
   (up to 12 rows), which fetches the weights ahead. `tile`: unused here (AVX2's block takes one). */
ALWAYS_INLINE void madd_block(const int32_t *x, int rows, int64_t kc_count, const uint8_t *wb, int tile,
                              float (*sums)[MADD_COLS]) {
    (void)tile;
    __m512 f[MADD_ROWS][2];
    for (int r = 0; r < rows; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
    for (int64_t kc = 0; kc < kc_count; kc++) {
        const uint8_t *chunk = wb + kc * W8_CHUNK_BYTES;
        const int8_t *q = (const int8_t *)(chunk + W8_SCALE_BYTES);
        const uint16_t *scales = (const uint16_t *)chunk;
        const int32_t *xk = x + kc * 16 * rows;
        for (int l = 0; l < W8_CHUNK_BYTES; l += 64)
            _mm_prefetch((const char *)(chunk + MADD_PREFETCH_CHUNKS * W8_CHUNK_BYTES + l), _MM_HINT_T1);
        _Pragma("GCC unroll 2") for (int g = 0; g < W8_GROUPS; g++) {
            __m512i a[MADD_ROWS][2][2]; /* [row][even or odd tile row, with few rows][tile] */
            for (int r = 0; r < rows; r++)
                for (int h = 0; h < 2; h++) a[r][h][0] = a[r][h][1] = _mm512_setzero_si512();
            _Pragma("GCC unroll 8") for (int pp = 0; pp < W8_ROWS_PER_GROUP; pp++) {
                const int p = g * W8_ROWS_PER_GROUP + pp, h = rows <= MADD_SPLIT_ROWS ? pp % 2 : 0;
                const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * p)));
                const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + 512 + 32 * p)));
                for (int r = 0; r < rows; r++) {
                    const __m512i xv = _mm512_set1_epi32(xk[p * rows + r]);
                    a[r][h][0] = _mm512_dpwssd_epi32(a[r][h][0], w0, xv);
                    a[r][h][1] = _mm512_dpwssd_epi32(a[r][h][1], w1, xv);
                }
            }
            if (rows <= MADD_SPLIT_ROWS) /* integer sums: exact in any order */
                for (int r = 0; r < rows; r++)
                    for (int t = 0; t < 2; t++) a[r][0][t] = _mm512_add_epi32(a[r][0][t], a[r][1][t]);
            /* the group's scales (bf16, exact in fp32), tile 0's 16 columns then tile 1's */
            const __m512 s0 = (__m512)load16_bf16(scales + 32 * g), s1 = (__m512)load16_bf16(scales + 32 * g + 16);
            for (int r = 0; r < rows; r++) {
                f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][0][0]), s0, f[r][0]);
                f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][0][1]), s1, f[r][1]);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(sums[r], f[r][0]), _mm512_storeu_ps(sums[r] + 16, f[r][1]);
}

/* madd_block's sums for one tile (16 columns, `tile` of the chunk's two) and so half its registers: with 12
   rows both tiles' fp32 sums would not fit beside their int32 ones. The same sums, the same bits. */
ALWAYS_INLINE void madd_tile_block(const int32_t *x, int rows, int64_t kc_count, const uint8_t *wb, int tile,
                                   int fetch, float (*sums)[MADD_COLS]) {
    __m512 f[MADD_ROWS];
    for (int r = 0; r < rows; r++) f[r] = _mm512_setzero_ps();
    for (int64_t kc = 0; kc < kc_count; kc++) {
        const uint8_t *chunk = wb + kc * W8_CHUNK_BYTES;
        const int8_t *q = (const int8_t *)(chunk + W8_SCALE_BYTES) + 512 * tile;
        const uint16_t *scales = (const uint16_t *)chunk + 16 * tile;
        const int32_t *xk = x + kc * 16 * rows;
        if (fetch)
            for (int l = 0; l < W8_CHUNK_BYTES; l += 64)
                _mm_prefetch((const char *)(chunk + MADD_PREFETCH_CHUNKS * W8_CHUNK_BYTES + l), _MM_HINT_T1);
        _Pragma("GCC unroll 2") for (int g = 0; g < W8_GROUPS; g++) {
            __m512i a[MADD_ROWS];
            for (int r = 0; r < rows; r++) a[r] = _mm512_setzero_si512();
            _Pragma("GCC unroll 8") for (int pp = 0; pp < W8_ROWS_PER_GROUP; pp++) {
                const int p = g * W8_ROWS_PER_GROUP + pp;
                const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * p)));
                for (int r = 0; r < rows; r++) a[r] = _mm512_dpwssd_epi32(a[r], w, _mm512_set1_epi32(xk[p * rows + r]));
            }
            const __m512 sc = (__m512)load16_bf16(scales + 32 * g);
            for (int r = 0; r < rows; r++) f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r]), sc, f[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(sums[r] + 16 * tile, f[r]);
}

static void madd_tile_rows(const int32_t *x, int rows, int64_t kc_count, const uint8_t *wb, int tile, int fetch,
                           float (*sums)[MADD_COLS]) {
#define MADD(R) madd_tile_block(x, R, kc_count, wb, tile, fetch, sums)
    MADD_BY_ROWS(rows)
#undef MADD
}

#else
/* rows (1..MADD_ROWS) rows of x (block layout: the rows' pairs interleaved) times one tile (16 columns,
   `tile` of each chunk's two) of a panel's kc_count chunks, into sums [rows][16] (fp32, the tile's columns
   in order). Always inlined with a constant row count, so the int32 sums stay in registers; the fp32 ones
   live in L1 (12 registers more than AVX2's 16). Both loops over a chunk unrolled: with the groups' loop
   rolled GCC's code ran 1.3-2.3x slower at 8-32 rows. Prefetches `step` bytes from `ahead` a chunk (see
   w8_linear's MADD_AHEAD). */
ALWAYS_INLINE void madd_block(const int32_t *x, int rows, int64_t kc_count, const uint8_t *wb, int tile,
                              float (*sums)[MADD_COLS], const char *ahead, int64_t step) {
    float f[MADD_ROWS][16] __attribute__((aligned(32))) = {{0}}; /* the sums' columns in w0's and w1's order */
    for (int64_t kc = 0; kc < kc_count; kc++) {
        const uint8_t *chunk = wb + kc * W8_CHUNK_BYTES;
        const int8_t *q = (const int8_t *)(chunk + W8_SCALE_BYTES) + 512 * tile;
        const uint16_t *scales = (const uint16_t *)chunk + 16 * tile;
        const int32_t *xk = x + kc * 16 * rows;
        for (int64_t l = 0; l < step; l += 64) _mm_prefetch(ahead + kc * step + l, _MM_HINT_T1);
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
                    const __m256i xv = _mm256_set1_epi32(xk[p * rows + r]);
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

#endif

/* madd_block with `rows` a constant in each copy. `tile`: on AVX2 which tile (16 columns); unused on AVX-512
   (both tiles a pass). `ahead`, `step`: AVX2's prefetch (MADD_AHEAD); AVX-512's block fetches its own. */
static void madd_rows(const int32_t *x, int rows, int64_t kc_count, const uint8_t *wb, int tile,
                      float (*sums)[MADD_COLS], const char *ahead, int64_t step) {
#ifdef MADD512
    (void)ahead, (void)step;
#define MADD(R) madd_block(x, R, kc_count, wb, tile, sums)
#else
#define MADD(R) madd_block(x, R, kc_count, wb, tile, sums, ahead, step)
#endif
    MADD_BY_ROWS(rows)
#undef MADD
}

/* AVX2, a call of 1-2 rows (a decode step of one or two sequences, bound by the weights' bytes): each tile's
   pass prefetches half the next panel (it lies right after this one), so the weights stream the whole time
   rather than as fast as the hardware's prefetcher follows: on a Zen 3 over Qwen2.5-1.5B's linears 1.10-1.85x
   at 1 row, 1.41-1.43x at 2. At 4-6 rows it ran 0.95x, and spread over every block's passes (f32_panels.h's
   way) 0.96-0.97x at 8-12 rows: there the products bound a call (bench/RESULTS.md). */
#define MADD_AHEAD(m) ((m) <= 2)

static int w8_linear(const uint16_t *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, uint16_t *out_bf16,
                     float *out_f32) {
    if (m == 0 || n == 0) return 0;
    const int64_t kc_count = (k + 31) / 32, pairs = kc_count * 16, blocks = (m + MADD_ROWS - 1) / MADD_ROWS;
    const int64_t bytes = blocks * pairs * MADD_ROWS * (int64_t)sizeof(int32_t) + m * (int64_t)sizeof(float);
    int32_t *xq = bytes <= X_KEEP_BYTES ? thread_buffer(bytes) : malloc((size_t)bytes);
    if (xq == NULL) return -1;
    float *row_scale = (float *)(xq + blocks * pairs * MADD_ROWS);
    for (int64_t r = 0; r < m; r++) { /* a block of fewer rows interleaves only those: a row alone reads its own */
        const int64_t blk = r / MADD_ROWS, left = m - blk * MADD_ROWS;
        const int in_block = left < MADD_ROWS ? (int)left : MADD_ROWS;
        row_scale[r] = quantize_row_i16(x + r * k, k, pairs, xq + blk * pairs * MADD_ROWS + r % MADD_ROWS, in_block);
    }
    const int64_t panels = (n + 31) / 32;
    const int64_t pf_step = MADD_AHEAD(m) ? (W8_CHUNK_BYTES + 1) / 2 : 0; /* a tile's pass: half of each chunk */
#pragma omp parallel for schedule(static) if (m * n * k > 65536)
    for (int64_t np = 0; np < panels; np++) {
        const uint8_t *wb = w + np * kc_count * W8_CHUNK_BYTES;
        const char *next = (const char *)(wb + kc_count * W8_CHUNK_BYTES);
        for (int tile = 0; tile < 32 / MADD_COLS; tile++) {
            const int64_t col = np * 32 + MADD_COLS * tile, cols = n - col < MADD_COLS ? n - col : MADD_COLS;
            if (cols <= 0) break;
            for (int64_t blk = 0; blk < blocks; blk++) {
                const int64_t m0 = blk * MADD_ROWS;
                const int rows = m - m0 < MADD_ROWS ? (int)(m - m0) : MADD_ROWS;
                float sums[MADD_ROWS][MADD_COLS];
#ifdef MADD512
                /* more than a block: a tile a pass, its fp32 sums in registers (Llama-3.2-1B's linears at 32
                   rows: 1.07x both tiles a pass); the first pass fetches the chunks, the rest read L2 */
                if (blocks > 1)
                    for (int t = 0; t < 2; t++)
                        madd_tile_rows(xq + blk * pairs * MADD_ROWS, rows, kc_count, wb, t, blk == 0 && t == 0, sums);
                else
                    madd_rows(xq + blk * pairs * MADD_ROWS, rows, kc_count, wb, 0, sums, NULL, 0);
#else
                madd_rows(xq + blk * pairs * MADD_ROWS, rows, kc_count, wb, tile, sums, next + tile * kc_count * pf_step,
                          pf_step);
#endif
                for (int r = 0; r < rows; r++)
                    for (int64_t h = 0; h < cols; h += 16) {
                        const int64_t at = (m0 + r) * n + col + h, left = cols - h;
                        const v16f v = load16_f32(sums[r] + h) * row_scale[m0 + r];
                        if (left >= 16 && out_f32) store16_f32(out_f32 + at, v);
                        else if (left >= 16) store16_bf16(out_bf16 + at, v);
                        else
                            for (int64_t c = 0; c < left; c++) {
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
