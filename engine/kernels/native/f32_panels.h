/* fp32 products over panels of 32 weight columns ([k][32] floats, f32_linear.c's layout): the block of
   rows x 32 columns of accumulators f32_linear.c multiplies its packed weights with, and the driver that
   lays a weight out as such panels per call, a chunk of K at a time, for weights kept another way (fp32
   rows in place: f32_linear.c; int8 widened to bf16 values on a CPU without AVX512-BF16: w8_linear.c). */
#ifndef ROLLOUT_NATIVE_F32_PANELS_H
#define ROLLOUT_NATIVE_F32_PANELS_H

#include "common.h"

/* A packed weight's chunks lie one after another in the order a thread takes them (the next chunk of K, or
   the next panel's first), so while a thread's blocks multiply one chunk (from L2) they prefetch the next,
   spread evenly over every block's loop: the weights stream from memory the whole time the products run,
   rather than during the first block alone while the others wait on nothing but the FMAs. On a Zen 3 over
   Qwen2.5-1.5B's linears, fp32: 1.58x / 1.40x / 1.24x at 8 / 16 / 32 rows, 1.13x at 1, the same at 256;
   bf16 panels 1.05-1.26x (bench/RESULTS.md). prefetcht0, as before (t1, into L2 only, ran the same there). */
/* Where a chunk is laid out per call instead (into a buffer, so nothing to stream ahead): how far ahead of
   its loads a block prefetches it (32 of its rows, 4 KB in fp32). */
#define PREFETCH_VALUES 1024
#ifdef __AVX512F__
#define MR 12 /* rows a block: 24 accumulators of the 32 vector registers on AVX-512 */
#else
#define MR 6 /* AVX2: a block is 6 rows x 16 columns, 12 accumulators of the 16 ymm registers, run twice a panel */
#endif
/* Values of K a chunk: 96 KB of a panel, within L2. Chunks of 256 (32 KB, within L1) ran 6% slower
   at 256 rows (SmolLM2's linears swept, bench/RESULTS.md): the hardware streams a panel's rows
   into L1 well enough, and every chunk boundary stores and reloads the block's sums. */
#define KC 768

/* x's rows copied STAGGER_FLOATS further apart where a block's rows all fall in one set of L1 (K's rows
   whole multiples of 4096 bytes: f32_linear.c says what it cost) */
#define STAGGER_FLOATS 16
static inline int rows_share_l1_set(int64_t m, int64_t k) { return m > 1 && (k * (int64_t)sizeof(float)) % 4096 == 0; }

/* A block's vectors (common.h's vec): a zmm of 16 floats on AVX-512, where 2 span a panel's 32 columns; a ymm of 8 on AVX2,
   where 2 span half a panel and a block runs once for each half (12 x 32 sums would spill AVX2's 16
   registers). The halves read different cache lines of the panel's rows, so each line is still read once a
   block, and each output's sum is the same FMAs in the same order of k: the same bits on either. */

/* A panel row's 2 * VW weights from q as two vectors, b0 (columns 0..VW-1 of the block) and b1 (VW..2VW-1). */
#define LOAD_F32_PAIR(q, b0, b1) (b0 = loadv(q), b1 = loadv((q) + VW))

/* A block's sums in: acc's rows (row r's at acc + 32 r) where `more`, else zero; and out again. Always
   inlined with a constant row count, so the sums stay in registers. */
ALWAYS_INLINE void sums_in(vec (*c)[2], int rows, const float *acc, int more) {
    for (int r = 0; r < rows; r++) {
        c[r][0] = more ? loadv(acc + 32 * r) : (vec){0};
        c[r][1] = more ? loadv(acc + 32 * r + VW) : (vec){0};
    }
}

ALWAYS_INLINE void sums_out(vec (*c)[2], int rows, float *acc) {
    for (int r = 0; r < rows; r++) storev(acc + 32 * r, c[r][0]), storev(acc + 32 * r + VW, c[r][1]);
}

/* rows (1..MR) rows from x (row stride ldx) times kc rows of a panel of T ([kc][32], from column `p`'s, each
   row's pair loaded by LOAD_PAIR) into 2 * VW columns of acc (row r's at acc + 32 r), starting from acc's sums
   (`more`) or from zero; prefetching from `ahead`, `step` bytes further each row of the panel. */
