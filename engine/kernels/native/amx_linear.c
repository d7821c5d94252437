/* Linears on Intel AMX tiles for the row counts of a decode step (1-256 rows): int8 x int8 -> int32
   (TDPBSSD) and weight-only int8 (widened to bf16, then TDPBF16PS) for the int8 engine,
   bf16 x bf16 -> fp32 (TDPBF16PS) for the bf16 one. At these sizes a
   linear is a stream of its weight through the cores: the tiles do a 32 x 32 block of outputs per
   1 KB weight tile pair, so the kernel's job is to read each weight byte once, in order, and keep
   the per-call work (no primitive lookup, no reorder) small.

   Weights are packed once (amx_linears.py: the pure layouts) into [N/32][K/TK][2][16][64 bytes]: for
   each pair of 16-column tiles and each K chunk, the two B tiles side by side, so one linear's
   weight is one sequential stream. Activations are [M, K] row-major; rows past M and columns past
   K are read from a zero-padded copy when the shape asks for one.

   Only built with -mamx-* and only called where the CPU has AMX (amx_linears.py probes
   /proc/cpuinfo) and the kernel asked the OS for the tile state (amx_init: Linux's
   ARCH_REQ_XCOMP_PERM, once per process). */

#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common.h"
#include "w8_chunk.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* 0 where this process may use the tiles (asked once; the OS keeps the grant). */
int amx_init(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) { /* every tile 16 rows x 64 bytes: C 0-3, A 4-5, B 6-7 */
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* A copy of `a` ([rows, cols] of `elem`-byte values) padded with zeros to [prows, pcols]. */
static void *padded(const void *a, int64_t rows, int64_t cols, int64_t prows, int64_t pcols, int elem) {
    uint8_t *p = aligned_alloc(64, (size_t)(((prows * pcols * elem) + 63) / 64 * 64));
    if (p == NULL) return NULL;
    memset(p, 0, (size_t)(prows * pcols * elem));
    for (int64_t r = 0; r < rows; r++) memcpy(p + r * pcols * elem, (const uint8_t *)a + r * cols * elem, (size_t)(cols * elem));
    return p;
}

/* How far ahead of the tiles the weight stream is fetched: tile loads that miss the caches stall
   the tile unit, and the hardware prefetcher follows them poorly. */
#define PREFETCH_CHUNKS 8
/* int8 chunks are half the bytes and take longer (the widening): 4 ahead streamed 5-8% faster than 8
   (1.1 GB of 8192 x 2048 weights at 32 rows, 2 threads; 3 and 6 slower) */
#define W8_PREFETCH_CHUNKS 4
/* The rows kernel's: 32 rows' next 64 bytes each, one chunk ahead. Its weight is 32 streams a panel
   (a row each, at the row stride), and on 2 MB pages the hardware's own prefetchers keep them coming
   from a line on; asking 8 chunks ahead held 32 x 8 lines in flight for the few fill buffers a core
   has (Llama-3.2-1B's linears at 32 rows, 2 cores: 27.0 GB/s at 8 ahead, 28.7-29.4 at 1, 26-27 with
   none; 1.02x at 8 rows; Qwen2.5-1.5B's, K = 1536, 27-28 GB/s at any of 1, 2, 4, 8; bench/RESULTS.md) */
#define ROWS_PREFETCH_CHUNKS 1
/* The most bytes of activations (as B tiles) a rows-kernel pass over the panels reads: each panel
   reads them all again, so they must stay in a core's L2 (2 MB). A longer K is cut into blocks
   that do, the sums carried between blocks in fp32 (a down projection at 256 rows, K = 8960:
   4.6 MB of activations read from L3 per panel ran at 0.6 of the other linears' FLOP/s; in 1 MB
   blocks 1.45x faster; 512 KB and 1.5 MB blocks slower). */
#define X_BLOCK_BYTES (1 << 20)
#define ROW_BLOCK 256 /* a multiple of 32 */
/* A rows-kernel panel of 33-128 rows goes over K in steps of SUB_CHUNKS chunks (rows_panel), its sums
   between steps in a thread's CARRY_BYTES (4 C tiles per 32 rows) */
#define SUB_CHUNKS 8
#define SUB_MAX_ROW_TILES 4
#define CARRY_BYTES (SUB_MAX_ROW_TILES * 4096)

static inline void prefetch_weights(const uint8_t *p, int64_t bytes) { /* one K chunk's tile pair */
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}

/* The 32 x 32 block of outputs at (m0, n0) from the four C tiles stored in c[2][2][16][16]
   (row tile, column tile): `finish` turns a tile row of 16 into the output's values. */
#define STORE_TILES(C_TYPE)                                          \
    C_TYPE c[2][2][16][16] __attribute__((aligned(64)));             \
    _tile_stored(0, c[0][0], 64);                                    \
    _tile_stored(1, c[0][1], 64);                                    \
    _tile_stored(2, c[1][0], 64);                                    \
    _tile_stored(3, c[1][1], 64);

/* How many chunks ahead of the tiles the weights are widened: a tile load of bytes the vector
   stores have just written waits for them to reach L1 (no store forwarding into tiles), which
   took a quarter of the kernel's time when each chunk was widened right before its loads. */
#define WIDEN_AHEAD 2
#define SLOT(kc) (ring ? (kc) % ring : (kc)) /* a widened chunk's place in the thread's buffer */

/* One linear, out [M, N] = a [M, K] . w^T, over the packed weight: `ELEM` bytes per value, `TK`
   values of K per tile row chunk, `DP` the tile product; `EPILOGUE(m, n, row16)` writes 16
   outputs of row m from column n. `WIDE`: the weight is int8 with scales (widen_chunk's
   W8_CHUNK_BYTES a chunk), widened to bf16 by the first row block's pass into a per-thread buffer that the
   later row blocks read again from the caches (K/32 x 2 KB: 96 KB for K = 1536). */
#define AMX_LOOP(A_TYPE, TK, DP, C_TYPE, EPILOGUE, WIDE)                                                \
    const int64_t mp_count = (m + 31) / 32, np_count = (n + 31) / 32, kc_count = (k + TK - 1) / TK; \
    const int64_t pm = mp_count * 32, pk = kc_count * TK;                                           \
    const int64_t chunk = WIDE ? W8_CHUNK_BYTES : 2048; /* packed weight per K chunk's tile pair */ \
    const A_TYPE *a = x;                                                                            \
    void *copy = NULL;                                                                              \
    uint8_t *wide = NULL;                                                                           \
    if (pm != m || pk != k) {                                                                       \
        copy = padded(x, m, k, pm, pk, sizeof(A_TYPE));                                             \
        if (copy == NULL) return -1;                                                                \
        a = copy;                                                                                   \
    }                                                                                               \
    if (WIDE && (wide = thread_buffer(omp_get_max_threads() * kc_count * 2048)) == NULL) {            \
        free(copy);                                                                                 \
        return -1;                                                                                  \
    }                                                                                               \
    const int64_t stride = pk * (int64_t)sizeof(A_TYPE);                                            \
    _Pragma("omp parallel") {                                                                       \
        configure_tiles();                                                                          \
        uint8_t *mine = WIDE ? wide + omp_get_thread_num() * kc_count * 2048 : NULL;                \
        /* one row block: the widened chunks are read once, so a ring of a few stays in L1 */          \
        const int64_t ring = mp_count == 1 ? WIDEN_AHEAD + 2 : 0;                                   \
        _Pragma("omp for schedule(static)")                                                         \
        for (int64_t np = 0; np < np_count; np++) {                                                 \
            const uint8_t *wb = (const uint8_t *)w + np * kc_count * chunk;                         \
            for (int64_t mp = 0; mp < mp_count; mp++) {                                             \
                const uint8_t *ab = (const uint8_t *)(a + mp * 32 * pk);                            \
                _tile_zero(0);                                                                      \
                _tile_zero(1);                                                                      \
                _tile_zero(2);                                                                      \
                _tile_zero(3);                                                                      \
                const int row_tiles = m - mp * 32 > 16 ? 2 : 1; /* <= 16 rows left: half the work */ \
                if (WIDE && mp == 0)                                                                \
                    for (int64_t kw = 0; kw < WIDEN_AHEAD && kw < kc_count; kw++)                   \
                        widen_chunk(wb + kw * chunk, (uint16_t *)(mine + SLOT(kw) * 2048));         \
                for (int64_t kc = 0; kc < kc_count; kc++) {                                         \
                    const uint8_t *wt = WIDE ? mine + SLOT(kc) * 2048 : wb + kc * 2048;             \
                    if (mp == 0) {                                                                  \
                        prefetch_weights(wb + (kc + (WIDE ? W8_PREFETCH_CHUNKS : PREFETCH_CHUNKS)) * chunk, chunk); \
                        if (WIDE && kc + WIDEN_AHEAD < kc_count)                                    \
                            widen_chunk(wb + (kc + WIDEN_AHEAD) * chunk,                            \
                                        (uint16_t *)(mine + SLOT(kc + WIDEN_AHEAD) * 2048));        \
                    }                                                                               \
                    _tile_loadd(4, ab + kc * 64, stride);                                           \
                    _tile_loadd(6, wt, 64);                                                         \
                    _tile_loadd(7, wt + 1024, 64);                                                  \
                    DP(0, 4, 6);                                                                    \
                    DP(1, 4, 7);                                                                    \
                    if (row_tiles == 2) {                                                           \
                        _tile_loadd(5, ab + 16 * stride + kc * 64, stride);                         \
                        DP(2, 5, 6);                                                                \
                        DP(3, 5, 7);                                                                \
                    }                                                                               \
                }                                                                                   \
                STORE_TILES(C_TYPE)                                                                 \
                for (int rt = 0; rt < row_tiles; rt++)                                              \
                    for (int r = 0; r < 16; r++) {                                                  \
                        const int64_t row = mp * 32 + rt * 16 + r;                                  \
                        if (row >= m) break;                                                        \
                        for (int ct = 0; ct < 2; ct++) {                                            \
                            const int64_t col = np * 32 + ct * 16;                                  \
                            if (col >= n) break;                                                    \
                            EPILOGUE(row, col, c[rt][ct][r]);                                       \
                        }                                                                           \
                    }                                                                               \
            }                                                                                       \
        }                                                                                           \
        _tile_release();                                                                            \
    }                                                                                               \
    free(copy);                                                                                     \
    return 0;

/* Writes the `cols` (<= 16) first of 16 values v to p, rounded to bf16 or as fp32. */
static inline void put_f32(float *p, v16f v, int64_t cols) {
    if (cols >= 16) store16_f32(p, v);
    else for (int64_t i = 0; i < cols; i++) p[i] = v[i];
}

static inline void put_bf16(uint16_t *p, v16f v, int64_t cols) {
    if (cols >= 16) store16_bf16(p, v);
    else for (int64_t i = 0; i < cols; i++) p[i] = f32_to_bf16(v[i]);
}

static inline v16f load_cols(const float *p, int64_t cols) { /* 16 floats, zero past `cols` */
    if (cols >= 16) return load16_f32(p);
    v16f v = {0};
    for (int64_t i = 0; i < cols; i++) v[i] = p[i];
    return v;
}

static inline v16f int_row(const int32_t *c) {
    v16i v;
    memcpy(&v, c, sizeof v);
    return __builtin_convertvector(v, v16f);
}

/* int8: out[r, j] = (c[r, j] * wscale[j], rounded to the output's dtype) * xscale[r], rounded again:
   the bits of the oneDNN path it replaces (its output scaled per channel, then engine/kernels/native's
   scale_rows per token). */
#define EPI_S8_F32(row, col, crow)                                                                   \
    do {                                                                                             \
        const int64_t left = n - (col);                                                              \
        const v16f v = (int_row(crow) * load_cols(wscale + (col), left)) * xscale[row];              \
        put_f32(out_f32 + (row) * n + (col), v, left);                                               \
    } while (0)

#define EPI_S8_BF16(row, col, crow)                                                                  \
    do {                                                                                             \
        const int64_t left = n - (col);                                                              \
        const v16f v = round16_bf16(int_row(crow) * load_cols(wscale + (col), left)) * xscale[row];  \
        put_bf16(out_bf16 + (row) * n + (col), v, left);                                             \
    } while (0)

static inline v16f load_bias(const uint16_t *bias, int64_t col, int64_t cols) { /* zero without a bias */
    v16f v = {0};
    if (bias == NULL) return v;
    if (cols >= 16) return load16_bf16(bias + col);
    for (int64_t i = 0; i < cols; i++) v[i] = bf16_to_f32(bias[col + i]);
    return v;
}

#define EPI_BF16(row, col, crow) \
    put_bf16(out_bf16 + (row) * n + (col), load16_f32(crow) + load_bias(bias, col, n - (col)), n - (col))

#define DP_S8(c, a, b) _tile_dpbssd(c, a, b)
#define DP_BF16(c, a, b) _tile_dpbf16ps(c, a, b)

/* q [m, k] int8 (per-row scales xscale [m]), w packed int8 with per-column scales wscale [n]. */
int amx_linear_s8_f32(const int8_t *x, int64_t m, int64_t k, const int8_t *w, int64_t n, const float *wscale,
                      const float *xscale, float *out_f32) {
    AMX_LOOP(int8_t, 64, DP_S8, int32_t, EPI_S8_F32, 0)
}

int amx_linear_s8_bf16(const int8_t *x, int64_t m, int64_t k, const int8_t *w, int64_t n, const float *wscale,
                       const float *xscale, uint16_t *out_bf16) {
    AMX_LOOP(int8_t, 64, DP_S8, int32_t, EPI_S8_BF16, 0)
}

/* x [m, k] bf16, w packed bf16, bias [n] bf16 or NULL: out [m, n] bf16, each output the fp32 sum
   (with its bias) rounded once, as a bf16 GEMM with a bias does. */
int amx_linear_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n, const uint16_t *bias,
                    uint16_t *out_bf16) {
    AMX_LOOP(uint16_t, 32, DP_BF16, float, EPI_BF16, 0)
}

