/* A sparse MLP's experts over a step's tokens in one call: each active expert's gate/up and down
   GEMMs on its weights in place (amx_linear.c's bf16 rows kernel, f32_linear.c's fp32 one, through
   the addresses engine/moe_experts.py hands over), the silu between them, the routing weights and
   each token's sum over its k picks.

   torch's grouped GEMM, at a decode step's 1-10 rows an expert, ran oneDNN's small-M path at about a
   sixth of the memory's speed (a 32-sequence bf16 step of the 0.94B Qwen3-MoE shape spent 82% of
   its time there); the rows kernels stream a weight once whatever the rows. The operations and
   their order are transformers' grouped experts' (engine/moe_experts.run): the picks sorted by
   expert, gate/up rounded to the dtype, silu(gate) rounded times up rounded, down rounded, times the
   pick's weight (rounded in bf16 unless the weights are fp32: Mixtral's), the k products of a token
   summed in fp32 in slot order and rounded once. Only each GEMM's sum runs in the rows kernel's
   order, within a GEMM's error of torch's. */

#include <stdlib.h>

#include "common.h"

typedef int (*rows_bf16_fn)(const uint16_t *x, int64_t m, int64_t k, const int64_t *seg_ptr, const int64_t *seg_rows,
                            int64_t nseg, const uint16_t *bias, uint16_t *out);
typedef int (*rows_f32_fn)(const float *x, int64_t m, int64_t k, const int64_t *seg_ptr, const int64_t *seg_rows,
                           int64_t nseg, const float *bias, float *out);
typedef void (*silu_bf16_fn)(const uint16_t *gate_up, int64_t stride, int64_t T, int64_t I, uint16_t *out);
typedef void (*silu_f32_fn)(const float *gate_up, int64_t stride, int64_t T, int64_t I, float *out);

static inline float load_bf16(uint16_t x) { return bf16_to_f32(x); }
static inline float load_f32(float x) { return x; }
static inline uint16_t store_bf16(float x) { return f32_to_bf16(x); }
static inline float store_f32(float x) { return x; }
static inline float keep_f32(float x) { return x; }

/* kernels: [the rows linear, the silu * up] of the dtype; order [S] the picks (token-major, pick
   t * k + j) sorted by expert, ends [E] where each expert's picks end in it; weights [S] per pick in
   pick order, fp32 when weights_f32 else the dtype; gate_up [E, 2I, H], down [E, H, I]; scratch
   xg [S, H], gu [S, 2I], act [S, I], dn [S, H] and inv [S] (int64); out [T, H]. Returns 0, or a
   kernel's code (-1: no memory, -2: a shape the rows kernel does not take). */
#define DEFINE_EXPERTS(NAME, T_, ROWS_FN, SILU_FN, LOAD, STORE, ROUND)                                           \
    int NAME(const int64_t *kernels, const T_ *x, int64_t T, int64_t H, int64_t k, const int64_t *order,        \
             const int64_t *ends, int64_t E, const void *weights, int weights_f32, const T_ *gate_up,            \
             const T_ *down, int64_t I, T_ *xg, T_ *gu, T_ *act, T_ *dn, int64_t *inv, T_ *out) {               \
        const ROWS_FN rows = (ROWS_FN)kernels[0];                                                             \
        const int64_t S = T * k;                                                                              \
        _Pragma("omp parallel for schedule(static) if (S * H > 65536)")                                       \
        for (int64_t j = 0; j < S; j++) {                                                                     \
            memcpy(xg + j * H, x + (order[j] / k) * H, H * sizeof(T_));                                      \
            inv[order[j]] = j;                                                                                \
        }                                                                                                     \
        for (int64_t e = 0, start = 0; e < E; e++) {                                                          \
            const int64_t n = ends[e] - start;                                                                \
            if (n > 0) {                                                                                      \
                const int64_t seg = (int64_t)(gate_up + e * 2 * I * H), seg_rows = 2 * I;                     \
                const int rc = rows(xg + start * H, n, H, &seg, &seg_rows, 1, NULL, gu + start * 2 * I);      \
                if (rc) return rc;                                                                            \
            }                                                                                                 \
            start = ends[e];                                                                                  \
        }                                                                                                     \
        ((SILU_FN)kernels[1])(gu, 2 * I, S, I, act);                                                          \
        for (int64_t e = 0, start = 0; e < E; e++) {                                                          \
            const int64_t n = ends[e] - start;                                                                \
            if (n > 0) {                                                                                      \
                const int64_t seg = (int64_t)(down + e * H * I), seg_rows = H;                                \
                const int rc = rows(act + start * I, n, I, &seg, &seg_rows, 1, NULL, dn + start * H);         \
                if (rc) return rc;                                                                            \
            }                                                                                                 \
            start = ends[e];                                                                                  \
        }                                                                                                     \
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

DEFINE_EXPERTS(moe_experts_bf16, uint16_t, rows_bf16_fn, silu_bf16_fn, load_bf16, store_bf16, round_bf16)
DEFINE_EXPERTS(moe_experts_f32, float, rows_f32_fn, silu_f32_fn, load_f32, store_f32, keep_f32)