#define PANEL_ROWS(R, NAME, T, LOAD_PAIR)                                                                \
    static void NAME##_##R(const float *x, int64_t ldx, int64_t kc, const void *pv, float *acc, int more,     \
                           const char *ahead, int64_t step) {                                          \
        const T *p = pv;                                                                                 \
        vec c[R][2];                                                                                     \
        sums_in(c, R, acc, more);                                                                        \
        for (int64_t kk = 0; kk < kc; kk++) {                                                            \
            for (int line = 0; line < 2 * VW * (int)sizeof(T); line += 64) /* the lines this block reads */ \
                __builtin_prefetch(ahead + kk * step + line);                                            \
            vec b0, b1;                                                                                  \
            LOAD_PAIR(p + kk * 32, b0, b1);                                                              \
            for (int r = 0; r < R; r++) {                                                                \
                const float a = x[r * ldx + kk];                                                         \
                c[r][0] += a * b0;                                                                       \
                c[r][1] += a * b1;                                                                       \
            }                                                                                            \
        }                                                                                                \
        sums_out(c, R, acc);                                                                             \
    }

/* Every row count's block (1..MR), and the table of them, for a panel of T. */
#ifdef __AVX512F__
#define PANEL_FAMILY(NAME, T, LOAD_PAIR)                                                                 \
    PANEL_ROWS(1, NAME, T, LOAD_PAIR) PANEL_ROWS(2, NAME, T, LOAD_PAIR) PANEL_ROWS(3, NAME, T, LOAD_PAIR) \
    PANEL_ROWS(4, NAME, T, LOAD_PAIR) PANEL_ROWS(5, NAME, T, LOAD_PAIR) PANEL_ROWS(6, NAME, T, LOAD_PAIR) \
    PANEL_ROWS(7, NAME, T, LOAD_PAIR) PANEL_ROWS(8, NAME, T, LOAD_PAIR) PANEL_ROWS(9, NAME, T, LOAD_PAIR) \
    PANEL_ROWS(10, NAME, T, LOAD_PAIR) PANEL_ROWS(11, NAME, T, LOAD_PAIR) PANEL_ROWS(12, NAME, T, LOAD_PAIR) \
    static const panel_fn NAME##_of_rows[MR] = {NAME##_1, NAME##_2, NAME##_3, NAME##_4,  NAME##_5,  NAME##_6,  \
                                                NAME##_7, NAME##_8, NAME##_9, NAME##_10, NAME##_11, NAME##_12};
#else
#define PANEL_FAMILY(NAME, T, LOAD_PAIR)                                                                 \
    PANEL_ROWS(1, NAME, T, LOAD_PAIR) PANEL_ROWS(2, NAME, T, LOAD_PAIR) PANEL_ROWS(3, NAME, T, LOAD_PAIR) \
    PANEL_ROWS(4, NAME, T, LOAD_PAIR) PANEL_ROWS(5, NAME, T, LOAD_PAIR) PANEL_ROWS(6, NAME, T, LOAD_PAIR) \
    static const panel_fn NAME##_of_rows[MR] = {NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6};
#endif

typedef void (*panel_fn)(const float *, int64_t, int64_t, const void *, float *, int, const char *, int64_t);

/* Where a block's pass over a half (AVX2) or the whole (AVX-512) of a panel's chunk prefetches: its share of
   the next chunk (`next`: this block's, `step` bytes a row of the panel; see PREFETCH_VALUES), or, with
   no next chunk to stream, PREFETCH_VALUES ahead in the chunk itself (`here`: the pass's columns). */
typedef struct {
    const char *at;
    int64_t step;
} prefetch_from;

static inline prefetch_from pass_prefetch(const char *next, int64_t step, int64_t kc, int col, const char *here,
                                          int64_t value_bytes) {
    if (next) return (prefetch_from){next + col / (2 * VW) * kc * step, step};
    return (prefetch_from){here + PREFETCH_VALUES * value_bytes, 32 * value_bytes};
}
PANEL_FAMILY(panel, float, LOAD_F32_PAIR)

