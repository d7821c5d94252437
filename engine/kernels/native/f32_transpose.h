/* Register transposes that lay weight rows out as f32_panels.h's panels: a pack's (f32_pack.c, once a push)
   and a layout per call's (f32_linear.c's in-place kernels) share them, so both write the same bytes. */
#ifndef ROLLOUT_NATIVE_F32_TRANSPOSE_H
#define ROLLOUT_NATIVE_F32_TRANSPOSE_H

#include "common.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
/* 8 x 8 32-bit values transposed in registers: r[i]'s lane j becomes r[j]'s lane i */
static inline void transpose8_regs(__m256 r[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 8; i += 2)
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++)
        r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20), r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
}

/* 16 bf16 rows (src[j], read from value `at`) x 8 values of K as 8 rows of a bf16 panel (dst, a panel row
   apart) in load_bf16_pair's order: rows j and j + 8 paired into 32 bits, then 8 x 8 of those transposed */
static inline void bf16_pairs_8x16(const uint16_t *const *src, int64_t at, uint16_t *dst) {
    __m256 r[8];
    for (int j = 0; j < 8; j++) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(src[j] + at));
        const __m128i b = _mm_loadu_si128((const __m128i *)(src[j + 8] + at));
        r[j] = _mm256_castsi256_ps(_mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b)));
    }
    transpose8_regs(r);
    for (int kk = 0; kk < 8; kk++) _mm256_storeu_ps((float *)(dst + kk * 32), r[kk]);
}
#endif

/* Where column j of a panel row lies in a bf16 panel (load_bf16_pair's order within each block of 2 * VW) */
static inline int bf16_slot(int j) {
    const int c = j % (2 * VW);
    return j - c + 2 * (c % VW) + c / VW;
}

#endif
