/* A bf16 linear on a CPU with AVX512-BF16 but no AMX tiles (AMD Zen 4 and 5, Intel Cooper Lake):
   out [m, n] = x [m, k] . w^T (+ bias), the weights read where they lie ([n, k] rows, in up to three
   segments: a layer's q/k/v or gate/up), as amx_linear.c's rows kernel reads them on AMX. Engines of at
   most 64 sequences run it (engine/kernels/bf16_rows.py says why); bf16_rows_groups runs a sparse MLP's
   active experts in one call, in engines of any size (engine/kernels/moe_experts.py).

   On Zen 4 a decode step of a 1-2B model is bound by the products, not by memory (Qwen2.5-1.5B at 32
   rows: 98 GFLOP a step, 0.25 s of VDPBF16PS on 2 cores, against 3 GB of weights, 0.1 s of reading).
   Each block holds nr weight rows x mr activation rows of sums in 24 of the 32 vector registers and
   feeds VDPBF16PS from 10-11 loads per 24 of them; a thread's nr weight rows stay in L1 or L2 while
   every block of activation rows reads them, so each weight byte comes from memory once a tile of rows.
   Two shapes: 4 weight rows x 6 activation rows up to 12 rows a call (memory's calls), 8 x 3 from 13 rows
   (a decode step's products and a prefill's: half the activation loads from L2 per product). Measured
   on Qwen2.5-1.5B's linears (bench/RESULTS.md, 2026-12-05): 1.2-1.3x oneDNN's prepacked op at 9-12 rows,
   where memory binds, 1.11-1.16x at 16-32 rows (397-401 GFLOP/s; VDPBF16PS alone, from registers,
   420-427), 1.01x at 64, 0.93-0.96x at 128-256, where oneDNN's broadcasts from a packed copy need less
   of the caches.

   Arithmetic: every product of two bf16 values is exact in fp32. Lane i of a sum holds the pairs at
   K = 32 j + 2 i and 2 i + 1 for j = 0, 1, ... (VDPBF16PS adds each pair's two products in turn, with
   denormals flushed), then the 16 lanes are added in one fixed tree; an output's bits depend on its
   own row and column alone, not on the batch around it or the block it fell in (a row prefilled and
   the same row decoded give the same bits). The bias is added in fp32, then the sum rounded once. */

#include <omp.h>
#include <stdlib.h>

#include "common.h"

#define NR_MAX 8 /* weight rows a block at most: its outputs' columns (lane_sums takes four at a time) */
#define MR_MAX 6 /* activation rows a block at most */
/* Calls of WIDE_MIN_ROWS rows and more take blocks of 8 weight rows x 3 activation rows, each activation
   vector loaded from L2 feeding 8 products rather than 4 (SmolLM2-1.7B's linears, 2 MB pages: 16-32 rows
   1.00-1.05x the 4 x 6 blocks, a decode step of 16-32 rows 4-9% shorter; Qwen2.5-1.5B's at 128-256 rows
   1.04-1.05x, K whole; at 1-12 rows, where the weights' reads bound a call, 0.92-0.97x, so smaller calls
   keep 4 x 6) */
#define WIDE_MIN_ROWS 13
/* Where a call has at most two blocks (up to 12 rows) a group's time is the memory's: its first block also
   fetches its own rows into L1 this far ahead of its loads (8 rows of Qwen2.5-1.5B's linears 1.22x; at 16-32
   rows, two blocks and more of products to hide the loads behind, it gained nothing) */
#define L1_AHEAD_BYTES 512
/* Activations a tile of rows holds at most: 3/4 of Zen 4's 1 MB L2, so that 32 rows of K = 8960 (560 KB) are one
   tile and the weights are read once (a 512 KB tile split them in two: Qwen2.5-1.5B's down projection 0.88x ->
   0.97x oneDNN at 32 rows, Llama-3.2-1B's 0.78x -> 0.96x; 256 rows ran alike with 256-768 KB) */