/* Weight-only int8: x [m, k] bf16, w int8 with a bf16 scale per W8_GROUP values of K of each column,
   packed with them (widen_chunk). Each output is the fp32 sum of bf16 x bf16 products, the weight
   being q * scale rounded once to bf16: out fp32, or rounded once more to bf16. */
#define EPI_W8_F32(row, col, crow) put_f32(out_f32 + (row) * n + (col), load16_f32(crow), n - (col))
#define EPI_W8_BF16(row, col, crow) put_bf16(out_bf16 + (row) * n + (col), load16_f32(crow), n - (col))

int amx_linear_w8_f32(const uint16_t *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *out_f32) {
    AMX_LOOP(uint16_t, 32, DP_BF16, float, EPI_W8_F32, 1)
}

int amx_linear_w8_bf16(const uint16_t *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, uint16_t *out_bf16) {
    AMX_LOOP(uint16_t, 32, DP_BF16, float, EPI_W8_BF16, 1)
}

/* ---- bf16 on the weight as the engine holds it: no packed copy ---------------------------------

   The same tile products on the parameter itself ([n, k] row-major, possibly in up to three row
   segments: a layer's q/k/v or gate/up, each its own tensor), so a bf16 engine keeps no second copy
   of its linears and a push derives nothing for them. The weight rows are the tiles' A operand (16
   rows x 32 values of K: each row's 64 bytes at its row stride) and the activations the B operand,
   laid out per call in pairs of K (VNNI: each 16 x 16 block of 4-byte pairs transposed), which is
   m * k values against the weight's n * k. A C tile is then 16 columns of the output by 16 rows of
   x, transposed at the store. TDPBF16PS sums a pair's two products and adds them to the fp32
   accumulator in the same order whichever operand is which, so each output has the packed kernel's
   bits (tested). Needs k % 32 == 0 and each segment's rows % 16 == 0 (amx_linears.rows_fit). */

