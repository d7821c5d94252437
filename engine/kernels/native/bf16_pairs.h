/* paged_decode.c's passes over a bf16 cache with AVX512-BF16's vdpbf16ps (each fp32 lane += the two
   products of a pair of bf16, exact products summed in fp32): included by paged_decode.c after its
   RowShape, reduce4, hsum, prefetch_slots and min64; BF16_PAIRS says whether this CPU has them.

   Why: at long contexts a row's keys and values come from DRAM, and the fp32 passes widened every bf16
   (two ops a vector) before multiplying: a core's arithmetic, not its reads, set the pace (a 32-row
   step of Qwen3-1.7B at 530-1150 keys read 20 GB/s of KV; 25-28 GB/s here, 1.12-1.28x, bench/RESULTS.md).
   Here
   - keys: the query as the model made it (bf16) against the keys as they lie, scaled after the dot
     product, as the softmax reads them (scale * q.k, not (scale * q).k): no widening, half the multiplies;
   - values: two slots' values interleaved (vpunpck{l,h}wd: lane i a pair, slot j's and slot j + 1's
     value of one d) against their two weights, each weight p split p = hi + lo into two bf16 (hi + lo
     within 2^-18 p of p): the output within 2^-18 max|v| of fp32 weights' (a 512th of a bf16 ulp), as
     torch's CPU flash attention rounds its weights to bf16 whole (2^-9).
   Each row's sums still run in an order set by the row alone (its keys four, then one at a time; its
   values four, two, then one, paired with a weight of 0): batch invariant, and a row's prefill bits
   its decode bits, as before. */
#ifndef ROLLOUT_NATIVE_BF16_PAIRS_H
#define ROLLOUT_NATIVE_BF16_PAIRS_H

#ifdef __AVX512BF16__
#define BF16_PAIRS 1

/* Whether a row's passes run here: a bf16 cache, and heads of whole 32-value words (r: anything with a D). */
#define PAIRS_FOR(bf16, r) ((bf16) && (r)->D % 32 == 0)

/* q . k over one head: D / 32 words. */
ALWAYS_INLINE vec dot_words(const __m512bh *q, const uint16_t *k, int words) {
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(k));
    for (int i = 1; i < words; i++) a = _mm512_dpbf16_ps(a, q[i], (__m512bh)_mm512_loadu_si512(k + 32 * i));
    return (vec)a;
}

/* score_four's and score_one's work for `keys` (4 or 1) keys from element `at` of the cache, every query
   head, unscaled (softmax_heads scales them); q: the row's bf16 query, head after head. */
ALWAYS_INLINE void score_pairs(const void *q, const void *kc, int64_t at, const RowShape *r, float *scores,
                               int keys) {
    const int words = r->D / 32, G = r->G;
    const __m512bh *qh = q;
    for (int kh = 0; kh < r->KVH; kh++) {
        const uint16_t *k = (const uint16_t *)kc + at + kh * r->D;
        for (int g = 0; g < G; g++) {
            const __m512bh *qg = qh + (kh * G + g) * words;
            float *s = scores + (kh * G + g) * r->padded;
            if (keys == 1) {
                s[0] = hsum(dot_words(qg, k, words));
                continue;
            }
            reduce4(dot_words(qg, k, words), dot_words(qg, k + r->slot, words), dot_words(qg, k + 2 * r->slot, words),
                    dot_words(qg, k + 3 * r->slot, words), s);
        }
    }
}

/* Weights e (16 lanes) as bf16 halves: hi = e rounded, lo = the rest rounded. */
ALWAYS_INLINE void split_weights(vec e, uint16_t *hi, uint16_t *lo) {
    const __m256bh h = _mm512_cvtneps_pbh((__m512)e);
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
    _mm256_storeu_si256((__m256i *)hi, (__m256i)h);
    _mm256_storeu_si256((__m256i *)lo, (__m256i)_mm512_cvtneps_pbh((__m512)e - back));
}