#define X_TILE_BYTES (768 << 10)
#define MIN_TILE_ROWS (4 * MR_MAX)
#define MAX_TILE_ROWS 96 /* 256-row tiles ran within 1-2% (Qwen2.5-1.5B's linears at 128-256 rows) */
/* Calls of at most CHUNK_MAX_ROWS rows (memory's) take K in chunks whose block of activations and group of
   weight rows fit L1_BUDGET of Zen 4's 32 KB L1 together: 8 rows 1.03-1.10x one chunk (Qwen2.5-1.5B's and
   Gemma 3 1B's linears). Larger calls take K whole, the sums never leaving their registers: 9-64 rows
   1.05-1.15x the chunks (Llama-3.2-1B, Qwen2.5-1.5B, Qwen3-1.7B, Gemma 3 1B at 12-64 rows; 16 rows even),
   a prefill's 128-256 rows 1.09-1.11x. A block's weight rows then outgrow L1 and come from L2, which
   feeds them: the chunks' price, each block's sums stored and reloaded between chunks, was the larger. */
#define L1_BUDGET (24 << 10)
#define CHUNK_MAX_ROWS 8

#ifdef __AVX512BF16__

/* The sums of 4 accumulators' 16 lanes each, in one fixed order per accumulator: lanes i and i + 8,
   then those of i + 4 and i + 12 (i < 4), then the four so made as (0 + 2) + (1 + 3). Done for the four
   at once (a shuffle moves each accumulator's lanes beside another's): 13 instructions where a
   reduction each took 32, 15% of a block at K = 1536. */
static inline __m128 lane_sums(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                         12, 8, 4, 0), v));
}

/* The next group's weight rows are fetched into L2 a cache line at a time while this group's blocks
   compute: from memory, a group's 4 rows at 32 rows a call take about as long to read as to multiply,
   and the two did not overlap (the blocks waited on the first one's loads). A group is nr consecutive
   rows of one segment (nr divides each segment's rows), so its bytes are one span; each block of the
   group fetches its share of the next one's, `per` lines a step from `fetch` up to `fetch_end`. */

/* rows (1..6 with nr = 4, 1..3 with nr = 8) activation rows from x (row stride ldx) times the nr weight
   rows from w (row stride ldw) over kc values of K, fetching [fetch, fetch_end) meanwhile: the sums
   start from carry's (`resume`) or from zero, and end in carry, or (sums not NULL) reduced into
   sums[r * nr + i]. The rows are reached by one pointer and a stride each: a pointer a row left too few
   registers for the sums. With 8 weight rows the activation vectors are loaded first (3 + 1 + 24
   registers; the weights first would take 8 + 1 + 24, one more than there are). */
ALWAYS_INLINE void block(const uint16_t *w, int64_t ldw, const uint16_t *x, int64_t ldx, int nr, int rows, int64_t kc,
                         const char *fetch, const char *fetch_end, int64_t per, int first, __m512 *carry,
                         int resume, float *sums) {
    __m512 acc[MR_MAX][NR_MAX];
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < nr; i++) acc[r][i] = resume ? carry[r * nr + i] : _mm512_setzero_ps();
    for (int64_t kk = 0; kk < kc; kk += 32) {
        for (int64_t j = 0; j < per && fetch < fetch_end; j++, fetch += 64) _mm_prefetch(fetch, _MM_HINT_T1);
        if (first) /* the group's own rows into L1, ahead of this block's loads */
            for (int i = 0; i < nr; i++) _mm_prefetch((const char *)(w + i * ldw + kk) + L1_AHEAD_BYTES, _MM_HINT_T0);
        if (nr == 8) {
            __m512bh xv[MR_MAX];
            for (int r = 0; r < rows; r++) xv[r] = (__m512bh)_mm512_loadu_si512((const void *)(x + r * ldx + kk));
            for (int i = 0; i < nr; i++) {
                const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + i * ldw + kk));
                for (int r = 0; r < rows; r++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], xv[r], wv);
            }
        } else {
            __m512bh wv[NR_MAX];
            for (int i = 0; i < nr; i++) wv[i] = (__m512bh)_mm512_loadu_si512((const void *)(w + i * ldw + kk));
            for (int r = 0; r < rows; r++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + r * ldx + kk));
                for (int i = 0; i < nr; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], xv, wv[i]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        if (sums)
            for (int i = 0; i < nr; i += 4)
                _mm_storeu_ps(sums + r * nr + i, lane_sums(acc[r][i], acc[r][i + 1], acc[r][i + 2], acc[r][i + 3]));
        else
            for (int i = 0; i < nr; i++) carry[r * nr + i] = acc[r][i];
    }
}

/* block() with nr and `rows` constants in each copy, so the compiler keeps every sum in a register.
   Inlined into each caller: with two (rows_linear's and rows_groups') GCC called it out of line, and
   Qwen3-1.7B's linears at 32 rows ran 1.1x slower on a Zen 4. */
