/* An fp32 linear, out [m, n] = x [m, k] . w^T (+ bias), over a weight packed once into panels of
   32 output columns: [n/32][k][32] floats, zero-padded to whole panels (engine/kernels/f32_linears.py).

   oneDNN's fp32 matmul, through torch's op, costs a primitive lookup and its own blocking per call
   and MKL's packed GEMM pads every weight's copy to at least 8 MB (2 GB for SmolLM2's 538 MB); a
   decode step's GEMMs are small (32-256 rows), so one panel of 32 columns at a time, 12 rows x 32
   columns of accumulators held in 24 vector registers, each weight row of the panel (128 bytes)
   read once per 12 rows from L1 (on AVX2, 6 rows x 16 columns in 12 of its 16, each half of the panel
   in turn). Threads take whole panels.

   Arithmetic: each output is the fp32 sum of its k products in order of k (FMA: each product added
   exact, one rounding per step), then its bias added: a plain fp32 GEMM's error bound. */

#include <stdlib.h>
#include <string.h>

#include "f32_panels.h"
#include "f32_transpose.h"


/* x's rows copied a cache line further apart than K where K's rows are whole multiples of 4096 bytes
   (K = 2048, 6144, 8192: Llama's and Qwen3's linears): there a block's 12 rows all fall in one set of L1
   (8 ways), and at each step of K every row's line evicts another's, so the broadcasts came from L2. On a
   Zen 4 at 32 rows: 1.35x at K = 2048 x 3072 columns, 1.04-1.07x on the others (bench/RESULTS.md); the
   copy is 0.1-1% of the call. Kept per thread up to STAGGER_KEEP_BYTES (a decode step's calls reuse it;
   a prefill's larger copy is freed after its call). NULL (ldx untouched) where it cannot be had: then x
   is read as is. The sums are the same: only where x lies changes. */
#define STAGGER_KEEP_BYTES (4 << 20)
static _Thread_local rows_apart_buf stagger;

/* x, or its rows copied apart where they share a set of L1 (above), with its row stride in *ldx; a call
   ends with rows_apart_release(&stagger, STAGGER_KEEP_BYTES). */
static const float *staggered(const float *x, int64_t m, int64_t k, int64_t *ldx) {
    *ldx = k;
    if (!rows_share_l1_set(m, k)) return x;
    const float *copy = rows_apart(&stagger, x, m, (size_t)k * sizeof(float), STAGGER_FLOATS * sizeof(float), 0);
    if (copy == NULL) return x;
    *ldx = k + STAGGER_FLOATS;
    return copy;
}

/* A packed weight (fp32 or bf16 panels) as panels_per_call reads it: each chunk where it lies. */
typedef struct {
    const char *w;
    int64_t k, value_bytes;
} packed_weight;

static const void *chunk_in_place(const void *weights, int64_t n, int64_t n0, int64_t k0, int64_t kc, float *buf) {
    (void)n, (void)kc, (void)buf;
    const packed_weight *p = weights;
    return p->w + (n0 * p->k + k0 * 32) * p->value_bytes; /* panel n0 / 32's row k0 */
}

/* x [m, k], w packed [ceil(n/32)][k][32] (fp32, or bf16 panels where `bf16`), bias [n] or NULL: out [m, n],
   all fp32 and contiguous: panels_per_call over the panels where they lie, x's rows copied apart first where
   they share a set of L1 (above). Returns 0, or -1 when out of memory. */
static int linear_packed(const float *x, int64_t m, int64_t k, const void *w, int bf16, int64_t n, const float *bias,
                         float *out) {
    int64_t ldx;
    x = staggered(x, m, k, &ldx);
    const packed_weight packed = {w, k, bf16 ? (int64_t)sizeof(uint16_t) : (int64_t)sizeof(float)};
    const int rc = panels_per_call(x, ldx, m, k, n, bias, chunk_in_place, &packed, KC, bf16, out, NULL, 1);
    rows_apart_release(&stagger, STAGGER_KEEP_BYTES);
    return rc;
}

int f32_linear(const float *x, int64_t m, int64_t k, const float *w, int64_t n, const float *bias, float *out) {
    return linear_packed(x, m, k, w, 0, n, bias, out);
}

