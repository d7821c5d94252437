/* Weight-only int8's packed chunk (amx_linears.pack_w8's layout), widened to bf16: shared by the AMX
   kernel (amx_linear.c, whose tiles read the widened chunk) and the AVX512-BF16 one (w8_linear.c, whose
   dot products do), so both multiply the same bf16 weights. */
#ifndef ROLLOUT_NATIVE_W8_CHUNK_H
#define ROLLOUT_NATIVE_W8_CHUNK_H

#include "common.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* Values of K per scale (amx_linears.W8_GROUP): a chunk's 32 values of K hold 32 / W8_GROUP groups. 16,
   not 32: SmolLM2's sampled tokens outside [0.9, 1.1] of the trainer's fell from 8.9% to 6.7% (weights
   rounded in fp32, bench/fidelity.py's ablation), under bf16's engine's 7.7%, for 6% more bytes. */
#define W8_GROUP 16
#define W8_GROUPS (32 / W8_GROUP)
#define W8_ROWS_PER_GROUP (W8_GROUP / 2)          /* tile rows (pairs of K) a scale covers */
#define W8_SCALE_BYTES (64 * W8_GROUPS)           /* per group, the chunk's 32 columns' bf16 scales */
#define W8_CHUNK_BYTES (W8_SCALE_BYTES + 1024)    /* then 2 x 16 columns x 32 values of K in int8 */
#define W8_WIDE_BYTES 2048                        /* the same chunk in bf16 */

#ifdef __AVX512BF16__
/* Tile t's 16 column scales of group g (of a chunk's 32 columns) as fp32, each twice, for the two halves
   of a tile row (16 columns x 2 values of K): columns 0-7 in *lo, 8-15 in *hi. */
static inline void chunk_scales(const uint8_t *chunk, int t, int g, __m512 *lo, __m512 *hi) {
    const __m512i lo_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)chunk + 32 * g + 16 * t))), 16));
    *lo = _mm512_permutexvar_ps(lo_cols, s);
    *hi = _mm512_permutexvar_ps(_mm512_add_epi32(lo_cols, _mm512_set1_epi32(8)), s);
}

/* One tile row's 32 int8 weights (16 columns x 2 values of K) widened to fp32 (exact), times their
   columns' scales, and rounded once to bf16. */
static inline __m512bh widen_row(const int8_t *q, __m512 lo_scales, __m512 hi_scales) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, hi_scales), _mm512_mul_ps(lo, lo_scales));
}
#endif

/* One chunk of a weight-only int8 weight to bf16 tiles: per group of W8_GROUP values of K the 32
   columns' bf16 scales, then the two B tiles' 1024 int8, each tile row widen_row'd with its group's. Every CPU
   with AMX has AVX512-BF16, and w8_linear.c runs only where a CPU has it: the scalar path builds so
   that the files compile anywhere. */
static inline void widen_chunk(const uint8_t *chunk, uint16_t *dst) {
    const int8_t *q = (const int8_t *)(chunk + W8_SCALE_BYTES);
#ifdef __AVX512BF16__
    for (int t = 0; t < 2; t++) { /* the groups' scales first: 4% faster than loading them between rows */
        __m512 lo[W8_GROUPS], hi[W8_GROUPS];
        for (int g = 0; g < W8_GROUPS; g++) chunk_scales(chunk, t, g, &lo[g], &hi[g]);
        for (int p = 0; p < 16; p++) {
            const int g = p / W8_ROWS_PER_GROUP;
            const int at = 512 * t + 32 * p; /* tile t's row p */
            _mm512_store_si512((void *)(dst + at), (__m512i)widen_row(q + at, lo[g], hi[g]));
        }
    }
#else
    const uint16_t *scales = (const uint16_t *)chunk;
    for (int i = 0; i < 1024; i++) { /* tile i / 512, its row (i % 512) / 32, column (i % 32) / 2 */
        const int group = (i % 512) / 32 / W8_ROWS_PER_GROUP;
        dst[i] = f32_to_bf16((float)q[i] * bf16_to_f32(scales[32 * group + 16 * (i / 512) + (i % 32) / 2]));
    }
#endif
}


/* One chunk widened to the same bf16 values as widen_chunk, held in fp32 (exact), in f32_panels.h's layout:
   [32 values of K][32 columns] (w8_linear.c's way on a CPU without AVX512-BF16): a tile row's 32 int8 hold 16
   columns' pairs of K, the even value of K going to one row of the panel and the odd to the next. */
#ifdef __AVX2__
/* (GCC's 16-float vectors went through the stack on AVX2 here: 2.5x slower than these 8-float ones.) x
   rounded to the nearest bf16 (ties even), kept in fp32, for a product q * scale: without round16_bf16's NaN
   test, which such a product never needs (its NaN is the scale's, a bf16 whose low 16 bits are zero, or the
   default one: neither carries into the bits kept). */
static inline __m256 round8_bf16_product(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32((int)0xffff0000u)));
}

static inline __m256 widen8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256 widen8_s8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }

static inline void widen_chunk_f32(const uint8_t *chunk, float *dst) {
    const uint16_t *scales = (const uint16_t *)chunk;
    const int8_t *q = (const int8_t *)(chunk + W8_SCALE_BYTES);
    /* per 8 columns (a 16-byte lane), their even values of K, then their odd */
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int t = 0; t < 2; t++)
        for (int g = 0; g < W8_GROUPS; g++) {
            const uint16_t *s = scales + 32 * g + 16 * t; /* tile t's 16 columns' scales of group g */
            const __m256 s0 = widen8_bf16(s), s1 = widen8_bf16(s + 8);
            for (int p = g * W8_ROWS_PER_GROUP; p < (g + 1) * W8_ROWS_PER_GROUP; p++) {
                const __m256i row = _mm256_loadu_si256((const __m256i *)(q + 512 * t + 32 * p));
                const __m256i b = _mm256_shuffle_epi8(row, split);
                const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
                float *even = dst + 64 * p + 16 * t, *odd = even + 32;
                _mm256_storeu_ps(even, round8_bf16_product(_mm256_mul_ps(widen8_s8(lo), s0)));
                _mm256_storeu_ps(even + 8, round8_bf16_product(_mm256_mul_ps(widen8_s8(hi), s1)));
                _mm256_storeu_ps(odd, round8_bf16_product(_mm256_mul_ps(widen8_s8(_mm_srli_si128(lo, 8)), s0)));
                _mm256_storeu_ps(odd + 8, round8_bf16_product(_mm256_mul_ps(widen8_s8(_mm_srli_si128(hi, 8)), s1)));
            }
        }
}
#else
static inline void widen_chunk_f32(const uint8_t *chunk, float *dst) {
    const uint16_t *scales = (const uint16_t *)chunk;
    const int8_t *q = (const int8_t *)(chunk + W8_SCALE_BYTES);
    for (int i = 0; i < 1024; i++) { /* tile i / 512, its row p = (i % 512) / 32, column c = (i % 32) / 2 */
        const int t = i / 512, p = (i % 512) / 32, c = (i % 32) / 2;
        const float scale = bf16_to_f32(scales[32 * (p / W8_ROWS_PER_GROUP) + 16 * t + c]);
        dst[64 * p + 32 * (i % 2) + 16 * t + c] = round_bf16((float)q[i] * scale);
    }
}
#endif
#endif