/* The bf16 weights of slots t and t + 1 (lone: t's, with 0 for its partner) in every fp32 lane. */
ALWAYS_INLINE __m512bh weight_pair(const uint16_t *p, int lone) {
    uint32_t w = p[0];
    if (!lone) memcpy(&w, p, sizeof w);
    return (__m512bh)_mm512_set1_epi32((int)w);
}

/* acc += the weights of `pairs` (1 or 2) pairs of slots from element `at` of the cache (slots j, j + 1,
   then j + 2, j + 3; lone: slot j alone), every head; t: slot j's index into the halves hi / lo
   ([H][padded]). acc: each head's 2 * D / 32 vectors, word w's as [2w] (unpacklo's d) and [2w + 1]
   (unpackhi's). */
ALWAYS_INLINE void weigh_pairs(const uint16_t *hi, const uint16_t *lo, int64_t t, const void *vc, int64_t at,
                               const RowShape *r, vec *acc, int pairs, int lone) {
    const int words = r->D / 32, G = r->G;
    for (int kh = 0; kh < r->KVH; kh++) {
        __m512bh vlo[2][256 / 32], vhi[2][256 / 32];
        for (int p = 0; p < pairs; p++)
            for (int w = 0; w < words; w++) {
                const uint16_t *v = (const uint16_t *)vc + at + 2 * p * r->slot + kh * r->D + 32 * w;
                const __m512i a = _mm512_loadu_si512(v), b = lone ? a : _mm512_loadu_si512(v + r->slot);
                vlo[p][w] = (__m512bh)_mm512_unpacklo_epi16(a, b), vhi[p][w] = (__m512bh)_mm512_unpackhi_epi16(a, b);
            }
        for (int g = 0; g < G; g++) {
            const int h = kh * G + g;
            __m512bh wh[2], wl[2];
            for (int p = 0; p < pairs; p++)
                wh[p] = weight_pair(hi + h * r->padded + t + 2 * p, lone),
                wl[p] = weight_pair(lo + h * r->padded + t + 2 * p, lone);
            for (int w = 0; w < words; w++) {
                __m512 x = (__m512)acc[h * 2 * words + 2 * w], y = (__m512)acc[h * 2 * words + 2 * w + 1];
                for (int p = 0; p < pairs; p++) {
                    x = _mm512_dpbf16_ps(x, vlo[p][w], wh[p]), x = _mm512_dpbf16_ps(x, vlo[p][w], wl[p]);
                    y = _mm512_dpbf16_ps(y, vhi[p][w], wh[p]), y = _mm512_dpbf16_ps(y, vhi[p][w], wl[p]);
                }
                acc[h * 2 * words + 2 * w] = (vec)x, acc[h * 2 * words + 2 * w + 1] = (vec)y;
            }
        }
    }
}

/* Eight keys' lane sums a[0..7] into out[0..7], each key's sum in reduce4's order (lanes i and i + 8, then
   i and i + 4, then i and i + 2, then the two left: the same bits), the keys' trees side by side: a blend
   and one shuffle a step where reduce4 took two shuffles, and one store for the eight where reduce4
   extracted each lane (about 5 instructions a key against 3.5; a 64-value head's products are 2). */
ALWAYS_INLINE void reduce8(const vec *a, float *out) {
    __m512 x[4], y[2];
    for (int m = 0; m < 4; m++) { /* keys 2m, 2m + 1: lanes i and i + 8 */
        const __m512 e = (__m512)a[2 * m], o = (__m512)a[2 * m + 1];
        x[m] = _mm512_mask_blend_ps(0xFF00, e, o) + _mm512_shuffle_f32x4(e, o, 0x4E);
    }
    for (int n = 0; n < 2; n++) { /* lanes i and i + 4: 128-bit lanes 0..3 hold keys 4n, 4n + 2, 4n + 1, 4n + 3 */
        const __m512 A = x[2 * n], B = x[2 * n + 1], swapped = _mm512_mask_blend_ps(0x0F0F, A, B);
        y[n] = _mm512_mask_blend_ps(0xF0F0, A, B) + _mm512_shuffle_f32x4(swapped, swapped, 0xB1);
    }
    /* lanes i and i + 2: 128-bit lane L holds [y0's key's two, y1's key's two] */
    const __m512 w = _mm512_mask_blend_ps(0xCCCC, y[0], y[1]) +
                     _mm512_permute_ps(_mm512_mask_blend_ps(0x3333, y[0], y[1]), 0x4E);
    const __m512 z = w + _mm512_permute_ps(w, 0xB1); /* the two left: key k < 4 at 4 [0, 2, 1, 3][k], k + 4 two on */
    const __m512i order = _mm512_setr_epi32(0, 8, 4, 12, 2, 10, 6, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, z)));
}