int f32_linear_bf16_panels(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, const float *bias,
                           float *out) {
    return linear_packed(x, m, k, w, 1, n, bias, out);
}

/* ---- a sparse MLP's experts over panels ---------------------------------------------------------

   Each active expert's GEMM over its rows (a step's picks sorted by expert: moe_experts.c), on one packed
   weight of all the experts, [E * n, k] as panels, expert e's n columns from e * n on (n a multiple of 32:
   its panels its own): one team over every (expert, panel) item, each run as a dense call's panel, so the
   weights stream while the products run (f32_panels.h) and a token's sums are a dense linear's, in order
   of k whatever else shares its expert (batch invariant). On AVX2 the dot products over the weights in place
   (moe_experts.c) reduce each output across lanes and run two x rows a pass: over qwen3-moe-2core's bf16
   experts this ran 1.3x them at 4 rows an expert, 1.6-1.7x at 8-32 (bench.expert_gemms). x [rows, k] with row
   stride ldx, fp32; out [rows, n], fp32 or rounded once to bf16 (out_bf16). Returns 0, or -1 without memory. */
static int panel_groups(const float *x, int64_t ldx, int64_t k, const int64_t *starts, const int64_t *experts,
                        int64_t G, const void *w, int bf16, int64_t n, float *out, uint16_t *out_bf16) {
    const int64_t panels = n / 32, value_bytes = bf16 ? 2 : 4;
    int64_t most = 0;
    for (int64_t g = 0; g < G; g++) most = starts[g + 1] - starts[g] > most ? starts[g + 1] - starts[g] : most;
    if (most == 0 || panels == 0) return 0;
    const int64_t blocks = (most + MR - 1) / MR;
    int failed = 0;
    _Pragma("omp parallel") {
        v16f *sums = k > KC ? aligned_alloc(64, sizeof(v16f) * 2 * MR * (size_t)blocks) : NULL;
        if (k > KC && sums == NULL) failed = 1;
        int first = 1;
        _Pragma("omp for schedule(static)")
        for (int64_t i = 0; i < G * panels; i++) {
            const int64_t g = i / panels, m = starts[g + 1] - starts[g];
            if ((k > KC && sums == NULL) || m == 0) continue;
            const packed_weight pw = {(const char *)w + experts[g] * n * k * value_bytes, k, value_bytes};
            one_panel(x + starts[g] * ldx, ldx, m, k, n, (i % panels) * 32, NULL, chunk_in_place, &pw, KC, bf16,
                      out ? out + starts[g] * n : NULL, out_bf16 ? out_bf16 + starts[g] * n : NULL, 1, sums, NULL,
                      &first);
        }
        free(sums);
    }
    return failed ? -1 : 0;
}

/* panel_groups for bf16 experts over bf16 panels (f32_pack_rows_bf16's), x and out in bf16 (x widened
   exactly, its rows apart where they share a set of L1): moe_experts.c's GEMM signature (groups_bf16). */
int f32_panel_groups_bf16(const uint16_t *x, int64_t k, const int64_t *starts, const int64_t *experts, int64_t G,
                          const uint16_t *w, int64_t n, uint16_t *out) {
    const int64_t rows = starts[G], ldx = k + (rows_share_l1_set(rows, k) ? STAGGER_FLOATS : 0);
    if (rows == 0) return 0;
    const int64_t bytes = rows * ldx * (int64_t)sizeof(float);
    float *x32 = bytes <= STAGGER_KEEP_BYTES ? thread_buffer(bytes) : malloc((size_t)bytes); /* a prefill's: freed */
    if (x32 == NULL) return -1;
    for (int64_t r = 0; r < rows; r++) widen_bf16(x + r * k, k, x32 + r * ldx);
    const int rc = panel_groups(x32, ldx, k, starts, experts, G, w, 1, n, NULL, out);
    if (bytes > STAGGER_KEEP_BYTES) free(x32);
    return rc;
}

