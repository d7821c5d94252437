/* Decode attention over the paged KV cache, reading every key and value where it lies.

   The torch path (engine/models/attention.py) gathers each row's blocks into a dense buffer and then
   runs SDPA over it: every key and value is read, written and read again, per layer and step
   (a third of a 256-sequence fp32 decode step on 2 cores). Here one pass reads the keys, one
   the values, straight from the cache through the block table, as vLLM's CPU paged attention does.

   Work item: one row (sequence), all its heads, rows taken in sibling runs (sibling_runs.h): a cache slot
   holds every kv head's key side by side, so each slot is read once, whole. The ISA's own vectors
   (common.h's vec: 16 floats on AVX-512, 8 on AVX2, where 16-float vectors living across loops went
   through memory: the kernel 1.1-1.4x slower at SmolLM2's heads), the head size a compile-time multiple of the
   width, so a key's vectors stay in registers (or in L1, read again for each query head of its group: an
   fp32 cache's on AVX2) while every query head of its group takes its dot product. Where the CPU widens a
   bf16 cache (AVX2) each 16 values are taken as their 8 even then 8 odd ones, widened by one load, a shift and
   a mask, the query and the sums laid out to match (even_odd_passes.h: 1.2-2.1x the zero-extending loads).
   Arithmetic in fp32 whatever the cache holds (bf16 is widened exactly), as SDPA's CPU kernel
   does; softmax with the row's max subtracted; output rounded to the cache's dtype once. Where the
   CPU has AVX512-BF16 a bf16 cache's passes multiply pairs of bf16 instead (bf16_pairs.h: exact
   products, fp32 sums, each weight as two bf16 halves), without widening the keys and values first.
   Each row's sums run in one fixed order, set by the row alone (its keys block by block, four at a
   time then one by one, each head's lanes reduced by reduce4 / hsum; its values the same way), never
   by the other rows or the threads: batch invariant. A layer with a sliding window W (Mistral's,
   Qwen2's upper layers) gives a row its last W keys only (HF's mask: key j of query i where
   i - W < j <= i), the first block read from the window's first key on: the order is still set by
   the row alone. A batch-invariant engine's prefill rows come here too (engine/models/attention.py,
   _native_prefill: a row's keys up to its own position), so a row has the same bits in a prefill as
   in a decode step. A prefill's rows of one prompt (one block table) go to a thread eight at a time as a
   tile: their whole blocks' keys read once for all of them and their values' sums kept in registers
   (bf16_pairs.h's score_rows / weigh_rows, where the CPU multiplies bf16 pairs; elsewhere four slots at
   a time from L1 for each row in turn), each row's sums the same products in the same order, so its
   bits are still the ones it gets alone (a 2048-token prefill's attention at Qwen3's heads 1.42x in
   bf16, 1.29-1.43x in fp32, bench.prefill_attention).
   Compiled at first use by engine/kernels/native_kernels.py (-O3 -march=native -fopenmp); OpenMP's
   threads are torch's own (the same libgomp, already loaded). */

#include <stdlib.h>

#include "common.h"

#define MAX_HEADS 128
#define MAX_VECS (256 / VW) /* head size up to 256 */

/* x's lanes summed: halves paired, then quarters, and so on (one order, set by the width). */
static inline float hsum(vec x) {
#ifdef __AVX512F__
    x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5);
    x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
    return x[0];
}

static inline float hmax(vec x) {
    for (int i = VW / 2; i >= 1; i /= 2) {
        vec y;
        for (int l = 0; l < VW; l++) y[l] = x[l ^ i];
        x = vmaxv(x, y);
    }
    return x[0];
}

/* The four dot products a0..a3 hold in their lanes, summed across lanes at once: rounds of pairing
   halves, then the rest within each group (a tenth of four separate sums' shuffles). */