/* Keys a tile's group takes at once: eight where they fit in registers (heads of 64 values or fewer,
   whose reduce4 cost more than their products), else four. */
#define TILE_KEYS(r) ((r)->D <= 64 && (r)->bs % 8 == 0 ? 8 : 4)

/* A prefill's rows sharing their blocks (paged_decode.c's tiles), their keys: KEYS (TILE_KEYS) slots from
   element `at` of the cache against `rows` rows' queries, every head; each kv head's keys loaded into
   registers once for all the rows (score_pairs, row after row, loaded them again for each row and head).
   The sums are score_pairs' (dot_words, then reduce4's order): the bits each row gets alone. q[i]: row
   i's bf16 query, s[i]: where its head 0's scores go, padded[i]: its heads' stride in scores. */
ALWAYS_INLINE void score_rows(const void *const *q, float *const *s, const int64_t *padded, int rows, const void *kc,
                              int64_t at, const RowShape *r, const int KEYS) {
    const int words = r->D / 32, G = r->G;
    for (int kh = 0; kh < r->KVH; kh++) {
        __m512bh k[8][256 / 32];
        for (int j = 0; j < KEYS; j++)
            for (int w = 0; w < words; w++)
                k[j][w] = (__m512bh)_mm512_loadu_si512((const uint16_t *)kc + at + j * r->slot + kh * r->D + 32 * w);
        for (int i = 0; i < rows; i++)
            for (int g = 0; g < G; g++) {
                const __m512bh *qg = (const __m512bh *)q[i] + (kh * G + g) * words;
                vec a[8];
                for (int j = 0; j < KEYS; j++) {
                    __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), qg[0], k[j][0]);
                    for (int w = 1; w < words; w++) x = _mm512_dpbf16_ps(x, qg[w], k[j][w]);
                    a[j] = (vec)x;
                }
                float *out = s[i] + (kh * G + g) * padded[i];
                if (KEYS == 8)
                    reduce8(a, out);
                else
                    reduce4(a[0], a[1], a[2], a[3], out);
            }
    }
}

/* A prefill's rows sharing their blocks (paged_decode.c's tiles), their values: ROWS rows' sums of head h
   (kv head kh), WORDS words of it from word w0 on (acc[i][2w], acc[i][2w + 1]: d = 32w ...), += the
   weights of every slot of the whole blocks table[0 .. blocks) (pairs of slots only); each pair's values
   loaded and interleaved once for all the rows, the rows' sums in registers over the blocks. Each sum
   gets the products weigh_pairs gives it, in its order: the bits each row gets alone. hi[i] / lo[i]: row
   i's weight halves of head h (slot t's at [t]), acc[i]: row i's sums of head h. Four rows and two words
   at a time: each weight broadcast once for both words, and the rows' 8 pointers stay in registers
   (eight rows' 16 did not: the compiler moved each from a vector register at each use). */
