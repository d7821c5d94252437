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

typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

/* acc[0 .. VW / 4 - 1] += x, a vector of fp32 values widened to float64 four at a time (lane l in acc[l / 4];
   no dependent chain of scalar adds: that cost 4 times the rest of the pass). Vectors of 4 doubles: a register
   on AVX2 as on AVX-512 (8-double vectors lived on the stack on AVX2). */
ALWAYS_INLINE void add_wide(v4d *acc, vec x) {
    for (int j = 0; j < VW / 4; j++) {
        v4f quarter;
        memcpy(&quarter, (const float *)&x + 4 * j, sizeof quarter);
        acc[j] += __builtin_convertvector(quarter, v4d);
    }
}

static inline double sum_wide(const v4d *acc) { /* lanes l and l + VW / 2 paired, in order of l */
    double s = 0;
    for (int i = 0; i < VW / 2; i++) s += acc[i / 4][i % 4] + acc[(i + VW / 2) / 4][i % 4];
    return s;
}

/* A row's logits (element `row` of `logits` on) and its temperature t (unit: t is 1, no division:
   x / 1 is x, and the division is the step's costliest op); `bf16` a constant where it is inlined. */
typedef struct {
    const void *logits;
    int64_t row, vocab;
    float t;
    int unit;
} Row;

/* l / t as torch divides, a vector's values from index c of the row (common.h's vec: 16 on AVX-512, 8 on
   AVX2, where 16-float vectors living across the loops below went through memory: the sampler at half speed),
   and one value at c. */
ALWAYS_INLINE vec scaledv(const Row *r, int64_t c, int bf16) {
    return r->unit ? loadv_at(r->logits, r->row + c, bf16) : loadv_at(r->logits, r->row + c, bf16) / r->t;
}

ALWAYS_INLINE float scaled(const Row *r, int64_t c, int bf16) {
    return r->unit ? load_at(r->logits, r->row + c, bf16) : load_at(r->logits, r->row + c, bf16) / r->t;
}

/* max(l / t) = max(l) / t: a correctly rounded division by t > 0 keeps the order. */
ALWAYS_INLINE float scaled_max(const Row *r, int bf16) {
    int64_t c = 0;
    vec mv = (vec){0} - INFINITY;
    for (; c + VW <= r->vocab; c += VW) mv = vmaxv(loadv_at(r->logits, r->row + c, bf16), mv);
    float m = -INFINITY;
    for (int i = 0; i < VW; i++) m = fmaxf(m, mv[i]);
    for (; c < r->vocab; c++) m = fmaxf(m, load_at(r->logits, r->row + c, bf16));
    return m / r->t;
}

/* sums[b] = the weights e^(l / t - m) of block b (float64); returns their total. */
ALWAYS_INLINE double block_sums(const Row *r, float m, int64_t block, int64_t nblocks, double *sums, int bf16) {
    double total = 0;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t end = b * block + block < r->vocab ? b * block + block : r->vocab;
        v4d acc[VW / 4] = {{0}};
        int64_t c;
        for (c = b * block; c + VW <= end; c += VW) add_wide(acc, vexpv(scaledv(r, c, bf16) - m));
        double s = sum_wide(acc);
        for (; c < end; c++) s += (double)vexpv((vec){0} + (scaled(r, c, bf16) - m))[0];
        sums[b] = s;
        total += s;
    }
    return total;
}

/* A token's weight e^(l / t - m): one expression for the sampler and the scorer, so both round alike. */
ALWAYS_INLINE float token_weight(const Row *r, int64_t c, float m, int bf16) {
    return vexpv((vec){0} + (scaled(r, c, bf16) - m))[0];
}

/* The token the uniform u picks (its block by the sums, then the token by its weights), and its
   weight in *weight; -1 where no weight in its block is positive. */
ALWAYS_INLINE int64_t pick_token(const Row *r, float m, int64_t block, int64_t nblocks, const double *sums,
                                 double target, float *weight, int bf16) {
    int64_t j = 0;
    double before = 0;
    while (j < nblocks - 1 && before + sums[j] < target) before += sums[j++];
    double rest = target - before;
    if (rest < DBL_MIN) rest = DBL_MIN; /* some weight must be reached: never a zero one */
    const int64_t start = j * block, end = start + block < r->vocab ? start + block : r->vocab;
    int64_t pick = -1;
    double cum = 0;
    for (int64_t c = start; c < end; c++) {
        const float e = token_weight(r, c, m, bf16);
        if (e > 0) {
            pick = c; /* the last positive weight so far: where rounding overshoots the block */
            *weight = e;
        }
        cum += (double)e;
        if (e > 0 && cum >= rest) break;
    }
    return pick;
}