static inline void reduce4(vec a0, vec a1, vec a2, vec a3, float *out) {
#ifdef __AVX512F__
    const vec x = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vec y = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    /* lanes: a0 in 0-3, a2 in 4-7, a1 in 8-11, a3 in 12-15 */
    vec z = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
            __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    z += __builtin_shufflevector(z, z, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    z += __builtin_shufflevector(z, z, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    out[0] = z[0], out[1] = z[8], out[2] = z[4], out[3] = z[12];
#else
    const vec x = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
    const vec y = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
    /* lanes: a0 in 0-1, a2 in 2-3, a1 in 4-5, a3 in 6-7 */
    vec z = __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
    z += __builtin_shufflevector(z, z, 1, 0, 3, 2, 5, 4, 7, 6);
    out[0] = z[0], out[1] = z[4], out[2] = z[2], out[3] = z[6];
#endif
}

/* The cache's two dtypes, one code: every function below that reads or writes the cache takes `bf16`
   and is inlined with it constant (common.h's ALWAYS_INLINE functions, loadv_at and storev_at). */

/* A row's sizes: H query heads in groups of G per kv head (KVH of them), NV vectors a head (D
   values, NV * VW), `slot` values a cache slot (every kv head's), the keys [first, len) it attends (first > 0
   under a sliding window), `padded` scores a head (len - first rounded up to 16), the cache's `bs`
   slots a block. */
typedef struct {
    int H, KVH, G, NV, D;
    int64_t slot, padded, first, len, bs;
    float scale; /* the scores' (softmax_heads applies it to bf16_pairs.h's; the fp32 passes get a scaled query) */
} RowShape;

/* One kv head's vectors of four consecutive cache slots, from element `at` (the first slot's head) on, for
   every query head of its group (widened once where bf16): x[s] the slot s after it. */
ALWAYS_INLINE void load_four(const void *cache, int64_t at, const RowShape *r, vec x[4][MAX_VECS], int bf16) {
    for (int i = 0; i < r->NV; i++) {
        x[0][i] = loadv_at(cache, at + i * VW, bf16), x[1][i] = loadv_at(cache, at + r->slot + i * VW, bf16);
        x[2][i] = loadv_at(cache, at + 2 * r->slot + i * VW, bf16);
        x[3][i] = loadv_at(cache, at + 3 * r->slot + i * VW, bf16);
    }
}

#include "even_odd_passes.h"

/* Whether the four slots' vectors are read into an array first (load_four) rather than where they lie at each
   use: a bf16 cache's, widened once for the group's query heads (where even_odd_passes.h does not take it: on
   AVX2 widening at each use had run 0.57-0.76x); an fp32 cache's on AVX-512 as before (unmeasured there). On
   AVX2 an fp32 cache's array of a 128-value head (64 vectors) went through the stack, and read in place from L1
   fp32 prefill attention ran 1.36-1.87x faster (bench/RESULTS.md, 2026-12-07). */
#ifdef __AVX512F__
#define SLOTS_COPIED(bf16) 1
#else
#define SLOTS_COPIED(bf16) (bf16)
#endif

/* Vector i of slot j of the four: from the array x, or where it lies in an fp32 cache (SLOTS_COPIED) */
ALWAYS_INLINE vec slot_vec(const void *cache, vec x[4][MAX_VECS], int64_t at, int64_t slot, int j, int i,
                           int bf16) {
    return SLOTS_COPIED(bf16) ? x[j][i] : loadv((const float *)cache + at + j * slot + i * VW);
}

/* Slots [from, to) of cache block `block` into L2 ahead of their pass (a software prefetch, locality 1).
   A row's blocks lie anywhere in the cache and a block is 8 pages of 4 KB for Qwen3's 2 KB slots; the
   hardware's prefetchers follow neither a jump between blocks nor a page's end, so a row's keys came at
   half the read probe's rate (13 GB/s of 27, 32 rows on 2 cores): each group of four keys now asks for
   the same slots of the block its pass reads next (the last key block: the first value block), a block
   ahead. Qwen3-1.7B's attention 1.16-1.28x, the same bits (bench/RESULTS.md). */
ALWAYS_INLINE void prefetch_slots(const void *cache, int64_t block, int64_t from, int64_t to, const RowShape *r,
                                  int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    const char *p = (const char *)cache + size * (block * r->bs + from) * r->slot;
    for (int64_t o = 0, bytes = size * (to - from) * r->slot; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 1);
}

/* The scores of keys j..j+3 of a block (at element `keys` of the cache) for every query head. */
ALWAYS_INLINE void score_four(const vec *qs, const void *kc, int64_t keys, const RowShape *r,
                              float *restrict scores, int bf16) {
    if (EVEN_ODD(bf16)) { score_four_eo(qs, kc, keys, r, scores); return; }
    const int NV = r->NV, G = r->G;
    for (int kh = 0; kh < r->KVH; kh++) {
        const int64_t at = keys + kh * r->D, s = r->slot;
        vec k[4][MAX_VECS];
        if (SLOTS_COPIED(bf16)) load_four(kc, at, r, k, bf16);
        for (int g = 0; g < G; g++) {
            const vec *q = qs + (kh * G + g) * NV;
#define K(j, i) slot_vec(kc, k, at, s, j, i, bf16)
            vec a0 = q[0] * K(0, 0), a1 = q[0] * K(1, 0), a2 = q[0] * K(2, 0), a3 = q[0] * K(3, 0);
            for (int i = 1; i < NV; i++) /* each key's chain of FMAs in order of i, as written (fmav) */
                a0 = fmav(q[i], K(0, i), a0), a1 = fmav(q[i], K(1, i), a1), a2 = fmav(q[i], K(2, i), a2),
                a3 = fmav(q[i], K(3, i), a3);
#undef K
            reduce4(a0, a1, a2, a3, scores + (kh * G + g) * r->padded);
        }
    }
}

/* The score of the key at element `key` of the cache for every query head. */
ALWAYS_INLINE void score_one(const vec *qs, const void *kc, int64_t key, const RowShape *r, float *scores,
                             int bf16) {
    if (EVEN_ODD(bf16)) { score_one_eo(qs, kc, key, r, scores); return; }
    const int NV = r->NV, G = r->G;
    for (int kh = 0; kh < r->KVH; kh++) {
        const int64_t k = key + kh * r->D;
        for (int g = 0; g < G; g++) {
            const vec *q = qs + (kh * G + g) * NV;
            vec a = q[0] * loadv_at(kc, k, bf16);
            for (int i = 1; i < NV; i++) a += q[i] * loadv_at(kc, k + i * VW, bf16);
            scores[(kh * G + g) * r->padded] = hsum(a);
        }
    }
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

#include "bf16_pairs.h"

/* Every head's scores of the row's keys [first, len) (key t's at scores[t - first]), block by block
   through `table` from block `from` on (a tile's shared blocks before it: shared_keys'): four keys at a
   time within a block (their vectors in registers, each query head's four sums reduced together), the
   block's rest one at a time; the next block's keys prefetched alongside (the last block's: the first
   values). */
ALWAYS_INLINE void score_keys(const vec *qs, const void *kc, const void *vc, const int64_t *table,
                              const RowShape *r, float *scores, int64_t from, int bf16) {
    const int64_t b0 = r->first / r->bs;
    for (int64_t blk = b0 > from ? b0 : from, t0 = blk * r->bs; t0 < r->len; t0 += r->bs, blk++) {
        const int64_t n = min64(r->len - t0, r->bs);
        const int64_t kb = table[blk] * r->bs * r->slot;
        const int last = t0 + r->bs >= r->len;
        const void *next = last ? vc : kc;
        const int64_t next_block = last ? table[b0] : table[blk + 1];
        const int64_t next_n = last ? min64(r->len - b0 * r->bs, r->bs) : min64(r->len - t0 - r->bs, r->bs);
        float *s = scores + t0 - r->first; /* key t0 + j's score at s[j] */
        int64_t j = blk == b0 ? r->first - t0 : 0;
        for (; j + 4 <= n; j += 4) {
            if (j < next_n) prefetch_slots(next, next_block, j, min64(j + 4, next_n), r, bf16);
            if (PAIRS_FOR(bf16, r))
                score_pairs(qs, kc, kb + j * r->slot, r, s + j, 4);
            else
                score_four(qs, kc, kb + j * r->slot, r, s + j, bf16);
        }
        if (j < next_n) prefetch_slots(next, next_block, j, next_n, r, bf16);
        for (; j < n; j++)
            if (PAIRS_FOR(bf16, r))
                score_pairs(qs, kc, kb + j * r->slot, r, s + j, 1);
            else
                score_one(qs, kc, kb + j * r->slot, r, s + j, bf16);
    }
}

/* Each head's scores to e^(s - max) (padded with -inf: e^-inf = 0), and 1 / their sum in inv: in place,
   or with hi != NULL as bf16_pairs.h's two bf16 halves into hi / lo ([H][padded]). */
ALWAYS_INLINE void softmax_heads(float *scores, const RowShape *r, float *inv, uint16_t *hi, uint16_t *lo) {
    for (int h = 0; h < r->H; h++) {
        float *s = scores + h * r->padded;
        for (int64_t t = r->len - r->first; t < r->padded; t++) s[t] = -INFINITY;
    }
    for (int h = 0; h < r->H; h++) {
        float *s = scores + h * r->padded;
        vec mv = loadv(s); /* in vectors: a scalar max's chain of compares took an eighth */
        for (int64_t t = VW; t < r->padded; t += VW) mv = vmaxv(loadv(s + t), mv);
        const float scale = hi ? r->scale : 1.f, m = hmax(mv) * scale; /* bf16_pairs.h's scores come unscaled */
        vec sum = {0};
        for (int64_t t = 0; t < r->padded; t += VW) {
            vec e = vexpv(loadv(s + t) * scale - m);
            if (hi)
                split_weights(e, hi + h * r->padded + t, lo + h * r->padded + t);
            else
                memcpy(s + t, &e, sizeof e);
            sum += e;
        }
        inv[h] = 1.f / hsum(sum);
    }
}

/* acc += the weights p[0..3] of values j..j+3 of a block (at element `values` of the cache), every head. */
ALWAYS_INLINE void weigh_four(const float *restrict scores, const void *vc, int64_t values, const RowShape *r,
                              vec *restrict acc, int bf16) {
    if (EVEN_ODD(bf16)) { weigh_four_eo(scores, vc, values, r, acc); return; }
    const int NV = r->NV, G = r->G;
    for (int kh = 0; kh < r->KVH; kh++) {
        const int64_t at = values + kh * r->D, s = r->slot;
        vec v[4][MAX_VECS];
        if (SLOTS_COPIED(bf16)) load_four(vc, at, r, v, bf16);
        for (int g = 0; g < G; g++) {
            const int h = kh * G + g;
            const float *p = scores + h * r->padded;
#define V(j, i) slot_vec(vc, v, at, s, j, i, bf16)
            for (int i = 0; i < NV; i++) acc[h * NV + i] += p[0] * V(0, i) + p[1] * V(1, i) + p[2] * V(2, i) + p[3] * V(3, i);
#undef V
        }
    }
}

/* acc += the weight of the value at element `value` of the cache, every head. */
ALWAYS_INLINE void weigh_one(const float *scores, const void *vc, int64_t value, const RowShape *r, vec *acc,
                             int bf16) {
    if (EVEN_ODD(bf16)) { weigh_one_eo(scores, vc, value, r, acc); return; }
    const int NV = r->NV, G = r->G;
    for (int kh = 0; kh < r->KVH; kh++) {
        const int64_t v = value + kh * r->D;
        for (int g = 0; g < G; g++) {
            const int h = kh * G + g;
            const float p = scores[h * r->padded];
            for (int i = 0; i < NV; i++) acc[h * NV + i] += p * loadv_at(vc, v + i * VW, bf16);
        }
    }
}

/* acc [H][NV] += every head's values [first, len) weighted by its (unnormalised) scores from block
   `from` on, as score_keys goes (the next block's values prefetched alongside); with bf16_pairs.h's
   passes, by the weights' halves hi / lo, a pair of slots at a time (four, two, then one alone). */
ALWAYS_INLINE void weigh_values(const float *scores, const uint16_t *hi, const uint16_t *lo, const void *vc,
                                const int64_t *table, const RowShape *r, vec *acc, int64_t from, int bf16) {
    const int pairs = PAIRS_FOR(bf16, r);
    const int64_t b0 = r->first / r->bs;
    for (int64_t blk = b0 > from ? b0 : from, t0 = blk * r->bs; t0 < r->len; t0 += r->bs, blk++) {
        const int64_t n = min64(r->len - t0, r->bs);
        const int64_t vb = table[blk] * r->bs * r->slot;
        const int64_t next_n = t0 + r->bs < r->len ? min64(r->len - t0 - r->bs, r->bs) : 0;
        const int64_t t = t0 - r->first; /* value t0 + j's weight at index t + j */
        int64_t j = blk == b0 ? r->first - t0 : 0;
        for (; j + 4 <= n; j += 4) {
            if (j < next_n) prefetch_slots(vc, table[blk + 1], j, min64(j + 4, next_n), r, bf16);
            if (pairs)
                weigh_pairs(hi, lo, t + j, vc, vb + j * r->slot, r, acc, 2, 0);
            else
                weigh_four(scores + t + j, vc, vb + j * r->slot, r, acc, bf16);
        }
        if (j < next_n) prefetch_slots(vc, table[blk + 1], j, next_n, r, bf16);
        if (pairs && j + 2 <= n) weigh_pairs(hi, lo, t + j, vc, vb + j * r->slot, r, acc, 1, 0), j += 2;
        if (pairs && j < n) weigh_pairs(hi, lo, t + j, vc, vb + j * r->slot, r, acc, 1, 1), j++;
        for (; j < n; j++) weigh_one(scores + t + j, vc, vb + j * r->slot, r, acc, bf16);
    }
}

/* The first key a row of `len` keys attends under a sliding window of `window` keys (<= 0: none). */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

#define MAX_RUN 8 /* rows a thread attends together at most (sibling_runs.h) */

/* The shapes and buffers of one call (the entry points' arguments). */
typedef struct {
    const void *q, *kc, *vc;
    const int64_t *table, *lengths;
    void *out;
    int64_t table_stride, H, KVH, D, bs, window; /* window: a sliding window's keys (0: none) */
    float scale;
} Call;

/* Row b of the call's shape, its keys [first, len); NV, the head's vectors, a constant where this is
   inlined (attend_nv's cases), so each head size gets loops unrolled for it. */
ALWAYS_INLINE RowShape row_shape(const Call *c, int64_t b, const int NV, int64_t first) {
    const int64_t len = c->lengths[b];
    return (RowShape){.H = (int)c->H, .KVH = (int)c->KVH, .G = (int)(c->H / c->KVH), .NV = NV, .D = NV * VW,
                      .slot = c->KVH * NV * VW, .padded = (len - first + 15) & ~(int64_t)15, .first = first,
                      .len = len, .bs = c->bs, .scale = c->scale};
}

/* A tile: rows b0 .. b0 + n - 1 of the call that one thread attends together, the first `shared` blocks
   of their tables the same cache blocks, read whole by each (0: none; then n is 1). Row i's scratch:
   its scores (and bf16_pairs.h's weight halves after them) at scores + i * stride, its query and its
   acc at buf + i * 2 * H * NV. */
typedef struct {
    int64_t b0, shared, stride;
    int n;
    float *scores;
    vec *buf;
} Tile;

/* Row i of the tile's query, its acc, and bf16_pairs.h's weight halves (NULL for the fp32 passes). */
ALWAYS_INLINE vec *tile_qs(const Tile *t, int i, const RowShape *r) { return t->buf + (int64_t)i * 2 * r->H * r->NV; }
ALWAYS_INLINE vec *tile_acc(const Tile *t, int i, const RowShape *r) { return tile_qs(t, i, r) + r->H * r->NV; }
ALWAYS_INLINE uint16_t *tile_hi(const Tile *t, int i, const RowShape *r, int bf16) {
    return PAIRS_FOR(bf16, r) ? (uint16_t *)(t->scores + i * t->stride + r->H * r->padded) : NULL;
}

#include "tile_passes.h"

/* The tile's rows, their keys [first, len) (first > 0 only for a tile of one row): the shared blocks'
   keys, each row's own keys, each row's softmax, the shared blocks' values, each row's own values;
   out [H][D] at row b's place. `single`: a constant 1 for a tile of one row (a decode row), whose code
   then holds none of the tile's (one function for both ran a step of Qwen3's decode attention at
   0.92-0.96x in one-process A/Bs, bench/RESULTS.md). */
ALWAYS_INLINE void attend(const Call *c, const Tile *t, int64_t first, const int NV, int bf16, const int single) {
    float inv[MAX_RUN][MAX_HEADS];
    const int n = single ? 1 : t->n;
    const int tiled = !single && t->shared; /* a decode row's code holds none of the tile's passes */
    const int pairs = PAIRS_FOR(bf16, c) && NV * VW % 32 == 0; /* bf16_pairs.h's (constant 0 where NV rules them out) */
    const int64_t from = tiled ? t->shared : 0; /* each row's own blocks from here */
    if (tiled && pairs) shared_keys(c, t, NV);
    if (tiled && !pairs) shared_f32(c, t, NV, bf16, 0);
    for (int i = 0; i < n; i++) {
        const RowShape r = row_shape(c, t->b0 + i, NV, first);
        float *scores = t->scores + i * t->stride;
        uint16_t *hi = tile_hi(t, i, &r, bf16);
        score_keys(tile_qs(t, i, &r), c->kc, c->vc, c->table + (t->b0 + i) * c->table_stride, &r, scores, from, bf16);
        softmax_heads(scores, &r, inv[i], hi, hi ? hi + r.H * r.padded : NULL);
        vec *acc = tile_acc(t, i, &r);
        for (int k = 0; k < r.H * NV; k++) acc[k] = (vec){0};
    }
    if (tiled && pairs) shared_values(c, t, NV);
    if (tiled && !pairs) shared_f32(c, t, NV, bf16, 1);
    for (int i = 0; i < n; i++) {
        const RowShape r = row_shape(c, t->b0 + i, NV, first);
        const float *scores = t->scores + i * t->stride;
        const uint16_t *hi = tile_hi(t, i, &r, bf16);
        vec *acc = tile_acc(t, i, &r);
        weigh_values(scores, hi, hi ? hi + r.H * r.padded : NULL, c->vc, c->table + (t->b0 + i) * c->table_stride, &r,
                     acc, from, bf16);
        const int64_t at = (t->b0 + i) * r.H * r.D;
        if (hi) {
            store_pairs(acc, inv[i], &r, c->out, at);
            continue;
        }
        if (EVEN_ODD(bf16)) {
            for (int h = 0; h < r.H; h++) even_odd_store(acc + h * NV, NV, inv[i][h], (uint16_t *)c->out + at + h * r.D);
            continue;
        }
        for (int h = 0; h < r.H; h++)
            for (int k = 0; k < NV; k++) storev_at(c->out, at + h * r.D + k * VW, acc[h * NV + k] * inv[i][h], bf16);
    }
}

/* attend with NV a constant in each case: head sizes 16, 32, 64, 128, 256 and Phi-3's 96. */
ALWAYS_INLINE void attend_nv(const Call *c, const Tile *t, int64_t first, int bf16, const int single) {
#define ATTEND_D(D) attend(c, t, first, (D) / VW, bf16, single)
    switch (c->D) {
    case 16: ATTEND_D(16); break;
    case 32: ATTEND_D(32); break;
    case 64: ATTEND_D(64); break;
    case 96: ATTEND_D(96); break;
    case 128: ATTEND_D(128); break;
    default: ATTEND_D(256); break;
    }
#undef ATTEND_D
}

/* The tile's queries into their scratch (bf16_pairs.h's: as they are; the fp32 passes': scaled), then
   attend; a row the window does not cut runs code compiled for first = 0 (the loops as they were
   before windows: one loop for both cost full attention 3-9% in bf16, bench.decode_attention, noisy). */
ALWAYS_INLINE void attend_tile(const Call *c, const Tile *t, int bf16, const int single) {
    const int64_t NV = c->D / VW, per_row = c->H * c->D;
    for (int i = 0; i < (single ? 1 : t->n); i++) {
        const int64_t b = t->b0 + i;
        const RowShape r = row_shape(c, b, (int)NV, 0);
        vec *qs = tile_qs(t, i, &r);
        if (PAIRS_FOR(bf16, c))
            memcpy(qs, (const uint16_t *)c->q + b * per_row, sizeof(uint16_t) * (size_t)per_row);
        else if (EVEN_ODD(bf16))
            widen_row_even_odd((const uint16_t *)c->q + b * per_row, per_row, c->scale, (float *)qs);
        else
            for (int64_t k = 0; k < c->H * NV; k++) qs[k] = loadv_at(c->q, b * per_row + k * VW, bf16) * c->scale;
    }
    const int64_t first = single ? window_start(c->lengths[t->b0], c->window) : 0;
    if (first)
        attend_nv(c, t, first, bf16, single);
    else
        attend_nv(c, t, 0, bf16, single);
}

/* attend_tile for each dtype, for one row and for a tile: its own code, the dtype a constant in it. */
static void attend_row_f32(const Call *c, const Tile *t) { attend_tile(c, t, 0, 1); }
static void attend_row_bf16(const Call *c, const Tile *t) { attend_tile(c, t, 1, 1); }
static void attend_tile_f32(const Call *c, const Tile *t) { attend_tile(c, t, 0, 0); }
static void attend_tile_bf16(const Call *c, const Tile *t) { attend_tile(c, t, 1, 0); }

#include "sibling_runs.h"

/* The rows of `c`, a thread a sibling run at a time (a tile, or row after row where its rows share no
   block), each thread with scratch of its own for the largest tile (a decode step's: one row). */
static int attend_rows(const Call *c, Run *runs, int64_t count, int64_t max_len, int bf16) {
    int failed = 0;
    const int64_t stride = 2 * c->H * (max_len + 16); /* a row's scores and bf16_pairs.h's weights */
    int64_t most = 1;
    for (int64_t r = 0; r < count; r++) {
        runs[r].shared = shared_blocks(c, runs[r].first, runs[r].end);
        if (runs[r].shared && runs[r].end - runs[r].first > most) most = runs[r].end - runs[r].first;
    }
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)(most * stride));
        vec *buf = aligned_alloc(64, sizeof(vec) * (size_t)(most * 2 * c->H * (c->D / VW))); /* 64 B a multiple */
        if (!scores || !buf) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < count; r++) {
            if (!scores || !buf) continue;
            const int64_t shared = runs[r].shared;
            for (int64_t b = runs[r].first; b < runs[r].end; b += shared ? runs[r].end - b : 1) {
                const Tile t = {.b0 = b, .shared = shared, .stride = stride,
                                .n = shared ? (int)(runs[r].end - b) : 1, .scores = scores, .buf = buf};
                if (shared && bf16)
                    attend_tile_bf16(c, &t);
                else if (shared)
                    attend_tile_f32(c, &t);
                else if (bf16)
                    attend_row_bf16(c, &t);
                else
                    attend_row_f32(c, &t);
            }
        }
        free(scores);
        free(buf);
    }
    return failed ? -2 : 0;
}

