/* A sparse MLP's experts over a step's tokens in one call: each active expert's gate/up and down
   GEMMs on its weights in place (bf16: amx_linear.c's rows kernel over all experts in one team, or
   without AMX bf16_rows.c's dot products, alike; fp32: dot products over K at a decode step's few rows
   an expert, f32_linear.c's rows kernel an expert at a time above), or, on AVX2, on a copy of every
   expert's weights as panels (f32_linear.c's f32_panel_groups*, both dtypes; kernels through the addresses
   engine/kernels/moe_experts.py hands over), the silu between them, the routing weights and each
   token's sum over its k picks (and, in moe_block_*, the routing before them).

   torch's grouped GEMM, at a decode step's 1-10 rows an expert, ran oneDNN's small-M path at about a
   sixth of the memory's speed (a 32-sequence bf16 step of the 0.94B Qwen3-MoE shape spent 82% of
   its time there); the rows kernels stream a weight once whatever the rows. The operations and
   their order are transformers' grouped experts' (engine/kernels/moe_experts.run): the picks sorted by
   expert, gate/up rounded to the dtype, silu(gate) rounded times up rounded, down rounded, times the
   pick's weight (rounded in bf16 unless the weights are fp32: Mixtral's), the k products of a token
   summed in fp32 in slot order and rounded once. Only each GEMM's sum runs in the rows kernel's
   order, within a GEMM's error of torch's. */

#include <immintrin.h> /* _mm_prefetch, on any x86-64 */
#include <stdlib.h>

#include "common.h"

typedef int (*rows_f32_fn)(const float *x, int64_t m, int64_t k, const int64_t *seg_ptr, const int64_t *seg_rows,
                           int64_t nseg, const float *bias, float *out);
typedef void (*silu_bf16_fn)(const uint16_t *gate_up, int64_t stride, int64_t T, int64_t I, uint16_t *out);
typedef void (*silu_f32_fn)(const float *gate_up, int64_t stride, int64_t T, int64_t I, float *out);

typedef int (*groups_bf16_fn)(const uint16_t *x, int64_t k, const int64_t *starts, const int64_t *experts, int64_t G,
                              const uint16_t *w, int64_t n, uint16_t *out);

/* Each active expert's GEMM over its rows: bf16 in one team (amx_linear_bf16_groups or bf16_rows_groups),
   fp32 one rows call an expert. starts [G + 1]: where each of the G active experts' rows start in x and out. */
static int groups_bf16(const int64_t *kernels, const uint16_t *x, int64_t k, const int64_t *starts,
                       const int64_t *experts, int64_t G, const uint16_t *w, int64_t n, uint16_t *out) {
    return ((groups_bf16_fn)kernels[0])(x, k, starts, experts, G, w, n, out);
}

/* out rows of group g = its x rows . w_g^T as dot products over K: 4 weight rows against up to DOT_ROWS
   x rows a pass (dot_pass), every (expert, 4 weight rows) one item of one team. At a decode step's few
   rows an expert this streams each weight row once at memory speed, where laying the weight out as
   panels per call (f32_linear_rows below 8 rows) cost more than reading it. Each output is the sum of
   its lanes' partial sums over K in steps of 16, the lanes in order, then K's last k % 16 one at a time,
   whatever the rows: a token's bits do not depend on how many others share its expert. fp32 weights and
   out, or bf16 ones (`bf16`: widened as loaded, each sum rounded once); x in fp32. */
#define DOT_AHEAD 4