/* panel_groups for fp32 experts over fp32 panels (f32_pack_rows'). */
int f32_panel_groups(const float *x, int64_t k, const int64_t *starts, const int64_t *experts, int64_t G,
                     const float *w, int64_t n, float *out) {
    int64_t ldx;
    x = staggered(x, starts[G], k, &ldx);
    const int rc = panel_groups(x, ldx, k, starts, experts, G, w, 0, n, out, NULL);
    rows_apart_release(&stagger, STAGGER_KEEP_BYTES);
    return rc;
}

/* ---- fp32 on the weight as the engine holds it: no packed copy --------------------------------

   The same block product with the roles swapped: 12 weight rows are broadcast a value at a time
   (each row read in place, a stream of its own) against 32 rows of the activations laid out per
   call as a panel [k][32] (x transposed: m * k values against the weight's n * k). Each output is
   still the fp32 sum of its k products in order of k, one FMA a product (a * b + c is the same
   whichever factor is broadcast): the packed kernel's bits (tested). The weight may come in up to
   three row segments (a layer's q/k/v, gate/up), each read where it lies. */

#define ROWS_AHEAD 64 /* values of K a weight row is fetched ahead of the block's loads */

/* rows (1..MR) weight rows w[0..rows) from value k0, kc values of K, times a panel of the activations
   ([kc][32], from row `p`'s) into 2 * VW of acc's (weight row r's at acc + 32 r), starting from acc's sums
   (`more`) or from zero; on AVX2 once for each half of the panel, as the packed kernel's blocks. */
#define WEIGHT_ROWS(R)                                                                                   \
    static void wrows_##R(const float *const *w, int64_t k0, int64_t kc, const float *p, float *acc, int more) { \
        vec c[R][2];                                                                                     \
        sums_in(c, R, acc, more);                                                                        \
        for (int64_t kk = 0; kk < kc; kk++) {                                                            \
            if ((kk & 15) == 0)                                                                          \
                for (int r = 0; r < R; r++) __builtin_prefetch(w[r] + k0 + kk + ROWS_AHEAD);             \
            const vec b0 = loadv(p + kk * 32), b1 = loadv(p + kk * 32 + VW);                             \
            for (int r = 0; r < R; r++) {                                                                \
                const float a = w[r][k0 + kk];                                                           \
                c[r][0] += a * b0;                                                                       \
                c[r][1] += a * b1;                                                                       \
            }                                                                                            \
        }                                                                                                \
        sums_out(c, R, acc);                                                                             \
    }

WEIGHT_ROWS(1)
WEIGHT_ROWS(2)
WEIGHT_ROWS(3)
WEIGHT_ROWS(4)
WEIGHT_ROWS(5)
WEIGHT_ROWS(6)
#ifdef __AVX512F__
WEIGHT_ROWS(7)
WEIGHT_ROWS(8)
WEIGHT_ROWS(9)
WEIGHT_ROWS(10)
WEIGHT_ROWS(11)
WEIGHT_ROWS(12)
#endif

typedef void (*wrows_fn)(const float *const *, int64_t, int64_t, const float *, float *, int);
static const wrows_fn wrows_of_rows[MR] = {wrows_1, wrows_2, wrows_3, wrows_4, wrows_5, wrows_6,
#ifdef __AVX512F__
                                           wrows_7, wrows_8, wrows_9, wrows_10, wrows_11, wrows_12
#endif
};

/* ... over the panel's first `cols` columns (rounded up to 2 * VW: the rest of the panel's rows are past m) */
static void weight_rows(int rows, const float *const *w, int64_t k0, int64_t kc, const float *p, v16f *acc, int more,
                        int64_t cols) {
    for (int col = 0; col < cols && col < 32; col += 2 * VW)
        wrows_of_rows[rows - 1](w, k0, kc, p + col, (float *)acc + col, more);
}

