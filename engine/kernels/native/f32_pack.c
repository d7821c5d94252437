/* Packs of weight rows into the panels f32_linear.c multiplies ([ceil(n/32)][k][32], fp32 or bf16 in
   load_bf16_pair's order): engine/kernels/f32_linears.pack, once a push for every linear it changes. */

#include <stdint.h>

#include "f32_transpose.h"

/* Row `row` of the segments as if stacked */
static const void *segment_row(const void *const *seg, const int64_t *rows, int64_t count, int64_t row,
                               int64_t row_bytes) {
    for (int64_t i = 0; i < count; i++) {
        if (row < rows[i]) return (const char *)seg[i] + row * row_bytes;
        row -= rows[i];
    }
    return NULL; /* past the last row: a zero row */
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* a panel's 32 rows all there (none past n): the register transposes' case */
static inline int all_rows(const void *const src[32]) {
    for (int j = 0; j < 32; j++)
        if (src[j] == NULL) return 0;
    return 1;
}
#endif

/* The pack f32_linears.pack describes, in one pass: the rows of up to three segments (a layer's
   q/k/v or gate/up, one after the other as if stacked, so a group is packed with no concatenated copy;
   seg[i] holds rows[i] rows of k floats) into panels [ceil(n/32)][k][32], the rows past n zero. A
   push derives it for every fp32 linear it changes (an adapter's merge: all of them), where torch's
   zero-fill, copy and transposing copy took three passes (~1.7 GB/s here). Each thread takes whole
   panels. On AVX-512 a 16 x 16 block (16 rows, 16 values of K) is transposed in registers and
   written as whole cache lines that bypass the cache (the panels are read at the next forward, long
   after): scalar stores 128 bytes apart read each line in before writing it. */
void f32_pack_rows(const float *const *seg, const int64_t *rows, int64_t count, int64_t k, float *out) {
    int64_t n = 0;
    for (int64_t i = 0; i < count; i++) n += rows[i];
    const int64_t panels = (n + 31) / 32;
#pragma omp parallel
    {
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * k * 32;
        const float *src[32];
        for (int j = 0; j < 32; j++)
            src[j] = segment_row((const void *const *)seg, rows, count, p * 32 + j, k * (int64_t)sizeof(float));
        int64_t k0 = 0;
#ifdef __AVX512F__
        /* whole lines: the panel's rows are 128 bytes, at 64-byte aligned addresses when out is */
        const int stream = ((uintptr_t)out & 63) == 0;
        for (; k0 < k; k0 += 16) {
            const int64_t kb = k - k0 < 16 ? k - k0 : 16;
            const __mmask16 m = (__mmask16)((1u << kb) - 1u);
            for (int half = 0; half < 2; half++) {
                __m512i r[16];
                for (int j = 0; j < 16; j++) {
                    const float *row = src[half * 16 + j];
                    r[j] = row ? _mm512_maskz_loadu_epi32(m, row + k0) : _mm512_setzero_si512();
                }
                transpose16_regs(r);
                for (int64_t kk = 0; kk < kb; kk++) {
                    float *d = dst + (k0 + kk) * 32 + half * 16;
                    if (stream) _mm512_stream_si512((void *)d, r[kk]);
                    else _mm512_storeu_si512((void *)d, r[kk]);
                }
            }
        }
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
        /* 8 columns x 8 values of K a transpose (a panel's last, partial, columns: the loop below) */
        if (all_rows((const void *const *)src))
            for (; k0 + 8 <= k; k0 += 8)
                for (int c = 0; c < 32; c += 8) {
                    __m256 r[8];
                    for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(src[c + j] + k0);
                    transpose8_regs(r);
                    for (int kk = 0; kk < 8; kk++) _mm256_storeu_ps(dst + (k0 + kk) * 32 + c, r[kk]);
                }
#endif
        for (; k0 < k; k0 += 16) {
            const int64_t kb = k - k0 < 16 ? k - k0 : 16;
            for (int j = 0; j < 32; j++)
                for (int64_t kk = 0; kk < kb; kk++) dst[(k0 + kk) * 32 + j] = src[j] ? src[j][k0 + kk] : 0.0f;
        }
    }
#ifdef __AVX512F__
    _mm_sfence(); /* this thread's streamed lines are visible before the panels are read */
#endif
    }
}

/* f32_pack_rows for bf16 rows into bf16 panels, each block's 2 * VW columns of a panel row in
   load_bf16_pair's order. Each thread takes whole panels; K in runs of 64, so each of the 32 source rows is
   read a line at a time. */
void f32_pack_rows_bf16(const uint16_t *const *seg, const int64_t *rows, int64_t count, int64_t k, uint16_t *out) {
    int64_t n = 0;
    for (int64_t i = 0; i < count; i++) n += rows[i];
    const int64_t panels = (n + 31) / 32;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *dst = out + p * k * 32;
        const uint16_t *src[32];
        for (int j = 0; j < 32; j++)
            src[j] = segment_row((const void *const *)seg, rows, count, p * 32 + j, k * (int64_t)sizeof(uint16_t));
        int64_t k0 = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
        /* a block's 16 columns x 8 values of K at a time (a panel's last, partial, columns: the loop below) */
        if (all_rows((const void *const *)src))
            for (; k0 + 8 <= k; k0 += 8)
                for (int c = 0; c < 32; c += 16) bf16_pairs_8x16(src + c, k0, dst + k0 * 32 + c);
#endif
        for (; k0 < k; k0 += 64) {
            const int64_t kb = k - k0 < 64 ? k - k0 : 64;
            for (int j = 0; j < 32; j++)
                for (int64_t kk = 0; kk < kb; kk++) dst[(k0 + kk) * 32 + bf16_slot(j)] = src[j] ? src[j][k0 + kk] : 0;
        }
    }
}