/* The 64 bytes of K chunk `kc` of the 32 rows of tiles t0 and t0 + 1, or, past the K block's end
   k1, of the next two tiles' from k0 (the panel this thread does next under a static schedule): the
   weights come from memory once, and the tile loads stall on a miss. */
static inline void prefetch_rows(const uint8_t **tiles, int64_t nt_count, int64_t t0, int64_t kc, int64_t k0,
                                 int64_t k1, int64_t stride) {
    if (kc >= k1) {
        t0 += 2;
        kc = k0 + kc - k1;
    }
    for (int64_t t = t0; t < t0 + 2 && t < nt_count; t++)
        for (int r = 0; r < 16; r++) _mm_prefetch((const char *)tiles[t] + r * stride + kc * 64, _MM_HINT_T0);
}

/* x [m, k] as B tiles: [m/32][k/32][2 row tiles][16 pairs][16 rows][2], rows past m zero. */
static void activations_as_b_tiles(const uint16_t *x, int64_t m, int64_t k, uint32_t *xv) {
    const int64_t mt_count = (m + 15) / 16, kc_count = k / 32, pairs = k / 2;
#pragma omp for schedule(static)
    for (int64_t mt = 0; mt < mt_count; mt++) {
        uint32_t block[16 * 16] __attribute__((aligned(64)));
        const uint32_t *src = (const uint32_t *)x + mt * 16 * pairs;
        const int64_t rows = m - mt * 16 < 16 ? m - mt * 16 : 16;
        for (int64_t kc = 0; kc < kc_count; kc++) {
            uint32_t *dst = xv + ((mt / 2) * kc_count + kc) * 512 + (mt % 2) * 256;
            const uint32_t *from[16];
            if (rows == 16) {
                for (int r = 0; r < 16; r++) from[r] = src + r * pairs + kc * 16;
            } else {
                memset(block, 0, sizeof block);
                for (int64_t r = 0; r < rows; r++) memcpy(block + r * 16, src + r * pairs + kc * 16, 64);
                for (int r = 0; r < 16; r++) from[r] = block + r * 16;
            }
            transpose16_u32(from, dst, 16);
        }
    }
}