/* x [m, k] as panels of 32 rows, [ceil(m/32)][k][32], rows past m zero. */
static void activations_as_panels(const float *x, int64_t m, int64_t k, float *xp) {
    static const float zeros[16] = {0};
    const int64_t halves = (m + 15) / 16;
#pragma omp for schedule(static)
    for (int64_t h = 0; h < halves; h++) {
        float *dst = xp + (h / 2) * k * 32 + (h % 2) * 16;
        const uint32_t *src[16]; /* the type transpose16_u32 reads them as: a float * array read so is not seen written */
        int64_t kk = 0;
        for (; kk + 16 <= k; kk += 16) {
            for (int r = 0; r < 16; r++) src[r] = (const uint32_t *)(h * 16 + r < m ? x + (h * 16 + r) * k + kk : zeros);
            transpose16_u32(src, (uint32_t *)(dst + kk * 32), 32);
        }
        for (; kk < k; kk++)
            for (int r = 0; r < 16; r++) dst[kk * 32 + r] = h * 16 + r < m ? x[(h * 16 + r) * k + kk] : 0.0f;
    }
    if (halves % 2) { /* the last panel's second half: zeros */
#pragma omp single
        for (int64_t kk = 0; kk < k; kk++) memset(xp + (halves / 2) * k * 32 + kk * 32 + 16, 0, 64);
    }
}

/* Each output column's weight row (of `value_bytes` values), kept between calls per calling thread (NULL
   without memory). */
static const void **row_pointers(const int64_t *seg_ptr, const int64_t *seg_rows, int64_t nseg, int64_t n, int64_t k,
                                 int64_t value_bytes) {
    static __thread const void **kept = NULL;
    static __thread int64_t cap = 0;
    if (n > cap) {
        free(kept);
        kept = malloc((size_t)n * sizeof *kept);
        cap = kept == NULL ? 0 : n;
        if (kept == NULL) return NULL;
    }
    for (int64_t s = 0, r = 0; s < nseg; s++)
        for (int64_t i = 0; i < seg_rows[s]; i++) kept[r++] = (const char *)seg_ptr[s] + i * k * value_bytes;
    return kept;
}

/* Up to 32 rows with the weight rows broadcast (the block product above). */
static int rows_broadcast(const float *x, int64_t m, int64_t k, const float **rows, int64_t n, const float *bias,
                          float *out) {
    static __thread float *kept_panels = NULL;
    static __thread int64_t panels_cap = 0;
    const int64_t mpanels = (m + 31) / 32, need = mpanels * k * 32;
    if (need > panels_cap) {
        free(kept_panels);
        kept_panels = aligned_alloc(64, (size_t)need * sizeof(float));
        panels_cap = kept_panels == NULL ? 0 : need;
    }
    if (kept_panels == NULL) return -1;
    float *xp = kept_panels; /* a local: the team shares it */
    const int64_t nblocks = (n + MR - 1) / MR;
    int failed = 0;
    _Pragma("omp parallel if (m * n * k > 32768)") {
        activations_as_panels(x, m, k, xp);
        v16f *sums = k > KC ? aligned_alloc(64, sizeof(v16f) * 2 * MR * (size_t)mpanels) : NULL;
        if (k > KC && sums == NULL) failed = 1;
        _Pragma("omp for schedule(static)")
        for (int64_t nb = 0; nb < nblocks; nb++) {
            if (k > KC && sums == NULL) continue;
            const int64_t n0 = nb * MR;
            const int nr = n - n0 < MR ? (int)(n - n0) : MR;
            const float *const *w = rows + n0;
            v16f one[2 * MR];
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                const int64_t kc = k - k0 < KC ? k - k0 : KC;
                for (int64_t mp = 0; mp < mpanels; mp++) {
                    v16f *acc = sums ? sums + mp * 2 * MR : one;
                    weight_rows(nr, w, k0, kc, xp + mp * k * 32 + k0 * 32, acc, k0 > 0, m - mp * 32);
                    if (k0 + kc < k) continue;
                    for (int r = 0; r < nr; r++) { /* acc[r]: column n0 + r of 32 output rows */
                        float v[32];
                        const float b = bias ? bias[n0 + r] : 0.0f;
                        store16_f32(v, acc[2 * r] + b);
                        store16_f32(v + 16, acc[2 * r + 1] + b);
                        for (int64_t i = 0; i < 32 && mp * 32 + i < m; i++) out[(mp * 32 + i) * n + n0 + r] = v[i];
                    }
                }
            }
        }
        free(sums);
    }
    return failed ? -1 : 0;
}