/* an output's sum from its lanes (`lanes` of them), then K's tail, stored in the dtype */
ALWAYS_INLINE void dot_store(const float *lane, int lanes, const void *w, int64_t wrow, const float *xr, int64_t k16,
                             int64_t k, int bf16, void *out, int64_t at) {
    float sum = 0.0f;
    for (int l = 0; l < lanes; l++) sum += lane[l];
    for (int64_t kk = k16; kk < k; kk++) sum += load_at(w, wrow + kk, bf16) * xr[kk];
    if (bf16) ((uint16_t *)out)[at] = f32_to_bf16(sum);
    else ((float *)out)[at] = sum;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2, in 8-lane vectors: 2 x rows a pass (8 sums, the x rows' 4 vectors and a weight's 2 in 14 of the 16
   registers; 4 x 4 sums of 16 lanes spilled them: fp32 experts ran 2.78x slower). Each 16 values of K: fp32
   weights as two loads; bf16 as one load widened by a shift (the even values of K) and a mask (the odd
   ones), as the bf16 panels are, against x laid out to match (bf16_dot_groups: each 16 values of K as its
   8 even, then its 8 odd). */
#define DOT_ROWS 2
/* 16 bf16 values, one load: the even ones widened by a shift, the odd ones by a mask (common.h's
   load_bf16_pair; vec is AVX2's __m256 here) */
static inline void widen_even_odd(const uint16_t *p, __m256 *even, __m256 *odd) {
    vec e, o;
    load_bf16_pair(p, &e, &o);
    *even = (__m256)e, *odd = (__m256)o;
}

ALWAYS_INLINE void dot_pass(const float *x0, int64_t nr, const void *w, const int64_t wr[4], int64_t nj, int bf16,
                            int64_t k, const char *next, int64_t next_bytes, int fetch, void *out, int64_t at,
                            int64_t n) {
    const int64_t k16 = k / 16 * 16, size = bf16 ? 2 : 4;
    const float *x1 = x0 + (nr > 1 ? k : 0); /* rows of K values; the 2nd again where there is one */
    __m256 acc[2][4];
    for (int j = 0; j < 4; j++) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k16; kk += 16) {
        if (fetch)
            for (int64_t off = kk * 4 * size; off < (kk + 16) * 4 * size && off < next_bytes; off += 64)
                _mm_prefetch(next + off, _MM_HINT_T1);
        const __m256 x0a = _mm256_loadu_ps(x0 + kk), x0b = _mm256_loadu_ps(x0 + kk + 8);
        const __m256 x1a = _mm256_loadu_ps(x1 + kk), x1b = _mm256_loadu_ps(x1 + kk + 8);
        for (int j = 0; j < 4; j++) {
            __m256 wa, wb;
            if (bf16) {
                widen_even_odd((const uint16_t *)w + wr[j] + kk, &wa, &wb);
            } else {
                wa = _mm256_loadu_ps((const float *)w + wr[j] + kk);
                wb = _mm256_loadu_ps((const float *)w + wr[j] + kk + 8);
            }
            acc[0][j] = _mm256_fmadd_ps(wb, x0b, _mm256_fmadd_ps(wa, x0a, acc[0][j]));
            acc[1][j] = _mm256_fmadd_ps(wb, x1b, _mm256_fmadd_ps(wa, x1a, acc[1][j]));
        }
    }
    for (int64_t r = 0; r < nr; r++)
        for (int64_t j = 0; j < nj; j++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[r][j]);
            dot_store(lanes, 8, w, wr[j], r ? x1 : x0, k16, k, bf16, out, at + r * n + j);
        }
}
#else
/* AVX-512 (or a build without AVX2): 16-lane vectors, 4 x rows a pass (16 sums) */
#define DOT_ROWS 4
ALWAYS_INLINE void dot_pass(const float *x0, int64_t nr, const void *w, const int64_t wr[4], int64_t nj, int bf16,
                            int64_t k, const char *next, int64_t next_bytes, int fetch, void *out, int64_t at,
                            int64_t n) {
    const int64_t k16 = k / 16 * 16, size = bf16 ? 2 : 4;
    const float *xr[DOT_ROWS]; /* rows of K values; past the last, the last again (its sums dropped) */
    for (int64_t r = 0; r < DOT_ROWS; r++) xr[r] = x0 + (r < nr ? r : nr - 1) * k;
    v16f acc[DOT_ROWS][4] = {{{0}}};
    for (int64_t kk = 0; kk < k16; kk += 16) {
        if (fetch) /* the next block (4 rows, contiguous) in k / 16 steps of 4 lines */
            for (int64_t off = kk * 4 * size; off < (kk + 16) * 4 * size && off < next_bytes; off += 64)
                _mm_prefetch(next + off, _MM_HINT_T1);
        const v16f w0 = load16_at(w, wr[0] + kk, bf16), w1 = load16_at(w, wr[1] + kk, bf16),
                   w2 = load16_at(w, wr[2] + kk, bf16), w3 = load16_at(w, wr[3] + kk, bf16);
        for (int r = 0; r < DOT_ROWS; r++) {
            v16f xv = load16_f32(xr[r] + kk);
            /* one load of x a row: GCC folded it into each of the row's 4 FMAs, 24 loads a step of K where 8
               do, and at 16-32 rows an expert the loads bound it (1.1-1.45x, the same sums: bench/RESULTS.md) */
            __asm__("" : "+v"(xv));
            acc[r][0] += w0 * xv, acc[r][1] += w1 * xv, acc[r][2] += w2 * xv, acc[r][3] += w3 * xv;
        }
    }
    for (int64_t r = 0; r < nr; r++)
        for (int64_t j = 0; j < nj; j++) {
            float lanes[16];
            memcpy(lanes, &acc[r][j], sizeof lanes);
            dot_store(lanes, 16, w, wr[j], xr[r], k16, k, bf16, out, at + r * n + j);
        }
}
#endif

