/* Decode attention over the paged KV cache, reading every key and value where it lies.

   The torch path (engine/attention.py) gathers each row's blocks into a dense buffer and then
   runs SDPA over it: every key and value is read, written and read again, per layer and step
   (a third of a 256-sequence fp32 decode step on 2 cores). Here one pass reads the keys, one
   the values, straight from the cache through the block table, as vLLM's CPU paged attention does.

   Work item: one (row, kv head); its G = H / KVH query heads share every key and value read.
   Arithmetic in fp32 whatever the cache holds (bf16 is widened exactly), as SDPA's CPU kernel
   does; softmax with the row's max subtracted; output rounded to the cache's dtype once.
   Compiled at first use by engine/native_kernels.py (-O3 -march=native -fopenmp); OpenMP's
   threads are torch's own (the same libgomp, already loaded). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define MAX_GROUP 16 /* query heads per kv head handled here; more falls back to torch */
#define MAX_DIM 256

/* One (row, kv head): q [G][D] fp32 (scaled), keys/values through the block table; out [G][D] fp32.
   `scores` holds G * len floats. Inlined into callers with a constant D, so the inner loops
   are unrolled and vectorised for the model's head size. */
#define DEFINE_ITEM(NAME, T, LOAD)                                                                       \
    static inline __attribute__((always_inline)) void NAME(                                            \
        const float *q, const T *kc, const T *vc, const int64_t *table, int64_t len, int64_t bs,       \
        int64_t kvh, int64_t kh, int G, const int D, float *scores, float *acc) {                      \
        const int64_t row_stride = kvh * D; /* one slot: kvh heads of D */                               \
        for (int64_t t0 = 0, blk = 0; t0 < len; t0 += bs, blk++) {                                       \
            const int64_t n = len - t0 < bs ? len - t0 : bs;                                             \
            const T *kb = kc + table[blk] * bs * row_stride + kh * D;                                    \
            for (int64_t j = 0; j < n; j++) {                                                            \
                const T *k = kb + j * row_stride;                                                        \
                for (int g = 0; g < G; g++) {                                                            \
                    const float *qg = q + g * D;                                                         \
                    float s = 0.f;                                                                       \
                    _Pragma("omp simd reduction(+ : s)") for (int d = 0; d < D; d++) s += qg[d] * LOAD(k[d]); \
                    scores[g * len + t0 + j] = s;                                                        \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        float inv[MAX_GROUP];                                                                            \
        for (int g = 0; g < G; g++) {                                                                    \
            float *sg = scores + g * len, m = -INFINITY, sum = 0.f;                                      \
            for (int64_t t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;                                 \
            for (int64_t t = 0; t < len; t++) {                                                          \
                sg[t] = expf(sg[t] - m);                                                                 \
                sum += sg[t];                                                                            \
            }                                                                                            \
            inv[g] = 1.f / sum;                                                                          \
        }                                                                                                \
        memset(acc, 0, sizeof(float) * G * D);                                                           \
        for (int64_t t0 = 0, blk = 0; t0 < len; t0 += bs, blk++) {                                       \
            const int64_t n = len - t0 < bs ? len - t0 : bs;                                             \
            const T *vb = vc + table[blk] * bs * row_stride + kh * D;                                    \
            for (int64_t j = 0; j < n; j++) {                                                            \
                const T *v = vb + j * row_stride;                                                        \
                for (int g = 0; g < G; g++) {                                                            \
                    const float p = scores[g * len + t0 + j];                                            \
                    float *a = acc + g * D;                                                              \
                    _Pragma("omp simd") for (int d = 0; d < D; d++) a[d] += p * LOAD(v[d]);              \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int g = 0; g < G; g++)                                                                      \
            for (int d = 0; d < D; d++) acc[g * D + d] *= inv[g];                                        \
    }

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
DEFINE_ITEM(item_f32, float, LOAD_F32)
DEFINE_ITEM(item_bf16, uint16_t, LOAD_BF16)

/* q [B, H, D] and out [B, H, D] contiguous, in the cache's dtype; k/v cache [blocks, bs, KVH, D];
   block_table [B, table_stride] int64; lengths [B] int64 (keys per row, all written already).
   Returns 0, or -1 for shapes this kernel does not take (the caller uses torch then). */
#define DEFINE_ENTRY(NAME, T, ITEM, LOADQ, STORE)                                                        \
    int NAME(const T *q, const T *kc, const T *vc, const int64_t *table, int64_t table_stride,         \
             const int64_t *lengths, T *out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs,  \
             int64_t max_len, float scale) {                                                             \
        if (KVH <= 0 || H % KVH || H / KVH > MAX_GROUP || D > MAX_DIM || max_len <= 0) return -1;        \
        const int G = (int)(H / KVH);                                                                    \
        int failed = 0;                                                                                  \
        _Pragma("omp parallel") {                                                                        \
            float *scores = malloc(sizeof(float) * (size_t)G * (size_t)max_len);                         \
            float qs[MAX_GROUP * MAX_DIM], acc[MAX_GROUP * MAX_DIM];                                     \
            if (!scores) failed = 1;                                                                     \
            _Pragma("omp for schedule(dynamic, 4)") for (int64_t it = 0; it < B * KVH; it++) {           \
                if (!scores) continue;                                                                   \
                const int64_t b = it / KVH, kh = it % KVH, len = lengths[b];                             \
                const T *qb = q + (b * H + kh * G) * D;                                                  \
                for (int64_t i = 0; i < G * D; i++) qs[i] = LOADQ(qb[i]) * scale;                        \
                const int64_t *tb = table + b * table_stride;                                            \
                if (D == 64) ITEM(qs, kc, vc, tb, len, bs, KVH, kh, G, 64, scores, acc);                  \
                else if (D == 128) ITEM(qs, kc, vc, tb, len, bs, KVH, kh, G, 128, scores, acc);          \
                else ITEM(qs, kc, vc, tb, len, bs, KVH, kh, G, (int)D, scores, acc);                     \
                T *ob = out + (b * H + kh * G) * D;                                                      \
                for (int64_t i = 0; i < G * D; i++) ob[i] = STORE(acc[i]);                               \
            }                                                                                            \
            free(scores);                                                                                \
        }                                                                                                \
        return failed ? -2 : 0;                                                                          \
    }

#define STORE_F32(x) (x)
#define STORE_BF16(x) f32_to_bf16(x)
DEFINE_ENTRY(paged_decode_f32, float, item_f32, LOAD_F32, STORE_F32)
DEFINE_ENTRY(paged_decode_bf16, uint16_t, item_bf16, LOAD_BF16, STORE_BF16)