/* Rows [row0, row0 + 32) of the weight (`rows`: each column's row), values [k0, k0 + kc) of K, laid out
   into buf as a panel chunk [kc][32] (panels_per_call's chunk). */
static const void *panel_from_rows(const void *weights, int64_t n, int64_t row0, int64_t k0, int64_t kc, float *buf) {
    const float *const *rows = weights;
    static const float zeros[16] = {0};
    for (int half = 0; half < 2; half++) {
        const uint32_t *src[16]; /* as in activations_as_panels */
        int64_t kk = 0;
        for (; kk + 16 <= kc; kk += 16) {
            for (int r = 0; r < 16; r++) {
                const int64_t row = row0 + half * 16 + r;
                src[r] = (const uint32_t *)(row < n ? rows[row] + k0 + kk : zeros);
            }
            transpose16_u32(src, (uint32_t *)(buf + kk * 32 + half * 16), 32);
        }
        for (; kk < kc; kk++) /* K's tail */
            for (int r = 0; r < 16; r++) {
                const int64_t row = row0 + half * 16 + r;
                buf[kk * 32 + half * 16 + r] = row < n ? rows[row][k0 + kk] : 0.0f;
            }
    }
    return buf;
}

/* out [m, n] = x [m, k] . w^T (+ bias [n] or NULL), w the rows of `nseg` (1-3) segments: seg_ptr[s]
   a [seg_rows[s], k] fp32 weight, read where it lies. Both ways compute f32_linear's sums in its
   order, so the bits are the packed kernel's whichever runs (and whatever shares the step): the
   rows broadcast at a decode step's 8-32 rows (0.85-1.06x the packed kernel's time), the panels
   laid out per call below and above (1.0-1.06x at 256 rows, 1.2-1.3x at 1; bench/RESULTS.md).
   Returns 0, or -1 without memory. */
int f32_linear_rows(const float *x, int64_t m, int64_t k, const int64_t *seg_ptr, const int64_t *seg_rows, int64_t nseg,
                    const float *bias, float *out) {
    int64_t n = 0;
    for (int64_t s = 0; s < nseg; s++) n += seg_rows[s];
    if (m == 0 || n == 0) return 0;
    const float **rows = (const float **)row_pointers(seg_ptr, seg_rows, nseg, n, k, sizeof(float));
    if (rows == NULL) return -1;
    if (m >= 8 && m <= 32) return rows_broadcast(x, m, k, rows, n, bias, out);
    /* else each weight panel's K chunk laid out per call (in L2) and the packed kernel's row blocks run over
       it: at a step's many rows the layout is paid once for many blocks */
    return panels_per_call(x, k, m, k, n, bias, panel_from_rows, rows, KC, 0, out, NULL, 0);
}

/* ---- a bf16 model's weights in place on the fp32 kernel: no panels ----------------------------

   A CPU without bf16 kernels (AVX2; AVX-512 without AVX512-BF16) serves a bf16 model's linears on this
   kernel: from bf16 panels derived at each push (f32_pack_rows_bf16), or from the weights where they lie,
   with no copy held (the model's bytes, and a push's derive, saved). The same arithmetic as the bf16
   panels', each weight widened exactly and the fp32 FMAs in order of k: the same bits (tested). */

/* Rows [row0, row0 + 32) of a bf16 weight (`rows`: each column's row), values [k0, k0 + kc) of K, laid out
   into buf as a bf16 panel chunk [kc][32] (f32_pack_rows_bf16's order; panels_per_call's chunk, widened as
   its blocks load it). */
