/* Per-row (per-token) symmetric int8 quantization of activations, one pass to find each row's
   largest |x| and one to quantize it: what int8_linears.quantize_rows does in eight torch ops
   (a copy to fp32, abs, amax, clamp, two divisions, round, a cast), each a pass over the rows.
   The same arithmetic, bit for bit: scale = max(max|x|, FLT_MIN) / 127 in fp32, q = x / scale
   rounded to nearest, ties to even (nearbyintf in the default rounding mode), as torch.round. */

#include <float.h>

#include "common.h"

typedef int8_t v16c __attribute__((vector_size(16)));

/* Rounds to nearest, ties to even, for |x| < 2^22 (here |x| <= 127): adding and taking away
   1.5 * 2^23 leaves no fraction bits, in the default rounding mode, as nearbyintf. */
static inline v16f round_even(v16f x) {
    const v16f magic = (v16f){0} + 12582912.0f;
    return (x + magic) - magic;
}

#define DEFINE_QUANTIZE(NAME, T, LOAD, LOAD16)                                                          \
    void NAME(const T *x, int64_t rows, int64_t cols, int8_t *q, float *scale) {                     \
        _Pragma("omp parallel for schedule(static) if (rows * cols > 16384)")                         \
        for (int64_t r = 0; r < rows; r++) {                                                          \
            const T *xr = x + r * cols;                                                               \
            int64_t c = 0;                                                                            \
            v16f mv = {0};                                                                            \
            for (; c + 16 <= cols; c += 16) {                                                         \
                const v16f a = LOAD16(xr + c);                                                        \
                const v16f abs = (v16f)((v16i)a & 0x7fffffff);                                        \
                mv = vmax16(abs, mv);                                                                 \
            }                                                                                         \
            float m = 0.f;                                                                            \
            for (int l = 0; l < 16; l++) m = fmaxf(m, mv[l]);                                         \
            for (; c < cols; c++) m = fmaxf(m, fabsf(LOAD(xr[c])));                                   \
            const float s = fmaxf(m, FLT_MIN) / 127.f;                                                \
            scale[r] = s;                                                                             \
            int8_t *qr = q + r * cols;                                                                \
            for (c = 0; c + 16 <= cols; c += 16) {                                                    \
                const v16c qc = __builtin_convertvector(__builtin_convertvector(round_even(LOAD16(xr + c) / s), v16i), v16c); \
                memcpy(qr + c, &qc, sizeof qc);                                                       \
            }                                                                                         \
            for (; c < cols; c++) qr[c] = (int8_t)nearbyintf(LOAD(xr[c]) / s);                        \
        }                                                                                             \
    }

DEFINE_QUANTIZE(quantize_rows_f32, float, load_f32, load16_f32)
DEFINE_QUANTIZE(quantize_rows_bf16, uint16_t, load_bf16, load16_bf16)

/* out[r, :] *= scale[r] in place, in fp32 and rounded back once (torch's bf16.mul_(fp32) bits):
   the per-row activation scales multiplied into an int8 linear's output. */
void scale_rows_f32(float *out, int64_t rows, int64_t cols, const float *scale) {
    _Pragma("omp parallel for schedule(static) if (rows * cols > 16384)")
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + r * cols;
        const float s = scale[r];
        _Pragma("omp simd")
        for (int64_t c = 0; c < cols; c++) o[c] *= s;
    }
}

void scale_rows_bf16(uint16_t *out, int64_t rows, int64_t cols, const float *scale) {
    _Pragma("omp parallel for schedule(static) if (rows * cols > 16384)")
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *o = out + r * cols;
        const float s = scale[r];
        int64_t c = 0;
        for (; c + 16 <= cols; c += 16) store16_bf16(o + c, load16_bf16(o + c) * s);
        for (; c < cols; c++) o[c] = f32_to_bf16(bf16_to_f32(o[c]) * s);
    }
}