ALWAYS_INLINE void dot_groups(const float *x, int64_t k, const int64_t *starts, const int64_t *experts, int64_t G,
                              const void *w, int bf16, int64_t n, void *out) {
    const int64_t nb = (n + 3) / 4, size = bf16 ? 2 : 4;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t i = 0; i < G * nb; i++) {
        const int64_t g = i / nb, j0 = (i % nb) * 4, nj = n - j0 < 4 ? n - j0 : 4, m = starts[g + 1] - starts[g];
        const int64_t wj = (experts[g] * n + j0) * k; /* the item's first weight value */
        const float *xg = x + starts[g] * k;
        int64_t wr[4]; /* past the last row: the last row again, its sums dropped (constant bounds: registers) */
        for (int64_t j = 0; j < 4; j++) wr[j] = wj + (j < nj ? j : nj - 1) * k;
        /* the rows of the item DOT_AHEAD items on, fetched into L2 while this item's loads run: rows a
           few KB long give the hardware's stream prefetcher little to learn from. On Zen 4 (2 cores,
           qwen3-moe-2core's experts, 4 rows an expert) 4 items ahead into L2 ran 1.1-1.9x the next
           item into L1: that item's rows came late, and this one's products waited on them */
        const int64_t ni = i + DOT_AHEAD < G * nb ? i + DOT_AHEAD : i, ng = ni / nb, nj0 = (ni % nb) * 4;
        const char *next = (const char *)w + (experts[ng] * n + nj0) * k * size;
        const int64_t next_bytes = (n - nj0 < 4 ? n - nj0 : 4) * k * size;
        for (int64_t r0 = 0; r0 < m; r0 += DOT_ROWS) {
            const int64_t nr = m - r0 < DOT_ROWS ? m - r0 : DOT_ROWS;
            dot_pass(xg + r0 * k, nr, w, wr, nj, bf16, k, next, next_bytes, r0 == 0, out, (starts[g] + r0) * n + j0, n);
        }
    }
}

/* fp32 experts' dot products (dot_groups) with the GEMMs' signature (groups_f32's; bench/expert_gemms.py's
   fp32 experts in place). Returns 0. */
int f32_dot_groups(const float *x, int64_t k, const int64_t *starts, const int64_t *experts, int64_t G, const float *w,
                   int64_t n, float *out) {
    dot_groups(x, k, starts, experts, G, w, 0, n, out);
    return 0;
}

/* bf16 experts on a CPU without AMX or AVX512-BF16 (AVX2): dot products on the bf16 weights in place
   (dot_groups), x widened to fp32 first (exact), each output rounded once
   to bf16; amx_linear_bf16_groups' signature, so the bf16 block takes it as its GEMM
   (engine/kernels/moe_experts.py). The same sums at any rows: an engine on it is batch-invariant. Returns
   0, or -1 when out of memory. */
#define X_KEEP_BYTES (4 << 20) /* x's fp32 copy kept per thread up to this (a decode step's); a prefill's freed */
int bf16_dot_groups(const uint16_t *x, int64_t k, const int64_t *starts, const int64_t *experts, int64_t G,
                    const uint16_t *w, int64_t n, uint16_t *out) {
    const int64_t rows = starts[G], bytes = rows * k * (int64_t)sizeof(float);
    if (bytes == 0) return 0;
    float *x32 = bytes <= X_KEEP_BYTES ? thread_buffer(bytes) : malloc((size_t)bytes);
    if (x32 == NULL) return -1;
#if defined(__AVX2__) && !defined(__AVX512F__)
    const int64_t k16 = k / 16 * 16;
    for (int64_t r = 0; r < rows; r++) { /* each 16 values of K as its 8 even, then its 8 odd: the weights' widening */
        const uint16_t *xr = x + r * k;
        float *dst = x32 + r * k;
        widen_row_even_odd(xr, k16, 1.0f, dst);
        for (int64_t kk = k16; kk < k; kk++) dst[kk] = bf16_to_f32(xr[kk]);
    }
#else
    widen_bf16(x, rows * k, x32);
#endif
    dot_groups(x32, k, starts, experts, G, w, 1, n, out);
    if (bytes > X_KEEP_BYTES) free(x32);
    return 0;
}

