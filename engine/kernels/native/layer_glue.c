/* The decoder layer's elementwise steps between its GEMMs, one pass each instead of a torch op
   per arithmetic step (in bf16 on 2 cores these ops took half of a 256-sequence decode step:
   each widens, computes and rounds a whole tensor, and the rotation alone is four of them).

   rope_cache: q and k rotated (HF's x * cos + rotate_half(x) * sin, every product and the sum
   rounded to the model's dtype as torch rounds them: the same bits), k and v written into the
   cache slots. Compiled with -ffp-contract=off (engine/kernels/native_kernels.py) for those bits.
   add_rms_norm (bf16): h = x + r rounded to bf16, then HF's RMSNorm of h (widen, mean of squares,
   times 1 / sqrt(mean + eps), round, times the weight, round): HF's arithmetic but for the order
   of the mean's fp32 sum.
   silu_mul (bf16): silu(gate) rounded, times up, rounded, as torch's two ops; e^x by Cephes' expf
   (within an ulp of torch's) where torch uses SLEEF's.
   Gemma 3's (engine/models/gemma_model.py), for torch's ten ops a norm and its bf16 GELU (a 32-sequence
   step of Gemma 3 1B's shape 3-11% faster): gemma_norm, HF's Gemma3RMSNorm (x widened, times
   1 / sqrt(mean(x^2) + eps), times 1 + w in fp32, rounded once); gelu_tanh_mul, GELU's tanh form of
   gate rounded, times up, rounded (a few ulps from torch's). */

#include "common.h"

/* q [T, H*D] and k, v [T, KVH*D] with row strides (views of one q/k/v GEMM's output, or three
   tensors); cos, sin_signed [T, R] (sin with rotate_half's sign folded in: -1 on the first half), R the
   rotated values of a head (D, or fewer: Phi-4-mini's partial rotary, whose last D - R values pass
   unrotated, as HF's apply_rotary_pos_emb); slots [T]; k_slots, v_slots [num_slots, KVH, D]; q_out
   [T, H, D], k_out [T, KVH, D]. */
#define DEFINE_ROPE(NAME, T_, LOAD, ROUND, STORE, LOAD16, ROUND16, STORE16)                           \
    void NAME(const T_ *q, int64_t q_stride, const T_ *k, int64_t k_stride, const T_ *v,            \
              int64_t v_stride, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t R,            \
              const T_ *cos, const T_ *sin_signed, const int64_t *slots, T_ *k_slots, T_ *v_slots,   \
              T_ *q_out, T_ *k_out) {                                                                \
        const int64_t half = R / 2;                                                                  \
        _Pragma("omp parallel for schedule(static) if (T * (H + KVH) * D > 16384)")                  \
        for (int64_t t = 0; t < T; t++) {                                                            \
            const T_ *c = cos + t * R, *s = sin_signed + t * R;                                      \
            for (int64_t h = 0; h < H + KVH; h++) {                                                  \
                const T_ *x = h < H ? q + t * q_stride + h * D : k + t * k_stride + (h - H) * D;     \
                T_ *o = h < H ? q_out + (t * H + h) * D : k_out + (t * KVH + h - H) * D;             \
                int64_t i = 0;                                                                       \
                for (; i + 16 <= half; i += 16) { /* 16 lanes a time: the same products, roundings, sums */ \
                    const v16f a = LOAD16(x + i), b = LOAD16(x + i + half);                          \
                    STORE16(o + i, ROUND16(a * LOAD16(c + i)) + ROUND16(b * LOAD16(s + i)));         \
                    STORE16(o + half + i, ROUND16(b * LOAD16(c + half + i)) + ROUND16(a * LOAD16(s + half + i))); \
                }                                                                                    \
                for (; i < half; i++) { /* rotate_half: the second half's partner */                \
                    o[i] = STORE(ROUND(LOAD(x[i]) * LOAD(c[i])) + ROUND(LOAD(x[i + half]) * LOAD(s[i]))); \
                    o[i + half] = STORE(ROUND(LOAD(x[i + half]) * LOAD(c[i + half])) +               \
                                        ROUND(LOAD(x[i]) * LOAD(s[i + half])));                      \
                }                                                                                    \
                if (R < D) memcpy(o + R, x + R, sizeof(T_) * (D - R)); /* the unrotated rest */      \
            }                                                                                        \
            T_ *ks = k_slots + slots[t] * KVH * D, *vs = v_slots + slots[t] * KVH * D;               \
            memcpy(ks, k_out + t * KVH * D, sizeof(T_) * KVH * D);                                   \
            memcpy(vs, v + t * v_stride, sizeof(T_) * KVH * D);                                      \
        }                                                                                            \
    }