/* The four C tiles' sums from / to `a` (fp32 [4][16][16]: stored and loaded exactly). */
static inline void load_sums(const float *a) {
    _tile_loadd(0, a, 64);
    _tile_loadd(1, a + 256, 64);
    _tile_loadd(2, a + 512, 64);
    _tile_loadd(3, a + 768, 64);
}

static inline void store_sums(float *a) {
    _tile_stored(0, a, 64);
    _tile_stored(1, a + 256, 64);
    _tile_stored(2, a + 512, 64);
    _tile_stored(3, a + 768, 64);
}

/* A group's finished sums (rows_linear's `fuse` R phase panels, each up to four C tiles), written out
   while the next group's weights stream in: written at once, the transposes and stores left the tile
   unit and the memory idle for 3-5% of a linear's time (Llama-3.2-1B's and Qwen2.5-1.5B's at 32 rows,
   2 cores). sums[p][2 nt + mt] is phase p's tile for its 16 columns nt and 16 rows of x mt, as stored:
   [16 columns][16 rows], column i of it the group's 16R nt + R i + p. A piece is 16 rows of x by 16
   of the group's 32R columns: one transpose of the 16 tile rows that hold them, in column order. */
typedef struct {
    float sums[4][4][256] __attribute__((aligned(64)));
    int left; /* bit 2 b + mt: the piece of column block b and rows mt still to write */
    int64_t fuse, col0, row0, rows;
    uint16_t *out_bf16;
    float *out_f32;
} pending_sums;

