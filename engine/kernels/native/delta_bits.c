/* Delta coding of 2-byte values (bf16 / fp16 weights as a push sends them): what changed between
   the values a receiver holds and the new ones, as a bitmap (bit i of byte i / 8, least significant
   first: weight_sync/common/delta.py's pack_bits) and the changed values in order, and its
   inverse. One pass each: torch's way (compare, nonzero, scatter, pack the bits) took passes and
   temporaries of the whole tensor, 5 s to encode and 4 s to apply a 1.7B model's delta here.
   Bits are compared, not values: -0 and 0 differ, a NaN's payload counts, as in delta.py. */

#include <immintrin.h>

#include "common.h"

#if defined(__AVX512BW__) && defined(__AVX512VBMI2__)
#define VECTOR_DELTA 1
#endif

/* Fills bitmap (ceil(n / 8) bytes) and values (room for n); returns how many changed. */
int64_t delta_encode_u16(const uint16_t *old, const uint16_t *now, int64_t n, uint8_t *bitmap, uint16_t *values) {
    int64_t k = 0, i = 0;
#ifdef VECTOR_DELTA
    for (; i + 32 <= n; i += 32) {
        const __m512i a = _mm512_loadu_si512((const void *)(old + i)), b = _mm512_loadu_si512((const void *)(now + i));
        const __mmask32 m = _mm512_cmpneq_epu16_mask(a, b);
        memcpy(bitmap + i / 8, &m, 4);
        _mm512_mask_compressstoreu_epi16(values + k, m, b);
        k += __builtin_popcount(m);
    }
#endif
    for (; i < n; i += 8) {
        uint8_t byte = 0;
        for (int j = 0; j < 8 && i + j < n; j++)
            if (old[i + j] != now[i + j]) {
                byte |= (uint8_t)(1u << j);
                values[k++] = now[i + j];
            }
        bitmap[i / 8] = byte;
    }
    return k;
}

/* How many of the first n bits are set. */
int64_t bitmap_count(const uint8_t *bitmap, int64_t n) {
    int64_t k = 0, i = 0;
    for (; i + 64 <= n; i += 64) {
        uint64_t w;
        memcpy(&w, bitmap + i / 8, 8);
        k += __builtin_popcountll(w);
    }
    for (; i < n; i++) k += (bitmap[i / 8] >> (i % 8)) & 1;
    return k;
}

/* base[i] = the next of `values` for each set bit i < n (delta_encode_u16's inverse). */
void delta_apply_u16(uint16_t *base, int64_t n, const uint8_t *bitmap, const uint16_t *values) {
    int64_t k = 0, i = 0;
#ifdef VECTOR_DELTA
    for (; i + 32 <= n; i += 32) {
        __mmask32 m;
        memcpy(&m, bitmap + i / 8, 4);
        if (!m) continue;
        const __m512i v = _mm512_mask_expandloadu_epi16(_mm512_loadu_si512((const void *)(base + i)), m, values + k);
        _mm512_storeu_si512((void *)(base + i), v);
        k += __builtin_popcount(m);
    }
#endif
    for (; i < n; i++)
        if ((bitmap[i / 8] >> (i % 8)) & 1) base[i] = values[k++];
}

/* The positions of the first n bits that are set, ascending, into out (int32); returns how many. */
int64_t bitmap_positions(const uint8_t *bitmap, int64_t n, int32_t *out) {
    int64_t k = 0, i = 0;
    for (; i + 64 <= n; i += 64) {
        uint64_t w;
        memcpy(&w, bitmap + i / 8, 8);
        while (w) {
            out[k++] = (int32_t)(i + __builtin_ctzll(w));
            w &= w - 1;
        }
    }
    for (; i < n; i++)
        if ((bitmap[i / 8] >> (i % 8)) & 1) out[k++] = (int32_t)i;
    return k;
}