ALWAYS_INLINE void block_rows(const uint16_t *w, int64_t ldw, const uint16_t *x, int64_t ldx, int nr, int rows,
                              int64_t kc, const char *fetch, const char *fetch_end, int64_t per, int first,
                              __m512 *carry, int resume, float *sums) {
#define BLOCK(NR_, ROWS_) block(w, ldw, x, ldx, NR_, ROWS_, kc, fetch, fetch_end, per, first, carry, resume, sums)
    if (nr == 8) {
        switch (rows) {
        case 1: BLOCK(8, 1); break;
        case 2: BLOCK(8, 2); break;
        default: BLOCK(8, 3); break;
        }
        return;
    }
    switch (rows) {
    case 1: BLOCK(4, 1); break;
    case 2: BLOCK(4, 2); break;
    case 3: BLOCK(4, 3); break;
    case 4: BLOCK(4, 4); break;
    case 5: BLOCK(4, 5); break;
    default: BLOCK(4, 6); break;
    }
#undef BLOCK
}

/* The weight row `row` of the segments (seg_ptr[s]: seg_rows[s] rows of k bf16 each, one after the other). */
static const uint16_t *weight_row(const int64_t *seg_ptr, const int64_t *seg_rows, int64_t nseg, int64_t row,
                                  int64_t k) {
    for (int64_t s = 0; s < nseg; s++) {
        if (row < seg_rows[s]) return (const uint16_t *)seg_ptr[s] + row * k;
        row -= seg_rows[s];
    }
    return NULL;
}

/* Rows x[0..m) times the groups [g0, g1) of nr weight rows into out (row stride n), in blocks of mr
   rows, one group at a time: its rows in L1 while every block of the rows reads them, the next group's
   fetched meanwhile. */
static void groups_times_rows(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const int64_t *seg_ptr,
                              const int64_t *seg_rows, int64_t nseg, int nr, int mr, int64_t g0, int64_t g1,
                              const uint16_t *bias, int64_t n, uint16_t *out_bf16, float *out_f32) {
    const int64_t blocks = (m + mr - 1) / mr;
    const int64_t kc_max = m <= CHUNK_MAX_ROWS ? L1_BUDGET / ((mr + nr) * 2) / 32 * 32 : k; /* above */
    const int64_t chunks = (k + kc_max - 1) / kc_max, kc = (k / 32 + chunks - 1) / chunks * 32;
    const int64_t span = nr * k * 2, slices = blocks * chunks;
    const int64_t slice_bytes = (span / 64 + slices - 1) / slices * 64; /* a block's share of the next group */
    const int64_t per = (slice_bytes / 64 + kc / 32 - 1) / (kc / 32);
    __m512 carry[(CHUNK_MAX_ROWS + MR_MAX) * NR_MAX]; /* each block's sums between chunks (blocks x mr <= m + mr) */
    for (int64_t g = g0; g < g1; g++) {
        const uint16_t *w = weight_row(seg_ptr, seg_rows, nseg, g * nr, k);
        const char *next = g + 1 < g1 ? (const char *)weight_row(seg_ptr, seg_rows, nseg, (g + 1) * nr, k) : NULL;
        float b[NR_MAX] = {0};
        if (bias)
            for (int i = 0; i < nr; i++) b[i] = bf16_to_f32(bias[g * nr + i]);
        for (int64_t c = 0, k0 = 0; k0 < k; c++, k0 += kc) {
            const int64_t kn = k - k0 < kc ? k - k0 : kc, last = k0 + kn == k;
            /* blocks of even rows: 32 = 6 + 6 + 5 x 4, not 6 x 5 + 2 (mr = 6) */
            for (int64_t blk = 0, m0 = 0; blk < blocks; blk++) {
                const int rows = (int)((m - m0 + blocks - blk - 1) / (blocks - blk));
                float sums[MR_MAX * NR_MAX];
                const char *fetch = next ? next + (c * blocks + blk) * slice_bytes : NULL;
                const char *fetch_end = next == NULL ? NULL : fetch + slice_bytes < next + span ? fetch + slice_bytes
                                                                                                 : next + span;
                block_rows(w + k0, k, x + m0 * ldx + k0, ldx, nr, rows, kn, fetch, fetch_end, per,
                           blk == 0 && blocks <= 2, carry + blk * mr * nr, k0 > 0, last ? sums : NULL);
                for (int r = 0; last && r < rows; r++)
                    for (int i = 0; i < nr; i++) {
                        const float v = sums[r * nr + i] + b[i];
                        if (out_f32) out_f32[(m0 + r) * n + g * nr + i] = v;
                        else out_bf16[(m0 + r) * n + g * nr + i] = f32_to_bf16(v);
                    }
                m0 += rows;
            }
        }
    }
}