/* Piece `piece` of `p`, each output its sum plus its bias, rounded once to bf16 (or, into out_f32, as
   it is). */
static void write_pending(pending_sums *p, int piece, const uint16_t *bias, int64_t n) {
    const int mt = piece % 2, block = piece / 2;
    const int64_t fuse = p->fuse, col = p->col0 + block * 16;
    const uint32_t *from[16];
    const int shift = fuse == 4 ? 2 : fuse == 2 ? 1 : 0; /* fuse a power of two: no divisions (a 64-bit
                                                           division a column cost 10-15% at 64-256 rows) */
    for (int j = 0; j < 16; j++) { /* the group's column block * 16 + j: tile nt's row i of phase ph */
        const int c = block * 16 + j, nt = c >> (4 + shift), ph = c & ((1 << shift) - 1);
        const int i = (c & ((16 << shift) - 1)) >> shift;
        from[j] = (const uint32_t *)p->sums[ph][2 * nt + mt] + 16 * i;
    }
    float ct[16 * 16] __attribute__((aligned(64)));
    transpose16_u32(from, (uint32_t *)ct, 16); /* [16 rows of x][16 columns] */
    const v16f b = load_bias(bias, col, 16);
    for (int64_t r = 0; r < 16 && mt * 16 + r < p->rows; r++) {
        const int64_t at = (p->row0 + mt * 16 + r) * n + col;
        const v16f v = load16_f32(ct + 16 * r) + b;
        if (p->out_f32) /* the fp32 sums as they are (an fp32 LM head) */
            put_f32(p->out_f32 + at, v, 16);
        else
            put_bf16(p->out_bf16 + at, v, 16);
    }
    p->left &= ~(1 << piece);
}

static void finish_pending(pending_sums *p, const uint16_t *bias, int64_t n) {
    while (p->left) write_pending(p, __builtin_ctz(p->left), bias, n);
}

/* Panel `np` (32 output columns: tiles 2np and 2np + 1 of `tiles`) of out [m, n] = x . w^T, for
   every 32 rows of x laid out as B tiles in `xv` (activations_as_b_tiles), in this thread's tiles,
   over K chunks [k0, k1): a block after the first starts from the sums the one before left in
   `acc` (fp32, 4 tiles per 32 rows per panel: stored and loaded exactly, so the bits are those of
   one pass), and all but the last leave theirs there. With 33-128 rows the block goes in steps of
   SUB_CHUNKS chunks, every 32 rows through a step before the next, their sums carried between steps
   in `carry` (CARRY_BYTES): the step's weights (16 KB) come from L1 for all but the first 32 rows,
   where a whole pass per 32 rows read the panel's 32 x K weights from L2 again each time
   (Llama-3.2-1B's linears, 2 cores: 1.06-1.13x at 64 rows, 1.0-1.07x at 96, 1.0-1.02x at 128; at 256,
   where the carried sums and the step's weights no longer fit L1 together, 0.96x: past 128 rows a
   block goes whole). */
