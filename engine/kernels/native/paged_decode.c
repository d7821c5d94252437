/* Decode attention over the paged KV cache, reading every key and value where it lies.

   The torch path (engine/models/attention.py) gathers each row's blocks into a dense buffer and then
   runs SDPA over it: every key and value is read, written and read again, per layer and step
   (a third of a 256-sequence fp32 decode step on 2 cores). Here one pass reads the keys, one
   the values, straight from the cache through the block table, as vLLM's CPU paged attention does.

   Work item: one row (sequence), all its heads, rows taken in sibling runs (below): a cache slot
   holds every kv head's key side by side, so each slot is read once, whole. Vectors of 16 floats
   (GCC vector extensions: zmm on AVX512, pairs of ymm on AVX2), the head size a compile-time
   multiple of 16, so a key's vectors stay in registers while every query head of its group takes
   its dot product.
   Arithmetic in fp32 whatever the cache holds (bf16 is widened exactly), as SDPA's CPU kernel
   does; softmax with the row's max subtracted; output rounded to the cache's dtype once.
   Compiled at first use by engine/kernels/native_kernels.py (-O3 -march=native -fopenmp); OpenMP's
   threads are torch's own (the same libgomp, already loaded). */

#include <stdlib.h>

#include "common.h"

#define MAX_HEADS 128
#define MAX_VECS 16 /* head size up to 256 */