/* q [B, H, D] and out [B, H, D] contiguous, in the cache's dtype; k/v cache [blocks, bs, KVH, D];
   block_table [B, table_stride] int64; lengths [B] int64 (keys per row, all written already); window:
   a row attends its last `window` keys only (<= 0: all of them).
   Returns 0, -1 for shapes this kernel does not take (the caller uses torch then), -2 when out
   of memory. */
static int paged_decode(const Call *c, int64_t B, int64_t max_len, int bf16) {
    const int64_t D = c->D;
    /* attend_nv's head sizes */
    if (c->KVH <= 0 || c->H % c->KVH || c->H > MAX_HEADS || max_len <= 0 ||
        (D != 16 && D != 32 && D != 64 && D != 96 && D != 128 && D != 256))
        return -1;
    int64_t count;
    Run *runs = sibling_runs(c->table, c->table_stride, c->lengths, B, c->window, c->bs, &count);
    if (runs == NULL) return -2;
    const int rc = attend_rows(c, runs, count, max_len, bf16);
    free(runs);
    return rc;
}

int paged_decode_f32(const float *q, const float *kc, const float *vc, const int64_t *table, int64_t table_stride,
                     const int64_t *lengths, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs,
                     int64_t max_len, int64_t window, float scale) {
    const Call c = {q, kc, vc, table, lengths, out, table_stride, H, KVH, D, bs, window, scale};
    return paged_decode(&c, B, max_len, 0);
}

int paged_decode_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int64_t *table,
                      int64_t table_stride, const int64_t *lengths, uint16_t *out, int64_t B, int64_t H, int64_t KVH,
                      int64_t D, int64_t bs, int64_t max_len, int64_t window, float scale) {
    const Call c = {q, kc, vc, table, lengths, out, table_stride, H, KVH, D, bs, window, scale};
    return paged_decode(&c, B, max_len, 1);
}
