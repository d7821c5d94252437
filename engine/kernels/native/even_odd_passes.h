/* A bf16 cache's passes on a CPU that widens bf16 (AVX2: no bf16 products): each 16 values of a head taken
   as its 8 even values, then its 8 odd ones, so one load, a shift and a mask widen them (common.h's
   load_bf16_pair), where two zero-extending loads and two shifts did, into an array the group's query
   heads read back through the stack. The query is laid out the same way (common.h's widen_row_even_odd), the keys' dot
   products summed in that order, and the values' weighted sums kept so until the output puts them back in
   order (even_odd_store). Part of paged_decode.c: included after RowShape, reduce4 and hsum. */
#ifndef ROLLOUT_NATIVE_EVEN_ODD_PASSES_H
#define ROLLOUT_NATIVE_EVEN_ODD_PASSES_H

#if defined(__AVX2__) && !defined(__AVX512F__)
#define EVEN_ODD(bf16) (bf16)
#else
#define EVEN_ODD(bf16) 0
#endif

/* slot j's (of four) 16 values from element `at`: its even ones into e[j], its odd ones into o[j] */
ALWAYS_INLINE void slot_pairs(const void *cache, int64_t at, int64_t slot, vec e[4], vec o[4]) {
    for (int j = 0; j < 4; j++) load_bf16_pair((const uint16_t *)cache + at + j * slot, &e[j], &o[j]);
}

/* score_four's scores: each key's chain of FMAs over the head's vectors in the even / odd order */
ALWAYS_INLINE void score_four_eo(const vec *qs, const void *kc, int64_t keys, const RowShape *r,
                                 float *restrict scores) {
    const int NV = r->NV, G = r->G;
    for (int kh = 0; kh < r->KVH; kh++) {
        const int64_t at = keys + kh * r->D;
        for (int g = 0; g < G; g++) {
            const vec *q = qs + (kh * G + g) * NV;
            vec e[4], o[4], a[4];
            slot_pairs(kc, at, r->slot, e, o);
            for (int j = 0; j < 4; j++) a[j] = fmav(q[1], o[j], q[0] * e[j]);
            for (int i = 2; i < NV; i += 2) {
                slot_pairs(kc, at + i * VW, r->slot, e, o);
                for (int j = 0; j < 4; j++) a[j] = fmav(q[i + 1], o[j], fmav(q[i], e[j], a[j]));
            }
            reduce4(a[0], a[1], a[2], a[3], scores + (kh * G + g) * r->padded);
        }
    }
}

ALWAYS_INLINE void score_one_eo(const vec *qs, const void *kc, int64_t key, const RowShape *r, float *scores) {
    const int NV = r->NV, G = r->G;
    for (int kh = 0; kh < r->KVH; kh++) {
        const uint16_t *k = (const uint16_t *)kc + key + kh * r->D;
        for (int g = 0; g < G; g++) {
            const vec *q = qs + (kh * G + g) * NV;
            vec e, o;
            load_bf16_pair(k, &e, &o);
            vec a = fmav(q[1], o, q[0] * e);
            for (int i = 2; i < NV; i += 2) load_bf16_pair(k + i * VW, &e, &o), a = fmav(q[i + 1], o, fmav(q[i], e, a));
            scores[(kh * G + g) * r->padded] = hsum(a);
        }
    }
}

/* weigh_four's sums, acc's vectors in the even / odd order */
ALWAYS_INLINE void weigh_four_eo(const float *restrict scores, const void *vc, int64_t values, const RowShape *r,
                                 vec *restrict acc) {
    const int NV = r->NV, G = r->G;
    for (int kh = 0; kh < r->KVH; kh++) {
        const int64_t at = values + kh * r->D;
        for (int g = 0; g < G; g++) {
            const int h = kh * G + g;
            const float *p = scores + h * r->padded;
            for (int i = 0; i < NV; i += 2) {
                vec e[4], o[4];
                slot_pairs(vc, at + i * VW, r->slot, e, o);
                acc[h * NV + i] += p[0] * e[0] + p[1] * e[1] + p[2] * e[2] + p[3] * e[3];
                acc[h * NV + i + 1] += p[0] * o[0] + p[1] * o[1] + p[2] * o[2] + p[3] * o[3];
            }
        }
    }
}

ALWAYS_INLINE void weigh_one_eo(const float *scores, const void *vc, int64_t value, const RowShape *r, vec *acc) {
    const int NV = r->NV, G = r->G;
    for (int kh = 0; kh < r->KVH; kh++) {
        const uint16_t *v = (const uint16_t *)vc + value + kh * r->D;
        for (int g = 0; g < G; g++) {
            const int h = kh * G + g;
            const float p = scores[h * r->padded];
            for (int i = 0; i < NV; i += 2) {
                vec e, o;
                load_bf16_pair(v + i * VW, &e, &o);
                acc[h * NV + i] += p * e, acc[h * NV + i + 1] += p * o;
            }
        }
    }
}

/* A head's sums (NV vectors, even / odd) times inv, back in order, rounded to bf16 at out */
static inline void even_odd_store(const vec *acc, int NV, float inv, uint16_t *out) {
#ifdef __AVX512F__
    (void)acc, (void)NV, (void)inv, (void)out; /* EVEN_ODD is 0 here: not called */
#else
    for (int i = 0; i < NV; i += 2) {
        const vec e = acc[i] * inv, o = acc[i + 1] * inv;
        /* e0 o0 e1 o1 | e4 o4 e5 o5 and e2 o2 e3 o3 | e6 o6 e7 o7, then their halves paired */
        const vec lo = __builtin_shufflevector(e, o, 0, 8, 1, 9, 4, 12, 5, 13);
        const vec hi = __builtin_shufflevector(e, o, 2, 10, 3, 11, 6, 14, 7, 15);
        storev_bf16(out + i * VW, __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11));
        storev_bf16(out + i * VW + VW, __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15));
    }
#endif
}

#endif