static inline void rows_panel(const uint8_t **tiles, int64_t nt_count, int64_t np, const uint32_t *xv, int64_t m,
                              int64_t kc_count, int64_t k0, int64_t k1, float *acc, float *carry, int64_t stride,
                              int64_t fuse, pending_sums *pend, const uint16_t *bias, uint16_t *out_bf16,
                              float *out_f32, int64_t n) {
    const int64_t mp_count = (m + 31) / 32;
    const int64_t step = mp_count > 1 && mp_count <= SUB_MAX_ROW_TILES ? SUB_CHUNKS : k1 - k0;
    const uint8_t *w0 = tiles[2 * np], *w1 = 2 * np + 1 < nt_count ? tiles[2 * np + 1] : NULL;
    for (int64_t s0 = k0; s0 < k1; s0 += step) {
        const int64_t s1 = s0 + step < k1 ? s0 + step : k1;
        for (int64_t mp = 0; mp < mp_count; mp++) {
            const uint8_t *xb = (const uint8_t *)xv + mp * kc_count * 2048;
            const int two_m = m - mp * 32 > 16; /* <= 16 rows left: half the work */
            float *a = acc == NULL ? NULL : acc + (np * (ROW_BLOCK / 32) + mp) * 1024; /* the panel's, any block */
            float *c_step = carry + mp * 1024;
            if (s0 == 0) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            } else {
                load_sums(s0 == k0 ? a : c_step);
            }
            for (int64_t kc = s0; kc < s1; kc++) {
                if (mp == 0) /* the chunk ROWS_PREFETCH_CHUNKS ahead: of these rows, or of the next panel's */
                    prefetch_rows(tiles, nt_count, 2 * np, kc + ROWS_PREFETCH_CHUNKS, k0, k1, stride);
                _tile_loadd(6, xb + kc * 2048, 64);
                _tile_loadd(4, w0 + kc * 64, stride);
                _tile_dpbf16ps(0, 4, 6);
                if (two_m) {
                    _tile_loadd(7, xb + kc * 2048 + 1024, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (w1) {
                    _tile_loadd(5, w1 + kc * 64, stride);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two_m) _tile_dpbf16ps(3, 5, 7);
                }
                if (pend->left && (kc & 1)) /* a piece of the group before every other chunk */
                    write_pending(pend, __builtin_ctz(pend->left), bias, n);
            }
            if (s1 < k1) {
                store_sums(c_step);
                continue;
            }
            if (k1 < kc_count) {
                store_sums(a);
                continue;
            }
            const int64_t phase = np % fuse;
            if (phase == 0) finish_pending(pend, bias, n); /* the group before's, where this K was too short */
            _tile_stored(0, pend->sums[phase][0], 64); /* tile ids are immediates */
            if (two_m) _tile_stored(1, pend->sums[phase][1], 64);
            if (w1) _tile_stored(2, pend->sums[phase][2], 64);
            if (w1 && two_m) _tile_stored(3, pend->sums[phase][3], 64);
            if (phase < fuse - 1) continue;
            pend->fuse = fuse;
            pend->col0 = np / fuse * 32 * fuse;
            pend->row0 = mp * 32;
            pend->rows = m - mp * 32;
            pend->out_bf16 = out_bf16;
            pend->out_f32 = out_f32;
            for (int block = 0; block < (w1 ? 2 * fuse : 1); block++)
                pend->left |= (two_m ? 3 : 1) << (2 * block);
            if (mp_count > 1) /* its writes in the next rows' K loop: 0.92x at 64 rows (the step's L1) */
                finish_pending(pend, bias, n);
        }
    }
}

/* How many weight rows the rows kernel reads as one (R): rows are contiguous, so R of them are one row
   of R k values, and a tile of 16 such rows at stride R k reads, in R phases of k values each, the
   outputs c, c + R, ... of its 16R rows. The hardware's prefetchers follow a row as a stream within
   its 4 KB pages; a row of k = 1536 (3 KB) ends mid-page, two rows of a tile share a page, and the
   32 rows of a panel streamed 26-27 GB/s where rows of whole pages (k = 2048) streamed 29
   (Qwen2.5-1.5B's and Llama-3.2-1B's linears at 32 rows, 2 cores). So R is the fewest rows (1, 2 or 4)
   that make a whole number of pages, where each segment has whole groups of 32R rows; else 1. */
static int64_t fused_rows(int64_t k, const int64_t *seg_rows, int64_t nseg) {
    for (int64_t fuse = 1; fuse <= 4; fuse *= 2) {
        if (k * 2 * fuse % 4096) continue;
        for (int64_t s = 0; s < nseg; s++)
            if (seg_rows[s] % (32 * fuse)) return 1;
        return fuse;
    }
    return 1;
}

