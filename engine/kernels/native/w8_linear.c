/* Weight-only int8 on a CPU without AMX tiles: out [m, n] = x [m, k] . w^T with w amx_linears.pack_w8's
   chunks (int8, a bf16 scale per W8_GROUP values of K of each column), each weight q * scale exactly,
   multiplied as integers by the activations rounded to int16: on AVX512-VNNI's VPDPWSSD (AMD Zen 4 and 5,
   Intel Ice Lake and later) or AVX2's VPMADDWD (AMD Zen 3, Intel Haswell and later); w8_madd.h says how
   far that is from bf16 products, and why it is the same bits on both.

   Where a step reads more bytes than it multiplies (a decode step of a few sequences) the int8 copy
   streams 0.56 of the bf16 weights' bytes. The kernel this replaced on AVX512-BF16 (the AMX kernel's bf16
   weights, q * scale rounded, widened before VDPBF16PS multiplied them) spent 9 instructions a tile row
   widening: in the engine on a Zen 4 the integers ran 1.10-1.16x its tokens/s at 8 sequences and
   1.05-1.07x at 32 (bench/RESULTS.md, 2026-12-07). */

#include "common.h"

#if defined(__AVX2__) /* AVX512-VNNI or AVX2: the int8 weights as integers */

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