#define LAYOUT_AHEAD 256 /* values of K a row is fetched ahead of the layout's loads */
static const void *panel_from_bf16_rows(const void *weights, int64_t n, int64_t row0, int64_t k0, int64_t kc,
                                        float *buf) {
    const uint16_t *const *rows = weights;
    uint16_t *dst = (uint16_t *)buf;
    int64_t kk = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
    /* a row's whole lines (32 values) before the next rows' */
    static const uint16_t zeros[32] = {0};
    for (; kk + 32 <= kc; kk += 32)
        for (int c = 0; c < 32; c += 16) {
            const uint16_t *src[16];
            for (int j = 0; j < 16; j++) {
                src[j] = row0 + c + j < n ? rows[row0 + c + j] + k0 + kk : zeros;
                __builtin_prefetch(src[j] + LAYOUT_AHEAD);
            }
            for (int q = 0; q < 32; q += 8) bf16_pairs_8x16(src, q, dst + (kk + q) * 32 + c);
        }
#endif
    for (; kk < kc; kk++) /* K's tail */
        for (int j = 0; j < 32; j++) dst[kk * 32 + bf16_slot(j)] = row0 + j < n ? rows[row0 + j][k0 + kk] : 0;
    return dst;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* A decode step's few rows (1..SMALL_M) on bf16 weight rows, with no layout in memory: 8 weight rows x 8 values
   of K widened and transposed in registers, then each of x's rows adds its 8 products per output in order of
   k, the sums in registers over the whole of K. The layout per call (below) wrote and read back a chunk of
   32 rows for each one row, twice the weights' time on a Zen 3 where memory bounds a step. */
#define SMALL_M 7
#define TILE_AHEAD 256 /* values of K each of a tile's 8 rows is fetched ahead of its loads */

/* (the sums as 7 named vectors, not an array: GCC 12 kept an array of them in memory across the loop) */
#define TILE_FMA(i, a, r)                                                                                \
    if (tile_m > i) a = _mm256_fmadd_ps(_mm256_broadcast_ss(x + (i) * ldx + kk), r, a)
#define TILE_ROWS(M)                                                                                     \
    static void tile_rows_##M(const float *x, int64_t ldx, int64_t k, const uint16_t *const *w, __m256 *sums) { \
        const int tile_m = M;                                                                            \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0;           \
        int64_t kk = 0;                                                                                  \
        for (; kk + 8 <= k; kk += 8) {                                                                   \
            if ((kk & 31) == 0)                                                                          \
                for (int j = 0; j < 8; j++) __builtin_prefetch(w[j] + kk + TILE_AHEAD);                  \
            __m256 r[8];                                                                                 \
            for (int j = 0; j < 8; j++) { /* (common.h's loadv_bf16 compiled to two halves here) */      \
                const __m128i h = _mm_loadu_si128((const __m128i *)(w[j] + kk));                         \
                r[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));             \
            }                                                                                            \
            transpose8_regs(r); /* r[q]: value kk + q of the 8 rows */                                   \
            for (int q = 0; q < 8; q++, kk++) {                                                          \
                TILE_FMA(0, a0, r[q]); TILE_FMA(1, a1, r[q]); TILE_FMA(2, a2, r[q]); TILE_FMA(3, a3, r[q]); \
                TILE_FMA(4, a4, r[q]); TILE_FMA(5, a5, r[q]); TILE_FMA(6, a6, r[q]);                     \
            }                                                                                            \
            kk -= 8;                                                                                     \
        }                                                                                                \
        for (; kk < k; kk++) { /* K's tail */                                                            \
            float v[8];                                                                                  \
            for (int j = 0; j < 8; j++) v[j] = bf16_to_f32(w[j][kk]);                                    \
            const __m256 r = _mm256_loadu_ps(v);                                                         \
            TILE_FMA(0, a0, r); TILE_FMA(1, a1, r); TILE_FMA(2, a2, r); TILE_FMA(3, a3, r);              \
            TILE_FMA(4, a4, r); TILE_FMA(5, a5, r); TILE_FMA(6, a6, r);                                  \
        }                                                                                                \
        sums[0] = a0, sums[1] = a1, sums[2] = a2, sums[3] = a3, sums[4] = a4, sums[5] = a5, sums[6] = a6; \
    }
TILE_ROWS(1)
TILE_ROWS(2)
TILE_ROWS(3)
TILE_ROWS(4)
TILE_ROWS(5)
TILE_ROWS(6)
TILE_ROWS(7)
typedef void (*tile_fn)(const float *, int64_t, int64_t, const uint16_t *const *, __m256 *);
static const tile_fn tile_rows_of[SMALL_M] = {tile_rows_1, tile_rows_2, tile_rows_3, tile_rows_4,
                                             tile_rows_5, tile_rows_6, tile_rows_7};