static inline v16f keep16_f32(v16f x) { return x; }
DEFINE_ROPE(rope_cache_f32, float, load_f32, round_f32, store_f32, load16_f32, keep16_f32, store16_f32)
DEFINE_ROPE(rope_cache_bf16, uint16_t, load_bf16, round_bf16, store_bf16, load16_bf16, round16_bf16, store16_bf16)

/* The squares of n16 values (a multiple of 16) summed lane by lane in 16 lanes, then the lanes in order: the norms'
   one order, whatever the ISA. The 16 lanes are the ISA's vectors (two of 8 on AVX2, where a 16-float vector
   carried across the loop lived in memory). */
#define DEFINE_SUM_SQUARES(NAME, T_, LOADV)                                                             \
    ALWAYS_INLINE float NAME(const T_ *p, int64_t n16) {                                               \
        vec lo = {0}, hi = {0}; /* lanes 0..VW-1 and (AVX2) VW..15 */                                  \
        for (int64_t i = 0; i < n16; i += 16) {                                                        \
            const vec a = LOADV(p + i);                                                                \
            lo += a * a;                                                                               \
            if (VW < 16) {                                                                             \
                const vec b = LOADV(p + i + VW % 16);                                                  \
                hi += b * b;                                                                           \
            }                                                                                          \
        }                                                                                              \
        float sum = 0.f;                                                                               \
        for (int l = 0; l < VW; l++) sum += lo[l];                                                     \
        for (int l = 0; VW < 16 && l < VW; l++) sum += hi[l];                                          \
        return sum;                                                                                    \
    }
DEFINE_SUM_SQUARES(sum_squares_bf16, uint16_t, loadv_bf16)
DEFINE_SUM_SQUARES(sum_squares_f32, float, loadv)

/* x [T, N] (+ r [T, N] when r is not NULL: h = x + r written to h_out) -> out [T, N], bf16. 16 lanes at a
   time (a 32-row step's norms ran at a nanosecond a value, a thread alone: 2% of a Qwen3-1.7B step),
   the squares summed lane by lane and then the lanes in order: one order, set by N alone. */
void add_rms_norm_bf16(const uint16_t *x, const uint16_t *r, uint16_t *h_out, const uint16_t *w, float eps,
                       int64_t T, int64_t N, uint16_t *out) {
    const int64_t N16 = N & ~(int64_t)15;
    _Pragma("omp parallel for schedule(static) if (T * N > 16384)")
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *xr = x + t * N;
        uint16_t *hr = h_out + t * N, *o = out + t * N;
        if (r) {
            const uint16_t *rr = r + t * N;
            for (int64_t i = 0; i < N16; i += 16) store16_bf16(hr + i, load16_bf16(xr + i) + load16_bf16(rr + i));
            for (int64_t i = N16; i < N; i++) hr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(rr[i]));
        } else {
            hr = (uint16_t *)xr;
        }
        /* one loop over h whether or not it was added here: one summation order, so the C decode loop
           (which adds a layer's residual in the next norm) and Python (which adds it with torch) agree */
        float sum = sum_squares_bf16(hr, N16);
        for (int64_t i = N16; i < N; i++) sum += bf16_to_f32(hr[i]) * bf16_to_f32(hr[i]);
        const float inv = 1.f / sqrtf(sum / (float)N + eps);
        for (int64_t i = 0; i < N16; i += 16)
            store16_bf16(o + i, load16_bf16(w + i) * round16_bf16(load16_bf16(hr + i) * inv));
        for (int64_t i = N16; i < N; i++) o[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(hr[i]) * inv));
    }
}

/* The gated MLP's activations: SiLU, x / (1 + e^-x); GELU's tanh form, 0.5 x (1 + tanh(y)) with
   y = sqrt(2 / pi) (x + 0.044715 x^3), computed as x / (1 + e^-2y) (the same function: one division, and no
   cancellation where tanh nears -1, which torch's form has). */
ALWAYS_INLINE v16f silu16(v16f x) { return x / (1.0f + vexp(-x)); }
static inline float silu1(float x) { return x / (1.0f + expf(-x)); }
ALWAYS_INLINE v16f gelu16(v16f x) {
    const v16f y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x / (1.0f + vexp(-(y + y)));
}
static inline float gelu1(float x) {
    const float y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x / (1.0f + expf(-(y + y)));
}

/* gate_up [T, 2I] with row stride `stride` (gate in the first I columns, up in the next) -> out [T, I]:
   act(gate), rounded to the dtype, times up, rounded (bf16: torch's two ops; fp32: no rounding between). */