typedef int (*groups_f32_fn)(const float *x, int64_t k, const int64_t *starts, const int64_t *experts, int64_t G,
                             const float *w, int64_t n, float *out);

/* kernels[3]: f32_linear.c's f32_panel_groups where the experts are packed as panels (w then their copy:
   engine/kernels/moe_experts.py), else 0. kernels[2]: the most rows an expert may have for the dot products;
   above, the rows kernel (faster there: 1.1x at 32 rows an expert, 1.2x at prefill's hundreds), whose sums
   run in another order. A batch-invariant engine passes no limit: then a token's experts sum in one order
   whatever else shares its step (engine/kernels/moe_experts.py). */
static int groups_f32(const int64_t *kernels, const float *x, int64_t k, const int64_t *starts, const int64_t *experts,
                      int64_t G, const float *w, int64_t n, float *out) {
    if (kernels[3]) return ((groups_f32_fn)kernels[3])(x, k, starts, experts, G, w, n, out);
    int64_t most = 0;
    for (int64_t g = 0; g < G; g++) most = starts[g + 1] - starts[g] > most ? starts[g + 1] - starts[g] : most;
    if (most <= kernels[2]) return f32_dot_groups(x, k, starts, experts, G, w, n, out);
    for (int64_t g = 0; g < G; g++) {
        const int64_t seg = (int64_t)(w + experts[g] * n * k);
        const int rc = ((rows_f32_fn)kernels[0])(x + starts[g] * k, starts[g + 1] - starts[g], k, &seg, &n, 1, NULL,
                                                 out + starts[g] * n);
        if (rc) return rc;
    }
    return 0;
}

/* kernels: [the rows linear, the silu * up, fp32's dot-product row limit, fp32's panel groups (groups_f32)] of
   the dtype; order [S] the picks (token-major, pick t * k + j) sorted by expert, ends [E] where each expert's
   picks end in it; weights [S] per pick in pick order, fp32 when weights_f32 else the dtype; gate_up
   [E, 2I, H], down [E, H, I] (or their copies as panels, where kernels[0] / kernels[3] take them); scratch
   xg [S, H], gu [S, 2I], act [S, I], dn [S, H] and inv [S] (int64); out [T, H]. Returns 0, or a
   kernel's code (-1: no memory, -2: a shape the rows kernel does not take). */
#define DEFINE_EXPERTS(NAME, T_, GROUPS, SILU_FN, LOAD, STORE, ROUND)                                           \
    static int NAME(const int64_t *kernels, const T_ *x, int64_t T, int64_t H, int64_t k, const int64_t *order, \
             const int64_t *ends, int64_t E, const void *weights, int weights_f32, const T_ *gate_up,            \
             const T_ *down, int64_t I, T_ *xg, T_ *gu, T_ *act, T_ *dn, int64_t *inv, T_ *out) {               \
        const int64_t S = T * k;                                                                              \
        _Pragma("omp parallel for schedule(static) if (S * H > 65536)")                                       \
        for (int64_t j = 0; j < S; j++) {                                                                     \
            memcpy(xg + j * H, x + (order[j] / k) * H, H * sizeof(T_));                                      \
            inv[order[j]] = j;                                                                                \
        }                                                                                                     \
        int64_t starts[E + 1], active[E], G = 0; /* the experts with picks, and where their rows start */     \
        starts[0] = 0;                                                                                        \
        for (int64_t e = 0; e < E; e++)                                                                       \
            if (ends[e] > starts[G]) active[G] = e, starts[++G] = ends[e];                                    \
        int rc = GROUPS(kernels, xg, H, starts, active, G, gate_up, 2 * I, gu);                               \
        if (rc) return rc;                                                                                    \
        ((SILU_FN)kernels[1])(gu, 2 * I, S, I, act);                                                          \
        if ((rc = GROUPS(kernels, act, I, starts, active, G, down, H, dn))) return rc;                        \
        _Pragma("omp parallel for schedule(static) if (T * H > 16384)")                                       \
        for (int64_t t = 0; t < T; t++) {                                                                     \
            float acc[H];                                                                                     \
            for (int64_t h = 0; h < H; h++) acc[h] = 0.0f;                                                    \
            for (int64_t j = 0; j < k; j++) {                                                                 \
                const int64_t p = t * k + j;                                                                  \
                const T_ *d = dn + inv[p] * H;                                                                \
                if (weights_f32) {                                                                            \
                    const float w = ((const float *)weights)[p];                                              \
                    for (int64_t h = 0; h < H; h++) acc[h] += LOAD(d[h]) * w;                                 \
                } else {                                                                                      \
                    const float w = LOAD(((const T_ *)weights)[p]);                                           \
                    for (int64_t h = 0; h < H; h++) acc[h] += ROUND(LOAD(d[h]) * w);                          \
                }                                                                                             \
            }                                                                                                 \
            T_ *o = out + t * H;                                                                              \
            for (int64_t h = 0; h < H; h++) o[h] = STORE(acc[h]);                                             \
        }                                                                                                     \
        return 0;                                                                                             \
    }