/* out [m, n] bf16 = x [m, k] bf16 . w^T (+ bias [n] bf16, or NULL), w the rows of `nseg` (1-3)
   segments: seg_ptr[s] a [seg_rows[s], k] bf16 weight. Each output is the fp32 sum of its products
   in the packed kernel's order, plus its bias, rounded once to bf16 (or, with out_f32, not rounded:
   every bf16 x bf16 product is exact in fp32, so this is an fp32 GEMM of the upcast operands, in
   another order of sums). Returns -1 without memory, -2 for a shape it does not take. */
static int rows_linear(const uint16_t *x, int64_t m, int64_t k, const int64_t *seg_ptr, const int64_t *seg_rows,
                       int64_t nseg, const uint16_t *bias, uint16_t *out_bf16, float *out_f32) {
    int64_t n = 0;
    for (int64_t s = 0; s < nseg; s++) {
        if (seg_rows[s] % 16) return -2;
        n += seg_rows[s];
    }
    if (k % 32 || nseg < 1 || nseg > 3) return -2;
    if (m == 0 || n == 0) return 0;
    const int64_t nt_count = n / 16, np_count = (nt_count + 1) / 2, mp_count = (m + 31) / 32, kc_count = k / 32;
    const int64_t stride = k * 2; /* bytes between weight rows */
    /* kept between calls, per calling thread (common.h's thread_buffer): a decode step makes a few hundred
       calls */
    static __thread const uint8_t **kept_tiles = NULL;
    static __thread int64_t kept_cap = 0;
    if (nt_count > kept_cap) {
        free(kept_tiles);
        kept_tiles = malloc((size_t)nt_count * sizeof *kept_tiles);
        kept_cap = kept_tiles == NULL ? 0 : nt_count;
    }
    const uint8_t **tiles = kept_tiles; /* each 16-row tile's first row; a local: the team shares it */
    /* rows in blocks of at most ROW_BLOCK (the weights read again per block: 256 rows make 256
       FLOPs a weight byte, past what the tiles do per byte the memory gives), each block's K in
       blocks of at most X_BLOCK_BYTES of activations */
    const int64_t rb_mp = ((m < ROW_BLOCK ? m : ROW_BLOCK) + 31) / 32;
    const int64_t kb_count = (rb_mp * kc_count * 2048 + X_BLOCK_BYTES - 1) / X_BLOCK_BYTES;
    const int64_t kc_block = (kc_count + kb_count - 1) / kb_count;
    const int64_t xv_bytes = mp_count * kc_count * 2048;
    const int64_t acc_bytes = kb_count > 1 ? np_count * (ROW_BLOCK / 32) * 4096 : 0;
    uint8_t *scratch = thread_buffer(xv_bytes + acc_bytes + omp_get_max_threads() * CARRY_BYTES);
    if (tiles == NULL || scratch == NULL) return -1;
    uint32_t *xv = (uint32_t *)scratch;
    float *acc = kb_count > 1 ? (float *)(scratch + xv_bytes) : NULL;
    const int64_t fuse = m <= 32 ? fused_rows(k, seg_rows, nseg) : 1; /* its pending sums: 32 rows */
    for (int64_t s = 0, t = 0; s < nseg; s++)
        for (int64_t g = 0; g < seg_rows[s]; g += 32 * fuse)
            for (int64_t p = 0; p < fuse; p++) /* fuse 1: every 16 rows in order */
                for (int64_t h = 0; h < 2 && g + 16 * fuse * h < seg_rows[s]; h++)
                    tiles[t++] = (const uint8_t *)seg_ptr[s] + (g + 16 * fuse * h + p) * stride;
#pragma omp parallel
    {
        activations_as_b_tiles(x, m, k, xv);
        configure_tiles();
        pending_sums pend;
        pend.left = 0;
        float *carry = (float *)(scratch + xv_bytes + acc_bytes + omp_get_thread_num() * CARRY_BYTES);
        /* no barriers between blocks: static schedules of one count give each thread the same
           panels in every block (OpenMP's rule), so the sums it left in `acc` are its own */
        for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
            const int64_t rows = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK;
            const uint32_t *xr = xv + r0 / 32 * kc_count * 512;
            uint16_t *ob = out_bf16 == NULL ? NULL : out_bf16 + r0 * n;
            float *of = out_f32 == NULL ? NULL : out_f32 + r0 * n;
            for (int64_t k0 = 0; k0 < kc_count; k0 += kc_block) {
                const int64_t k1 = k0 + kc_block < kc_count ? k0 + kc_block : kc_count;
#pragma omp for schedule(static) nowait
                for (int64_t group = 0; group < np_count / fuse; group++) /* a group's phases in one thread */
                    for (int64_t np = group * fuse; np < (group + 1) * fuse; np++)
                        rows_panel(tiles, nt_count, np, xr, rows, kc_count, k0, k1, acc, carry, fuse * stride,
                                   fuse, &pend, bias, ob, of, n);
            }
        }
        finish_pending(&pend, bias, n);
        _tile_release();
    }
    return 0;
}

