/* paged_decode.c's tiles (a prompt's rows a thread attends together: its Tile), their shared blocks'
   passes: bf16_pairs.h's where the CPU multiplies bf16 pairs, the fp32 passes elsewhere. Included by
   paged_decode.c after its row passes (score_four, weigh_four, bf16_pairs.h) and the Tile helpers. */
#ifndef ROLLOUT_NATIVE_TILE_PASSES_H
#define ROLLOUT_NATIVE_TILE_PASSES_H

/* The tile's shared blocks (bf16_pairs.h's passes only), keys then values. Keys: a group of four slots
   (eight for heads of 64 values or fewer: TILE_KEYS), every kv head's, read from memory once, then from
   L1 by the rows after the first, each row's scores the ones score_keys makes of them. Values: a kv
   head's words two at a time over every shared slot for four rows together (bf16_pairs.h's weigh_rows),
   the sums in registers. A prefill's rows read the prompt's keys up to their own: taken row after row,
   each read them all again (2048 times at 2048 tokens, from L3), and each row's sums went through memory
   every four slots. */
ALWAYS_INLINE void shared_keys(const Call *c, const Tile *t, const int NV) {
    const int64_t *table = c->table + t->b0 * c->table_stride;
    const RowShape r = row_shape(c, t->b0, NV, 0);
    const void *q[MAX_RUN];
    float *s[MAX_RUN]; /* row i's scores of the next `keys` slots */
    int64_t padded[MAX_RUN];
    const int keys = TILE_KEYS(&r);
    for (int i = 0; i < t->n; i++) {
        const RowShape ri = row_shape(c, t->b0 + i, NV, 0);
        q[i] = tile_qs(t, i, &ri), s[i] = t->scores + i * t->stride, padded[i] = ri.padded;
    }
    for (int64_t blk = 0; blk < t->shared; blk++) {
        const int64_t kb = table[blk] * c->bs * r.slot;
        for (int64_t j = 0; j < c->bs; j += keys) {
            if (blk + 1 < t->shared) prefetch_slots(c->kc, table[blk + 1], j, j + keys, &r, 1);
            if (keys == 8)
                score_rows(q, s, padded, t->n, c->kc, kb + j * r.slot, &r, 8);
            else
                score_rows(q, s, padded, t->n, c->kc, kb + j * r.slot, &r, 4);
            for (int i = 0; i < t->n; i++) s[i] += keys;
        }
    }
}

ALWAYS_INLINE void shared_values(const Call *c, const Tile *t, const int NV) {
    const int64_t *table = c->table + t->b0 * c->table_stride;
    const RowShape r = row_shape(c, t->b0, NV, 0);
    const uint16_t *hi[MAX_RUN], *lo[MAX_RUN];
    vec *acc[MAX_RUN];
    for (int kh = 0; kh < r.KVH; kh++)
        for (int h = kh * r.G; h < (kh + 1) * r.G; h++) {
            for (int i = 0; i < t->n; i++) {
                const RowShape ri = row_shape(c, t->b0 + i, NV, 0);
                hi[i] = tile_hi(t, i, &ri, 1) + h * ri.padded, lo[i] = hi[i] + ri.H * ri.padded;
                acc[i] = tile_acc(t, i, &ri) + h * 2 * (r.D / 32);
            }
            for (int w = 0; w < r.D / 32; w += 2) {
                const int two = w + 2 <= r.D / 32; /* Phi-3's 96 values: a last word alone */
                int i = 0;
#define WEIGH(ROWS, WORDS) weigh_rows(hi + i, lo + i, acc + i, c->vc, table, t->shared, &r, kh, w, ROWS, WORDS)
                for (; i + 4 <= t->n; i += 4) two ? WEIGH(4, 2) : WEIGH(4, 1);
                for (; i < t->n; i++) two ? WEIGH(1, 2) : WEIGH(1, 1);
#undef WEIGH
            }
        }
}

/* The tile's shared blocks through the fp32 passes (an fp32 cache, or bf16 widened where the CPU does not
   multiply bf16 pairs), keys then values: a group of four slots at a time, each row's score_four and
   weigh_four on it in turn, so the slots come from L1 for the rows after the first (row after row, each
   row read the prompt's keys and values from L3 again: a 2048-token prefill's attention at Qwen3's
   heads 1.29-1.43x, bench/RESULTS.md). A row's sums are the ones it makes alone, in the same order:
   the same inlined functions, NV a constant in each (a row's shape made in the loop, where it is one),
   so the compiler fuses the same products into FMAs (a shape read from an array left NV unknown, the
   loops rolled, and some values' bits an ulp apart; the tile test compares every row's bits). */
ALWAYS_INLINE void shared_f32(const Call *c, const Tile *t, const int NV, int bf16, const int values) {
    const int64_t *table = c->table + t->b0 * c->table_stride;
    const RowShape r = row_shape(c, t->b0, NV, 0);
    const void *cache = values ? c->vc : c->kc;
    for (int64_t blk = 0; blk < t->shared; blk++) {
        const int64_t at = table[blk] * c->bs * r.slot;
        for (int64_t j = 0; j < c->bs; j += 4) {
            if (blk + 1 < t->shared) prefetch_slots(cache, table[blk + 1], j, j + 4, &r, bf16);
            for (int i = 0; i < t->n; i++) {
                const RowShape ri = row_shape(c, t->b0 + i, NV, 0); /* NV a constant in it: loops unrolled */
                float *scores = t->scores + i * t->stride + blk * c->bs + j;
                if (values)
                    weigh_four(scores, cache, at + j * r.slot, &ri, tile_acc(t, i, &ri), bf16);
                else
                    score_four(tile_qs(t, i, &ri), cache, at + j * r.slot, &ri, scores, bf16);
            }
        }
    }
}

#endif