/* Row r of the call: its token and logprob. `sums` holds nblocks doubles. */
ALWAYS_INLINE void sample_row(const void *logits, int64_t r, int64_t vocab, float t, double u, int64_t block,
                              double *sums, int64_t *token, float *logprob, int bf16) {
    const Row row = {.logits = logits, .row = r * vocab, .vocab = vocab, .t = t, .unit = t == 1.0f};
    const int64_t nblocks = (vocab + block - 1) / block;
    const float m = scaled_max(&row, bf16);
    const double total = block_sums(&row, m, block, nblocks, sums, bf16);
    float weight = 0;
    *token = pick_token(&row, m, block, nblocks, sums, u * total, &weight, bf16);
    *logprob = (float)(log((double)weight) - log(total));
}

/* The logprob sample_row gives token `token` of row r when it picks it: the same max, block sums and
   weight, so the same bits (the trainer's exact forward scores a rollout's tokens with it). */
ALWAYS_INLINE float score_row(const void *logits, int64_t r, int64_t vocab, float t, int64_t token, int64_t block,
                              double *sums, int bf16) {
    const Row row = {.logits = logits, .row = r * vocab, .vocab = vocab, .t = t, .unit = t == 1.0f};
    const int64_t nblocks = (vocab + block - 1) / block;
    const float m = scaled_max(&row, bf16);
    const double total = block_sums(&row, m, block, nblocks, sums, bf16);
    return (float)(log((double)token_weight(&row, token, m, bf16)) - log(total));
}

static void sample_row_f32(const void *logits, int64_t r, int64_t vocab, float t, double u, int64_t block,
                           double *sums, int64_t *token, float *logprob) {
    sample_row(logits, r, vocab, t, u, block, sums, token, logprob, 0);
}

static void sample_row_bf16(const void *logits, int64_t r, int64_t vocab, float t, double u, int64_t block,
                            double *sums, int64_t *token, float *logprob) {
    sample_row(logits, r, vocab, t, u, block, sums, token, logprob, 1);
}

/* logits [rows, vocab]; temperature [rows]; uniforms [rows] in (0, 1]; the block sums' block size.
   Writes tokens [rows] and logprobs [rows]; returns 0, or -1 when out of memory. */
static int sample_rows(const void *logits, int64_t rows, int64_t vocab, const float *temperature,
                       const double *uniforms, int64_t block, int64_t *tokens, float *logprobs, int bf16) {
    const int64_t nblocks = (vocab + block - 1) / block;
    double *sums_all = malloc(sizeof(double) * (size_t)(nblocks * rows));
    if (sums_all == NULL) return -1;
#pragma omp parallel for schedule(static) if (rows * vocab > 65536)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16)
            sample_row_bf16(logits, r, vocab, temperature[r], uniforms[r], block, sums_all + r * nblocks, tokens + r,
                            logprobs + r);
        else
            sample_row_f32(logits, r, vocab, temperature[r], uniforms[r], block, sums_all + r * nblocks, tokens + r,
                           logprobs + r);
    }
    free(sums_all);
    return 0;
}

int sample_rows_f32(const float *logits, int64_t rows, int64_t vocab, const float *temperature,
                    const double *uniforms, int64_t block, int64_t *tokens, float *logprobs) {
    return sample_rows(logits, rows, vocab, temperature, uniforms, block, tokens, logprobs, 0);
}

int sample_rows_bf16(const uint16_t *logits, int64_t rows, int64_t vocab, const float *temperature,
                     const double *uniforms, int64_t block, int64_t *tokens, float *logprobs) {
    return sample_rows(logits, rows, vocab, temperature, uniforms, block, tokens, logprobs, 1);
}

/* logits [rows, vocab]; temperature [rows] (> 0); tokens [rows] in [0, vocab). Writes logprobs [rows]:
   what sample_rows reports for each row when it samples that token. Returns 0, or -1 when out of memory. */
static int score_rows(const void *logits, int64_t rows, int64_t vocab, const float *temperature,
                      const int64_t *tokens, int64_t block, float *logprobs, int bf16) {
    const int64_t nblocks = (vocab + block - 1) / block;
    double *sums_all = malloc(sizeof(double) * (size_t)(nblocks * rows));
    if (sums_all == NULL) return -1;
#pragma omp parallel for schedule(static) if (rows * vocab > 65536)
    for (int64_t r = 0; r < rows; r++)
        logprobs[r] = bf16 ? score_row(logits, r, vocab, temperature[r], tokens[r], block, sums_all + r * nblocks, 1)
                           : score_row(logits, r, vocab, temperature[r], tokens[r], block, sums_all + r * nblocks, 0);
    free(sums_all);
    return 0;
}

int score_rows_f32(const float *logits, int64_t rows, int64_t vocab, const float *temperature, const int64_t *tokens,
                   int64_t block, float *logprobs) {
    return score_rows(logits, rows, vocab, temperature, tokens, block, logprobs, 0);
}

int score_rows_bf16(const uint16_t *logits, int64_t rows, int64_t vocab, const float *temperature,
                    const int64_t *tokens, int64_t block, float *logprobs) {
    return score_rows(logits, rows, vocab, temperature, tokens, block, logprobs, 1);
}