static inline v16f load_f32(const float *p) {
    v16f x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline float hsum(v16f x) {
    x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return x[0];
}

static inline v16f vmax16(v16f a, v16f b) { /* lane-wise max */
    const v16i c = a > b;
    return (v16f)(((v16i)a & c) | ((v16i)b & ~c));
}

static inline float hmax(v16f x) {
    for (int i = 8; i >= 1; i /= 2) {
        v16f y;
        for (int l = 0; l < 16; l++) y[l] = x[l ^ i];
        x = vmax16(x, y);
    }
    return x[0];
}

static inline void store_f32(float *o, float x) { *o = x; }
static inline void store_bf16(uint16_t *o, float x) { *o = f32_to_bf16(x); }

/* The four dot products a0..a3 hold in their lanes, summed across lanes at once: two rounds of
   pairing halves, then two within each group of four (a tenth of four separate sums' shuffles). */
static inline void reduce4(v16f a0, v16f a1, v16f a2, v16f a3, float *out) {
    const v16f x = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const v16f y = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    /* lanes: a0 in 0-3, a2 in 4-7, a1 in 8-11, a3 in 12-15 */
    v16f z = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
             __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    z += __builtin_shufflevector(z, z, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    z += __builtin_shufflevector(z, z, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    out[0] = z[0], out[1] = z[8], out[2] = z[4], out[3] = z[12];
}

/* One row: qs [H][NV] vectors (scaled), its `len` keys through `table`; out [H][D].
   `scores` holds H * (len + 16) floats, `acc` H * NV vectors. Keys go four at a time within a
   block (their vectors in registers, each query head's four sums reduced together, each
   accumulator loaded and stored once per four values), the block's rest one at a time. */
#define DEFINE_ROW(NAME, T, LOAD, STORE)                                                                 \
    static inline __attribute__((always_inline)) void NAME(                                            \
        const v16f *qs, const T *kc, const T *vc, const int64_t *table, int64_t len, int64_t bs,       \
        int H, int KVH, const int NV, float *scores, v16f *acc, T *out) {                               \
        const int G = H / KVH, D = NV * 16;                                                              \
        const int64_t slot = (int64_t)KVH * D;                                                           \
        const int64_t padded = (len + 15) & ~(int64_t)15; /* a head's scores, padded with -inf: e^-inf = 0 */ \
        for (int64_t t0 = 0, blk = 0; t0 < len; t0 += bs, blk++) {                                       \
            const int64_t n = len - t0 < bs ? len - t0 : bs;                                             \
            const T *kb = kc + table[blk] * bs * slot;                                                   \
            int64_t j = 0;                                                                               \
            for (; j + 4 <= n; j += 4)                                                                   \
                for (int kh = 0; kh < KVH; kh++) {                                                       \
                    v16f k0[MAX_VECS], k1[MAX_VECS], k2[MAX_VECS], k3[MAX_VECS];                         \
                    const T *k = kb + j * slot + kh * D;                                                 \
                    for (int i = 0; i < NV; i++) {                                                       \
                        k0[i] = LOAD(k + i * 16), k1[i] = LOAD(k + slot + i * 16);                       \
                        k2[i] = LOAD(k + 2 * slot + i * 16), k3[i] = LOAD(k + 3 * slot + i * 16);        \
                    }                                                                                    \
                    for (int g = 0; g < G; g++) {                                                        \
                        const v16f *q = qs + (kh * G + g) * NV;                                          \
                        v16f a0 = q[0] * k0[0], a1 = q[0] * k1[0], a2 = q[0] * k2[0], a3 = q[0] * k3[0]; \
                        for (int i = 1; i < NV; i++)                                                     \
                            a0 += q[i] * k0[i], a1 += q[i] * k1[i], a2 += q[i] * k2[i], a3 += q[i] * k3[i]; \
                        reduce4(a0, a1, a2, a3, scores + (kh * G + g) * padded + t0 + j);                \
                    }                                                                                    \
                }                                                                                        \
            for (; j < n; j++)                                                                           \
                for (int kh = 0; kh < KVH; kh++) {                                                       \
                    const T *k = kb + j * slot + kh * D;                                                 \
                    for (int g = 0; g < G; g++) {                                                        \
                        const v16f *q = qs + (kh * G + g) * NV;                                          \
                        v16f a = q[0] * LOAD(k);                                                         \
                        for (int i = 1; i < NV; i++) a += q[i] * LOAD(k + i * 16);                       \
                        scores[(kh * G + g) * padded + t0 + j] = hsum(a);                                \
                    }                                                                                    \
                }                                                                                        \
        }                                                                                                \
        float inv[MAX_HEADS];                                                                            \
        for (int h = 0; h < H; h++) {                                                                    \
            float *s = scores + h * padded;                                                              \
            for (int64_t t = len; t < padded; t++) s[t] = -INFINITY;                                     \
        }                                                                                                \
        for (int h = 0; h < H; h++) {                                                                    \
            float *s = scores + h * padded;                                                              \
            v16f mv = load_f32(s); /* in vectors: a scalar max's chain of compares took an eighth */     \
            for (int64_t t = 16; t < padded; t += 16) mv = vmax16(load_f32(s + t), mv);                  \
            const float m = hmax(mv);                                                                    \
            v16f sum = {0};                                                                              \
            for (int64_t t = 0; t < padded; t += 16) {                                                   \
                v16f e = vexp(load_f32(s + t) - m);                                                      \
                memcpy(s + t, &e, sizeof e);                                                             \
                sum += e;                                                                                \
            }                                                                                            \
            inv[h] = 1.f / hsum(sum);                                                                    \
        }                                                                                                \
        for (int i = 0; i < H * NV; i++) acc[i] = (v16f){0};                                             \
        for (int64_t t0 = 0, blk = 0; t0 < len; t0 += bs, blk++) {                                       \
            const int64_t n = len - t0 < bs ? len - t0 : bs;                                             \
            const T *vb = vc + table[blk] * bs * slot;                                                   \
            int64_t j = 0;                                                                               \
            for (; j + 4 <= n; j += 4)                                                                   \
                for (int kh = 0; kh < KVH; kh++) {                                                       \
                    v16f v0[MAX_VECS], v1[MAX_VECS], v2[MAX_VECS], v3[MAX_VECS];                         \
                    const T *v = vb + j * slot + kh * D;                                                 \
                    for (int i = 0; i < NV; i++) {                                                       \
                        v0[i] = LOAD(v + i * 16), v1[i] = LOAD(v + slot + i * 16);                       \
                        v2[i] = LOAD(v + 2 * slot + i * 16), v3[i] = LOAD(v + 3 * slot + i * 16);        \
                    }                                                                                    \
                    for (int g = 0; g < G; g++) {                                                        \
                        const int h = kh * G + g;                                                        \
                        const float *p = scores + h * padded + t0 + j;                                   \
                        for (int i = 0; i < NV; i++)                                                     \
                            acc[h * NV + i] += p[0] * v0[i] + p[1] * v1[i] + p[2] * v2[i] + p[3] * v3[i]; \
                    }                                                                                    \
                }                                                                                        \
            for (; j < n; j++)                                                                           \
                for (int kh = 0; kh < KVH; kh++) {                                                       \
                    const T *v = vb + j * slot + kh * D;                                                 \
                    for (int g = 0; g < G; g++) {                                                        \
                        const int h = kh * G + g;                                                        \
                        const float p = scores[h * padded + t0 + j];                                     \
                        for (int i = 0; i < NV; i++) acc[h * NV + i] += p * LOAD(v + i * 16);            \
                    }                                                                                    \
                }                                                                                        \
        }                                                                                                \
        for (int h = 0; h < H; h++)                                                                      \
            for (int i = 0; i < NV; i++) {                                                               \
                v16f o = acc[h * NV + i] * inv[h];                                                       \
                for (int l = 0; l < 16; l++) STORE(out + h * D + i * 16 + l, o[l]);                      \
            }                                                                                            \
    }

DEFINE_ROW(row_f32, float, load_f32, store_f32)
DEFINE_ROW(row_bf16, uint16_t, load16_bf16, store_bf16)

/* Sibling runs: adjacent rows whose first cache block is the same one are the n samples of one
   prompt (prefix caching gave them its blocks; the batch, sorted by length, keeps them together).
   One thread takes a run, row after row, so the shared blocks it read for the first row are still
   in its L2 for the others (a 256-row GRPO-shaped step of SmolLM2: 5-7% less time). A run is cut at
   MAX_RUN rows so that rows which all share one system prompt still spread over the threads. */
#define MAX_RUN 8

/* q [B, H, D] and out [B, H, D] contiguous, in the cache's dtype; k/v cache [blocks, bs, KVH, D];
   block_table [B, table_stride] int64; lengths [B] int64 (keys per row, all written already).
   Returns 0, -1 for shapes this kernel does not take (the caller uses torch then), -2 when out
   of memory. */
#define DEFINE_ENTRY(NAME, T, ROW, LOAD)                                                                 \
    int NAME(const T *q, const T *kc, const T *vc, const int64_t *table, int64_t table_stride,         \
             const int64_t *lengths, T *out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs,  \
             int64_t max_len, float scale) {                                                             \
        const int NV = (int)(D / 16);                                                                    \
        if (KVH <= 0 || H % KVH || H > MAX_HEADS || D % 16 || NV > MAX_VECS || (NV & (NV - 1)) ||       \
            max_len <= 0)                                                                                \
            return -1;                                                                                   \
        int64_t *runs = malloc(sizeof(int64_t) * (size_t)(B + 1)), count = 0;                            \
        if (runs == NULL) return -2;                                                                     \
        for (int64_t b = 0; b < B; b++) /* the sibling runs (above) */                                   \
            if (b == 0 || b - runs[count - 1] >= MAX_RUN || table[b * table_stride] != table[(b - 1) * table_stride]) \
                runs[count++] = b;                                                                       \
        runs[count] = B;                                                                                 \
        int failed = 0;                                                                                  \
        _Pragma("omp parallel") {                                                                        \
            float *scores = malloc(sizeof(float) * (size_t)H * (size_t)(max_len + 16));                         \
            v16f *buf = aligned_alloc(64, sizeof(v16f) * 2 * MAX_HEADS * MAX_VECS);                      \
            if (!scores || !buf) failed = 1;                                                             \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t r = 0; r < count; r++)                  \
            for (int64_t b = runs[r]; b < runs[r + 1]; b++) {                                           \
                if (!scores || !buf) continue;                                                           \
                v16f *qs = buf, *acc = buf + MAX_HEADS * MAX_VECS;                                       \
                for (int64_t i = 0; i < H * NV; i++) qs[i] = LOAD(q + b * H * D + i * 16) * scale;       \
                const int64_t *tb = table + b * table_stride;                                            \
                T *ob = out + b * H * D;                                                                 \
                switch (NV) {                                                                            \
                case 1: ROW(qs, kc, vc, tb, lengths[b], bs, H, KVH, 1, scores, acc, ob); break;          \
                case 2: ROW(qs, kc, vc, tb, lengths[b], bs, H, KVH, 2, scores, acc, ob); break;          \
                case 4: ROW(qs, kc, vc, tb, lengths[b], bs, H, KVH, 4, scores, acc, ob); break;          \
                case 8: ROW(qs, kc, vc, tb, lengths[b], bs, H, KVH, 8, scores, acc, ob); break;          \
                default: ROW(qs, kc, vc, tb, lengths[b], bs, H, KVH, 16, scores, acc, ob); break;        \
                }                                                                                        \
            }                                                                                            \
            free(scores);                                                                                \
            free(buf);                                                                                   \
        }                                                                                                \
        free(runs);                                                                                      \
        return failed ? -2 : 0;                                                                          \
    }

DEFINE_ENTRY(paged_decode_f32, float, row_f32, load_f32)
DEFINE_ENTRY(paged_decode_bf16, uint16_t, row_bf16, load16_bf16)