/* x's rows copied where no step of K puts them in the L1 set of the weights' rows: rows of K = 2048 lie 4096
   bytes apart, so at each step of K a block's 6 activation rows and its group's 4 weight rows (and the next
   group's, being fetched) fall in one set of L1 (8 ways) wherever x starts at the weights' offset in a page,
   as every large tensor does under tcmalloc (vLLM's CPU set-up preloads it): Llama-3.2-1B's linears at 32
   rows ran 0.75x oneDNN's op there against 0.90x under glibc's malloc. The copy's rows lie a cache line
   further apart than K (each in a set of its own) and start 8 sets past the weights'. Kept per thread up to
   STAGGER_KEEP_BYTES (a decode step's calls reuse it; a prefill's larger copy is freed after its call);
   where it cannot be had x is read as is. */
#define STAGGER_KEEP_BYTES (4 << 20)
#define STAGGER_GAP 64 /* bytes: a cache line */
static _Thread_local rows_apart_buf stagger;

/* One thread's share of a call: its groups of nr weight rows (an even split of the n / nr) over m rows of
   x, tile by tile (tiles whose activations fit X_TILE_BYTES of L2). nr 8 where the rows and every
   segment's allow it, else 4. */
static void thread_share(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const int64_t *seg_ptr,
                         const int64_t *seg_rows, int64_t nseg, int64_t n, const uint16_t *bias, uint16_t *out_bf16,
                         float *out_f32, int t, int threads) {
    int nr = m >= WIDE_MIN_ROWS ? 8 : 4;
    for (int64_t s = 0; s < nseg; s++)
        if (seg_rows[s] % 8) nr = 4;
    const int mr = nr == 8 ? 3 : 6;
    int64_t tile = X_TILE_BYTES / (k * 2); /* not rounded to blocks: 32 rows of K = 8192 would be 30 + 2 */
    tile = tile < MIN_TILE_ROWS ? MIN_TILE_ROWS : tile > MAX_TILE_ROWS ? MAX_TILE_ROWS : tile;
    const int64_t tiles = (m + tile - 1) / tile;
    tile = (m + tiles - 1) / tiles; /* even tiles */
    const int64_t groups = n / nr, g0 = groups * t / threads, g1 = groups * (t + 1) / threads;
    for (int64_t r0 = 0; r0 < m; r0 += tile)
        groups_times_rows(x + r0 * ldx, ldx, m - r0 < tile ? m - r0 : tile, k, seg_ptr, seg_rows, nseg, nr, mr, g0, g1,
                          bias, n, out_bf16 ? out_bf16 + r0 * n : NULL, out_f32 ? out_f32 + r0 * n : NULL);
}

/* x's m rows copied apart where they lie a multiple of 4096 bytes apart (above), into `stagger`: the
   copy's row stride in *ldx; x itself where there is no need or no buffer. */
static const uint16_t *rows_for_l1(const uint16_t *x, int64_t m, int64_t k, const void *weights, int64_t *ldx) {
    *ldx = k;
    if (m <= 1 || (k * 2) % 4096) return x;
    const size_t offset = ((uintptr_t)weights + 8 * 64) & 4095; /* 8 sets past the weights' */
    const uint16_t *copy = rows_apart(&stagger, x, m, (size_t)k * 2, STAGGER_GAP, offset);
    if (copy == NULL) return x;
    *ldx = k + STAGGER_GAP / 2;
    return copy;
}

/* out_bf16 or out_f32 [m, n] = x [m, k] . w^T (+ bias [n] bf16, or NULL); w the rows of nseg (1-3)
   segments. Takes k % 32 == 0 and every segment's rows % 4 == 0 (else -2). Threads take whole groups
   of nr weight rows, each over every tile of the rows: every block reads its activations from L2,
   where 256 rows of K = 8960 (4.5 MB) came from L3 once per group; the weights are read once a tile. */