/* rows (1..MR) rows of x times a whole panel into acc's rows of 32 sums (v16f pairs) */
static void panel(int rows, const float *x, int64_t ldx, int64_t kc, const float *p, v16f *acc, int more,
                  const char *next, int64_t step) {
    for (int col = 0; col < 32; col += 2 * VW) {
        const prefetch_from pf = pass_prefetch(next, step, kc, col, (const char *)(p + col), sizeof(float));
        panel_of_rows[rows - 1](x, ldx, kc, p + col, (float *)acc + col, more, pf.at, pf.step);
    }
}

/* bf16 panels: the same panels with each weight in bf16, half the bytes, widened (exactly) as they are loaded:
   a bf16 model's linears on a CPU whose oneDNN has no bf16 kernels (AVX2; packed_linears.compute_dtype),
   whose fp32 copy held twice the model's bytes beside it. A block's 2 * VW values of a panel row lie as VW
   pairs of 32 bits, pair j holding column j in its low half and column VW + j in its high half, so one load,
   a shift and a mask give the block's two vectors (f32_pack.c's f32_pack_rows_bf16 lays them so): the same
   fp32 values as an fp32 panel's, the same FMAs in the same order, the same bits (common.h's load_bf16_pair). */
#define LOAD_BF16_PAIR(q, b0, b1) load_bf16_pair(q, &b0, &b1)
PANEL_FAMILY(bf16_panel, uint16_t, LOAD_BF16_PAIR)

static void bf16_panel(int rows, const float *x, int64_t ldx, int64_t kc, const uint16_t *p, v16f *acc, int more,
                       const char *next, int64_t step) {
    for (int col = 0; col < 32; col += 2 * VW) {
        const prefetch_from pf = pass_prefetch(next, step, kc, col, (const char *)(p + col), sizeof(uint16_t));
        bf16_panel_of_rows[rows - 1](x, ldx, kc, p + col, (float *)acc + col, more, pf.at, pf.step);
    }
}

/* Block blk's first row (*m0) and its row count when a call's m rows are shared evenly by `blocks` blocks
   of rows (the first m % blocks take one more): 8 rows as 4 + 4 rather than 6 + 2, so no block is one or
   two rows waiting on its loads more than on its few products. Which block a row falls in never changes
   its sums. (w8_madd.h's integer blocks ran 0.97-1.18x this way at 7-32 rows on a Zen 3: kept as they are.) */
static inline int even_block(int64_t m, int64_t blocks, int64_t blk, int64_t *m0) {
    const int64_t base = m / blocks, extra = m % blocks;
    *m0 = blk * base + (blk < extra ? blk : extra);
    return (int)(base + (blk < extra));
}

/* The chunk of a weight's panel a call reads: columns [n0, n0 + 32) (rows past n: zeros), values [k0, k0 + kc)
   of K, as [kc][32] (fp32, or bf16 panels where the caller says so): laid out into buf (kc <= KC; buf holds KC
   rows, so a chunk may fill up to a multiple of 32 past kc) or where it already lies (a packed weight). */
typedef const void *(*panel_chunk_fn)(const void *weights, int64_t n, int64_t n0, int64_t k0, int64_t kc, float *buf);

/* Columns [n0, n0 + 32) of out [m, n] (row stride n) = x [m, k] (row stride ldx) . w^T (+ bias [n] or NULL):
   one panel, its chunks of `step` values of K in turn, every block of rows over each (panels_per_call's work
   item; `sums`: room for every block's sums where k > step; `buf`: a chunk laid out per call; `first`: this
   thread's first chunk of the call, which nothing prefetched yet). */
