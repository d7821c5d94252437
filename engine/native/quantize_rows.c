/* Per-row (per-token) symmetric int8 quantization of activations, one pass to find each row's
   largest |x| and one to quantize it: what int8_linears.quantize_rows does in eight torch ops
   (a copy to fp32, abs, amax, clamp, two divisions, round, a cast), each a pass over the rows.
   The same arithmetic, bit for bit: scale = max(max|x|, FLT_MIN) / 127 in fp32, q = x / scale
   rounded to nearest, ties to even (nearbyintf in the default rounding mode), as torch.round. */

#include <float.h>

#include "common.h"

#define DEFINE_QUANTIZE(NAME, T, LOAD)                                                                  \
    void NAME(const T *x, int64_t rows, int64_t cols, int8_t *q, float *scale) {                     \
        _Pragma("omp parallel for schedule(static) if (rows * cols > 65536)")                         \
        for (int64_t r = 0; r < rows; r++) {                                                          \
            const T *xr = x + r * cols;                                                               \
            float m = 0.f;                                                                            \
            _Pragma("omp simd reduction(max : m)")                                                    \
            for (int64_t c = 0; c < cols; c++) m = fmaxf(m, fabsf(LOAD(xr[c])));                      \
            const float s = fmaxf(m, FLT_MIN) / 127.f;                                                \
            scale[r] = s;                                                                             \
            int8_t *qr = q + r * cols;                                                                \
            _Pragma("omp simd")                                                                       \
            for (int64_t c = 0; c < cols; c++) qr[c] = (int8_t)nearbyintf(LOAD(xr[c]) / s);          \
        }                                                                                             \
    }

#define LOAD_F32(v) (v)
#define LOAD_BF16(v) bf16_to_f32(v)
DEFINE_QUANTIZE(quantize_rows_f32, float, LOAD_F32)
DEFINE_QUANTIZE(quantize_rows_bf16, uint16_t, LOAD_BF16)

/* out[r, :] *= scale[r] in place, in fp32 and rounded back once (torch's bf16.mul_(fp32) bits):
   the per-row activation scales multiplied into an int8 linear's output. */
void scale_rows_f32(float *out, int64_t rows, int64_t cols, const float *scale) {
    _Pragma("omp parallel for schedule(static) if (rows * cols > 65536)")
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + r * cols;
        const float s = scale[r];
        _Pragma("omp simd")
        for (int64_t c = 0; c < cols; c++) o[c] *= s;
    }
}

void scale_rows_bf16(uint16_t *out, int64_t rows, int64_t cols, const float *scale) {
    _Pragma("omp parallel for schedule(static) if (rows * cols > 65536)")
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *o = out + r * cols;
        const float s = scale[r];
        _Pragma("omp simd")
        for (int64_t c = 0; c < cols; c++) o[c] = f32_to_bf16(bf16_to_f32(o[c]) * s);
    }
}