DEFINE_EXPERTS(experts_bf16, uint16_t, groups_bf16, silu_bf16_fn, load_bf16, store_bf16, round_bf16)
DEFINE_EXPERTS(experts_f32, float, groups_f32, silu_f32_fn, load_f32, store_f32, round_f32)

/* HF's TopKRouter on router logits [T, E]: softmax in fp32, the k largest (ties: the lower id first),
   renormalised when `norm`; weights [T * k] kept in fp32 when weights_f32 (Mixtral's) else rounded to
   the dtype; ids [T, k]. Then the picks (token-major) sorted by expert, stably: order [S], ends [E]. */
#define DEFINE_ROUTE(NAME, T_, LOAD, STORE)                                                                      \
    static void NAME(const T_ *logits, int64_t T, int64_t E, int64_t k, int norm, int weights_f32, int64_t *ids, \
                     void *weights, int64_t *order, int64_t *ends) {                                            \
        _Pragma("omp parallel for schedule(static) if (T * E > 65536)")                                       \
        for (int64_t t = 0; t < T; t++) {                                                                     \
            const T_ *l = logits + t * E;                                                                     \
            float p[E], top[k], mx = -INFINITY, sum = 0.0f;                                                  \
            for (int64_t e = 0; e < E; e++) mx = fmaxf(mx, LOAD(l[e]));                                       \
            for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(LOAD(l[e]) - mx));                            \
            for (int64_t e = 0; e < E; e++) p[e] /= sum;                                                      \
            for (int64_t j = 0; j < k; j++) { /* k passes of a selection: k is a handful */                 \
                int64_t best = -1;                                                                            \
                for (int64_t e = 0; e < E; e++)                                                               \
                    if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;                              \
                ids[t * k + j] = best, top[j] = p[best], p[best] = -1.0f;                                     \
            }                                                                                                 \
            float total = 0.0f;                                                                               \
            for (int64_t j = 0; j < k; j++) total += top[j];                                                  \
            for (int64_t j = 0; j < k; j++) {                                                                 \
                const float w = norm ? top[j] / total : top[j];                                               \
                if (weights_f32)                                                                              \
                    ((float *)weights)[t * k + j] = w;                                                        \
                else                                                                                          \
                    ((T_ *)weights)[t * k + j] = STORE(w);                                                    \
            }                                                                                                 \
        }                                                                                                     \
        for (int64_t e = 0; e < E; e++) ends[e] = 0;                                                          \
        for (int64_t p = 0; p < T * k; p++) ends[ids[p]]++;                                                   \
        for (int64_t e = 1; e < E; e++) ends[e] += ends[e - 1];                                               \
        int64_t pos[E];                                                                                       \
        for (int64_t e = 0; e < E; e++) pos[e] = ends[e];                                                     \
        for (int64_t p = T * k - 1; p >= 0; p--) order[--pos[ids[p]]] = p; /* backwards: stable */           \
    }

DEFINE_ROUTE(route_bf16, uint16_t, load_bf16, store_bf16)
DEFINE_ROUTE(route_f32, float, load_f32, store_f32)