#define DEFINE_GATED(NAME, T_, ACT16, ACT1, LOAD16, ROUND16, STORE16, LOAD, ROUND, STORE)   \
    void NAME(const T_ *gate_up, int64_t stride, int64_t T, int64_t I, T_ *out) {           \
        _Pragma("omp parallel for schedule(static) if (T * I > 16384)")                     \
        for (int64_t t = 0; t < T; t++) {                                                   \
            const T_ *g = gate_up + t * stride, *u = g + I;                                 \
            T_ *o = out + t * I;                                                            \
            int64_t i = 0;                                                                  \
            for (; i + 16 <= I; i += 16) STORE16(o + i, ROUND16(ACT16(LOAD16(g + i))) * LOAD16(u + i)); \
            for (; i < I; i++) o[i] = STORE(ROUND(ACT1(LOAD(g[i]))) * LOAD(u[i]));          \
        }                                                                                   \
    }

DEFINE_GATED(silu_mul_bf16, uint16_t, silu16, silu1, load16_bf16, round16_bf16, store16_bf16, load_bf16, round_bf16,
             store_bf16)
DEFINE_GATED(silu_mul_f32, float, silu16, silu1, load16_f32, keep16_f32, store16_f32, load_f32, round_f32, store_f32)
DEFINE_GATED(gelu_tanh_mul_bf16, uint16_t, gelu16, gelu1, load16_bf16, round16_bf16, store16_bf16, load_bf16,
             round_bf16, store_bf16)
DEFINE_GATED(gelu_tanh_mul_f32, float, gelu16, gelu1, load16_f32, keep16_f32, store16_f32, load_f32, round_f32,
             store_f32)

/* fp32 (the C decode loop's, engine/kernels/native/decode_layers.c): h = x + r (when r is not NULL, written
   to h_out), then HF's RMSNorm of h, w * (h * (1 / sqrt(mean(h^2) + eps))): HF's arithmetic but for
   the order of the mean's sum and a division for torch's rsqrt (each within an ulp or so). */
void add_rms_norm_f32(const float *x, const float *r, float *h_out, const float *w, float eps, int64_t T, int64_t N,
                      float *out) {
    _Pragma("omp parallel for schedule(static) if (T * N > 16384)")
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * N;
        float *hr = r ? h_out + t * N : (float *)xr, *o = out + t * N;
        if (r)
            for (int64_t i = 0; i < N; i++) hr[i] = xr[i] + r[t * N + i];
        float sum = 0.f; /* one loop over h whether or not it was added here: one summation order */
        _Pragma("omp simd reduction(+ : sum)")
        for (int64_t i = 0; i < N; i++) sum += hr[i] * hr[i];
        const float inv = 1.f / sqrtf(sum / (float)N + eps);
        _Pragma("omp simd")
        for (int64_t i = 0; i < N; i++) o[i] = w[i] * (hr[i] * inv);
    }
}

/* Gemma's RMS norm: x [T, N] -> out [T, N]: (x * (1 / sqrt(mean(x^2) + eps))) * (1 + w), in fp32 (x and w
   widened), rounded to the dtype once; the squares summed lane by lane, then the lanes in order. */
#define DEFINE_GEMMA_NORM(NAME, T_, SUM_SQUARES, LOAD16, STORE16, LOAD, STORE)                         \
    void NAME(const T_ *x, const T_ *w, float eps, int64_t T, int64_t N, T_ *out) {                   \
        const int64_t N16 = N & ~(int64_t)15;                                                          \
        /* a decode step's (32 rows of 1152, 128 heads' of 256) alone: waking a team cost more */     \
        _Pragma("omp parallel for schedule(static) if (T * N > 131072)")                              \
        for (int64_t t = 0; t < T; t++) {                                                              \
            const T_ *xr = x + t * N;                                                                  \
            T_ *o = out + t * N;                                                                       \
            float sum = SUM_SQUARES(xr, N16);                                                          \
            for (int64_t i = N16; i < N; i++) sum += LOAD(xr[i]) * LOAD(xr[i]);                        \
            const float inv = 1.f / sqrtf(sum / (float)N + eps);                                       \
            for (int64_t i = 0; i < N16; i += 16)                                                      \
                STORE16(o + i, (LOAD16(xr + i) * inv) * (1.0f + LOAD16(w + i)));                        \
            for (int64_t i = N16; i < N; i++) o[i] = STORE((LOAD(xr[i]) * inv) * (1.0f + LOAD(w[i])));  \
        }                                                                                              \
    }

DEFINE_GEMMA_NORM(gemma_norm_bf16, uint16_t, sum_squares_bf16, load16_bf16, store16_bf16, load_bf16, store_bf16)
DEFINE_GEMMA_NORM(gemma_norm_f32, float, sum_squares_f32, load16_f32, store16_f32, load_f32, store_f32)

