/* Sampling's common case, one call a step: every row sampled at its temperature from the model's
   logits, with no processors, penalties, min_p, top-k / top-p, greedy rows or top logprobs (an RL
   rollout's step). engine/sampler.py's torch path does it in about eight passes over the [B, V]
   logits (a copy to fp32, the division by the temperature, softmax's three, the block sums, the
   gathers); this reads each row twice (its max, then its block sums) and one block a third time.

   The same sampling as sampler.inverse_cdf: the uniform u in (0, 1] (float64) picks the first block
   whose cumulative mass reaches u times the row's total, then the first token inside it whose
   cumulative mass reaches the rest. Each token's weight is e^(l / T - max) in fp32 (l / T rounded
   as torch divides; e^x within about an ulp of torch's), summed in float64, so a token's
   probability is off by a relative ~1e-7 at most. A zero weight is never picked. The logprob is
   log(weight) - log(total), in float64. */

#include <float.h>
#include <stdlib.h>

#include "common.h"

typedef double v8d __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));

/* acc += x, 16 fp32 values widened to float64 in two vectors of 8 (no dependent chain of scalar
   adds: that cost 4 times the rest of the pass) */
static inline void add_wide(v8d *acc, v16f x) {
    acc[0] += __builtin_convertvector(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7), v8d);
    acc[1] += __builtin_convertvector(__builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15), v8d);
}

static inline double sum_wide(const v8d *acc) {
    double s = 0;
    for (int i = 0; i < 8; i++) s += acc[0][i] + acc[1][i];
    return s;
}

/* l / t as torch divides (unit: t is 1) */
#define SCALED16(LOAD16, p) (unit ? LOAD16(p) : LOAD16(p) / t)
#define SCALED(LOAD, x) (unit ? LOAD(x) : LOAD(x) / t)

#define DEFINE_SAMPLE(NAME, T, LOAD, LOAD16)                                                             \
    int NAME(const T *logits, int64_t rows, int64_t vocab, const float *temperature, const double *uniforms, \
             int64_t block, int64_t *tokens, float *logprobs) {                                          \
        const int64_t nblocks = (vocab + block - 1) / block;                                             \
        double *sums_all = malloc(sizeof(double) * (size_t)(nblocks * rows));                            \
        if (sums_all == NULL) return -1;                                                                 \
        _Pragma("omp parallel for schedule(static) if (rows * vocab > 65536)")                           \
        for (int64_t r = 0; r < rows; r++) {                                                             \
            const T *l = logits + r * vocab;                                                             \
            const float t = temperature[r];                                                              \
            const int unit = t == 1.0f; /* x / 1 is x: no division, the step's costliest op */          \
            double *sums = sums_all + r * nblocks;                                                       \
            int64_t c = 0;                                                                               \
            v16f mv = (v16f){0} - INFINITY;                                                              \
            for (; c + 16 <= vocab; c += 16) {                                                           \
                const v16f s = LOAD16(l + c);                                                            \
                const v16i gt = s > mv;                                                                  \
                mv = (v16f)(((v16i)s & gt) | ((v16i)mv & ~gt));                                          \
            }                                                                                            \
            float m = -INFINITY;                                                                         \
            for (int i = 0; i < 16; i++) m = fmaxf(m, mv[i]);                                            \
            for (; c < vocab; c++) m = fmaxf(m, LOAD(l[c]));                                             \
            m /= t; /* max(l / t) = max(l) / t: a correctly rounded division by t > 0 keeps the order */ \
            double total = 0;                                                                            \
            for (int64_t b = 0; b < nblocks; b++) {                                                      \
                const int64_t end = b * block + block < vocab ? b * block + block : vocab;               \
                v8d acc[2] = {{0}, {0}};                                                                 \
                for (c = b * block; c + 16 <= end; c += 16) add_wide(acc, vexp(SCALED16(LOAD16, l + c) - m)); \
                double s = sum_wide(acc);                                                                \
                for (; c < end; c++) s += (double)vexp((v16f){0} + (SCALED(LOAD, l[c]) - m))[0];            \
                sums[b] = s;                                                                             \
                total += s;                                                                              \
            }                                                                                            \
            const double target = uniforms[r] * total;                                                   \
            int64_t j = 0;                                                                               \
            double before = 0;                                                                           \
            while (j < nblocks - 1 && before + sums[j] < target) before += sums[j++];                    \
            double rest = target - before;                                                               \
            if (rest < DBL_MIN) rest = DBL_MIN; /* some weight must be reached: never a zero one */      \
            const int64_t start = j * block, end = start + block < vocab ? start + block : vocab;        \
            int64_t pick = -1;                                                                           \
            float weight = 0;                                                                            \
            double cum = 0;                                                                              \
            for (c = start; c < end; c++) {                                                              \
                const float e = vexp((v16f){0} + (SCALED(LOAD, l[c]) - m))[0];                              \
                if (e > 0) {                                                                             \
                    pick = c; /* the last positive weight so far: where rounding overshoots the block */ \
                    weight = e;                                                                          \
                }                                                                                        \
                cum += (double)e;                                                                        \
                if (e > 0 && cum >= rest) break;                                                         \
            }                                                                                            \
            tokens[r] = pick;                                                                            \
            logprobs[r] = (float)(log((double)weight) - log(total));                                     \
        }                                                                                                \
        free(sums_all);                                                                                  \
        return 0;                                                                                        \
    }

DEFINE_SAMPLE(sample_rows_f32, float, load_f32, load16_f32)
DEFINE_SAMPLE(sample_rows_bf16, uint16_t, load_bf16, load16_bf16)
