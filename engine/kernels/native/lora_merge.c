/* A LoRA merge, W = W0 + scale * (B @ A), as PEFT computes it (`weight.data += get_delta_weight()`),
   with its bits: each value of B @ A as torch's mm sums it, scaled, then added to W0, each step
   rounded as torch's `mul_` then `add_` round it (compiled with -ffp-contract=off: no FMA there).
   bf16 W0 with fp32 factors (a trainer's fp32 adapter into a bf16 engine): the sum in fp32, rounded
   once to bf16 (to nearest even), as torch's add of a bf16 and an fp32 tensor into a bf16 one.

   lora_merge_rows does it all in one pass, B @ A never written: each value summed in registers as r
   FMAs in order of r from zero, which is how MKL's sgemm sums a K of 8-64 on the CPUs this was built
   on; engine/kernels/lora_merge.py probes at first use that its bits are torch.mm's here, and elsewhere
   takes torch's mm and then lora_add (the scale and the add in one pass, where torch's two in-place
   ops read and wrote the whole weight twice more). Rows go two at a time, so that each load of A
   feeds two FMAs: SmolLM2's merge took 50 ms, now 40 (fp32, the memory's bound) and 30 (bf16). On
   AVX-512 the merged weights bypass the cache (a merge writes every target weight, read again only
   by the next forward or the derived copies' pack): a plain store reads each line in first. */

#include "common.h"

#define CHUNK 4096 /* values a thread takes at a time (lora_add) */
#define LANES 8 /* 16-float blocks of a row summed at once: 8 independent chains of r FMAs */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VECTOR_MERGE 1
#endif

#ifdef VECTOR_MERGE
/* 16 values rounded to bf16 as common.h's store16_bf16 rounds them (to nearest even, NaN kept), in
   registers (through memory the compiler went twice). */
static inline __m256i to_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                 _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}
#endif

/* W0 + s for the 16 values at `at` (s: the scaled delta; lanes past `m` untouched), into out: fp32,
   or bf16 (the sum in fp32, rounded once); whole 64-byte lines of out bypass the cache (`stream`). */
#ifdef VECTOR_MERGE
static inline void put_merged(const void *w0, void *out, int64_t at, __m512 s, __mmask16 m, int bf16, int stream) {
    if (bf16) {
        const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w0 + at)), 16));
        const __m256i v = to_bf16(_mm512_add_ps(w, s));
        if (stream && m == 0xffff) _mm256_stream_si256((__m256i *)((uint16_t *)out + at), v);
        else _mm256_mask_storeu_epi16((uint16_t *)out + at, m, v);
    } else {
        const __m512 o = _mm512_add_ps(_mm512_maskz_loadu_ps(m, (const float *)w0 + at), s);
        if (stream && m == 0xffff) _mm512_stream_ps((float *)out + at, o);
        else _mm512_mask_storeu_ps((float *)out + at, m, o);
    }
}
#endif

static inline void put_merged_one(const void *w0, void *out, int64_t at, float s, int bf16) {
    if (bf16) ((uint16_t *)out)[at] = f32_to_bf16(bf16_to_f32(((const uint16_t *)w0)[at]) + s);
    else ((float *)out)[at] = ((const float *)w0)[at] + s;
}

/* `width` (1..LANES) 16-float blocks of a row from column j, each value r FMAs in order of r from
   zero; `m` masks the last block where it passes k. Written for the compiler to keep the sums in
   registers (an array it kept in memory stored every sum at every FMA: 5x slower). */
#ifdef VECTOR_MERGE
static inline void merge_blocks(const float *b, const float *a, int64_t r, int64_t k, int64_t j, int width,
                                __mmask16 m, __m512 vs, const void *w0, void *out, int bf16, int stream) {
    __m512 acc[LANES];
#pragma GCC unroll 8
    for (int v = 0; v < LANES; v++) acc[v] = _mm512_setzero_ps();
    if (width == LANES && m == 0xffff) { /* the common case: no masks in the loop */
        for (int64_t q = 0; q < r; q++) {
            const __m512 bq = _mm512_set1_ps(b[q]);
            const float *aq = a + q * k + j;
#pragma GCC unroll 8
            for (int v = 0; v < LANES; v++) acc[v] = _mm512_fmadd_ps(bq, _mm512_loadu_ps(aq + 16 * v), acc[v]);
        }
    } else {
        for (int64_t q = 0; q < r; q++) {
            const __m512 bq = _mm512_set1_ps(b[q]);
            const float *aq = a + q * k + j;
#pragma GCC unroll 8
            for (int v = 0; v < LANES; v++)
                if (v < width)
                    acc[v] = _mm512_fmadd_ps(bq, _mm512_maskz_loadu_ps(v == width - 1 ? m : 0xffff, aq + 16 * v), acc[v]);
        }
    }
#pragma GCC unroll 8
    for (int v = 0; v < LANES; v++)
        if (v < width)
            put_merged(w0, out, j + 16 * v, _mm512_mul_ps(acc[v], vs), v == width - 1 ? m : 0xffff, bf16, stream);
}

/* The columns from j to k (fewer than 16 * LANES) as merge_blocks takes them: its block count,
   and the mask of the last block. */