ALWAYS_INLINE void one_panel(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t n, int64_t n0,
                             const float *bias, panel_chunk_fn chunk, const void *weights, int64_t step, int bf16,
                             float *out, uint16_t *out_bf16, int streams, v16f *sums, float *buf, int *first) {
    const int64_t blocks = (m + MR - 1) / MR, passes = blocks * (32 / (2 * VW));
    const int64_t cols = n - n0 < 32 ? n - n0 : 32;
    float b[32] = {0};
    if (bias)
        for (int64_t j = 0; j < cols; j++) b[j] = bias[n0 + j];
    v16f one[2 * MR];
    for (int64_t k0 = 0; k0 < k; k0 += step) {
        const int64_t kc = k - k0 < step ? k - k0 : step;
        const void *p = chunk(weights, n, n0, k0, kc, buf);
        /* the next chunk's bytes shared evenly by this chunk's passes (blocks x halves), a row of K at a time */
        const int64_t chunk_bytes = kc * 32 * (bf16 ? 2 : 4);
        const int64_t pf_step = (chunk_bytes + passes * kc - 1) / (passes * kc);
        const char *next = streams ? (const char *)p + chunk_bytes : NULL;
        if (streams && *first)
            for (int64_t b = 0; b < chunk_bytes; b += 64)
                __builtin_prefetch((const char *)p + b);
        *first = 0;
        for (int64_t blk = 0; blk < blocks; blk++) {
            const char *block_next = next ? next + blk * (passes / blocks) * kc * pf_step : NULL;
            /* rows shared evenly, against 6 a block and the rest in the last: bf16 panels over Qwen3-1.7B's
               linears on a Zen 3 1.10-1.15x at 7-20 rows, 1.05x at 32 (6 + 6 + 5 + 5 + 5 + 5) */
            int64_t m0;
            const int nrows = even_block(m, blocks, blk, &m0);
            v16f *acc = sums ? sums + blk * 2 * MR : one;
            if (bf16) bf16_panel(nrows, x + m0 * ldx + k0, ldx, kc, p, acc, k0 > 0, block_next, pf_step);
            else panel(nrows, x + m0 * ldx + k0, ldx, kc, p, acc, k0 > 0, block_next, pf_step);
            if (k0 + kc < k) continue;
            for (int r = 0; r < nrows; r++) {
                float v[32];
                store16_f32(v, acc[2 * r] + load16_f32(b));
                store16_f32(v + 16, acc[2 * r + 1] + load16_f32(b + 16));
                if (out_bf16)
                    for (int64_t j = 0; j < cols; j++) out_bf16[(m0 + r) * n + n0 + j] = f32_to_bf16(v[j]);
                else memcpy(out + (m0 + r) * n + n0, v, (size_t)cols * sizeof(float));
            }
        }
    }
}

/* out [m, n] = x [m, k] (row stride ldx) . w^T (+ bias [n] or NULL), in fp32 (out) or rounded once to bf16
   (out_bf16), over w's panels a chunk of `step` values of K (<= KC) at a time (`chunk`: in place, or laid out
   per call into a buffer each thread keeps, in L2: paid once for all the call's rows), every block of rows
   run over each chunk. Threads take whole panels. Each output is the fp32 sum of its products in order of k
   (the sums kept between chunks exactly), then its bias: the same bits whichever way w is kept. `streams`:
   the chunks lie one after another where they are read (a packed weight), so each is prefetched while the
   one before is multiplied (see PREFETCH_VALUES). Returns 0, or -1 without memory. */
static int panels_per_call(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t n, const float *bias,
                           panel_chunk_fn chunk, const void *weights, int64_t step, int bf16, float *out,
                           uint16_t *out_bf16, int streams) {
    if (m == 0 || n == 0) return 0; /* nothing to write (and no blocks to share the next chunk by) */
    const int64_t panels = (n + 31) / 32, blocks = (m + MR - 1) / MR;
    int failed = 0;
    _Pragma("omp parallel if (m * n * k > 32768)") {
        v16f *sums = k > step ? aligned_alloc(64, sizeof(v16f) * 2 * MR * (size_t)blocks) : NULL;
        static __thread float *buf = NULL; /* a panel chunk, [KC][32]: each thread's own, kept */
        if (buf == NULL) buf = aligned_alloc(64, sizeof(float) * 32 * KC);
        if ((k > step && sums == NULL) || buf == NULL) failed = 1;
        int first = 1;
        _Pragma("omp for schedule(static)")
        for (int64_t np = 0; np < panels; np++) {
            if ((k > step && sums == NULL) || buf == NULL) continue;
            one_panel(x, ldx, m, k, n, np * 32, bias, chunk, weights, step, bf16, out, out_bf16, streams, sums, buf,
                      &first);
        }
        free(sums);
    }
    return failed ? -1 : 0;
}

#endif
