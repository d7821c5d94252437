/* Weight-only int8 on a CPU without AMX tiles: out [m, n] = x [m, k] . w^T with w amx_linears.pack_w8's
   chunks (int8, a bf16 scale per W8_GROUP values of K of each column), the bf16 weights each q * scale
   rounded once (w8_chunk.h's widen_chunk, the AMX kernel's), so the int8 engine multiplies the same weights
   on every CPU with bf16 dot products. With AVX512-BF16 (AMD Zen 4 and 5, Intel Cooper Lake) on them, as
   below; on AVX2 (AMD Zen 3) as integers instead, each weight q x scale exactly and the activations rounded
   to int16 (w8_madd.h says how far that is from the bf16 weights' products).

   Where a step reads more bytes than it multiplies (a decode step of a few sequences) the int8 copy
   streams half the bf16 weights' bytes. Each chunk's 32 columns are multiplied widened: lane j
   of an accumulator is column j, each VDPBF16PS adds one pair of K of 16 columns for one row (the row's
   pair broadcast). A thread's columns are whole chunks' 32. A call of up to MR_MAX rows widens each tile
   row in registers just before its products; a larger one widens each chunk into a 2 KB slot of a
   panel in its first block of rows, which the later blocks read again from the caches (Qwen2.5-1.5B's
   linears on a Zen 4: in registers 1.05-1.17x the panel's way at 1-12 rows, the same bits).

   Arithmetic: every bf16 x bf16 product is exact in fp32; an output sums its pairs in K's order in
   one lane, so its bits depend on its own row and column alone (not on the batch or the block it fell
   in): a row prefilled and the same row decoded give the same bits. Rounded once to bf16 (or not:
   fp32 out). The same holds on AVX2's integer products (w8_madd.h). */

#include <omp.h>

#include "common.h"
#include "w8_chunk.h"

#define MR_MAX 12 /* rows a block: 2 x 12 accumulators, two weight vectors and a broadcast of 32 registers */
/* The weight stream fetched into L2 this many chunks ahead of the widening: the widening and the memory's
   reads did not overlap without it (Qwen2.5-1.5B's linears on a Zen 4, 1 row: 15.8 GB/s of int8 with no
   prefetch, 18.1 at 4 chunks ahead into L1, 34.0 at 8 into L2; 16 and 32 ahead ran alike) */
#define PREFETCH_CHUNKS 8

#ifdef __AVX512BF16__

/* rows (1..MR_MAX) rows of x (stride ldx, K padded to the chunks') times the packed chunks at wb (32
   columns' kc_count chunks) into out (stride n, columns col.. col + cols, cols <= 32). No panel (a call of
   one block): each tile row widened in registers just before its products. A panel (kc_count x 2 KB):
   `widen` widens each chunk into it first (the first block), else the products read it back. */
ALWAYS_INLINE void block(const uint16_t *x, int64_t ldx, int rows, int64_t kc_count, const uint8_t *wb, int widen,
                         uint16_t *panel, int64_t n, int64_t col, int64_t cols, uint16_t *out_bf16, float *out_f32) {
    __m512 acc[MR_MAX][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t kc = 0; kc < kc_count; kc++) {
        const uint8_t *chunk = wb + kc * W8_CHUNK_BYTES;
        const int8_t *q = (const int8_t *)(chunk + W8_SCALE_BYTES);
        const uint16_t *wt = panel ? panel + kc * (W8_WIDE_BYTES / 2) : NULL;
        if (widen)
            for (int l = 0; l < W8_CHUNK_BYTES; l += 64)
                _mm_prefetch((const char *)(chunk + PREFETCH_CHUNKS * W8_CHUNK_BYTES + l), _MM_HINT_T1);
        if (panel && widen) widen_chunk(chunk, (uint16_t *)wt);
        const uint16_t *xk = x + kc * 32;
        /* the tiles' scales, every group's before the rows (no panel): 4% faster at 8 rows than between them */
        __m512 lo0[W8_GROUPS], hi0[W8_GROUPS], lo1[W8_GROUPS], hi1[W8_GROUPS];
        for (int g = 0; g < W8_GROUPS; g++) {
            lo0[g] = hi0[g] = lo1[g] = hi1[g] = _mm512_setzero_ps();
            if (!panel) chunk_scales(chunk, 0, g, &lo0[g], &hi0[g]), chunk_scales(chunk, 1, g, &lo1[g], &hi1[g]);
        }
        for (int p = 0; p < 16; p++) {
            const int g = p / W8_ROWS_PER_GROUP;
            const __m512bh w0 = panel ? (__m512bh)_mm512_load_si512((const void *)(wt + p * 32))
                                      : widen_row(q + p * 32, lo0[g], hi0[g]);
            const __m512bh w1 = panel ? (__m512bh)_mm512_load_si512((const void *)(wt + 512 + p * 32))
                                      : widen_row(q + 512 + p * 32, lo1[g], hi1[g]);
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, xk + r * ldx + 2 * p, sizeof pair);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < 2; t++) {
            const int64_t c = col + 16 * t, left = cols - 16 * t;
            if (left <= 0) break;
            const __mmask16 mask = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            if (out_f32) _mm512_mask_storeu_ps(out_f32 + r * n + c, mask, acc[r][t]);
            else _mm256_mask_storeu_epi16(out_bf16 + r * n + c, mask, (__m256i)_mm512_cvtneps_pbh(acc[r][t]));
        }
}

