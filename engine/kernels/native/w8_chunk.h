/* Weight-only int8's packed chunk (amx_linears.pack_w8's layout): its constants for the kernels that read
   it (amx_linear.c, and w8_madd.h without AMX, which multiplies the int8 as integers), and its widening to
   bf16 for the AMX tiles. */
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
   with AMX has AVX512-BF16: the scalar path builds so that the files compile anywhere. */
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

#endif