/* A router's logits [T, E] = x [T, H] . w [E, H]^T on its weight in place, each a fp32 sum over H
   in 16 lanes (then the lanes in order) rounded to the dtype once. The engine's routers run here in
   both its forwards (Python's, engine/models/moe_model.Router, and the C decode loop's), so that both route
   every token alike to the bit; within a GEMM's rounding of F.linear's. E is a router's few outputs
   (8-256), below what the rows kernels take in bf16. A token's x row is loaded once for ROUTER_ROWS weight
   rows, each logit still its own sum in the same order (2.9-3.3x the one-row passes over qwen3-moe-2core's
   routers, the same bits; they had taken 6% of a 256-sequence step); threads from 2^16 multiply-adds (a
   32-sequence step's 2^20 had run on one thread, the other spinning: bench/RESULTS.md). */
#define ROUTER_ROWS 4 /* a token's logits a pass: its x widened once for four weight rows */
#define DEFINE_ROUTER(NAME, T_, LOAD16, LOAD)                                                                    \
    void NAME(const T_ *x, int64_t T, int64_t H, const T_ *w, int64_t E, T_ *out) {                            \
        const int64_t passes = (E + ROUTER_ROWS - 1) / ROUTER_ROWS;                                            \
        _Pragma("omp parallel for schedule(static) if (T * E * H > (1 << 16))")                               \
        for (int64_t i = 0; i < T * passes; i++) {                                                            \
            const int64_t t = i / passes, e0 = (i % passes) * ROUTER_ROWS;                                     \
            const int64_t ne = E - e0 < ROUTER_ROWS ? E - e0 : ROUTER_ROWS;                                    \
            const T_ *xr = x + t * H, *wr[ROUTER_ROWS];                                                       \
            for (int j = 0; j < ROUTER_ROWS; j++) wr[j] = w + (e0 + (j < ne ? j : ne - 1)) * H; /* past E: again */ \
            v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                                      \
            int64_t h = 0;                                                                                    \
            for (; h + 16 <= H; h += 16) {                                                                    \
                const v16f xv = LOAD16(xr + h);                                                               \
                a0 += xv * LOAD16(wr[0] + h), a1 += xv * LOAD16(wr[1] + h);                                   \
                a2 += xv * LOAD16(wr[2] + h), a3 += xv * LOAD16(wr[3] + h);                                   \
            }                                                                                                 \
            const v16f acc[ROUTER_ROWS] = {a0, a1, a2, a3};                                                   \
            for (int64_t j = 0; j < ne; j++) {                                                                \
                float sum = 0.0f;                                                                             \
                for (int l = 0; l < 16; l++) sum += acc[j][l];                                                \
                for (int64_t r = h; r < H; r++) sum += LOAD(xr[r]) * LOAD(wr[j][r]);                          \
                out[t * E + e0 + j] = STORE_##T_(sum);                                                        \
            }                                                                                                 \
        }                                                                                                     \
    }
#define STORE_uint16_t store_bf16
#define STORE_float store_f32

DEFINE_ROUTER(router_logits_bf16, uint16_t, load16_bf16, load_bf16)
DEFINE_ROUTER(router_logits_f32, float, load16_f32, load_f32)

/* The sparse block after its router's GEMM: route (above), then the experts (DEFINE_EXPERTS). The
   scratch as there, plus weights [S] (4 bytes each) and ends [E]; ids [T, k] out. */
#define DEFINE_BLOCK(NAME, T_, ROUTE, EXPERTS)                                                                   \
    int NAME(const int64_t *kernels, const T_ *x, const T_ *logits, int64_t T, int64_t H, int64_t E, int64_t k, \
             int norm, int weights_f32, const T_ *gate_up, const T_ *down, int64_t I, T_ *xg, T_ *gu, T_ *act,   \
             T_ *dn, int64_t *inv, int64_t *order, int64_t *ends, void *weights, int64_t *ids, T_ *out) {       \
        ROUTE(logits, T, E, k, norm, weights_f32, ids, weights, order, ends);                                 \
        return EXPERTS(kernels, x, T, H, k, order, ends, E, weights, weights_f32, gate_up, down, I, xg, gu, act, \
                       dn, inv, out);                                                                         \
    }

DEFINE_BLOCK(moe_block_bf16, uint16_t, route_bf16, experts_bf16)
DEFINE_BLOCK(moe_block_f32, float, route_f32, experts_f32)