/* block() with `rows` a constant in each copy, so the compiler keeps every sum in a register. */
static void block_rows(const uint16_t *x, int64_t ldx, int rows, int64_t kc_count, const uint8_t *wb, int widen,
                       uint16_t *panel, int64_t n, int64_t col, int64_t cols, uint16_t *out_bf16, float *out_f32) {
#define BLOCK(R) block(x, ldx, R, kc_count, wb, widen, panel, n, col, cols, out_bf16, out_f32)
    switch (rows) {
    case 1: BLOCK(1); break;
    case 2: BLOCK(2); break;
    case 3: BLOCK(3); break;
    case 4: BLOCK(4); break;
    case 5: BLOCK(5); break;
    case 6: BLOCK(6); break;
    case 7: BLOCK(7); break;
    case 8: BLOCK(8); break;
    case 9: BLOCK(9); break;
    case 10: BLOCK(10); break;
    case 11: BLOCK(11); break;
    default: BLOCK(12); break;
    }
#undef BLOCK
}

static int w8_linear(const uint16_t *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, uint16_t *out_bf16,
                     float *out_f32) {
    if (m == 0 || n == 0) return 0;
    const int64_t np_count = (n + 31) / 32, kc_count = (k + 31) / 32, pk = kc_count * 32;
    uint16_t *copy = NULL; /* x's rows with K padded with zeros to whole chunks (the chunks' zeros past k) */
    if (pk != k) {
        if ((copy = calloc((size_t)(m * pk), sizeof *copy)) == NULL) return -1;
        for (int64_t r = 0; r < m; r++) memcpy(copy + r * pk, x + r * k, (size_t)k * sizeof *copy);
        x = copy;
    }
    const int64_t blocks = (m + MR_MAX - 1) / MR_MAX;
    int failed = 0;
#pragma omp parallel if (m * n * k > 65536) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), threads = omp_get_num_threads();
        /* one block: widened in registers; more: into a panel, each thread its own (common.h) */
        uint16_t *panel = blocks > 1 ? thread_buffer(kc_count * W8_WIDE_BYTES) : NULL;
        if (blocks > 1 && panel == NULL) failed = 1;
        else
            for (int64_t np = np_count * t / threads; np < np_count * (t + 1) / threads; np++) {
                const uint8_t *wb = w + np * kc_count * W8_CHUNK_BYTES;
                const int64_t col = np * 32, cols = n - col < 32 ? n - col : 32;
                for (int64_t blk = 0, m0 = 0; blk < blocks; blk++) { /* blocks of even rows: 32 = 11 + 11 + 10 */
                    const int rows = (int)((m - m0 + blocks - blk - 1) / (blocks - blk));
                    block_rows(x + m0 * pk, pk, rows, kc_count, wb, blk == 0, panel, n, col, cols,
                               out_bf16 ? out_bf16 + m0 * n : NULL, out_f32 ? out_f32 + m0 * n : NULL);
                    m0 += rows;
                }
            }
    }
    free(copy);
    return failed ? -1 : 0;
}

#elif defined(__AVX2__) /* no AVX512-BF16 (AVX2): the int8 weights as integers, on VPMADDWD */

#include "w8_madd.h"

#else /* neither: no kernel here (w8_linears.available() says so), the library still builds */

static int w8_linear(const uint16_t *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, uint16_t *out_bf16,
                     float *out_f32) {
    (void)x, (void)m, (void)k, (void)w, (void)n, (void)out_bf16, (void)out_f32;
    return -1;
}

#endif

/* The AMX kernel's signatures (amx_linear_w8_bf16 / _f32), so the C decode loop takes either. */
int w8_linear_bf16(const uint16_t *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, uint16_t *out_bf16) {
    return w8_linear(x, m, k, w, n, out_bf16, NULL);
}

int w8_linear_f32(const uint16_t *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *out_f32) {
    return w8_linear(x, m, k, w, n, NULL, out_f32);
}