static int rows_linear(const uint16_t *x, int64_t m, int64_t k, const int64_t *seg_ptr, const int64_t *seg_rows,
                       int64_t nseg, const uint16_t *bias, uint16_t *out_bf16, float *out_f32) {
    int64_t n = 0;
    for (int64_t s = 0; s < nseg; s++) {
        if (seg_rows[s] % 4) return -2;
        n += seg_rows[s];
    }
    if (k % 32 || nseg < 1 || nseg > 3) return -2;
    if (m == 0 || n == 0) return 0;
    int64_t ldx;
    x = rows_for_l1(x, m, k, (const void *)seg_ptr[0], &ldx);
#pragma omp parallel if (m * n * k > 65536)
    thread_share(x, ldx, m, k, seg_ptr, seg_rows, nseg, n, bias, out_bf16, out_f32, omp_get_thread_num(),
                 omp_get_num_threads());
    rows_apart_release(&stagger, STAGGER_KEEP_BYTES);
    return 0;
}

/* A sparse MLP's experts (moe_experts.c's kernel table; amx_linear_bf16_groups' terms): for each group g
   of rows [starts[g], starts[g + 1]) of x [starts[G], k], those rows times expert experts[g]'s weight
   (w [E, n, k], each [n, k] row-major) into the same rows of out [starts[G], n]. In one team with no
   barrier between experts: each thread takes its share of every expert's weight rows (an expert's
   rows, a decode step's few, bound by its weights' reads, split evenly). Each output's sum is the one
   rows_linear gives that row on that expert's weight alone. Takes k % 32 == 0 and n % 4 == 0 (else -2). */
static int rows_groups(const uint16_t *x, int64_t k, const int64_t *starts, const int64_t *experts, int64_t G,
                       const uint16_t *w, int64_t n, uint16_t *out_bf16) {
    if (k % 32 || n % 4) return -2;
    if (G == 0 || n == 0 || starts[G] == 0) return 0;
    int64_t ldx;
    x = rows_for_l1(x, starts[G], k, w, &ldx);
#pragma omp parallel if (starts[G] * n * k > 65536)
    {
        const int t = omp_get_thread_num(), threads = omp_get_num_threads();
        for (int64_t g = 0; g < G; g++) {
            const int64_t m = starts[g + 1] - starts[g], seg_ptr = (int64_t)(uintptr_t)(w + experts[g] * n * k);
            if (m > 0)
                thread_share(x + starts[g] * ldx, ldx, m, k, &seg_ptr, &n, 1, n, NULL, out_bf16 + starts[g] * n, NULL,
                             t, threads);
        }
    }
    rows_apart_release(&stagger, STAGGER_KEEP_BYTES);
    return 0;
}

#else /* no AVX512-BF16: bf16_rows.py does not call these here; they build so the file compiles anywhere */

static int rows_linear(const uint16_t *x, int64_t m, int64_t k, const int64_t *seg_ptr, const int64_t *seg_rows,
                       int64_t nseg, const uint16_t *bias, uint16_t *out_bf16, float *out_f32) {
    (void)x, (void)m, (void)k, (void)seg_ptr, (void)seg_rows, (void)nseg, (void)bias, (void)out_bf16, (void)out_f32;
    return -3;
}

static int rows_groups(const uint16_t *x, int64_t k, const int64_t *starts, const int64_t *experts, int64_t G,
                       const uint16_t *w, int64_t n, uint16_t *out_bf16) {
    (void)x, (void)k, (void)starts, (void)experts, (void)G, (void)w, (void)n, (void)out_bf16;
    return -3;
}

#endif

int bf16_rows_linear(const uint16_t *x, int64_t m, int64_t k, const int64_t *seg_ptr, const int64_t *seg_rows,
                     int64_t nseg, const uint16_t *bias, uint16_t *out_bf16) {
    return rows_linear(x, m, k, seg_ptr, seg_rows, nseg, bias, out_bf16, NULL);
}

int bf16_rows_linear_f32(const uint16_t *x, int64_t m, int64_t k, const int64_t *seg_ptr, const int64_t *seg_rows,
                         int64_t nseg, const uint16_t *bias, float *out_f32) {
    return rows_linear(x, m, k, seg_ptr, seg_rows, nseg, bias, NULL, out_f32);
}

int bf16_rows_groups(const uint16_t *x, int64_t k, const int64_t *starts, const int64_t *experts, int64_t G,
                     const uint16_t *w, int64_t n, uint16_t *out_bf16) {
    return rows_groups(x, k, starts, experts, G, w, n, out_bf16);
}