ALWAYS_INLINE void weigh_rows(const uint16_t *const *hi, const uint16_t *const *lo, vec *const *acc, const void *vc,
                              const int64_t *table, int64_t blocks, const RowShape *r, int kh, int w0, const int ROWS,
                              const int WORDS) {
    __m512 x[8][2], y[8][2]; /* [ROWS][WORDS]: constant sizes, so they stay in registers */
    for (int i = 0; i < ROWS; i++)
        for (int w = 0; w < WORDS; w++) x[i][w] = (__m512)acc[i][2 * (w0 + w)], y[i][w] = (__m512)acc[i][2 * (w0 + w) + 1];
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint16_t *v = (const uint16_t *)vc + table[blk] * r->bs * r->slot + kh * r->D + 32 * w0;
        for (int64_t j = 0; j < r->bs; j += 2, v += 2 * r->slot) {
            __m512bh vl[2], vh[2];
            for (int w = 0; w < WORDS; w++) {
                const __m512i a = _mm512_loadu_si512(v + 32 * w), b = _mm512_loadu_si512(v + r->slot + 32 * w);
                vl[w] = (__m512bh)_mm512_unpacklo_epi16(a, b), vh[w] = (__m512bh)_mm512_unpackhi_epi16(a, b);
            }
            const int64_t t = blk * r->bs + j;
            for (int i = 0; i < ROWS; i++) {
                const __m512bh wh = weight_pair(hi[i] + t, 0), wl = weight_pair(lo[i] + t, 0);
                for (int w = 0; w < WORDS; w++) {
                    x[i][w] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(x[i][w], vl[w], wh), vl[w], wl);
                    y[i][w] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(y[i][w], vh[w], wh), vh[w], wl);
                }
            }
        }
    }
    for (int i = 0; i < ROWS; i++)
        for (int w = 0; w < WORDS; w++) acc[i][2 * (w0 + w)] = (vec)x[i][w], acc[i][2 * (w0 + w) + 1] = (vec)y[i][w];
}

/* Head h's output = its acc times inv[h], rounded to bf16 at element `at` of out, d back in order:
   word w's [2w] lanes 4L + k hold d = 32w + 8L + k, its [2w + 1] lanes d = 32w + 8L + 4 + k. */
ALWAYS_INLINE void store_pairs(const vec *acc, const float *inv, const RowShape *r, void *out, int64_t at) {
    const int words = r->D / 32;
    const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i high = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int h = 0; h < r->H; h++)
        for (int w = 0; w < words; w++) {
            const __m512 x = (__m512)acc[h * 2 * words + 2 * w], y = (__m512)acc[h * 2 * words + 2 * w + 1];
            const vec s = (vec){0} + inv[h];
            storev_at(out, at + h * r->D + 32 * w, (vec)_mm512_permutex2var_ps(x, low, y) * s, 1);
            storev_at(out, at + h * r->D + 32 * w + 16, (vec)_mm512_permutex2var_ps(x, high, y) * s, 1);
        }
}

#else /* no AVX512-BF16: the fp32 passes run; these are never called */
#define BF16_PAIRS 0
#define PAIRS_FOR(bf16, r) 0
ALWAYS_INLINE void score_pairs(const void *q, const void *kc, int64_t at, const RowShape *r, float *scores, int keys) {}
ALWAYS_INLINE void split_weights(vec e, uint16_t *hi, uint16_t *lo) {}
ALWAYS_INLINE void weigh_pairs(const uint16_t *hi, const uint16_t *lo, int64_t t, const void *vc, int64_t at,
                               const RowShape *r, vec *acc, int pairs, int lone) {}
ALWAYS_INLINE void store_pairs(const vec *acc, const float *inv, const RowShape *r, void *out, int64_t at) {}
#define TILE_KEYS(r) 4
ALWAYS_INLINE void score_rows(const void *const *q, float *const *s, const int64_t *padded, int rows, const void *kc,
                              int64_t at, const RowShape *r, const int KEYS) {}
ALWAYS_INLINE void weigh_rows(const uint16_t *const *hi, const uint16_t *const *lo, vec *const *acc, const void *vc,
                              const int64_t *table, int64_t blocks, const RowShape *r, int kh, int w0, const int ROWS,
                              const int WORDS) {}
#endif

#endif