static inline int tail_blocks(int64_t j, int64_t k, __mmask16 *m) {
    const int64_t left = k - j, width = (left + 15) / 16, last = left - 16 * (width - 1);
    *m = (__mmask16)(last == 16 ? 0xffff : (1u << last) - 1u);
    return (int)width;
}
#endif

static void merge_row(const float *b, const float *a, int64_t r, int64_t k, float scale, const void *w0, void *out,
                      int bf16, int stream) {
    int64_t j = 0;
#ifdef VECTOR_MERGE
    const __m512 vs = _mm512_set1_ps(scale);
    for (; j + 16 * LANES <= k; j += 16 * LANES) merge_blocks(b, a, r, k, j, LANES, 0xffff, vs, w0, out, bf16, stream);
    if (j < k) {
        __mmask16 m;
        const int width = tail_blocks(j, k, &m);
        merge_blocks(b, a, r, k, j, width, m, vs, w0, out, bf16, stream);
        j = k;
    }
#endif
    for (; j < k; j++) {
        float acc = 0.0f;
        for (int64_t q = 0; q < r; q++) acc = fmaf(b[q], a[q * k + j], acc);
        put_merged_one(w0, out, j, acc * scale, bf16);
    }
    (void)stream;
}

#ifdef VECTOR_MERGE
/* merge_row's whole blocks of two rows at once: each load of A feeds two FMAs (the same sums) */
static void merge_two_rows(const float *b, const float *a, int64_t r, int64_t k, float scale, const void *w0,
                           void *out, int64_t row_bytes, int bf16, int stream) {
    const __m512 vs = _mm512_set1_ps(scale);
    int64_t j = 0;
    for (; j + 16 * LANES <= k; j += 16 * LANES) {
        __m512 x[LANES], y[LANES];
#pragma GCC unroll 8
        for (int v = 0; v < LANES; v++) x[v] = y[v] = _mm512_setzero_ps();
        for (int64_t q = 0; q < r; q++) {
            const __m512 bx = _mm512_set1_ps(b[q]), by = _mm512_set1_ps(b[r + q]);
            const float *aq = a + q * k + j;
#pragma GCC unroll 8
            for (int v = 0; v < LANES; v++) {
                const __m512 av = _mm512_loadu_ps(aq + 16 * v);
                x[v] = _mm512_fmadd_ps(bx, av, x[v]);
                y[v] = _mm512_fmadd_ps(by, av, y[v]);
            }
        }
#pragma GCC unroll 8
        for (int v = 0; v < LANES; v++) {
            put_merged(w0, out, j + 16 * v, _mm512_mul_ps(x[v], vs), 0xffff, bf16, stream);
            put_merged((const char *)w0 + row_bytes, (char *)out + row_bytes, j + 16 * v, _mm512_mul_ps(y[v], vs),
                       0xffff, bf16, stream);
        }
    }
    if (j < k) {
        __mmask16 m;
        const int width = tail_blocks(j, k, &m);
        for (int i = 0; i < 2; i++)
            merge_blocks(b + i * r, a, r, k, j, width, m, vs, (const char *)w0 + i * row_bytes,
                         (char *)out + i * row_bytes, bf16, stream);
    }
}
#endif

/* rows of out = w0 + scale * (b @ a) (see above); out's rows streamed when they are whole lines */
void lora_merge_rows(const float *b, const float *a, int64_t n, int64_t r, int64_t k, float scale, const void *w0,
                     void *out, int bf16) {
    const int64_t row_bytes = k * (bf16 ? 2 : 4);
    const int stream = ((uintptr_t)out & 63) == 0 && row_bytes % 64 == 0;
#pragma omp parallel
    {
#ifdef VECTOR_MERGE
        const int64_t pairs = n / 2;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < pairs; g++)
            merge_two_rows(b + 2 * g * r, a, r, k, scale, (const char *)w0 + 2 * g * row_bytes,
                           (char *)out + 2 * g * row_bytes, row_bytes, bf16, stream);
        const int64_t first = 2 * pairs;
#else
        const int64_t first = 0;
#endif
#pragma omp for schedule(static)
        for (int64_t i = first; i < n; i++)
            merge_row(b + i * r, a, r, k, scale, (const char *)w0 + i * row_bytes, (char *)out + i * row_bytes, bf16,
                      stream);
#ifdef __AVX512F__
        _mm_sfence(); /* this thread's streamed sums are visible before anyone reads them */
#endif
    }
}

/* The second pass where the one-pass merge's sums are not torch's: d = B @ A by torch's mm, then
   out = w0 + d * scale over n values, fp32 or bf16 (`bf16`), streamed as above. */
void lora_add(const float *d, float scale, const void *w0, void *out, int64_t n, int bf16) {
    const int stream = ((uintptr_t)out & 63) == 0; /* chunks of 4096 values keep each chunk's start aligned */
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t c = 0; c < n; c += CHUNK) {
            const int64_t end = c + CHUNK < n ? c + CHUNK : n;
            int64_t i = c;
#ifdef VECTOR_MERGE
            const __m512 vs = _mm512_set1_ps(scale);
            for (; i + 16 <= end; i += 16) put_merged(w0, out, i, _mm512_mul_ps(_mm512_loadu_ps(d + i), vs), 0xffff, bf16, stream);
#endif
            for (; i < end; i++) put_merged_one(w0, out, i, d[i] * scale, bf16);
        }
#ifdef __AVX512F__
        _mm_sfence();
#endif
    }
    (void)stream;
}