int amx_linear_bf16_rows(const uint16_t *x, int64_t m, int64_t k, const int64_t *seg_ptr, const int64_t *seg_rows,
                         int64_t nseg, const uint16_t *bias, uint16_t *out_bf16) {
    return rows_linear(x, m, k, seg_ptr, seg_rows, nseg, bias, out_bf16, NULL);
}

int amx_linear_bf16_rows_f32(const uint16_t *x, int64_t m, int64_t k, const int64_t *seg_ptr,
                             const int64_t *seg_rows, int64_t nseg, const uint16_t *bias, float *out_f32) {
    return rows_linear(x, m, k, seg_ptr, seg_rows, nseg, bias, NULL, out_f32);
}

/* A sparse MLP's experts at one GEMM each, in one parallel region: group g's rows
   [starts[g], starts[g + 1]) of x times expert experts[g]'s weight, w + experts[g] * n * k ([E, n, k]
   contiguous), into the same rows of out [rows, n]. The rows kernel's tiles and bits; one team and
   its barriers for the whole layer instead of one per expert (a quarter of a decode step's expert
   time at 1-10 rows an expert went to starting and joining teams). */
int amx_linear_bf16_groups(const uint16_t *x, int64_t k, const int64_t *starts, const int64_t *experts, int64_t G,
                           const uint16_t *w, int64_t n, uint16_t *out_bf16) {
    if (k % 32 || n % 16) return -2;
    if (G == 0 || n == 0) return 0;
    const int64_t nt_count = n / 16, np_count = (nt_count + 1) / 2, kc_count = k / 32, stride = k * 2;
    /* kept between calls, each grown to what a call needs (their sizes apart: a call with more
       groups of fewer tiles needs more offsets and no more tiles) */
    static __thread const uint8_t **kept_tiles = NULL;
    static __thread int64_t *kept_offsets = NULL, tiles_cap = 0, offsets_cap = 0;
    if (G * nt_count > tiles_cap) {
        free(kept_tiles);
        kept_tiles = malloc((size_t)(G * nt_count) * sizeof *kept_tiles);
        tiles_cap = kept_tiles == NULL ? 0 : G * nt_count;
    }
    if (G + 1 > offsets_cap) {
        free(kept_offsets);
        kept_offsets = malloc((size_t)(G + 1) * sizeof *kept_offsets);
        offsets_cap = kept_offsets == NULL ? 0 : G + 1;
    }
    const uint8_t **tiles = kept_tiles;
    int64_t *xoff = kept_offsets; /* each group's activations in xv, in 4-byte words */
    if (tiles_cap == 0 || offsets_cap == 0) return -1;
    xoff[0] = 0;
    for (int64_t g = 0; g < G; g++) {
        xoff[g + 1] = xoff[g] + (starts[g + 1] - starts[g] + 31) / 32 * kc_count * 512;
        const uint8_t *base = (const uint8_t *)(w + experts[g] * n * k);
        for (int64_t t = 0; t < nt_count; t++) tiles[g * nt_count + t] = base + t * 16 * stride;
    }
    uint8_t *scratch = thread_buffer(xoff[G] * 4 + omp_get_max_threads() * CARRY_BYTES);
    if (scratch == NULL) return -1;
    uint32_t *xv = (uint32_t *)scratch;
#pragma omp parallel
    {
        for (int64_t g = 0; g < G; g++)
            activations_as_b_tiles(x + starts[g] * k, starts[g + 1] - starts[g], k, xv + xoff[g]);
        configure_tiles();
        pending_sums pend;
        pend.left = 0;
        float *carry = (float *)(scratch + xoff[G] * 4 + omp_get_thread_num() * CARRY_BYTES);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < G * np_count; i++) {
            const int64_t g = i / np_count;
            rows_panel(tiles + g * nt_count, nt_count, i % np_count, xv + xoff[g], starts[g + 1] - starts[g],
                       kc_count, 0, kc_count, NULL, carry, stride, 1, &pend, NULL, out_bf16 + starts[g] * n, NULL, n);
        }
        finish_pending(&pend, NULL, n);
        _tile_release();
    }
    return 0;
}
