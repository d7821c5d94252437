/* The add of a LoRA merge, W = W0 + (scale * (B @ A)), in one pass: `d` is B @ A as torch's mm gave it
   (its bits are torch's, so the merge stays PEFT's), and each value is scaled, then added, each step
   rounded as torch's `mul_` then `add_` round it (compiled with -ffp-contract=off: no FMA). torch's
   two in-place ops read and wrote the whole weight twice more (3 passes -> 1 here). On AVX-512 the
   sums bypass the cache (a merge writes the whole model, read again only by the next forward or the
   derived copies' pack): a plain store reads each line in first.

   bf16 W0 with fp32 factors (a trainer's fp32 adapter into a bf16 engine): the sum in fp32, rounded
   once to bf16 (to nearest even), as torch's add of a bf16 and an fp32 tensor into a bf16 one. */

#include "common.h"

#define CHUNK 4096 /* values a thread takes at a time */

/* The whole merge in one pass, B @ A never written: each value of B @ A summed in registers as r
   FMAs in order of r from zero, which is how MKL's sgemm sums a K of 8-64 on the CPUs this was
   built on; engine/lora_merge.py probes at first use that its bits are torch.mm's here and keeps
   torch's mm otherwise. Then scaled and added to W0 as above. The mm wrote and the add read back
   B @ A, a model's worth of bytes each. b [n, r], a [r, k], w0 and out [n, k]; out in W0's dtype
   (bf16: `w0_bf16`), written past the cache on AVX-512. */
#define LANES 8 /* 16-float blocks of a row summed at once: 8 independent chains of r FMAs */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VECTOR_MERGE 1
#endif

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
        for (int v = 0; v < LANES; v++) {
            if (!m[v]) break;
            const int64_t at = j + 16 * v;
            const __m512 s = _mm512_mul_ps(acc[v], vs);
            if (bf16) {
                const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m[v], (const uint16_t *)w0 + at)), 16));
                uint16_t h[16] __attribute__((aligned(32)));
                store16_bf16(h, (v16f)_mm512_add_ps(w, s));
                if (stream && m[v] == 0xffff) _mm256_stream_si256((__m256i *)((uint16_t *)out + at), _mm256_load_si256((const __m256i *)h));
                else _mm256_mask_storeu_epi16((uint16_t *)out + at, m[v], _mm256_load_si256((const __m256i *)h));
            } else {
                const __m512 o = _mm512_add_ps(_mm512_maskz_loadu_ps(m[v], (const float *)w0 + at), s);
                if (stream && m[v] == 0xffff) _mm512_stream_ps((float *)out + at, o);
                else _mm512_mask_storeu_ps((float *)out + at, m[v], o);
            }
        }
    }
#else
    for (; j < k; j++) {
        float acc = 0.0f;
        for (int64_t q = 0; q < r; q++) acc = fmaf(b[q], a[q * k + j], acc);
        const float s = acc * scale;
        if (bf16) ((uint16_t *)out)[j] = f32_to_bf16(bf16_to_f32(((const uint16_t *)w0)[j]) + s);
        else ((float *)out)[j] = ((const float *)w0)[j] + s;
    }
#endif
    (void)stream;
}

void lora_merge_rows(const float *b, const float *a, int64_t n, int64_t r, int64_t k, float scale, const void *w0,
                     void *out, int bf16) {
    const int64_t row_bytes = k * (bf16 ? 2 : 4);
    /* every row's start 64-byte aligned when out is and rows are whole lines: streamed whole */
    const int stream = ((uintptr_t)out & 63) == 0 && row_bytes % 64 == 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++)
            merge_row(b + i * r, a, r, k, scale, (const char *)w0 + i * row_bytes, (char *)out + i * row_bytes, bf16,
                      stream);
#ifdef __AVX512F__
        _mm_sfence();
#endif
    }
}

void lora_add_f32(const float *d, float scale, const float *w0, float *out, int64_t n) {
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t c = 0; c < n; c += CHUNK) {
            const int64_t end = c + CHUNK < n ? c + CHUNK : n;
            int64_t i = c;
#ifdef __AVX512F__
            if (((uintptr_t)out & 63) == 0) { /* chunks of 4096 floats keep each chunk's start aligned */
                const __m512 vs = _mm512_set1_ps(scale);
                for (; i + 16 <= end; i += 16)
                    _mm512_stream_ps(out + i, _mm512_add_ps(_mm512_loadu_ps(w0 + i),
                                                            _mm512_mul_ps(_mm512_loadu_ps(d + i), vs)));
            }
#endif
            for (; i < end; i++) {
                const float s = d[i] * scale;
                out[i] = w0[i] + s;
            }
        }
#ifdef __AVX512F__
        _mm_sfence(); /* this thread's streamed sums are visible before anyone reads them */
#endif
    }
}

void lora_add_bf16(const float *d, float scale, const uint16_t *w0, uint16_t *out, int64_t n) {
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t c = 0; c < n; c += CHUNK) {
            const int64_t end = c + CHUNK < n ? c + CHUNK : n;
            int64_t i = c;
#ifdef __AVX512F__
            if (((uintptr_t)out & 63) == 0)
                for (; i + 16 <= end; i += 16) {
                    const v16f s = load16_f32(d + i) * scale;
                    uint16_t h[16] __attribute__((aligned(32)));
                    store16_bf16(h, load16_bf16(w0 + i) + s);
                    _mm256_stream_si256((__m256i *)(out + i), _mm256_load_si256((const __m256i *)h));
                }
#endif
            for (; i < end; i++) {
                const float s = d[i] * scale;
                out[i] = f32_to_bf16(bf16_to_f32(w0[i]) + s);
            }
        }
#ifdef __AVX512F__
        _mm_sfence();
#endif
    }
}
