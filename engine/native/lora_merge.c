/* A LoRA merge, W = W0 + scale * (B @ A), as PEFT computes it (`weight.data += get_delta_weight()`),
   with its bits: each value of B @ A as torch's mm sums it, scaled, then added to W0, each step
   rounded as torch's `mul_` then `add_` round it (compiled with -ffp-contract=off: no FMA there).
   bf16 W0 with fp32 factors (a trainer's fp32 adapter into a bf16 engine): the sum in fp32, rounded
   once to bf16 (to nearest even), as torch's add of a bf16 and an fp32 tensor into a bf16 one.

   lora_merge_rows does it all in one pass, B @ A never written: each value summed in registers as r
   FMAs in order of r from zero, which is how MKL's sgemm sums a K of 8-64 on the CPUs this was built
   on; engine/lora_merge.py probes at first use that its bits are torch.mm's here, and elsewhere
   takes torch's mm and then lora_add (the scale and the add in one pass, where torch's two in-place
   ops read and wrote the whole weight twice more). On AVX-512 the merged weights bypass the cache (a
   merge writes every target weight, read again only by the next forward or the derived copies'
   pack): a plain store reads each line in first. */

#include "common.h"

#define CHUNK 4096 /* values a thread takes at a time (lora_add) */
#define LANES 8 /* 16-float blocks of a row summed at once: 8 independent chains of r FMAs */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VECTOR_MERGE 1
#endif

/* W0 + s for the 16 values at `at` (s: the scaled delta; lanes past `m` untouched), into out: fp32,
   or bf16 (the sum in fp32, rounded once); whole 64-byte lines of out bypass the cache (`stream`). */
#ifdef VECTOR_MERGE
static inline void put_merged(const void *w0, void *out, int64_t at, __m512 s, __mmask16 m, int bf16, int stream) {
    if (bf16) {
        const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w0 + at)), 16));
        uint16_t h[16] __attribute__((aligned(32)));
        store16_bf16(h, (v16f)_mm512_add_ps(w, s));
        const __m256i v = _mm256_load_si256((const __m256i *)h);
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

static void merge_row(const float *b, const float *a, int64_t r, int64_t k, float scale, const void *w0, void *out,
                      int bf16, int stream) {
    int64_t j = 0;
#ifdef VECTOR_MERGE
    const __m512 vs = _mm512_set1_ps(scale);
    for (; j < k; j += 16 * LANES) {
        __m512 acc[LANES];
        __mmask16 m[LANES];
        for (int v = 0; v < LANES; v++) {
            const int64_t left = k - j - 16 * v;
            m[v] = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
            acc[v] = _mm512_setzero_ps();
        }
        for (int64_t q = 0; q < r; q++) {
            const __m512 bq = _mm512_set1_ps(b[q]);
            for (int v = 0; v < LANES; v++)
                acc[v] = _mm512_fmadd_ps(bq, _mm512_maskz_loadu_ps(m[v], a + q * k + j + 16 * v), acc[v]);
        }
        for (int v = 0; v < LANES && m[v]; v++)
            put_merged(w0, out, j + 16 * v, _mm512_mul_ps(acc[v], vs), m[v], bf16, stream);
    }
#endif
    for (; j < k; j++) {
        float acc = 0.0f;
        for (int64_t q = 0; q < r; q++) acc = fmaf(b[q], a[q * k + j], acc);
        put_merged_one(w0, out, j, acc * scale, bf16);
    }
    (void)stream;
}

/* rows of out = w0 + scale * (b @ a) (see above); out's rows streamed when they are whole lines */
void lora_merge_rows(const float *b, const float *a, int64_t n, int64_t r, int64_t k, float scale, const void *w0,
                     void *out, int bf16) {
    const int64_t row_bytes = k * (bf16 ? 2 : 4);
    const int stream = ((uintptr_t)out & 63) == 0 && row_bytes % 64 == 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++)
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