/* x [m, k] (m <= SMALL_M, row stride ldx) . the bf16 rows^T (+ bias) into out [m, n]: each output the fp32 sum
   of its products in order of k, then its bias (the panels' sums and order: their bits). Threads take tiles of 8
   outputs. */
static void tiles_bf16(const float *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *const *rows, int64_t n,
                       const float *bias, float *out) {
    const int64_t tiles = (n + 7) / 8;
    _Pragma("omp parallel for schedule(static) if (m * n * k > 32768)")
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * 8, cols = n - n0 < 8 ? n - n0 : 8;
        const uint16_t *w[8];
        for (int j = 0; j < 8; j++) w[j] = rows[j < cols ? n0 + j : n0]; /* past n: a row read again, dropped */
        __m256 sums[SMALL_M];
        tile_rows_of[m - 1](x, ldx, k, w, sums);
        const float *acc = (const float *)sums;
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < cols; j++) out[i * n + n0 + j] = acc[i * 8 + j] + (bias ? bias[n0 + j] : 0.0f);
    }
}
#endif

/* f32_linear_rows over bf16 weight rows (seg_ptr[s] a [seg_rows[s], k] bf16 weight, read where it lies):
   f32_linear_bf16_panels' bits; up to SMALL_M rows on AVX2 by tiles transposed in registers (above), more over
   bf16 panels laid out per call. On a Zen 3 (Qwen3-1.7B's linears) 1.2-1.45x the packed panels' time at 1-4
   rows, 1.5-1.8x at 8-16, 1.1-1.3x at 32-256. Tried and dropped: the rows broadcast as f32_linear_rows does at
   8-32 rows, each block's rows widened first (its activations, twice a bf16 panel's bytes, stream from L2 for
   every block), and tiles of 8 columns transposed into L1 for groups of 7 rows (1.5-2.3x). The layout per call
   costs ~0.2 ns a weight on a core from L2 (its shuffles: as much from memory), so 2026-12-06 tried again: the
   next chunk's rows prefetched under the products (no gain), and the rows broadcast in groups of 8 blocks over
   chunks of 128 values of K (activations in L1, each block's rows widened by a load, a zero-extension and a
   shift): 1.1-1.25x the panels at 32 rows, 1.3x at 16, but 1.5-1.6x at 24 and 2x at 8 (a vector of x's rows
   half used; one-vector blocks did not help), and Qwen3-1.7B's engine no faster (0.73-0.76x the panels' tok/s).
   2026-12-07, dot products in another order of sums (each 16 values of K widened by a shift and a mask, x laid
   out even / odd to match, 8-lane sums, 2 x rows x 4 weight rows a block): 1.2-1.36x the panels at 1 row, but
   0.81-0.85x at 32 and 0.6-0.7x at 256 (each widened weight feeds 2-4 products on AVX2's 16 registers, the
   panels' 12; bench/RESULTS.md). Returns 0, or -1 without memory. */
int f32_linear_rows_bf16(const float *x, int64_t m, int64_t k, const int64_t *seg_ptr, const int64_t *seg_rows,
                         int64_t nseg, const float *bias, float *out) {
    int64_t n = 0;
    for (int64_t s = 0; s < nseg; s++) n += seg_rows[s];
    if (m == 0 || n == 0) return 0;
    const void **rows = row_pointers(seg_ptr, seg_rows, nseg, n, k, sizeof(uint16_t));
    if (rows == NULL) return -1;
#if defined(__AVX2__) && !defined(__AVX512F__)
    if (m <= SMALL_M) {
        int64_t ldx;
        x = staggered(x, m, k, &ldx);
        tiles_bf16(x, ldx, m, k, (const uint16_t *const *)rows, n, bias, out);
        rows_apart_release(&stagger, STAGGER_KEEP_BYTES);
        return 0;
    }
#endif
    return panels_per_call(x, k, m, k, n, bias, panel_from_bf16_rows, rows, KC, 1, out, NULL, 0);
}
