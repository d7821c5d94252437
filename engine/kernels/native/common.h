/* What the engine's C kernels share: bf16 <-> fp32 as torch converts, 16-float vectors (GCC's
   vector extensions: zmm on AVX512, pairs of ymm on AVX2, where GCC keeps one that lives across a loop
   in memory), the ISA's own vector (vec: a zmm or a ymm) and a vectorised e^x for each. */
#ifndef ROLLOUT_NATIVE_COMMON_H
#define ROLLOUT_NATIVE_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

/* Inlined whatever GCC's heuristics say: also where a v16f crosses a call on AVX2 (no 64-byte vector registers
   there: it goes through memory, and silu_mul_f32's e^x, left a call, ran at half its inlined speed). */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* a > b lane by lane, all ones or zero. GCC 12 lowers a comparison of vectors wider than the ISA's to one
   scalar comparison and insert a lane (on AVX2 a v16f `>` was 16 vcomiss: e^x below ran ~17 cycles a
   value, 5% of a SmolLM2 run in SiLU alone); there, two 8-float comparisons. */
ALWAYS_INLINE v16i gt16(v16f a, v16f b) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    typedef float v8f_ __attribute__((vector_size(32)));
    typedef int32_t v8i_ __attribute__((vector_size(32)));
    v8f_ ha[2], hb[2];
    v8i_ c[2];
    memcpy(ha, &a, sizeof a), memcpy(hb, &b, sizeof b);
    c[0] = ha[0] > hb[0], c[1] = ha[1] > hb[1];
    v16i out;
    memcpy(&out, c, sizeof out);
    return out;
#else
    return a > b;
#endif
}

/* lane-wise max (b where either is NaN): one body for the 16-float vectors (vmax16) and the ISA's own (vmaxv) */
#define DEFINE_VMAX(NAME, VF, VI, GT)                \
    ALWAYS_INLINE VF NAME(VF a, VF b) {              \
        const VI c = GT(a, b);                       \
        return (VF)(((VI)a & c) | ((VI)b & ~c));     \
    }

DEFINE_VMAX(vmax16, v16f, v16i, gt16)

static inline float bf16_to_f32(uint16_t x) { /* exact: the high half of the bits */
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* One value of either dtype to fp32 and back, and fp32's rounding (none): for code written once for
   both dtypes, which takes these by name as it takes the 16-value loads and stores below. */
static inline float load_f32(float x) { return x; }
static inline float load_bf16(uint16_t x) { return bf16_to_f32(x); }
static inline float store_f32(float x) { return x; }
static inline uint16_t store_bf16(float x) { return f32_to_bf16(x); }
static inline float round_f32(float x) { return x; }

/* 16 values at a time, widened to fp32 on load and rounded (to nearest even, as torch) on store. */
static inline v16f load16_f32(const float *p) {
    v16f x;
    memcpy(&x, p, sizeof x);
    return x;
}

#ifdef __AVX512F__
/* One widening load: GCC splits the generic version's 16-lane conversion into two ymm halves and
   a merge (-march=native prefers 256-bit vectors), which showed in decode attention's profile. */
static inline v16f load16_bf16(const uint16_t *p) {
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
#else
static inline v16f load16_bf16(const uint16_t *p) { /* bf16 -> fp32 is exact: the high half of the bits */
    v16h h;
    memcpy(&h, p, sizeof h);
    const v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f x;
    memcpy(&x, &u, sizeof x);
    return x;
}
#endif

static inline v16f round16_bf16(v16f x) { /* to the nearest bf16 (ties even), kept in fp32 */
    v16u u;
    memcpy(&u, &x, sizeof u);
    /* all ones where NaN: GCC turned the unsigned compare of 16 lanes into scalar code on AVX2 */
    const v16i nan = (0x7f800000 - (v16i)(u & 0x7fffffffu)) >> 31;
    const v16u rounded = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) << 16;
    const v16i bits = ((v16i)rounded & ~nan) | ((v16i)u & nan);
    v16f y;
    memcpy(&y, &bits, sizeof y);
    return y;
}

static inline void store16_f32(float *p, v16f x) { memcpy(p, &x, sizeof x); }

/* count bf16 values widened to fp32 (exact), 16 at a time */
static inline void widen_bf16(const uint16_t *from, int64_t count, float *to) {
    int64_t i = 0;
    for (; i + 16 <= count; i += 16) store16_f32(to + i, load16_bf16(from + i));
    for (; i < count; i++) to[i] = bf16_to_f32(from[i]);
}

/* A vector's floats rounded to bf16 (to nearest even, as torch) and stored: one body for the 16-float vectors
   (store16_bf16) and the ISA's own (storev_bf16, below); VF/VU/VI the float, unsigned and int vectors, VH
   the bf16 one. */
#define DEFINE_STORE_BF16(NAME, VF, VU, VI, VH)                                                                   \
    static inline void NAME(uint16_t *p, VF x) {                                                                 \
        VU u;                                                                                                    \
        memcpy(&u, &x, sizeof u);                                                                                \
        /* all ones where NaN: GCC turned the unsigned compare of 16 lanes into scalar code on AVX2 */           \
        const VI nan = (0x7f800000 - (VI)(u & 0x7fffffffu)) >> 31;                                               \
        const VU rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;                                               \
        const VU quiet = (u >> 16) | 0x40u; /* NaN stays NaN */                                                  \
        const VH h = __builtin_convertvector((VU)(((VI)rounded & ~nan) | ((VI)quiet & nan)), VH);                \
        memcpy(p, &h, sizeof h);                                                                                 \
    }

DEFINE_STORE_BF16(store16_bf16, v16f, v16u, v16i, v16h)

/* count fp32 values rounded to bf16 (to nearest even, as torch), 16 at a time */
static inline void narrow_bf16(const float *from, int64_t count, uint16_t *to) {
    int64_t i = 0;
    for (; i + 16 <= count; i += 16) store16_bf16(to + i, load16_f32(from + i));
    for (; i < count; i++) to[i] = f32_to_bf16(from[i]);
}

/* Code written once for both dtypes as functions: each takes `bf16` (0: fp32, 1: bf16 bit patterns)
   and is always inlined into a caller that passes a constant, so each dtype compiles to its own loops,
   as a template would, and a debugger steps through them as functions. These are their loads and
   stores: element `at` of `base` in that dtype, widened to fp32 on load and rounded on store. */

ALWAYS_INLINE float load_at(const void *base, int64_t at, int bf16) {
    return bf16 ? load_bf16(((const uint16_t *)base)[at]) : load_f32(((const float *)base)[at]);
}

ALWAYS_INLINE v16f load16_at(const void *base, int64_t at, int bf16) {
    return bf16 ? load16_bf16((const uint16_t *)base + at) : load16_f32((const float *)base + at);
}

ALWAYS_INLINE void store16_at(void *base, int64_t at, v16f x, int bf16) {
    if (bf16)
        store16_bf16((uint16_t *)base + at, x);
    else
        store16_f32((float *)base + at, x);
}

#ifdef __AVX512F__
/* A 16 x 16 block of 4-byte values transposed in registers: r[i]'s lane j becomes r[j]'s lane i. */
static inline void transpose16_regs(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* r[4g + c]'s lane L: rows 4g..4g+3 of column 4L + c; output row j = 4L + c takes lane L of
       r[c], r[4 + c], r[8 + c], r[12 + c] */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}
#endif

/* dst[j * dst_stride + i] = rows[i][j] for a 16 x 16 block of 4-byte values: row i read at rows[i]
   (16 floats or bf16 pairs). The AMX kernel lays activations out as tiles with it, the fp32 kernel
   a weight's panel. */
static inline void transpose16_u32(const uint32_t *const rows[16], uint32_t *dst, int64_t dst_stride) {
#ifdef __AVX512F__
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)rows[i]);
    transpose16_regs(r);
    for (int i = 0; i < 16; i++) _mm512_storeu_si512((void *)(dst + dst_stride * i), r[i]);
#else
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) dst[j * dst_stride + i] = rows[i][j];
#endif
}

/* e^x, a vector at a time: Cephes' expf (Cody-Waite reduction by ln 2, degree-6 polynomial), within
   about an ulp; exactly 0 below -87.3 (where e^x leaves fp32's normal range; e^-inf = 0), x
   clamped at 88.3 above. A scalar expf per element cost as much as the work around it. One body for
   the 16-float vectors (vexp) and the ISA's own (vexpv, below): VF/VI the float and int vectors, GT their `>`. */
#define DEFINE_VEXP(NAME, VF, VI, GT)                                                                            \
    ALWAYS_INLINE VF NAME(VF x) {                                                                                \
        const VI tiny = GT((VF){0} - 87.3f, x), huge = GT(x, (VF){0} + 88.3f);                                   \
        x = (VF)(((VI)x & ~(tiny | huge)) | ((VI)((VF){0} - 87.3f) & tiny) | ((VI)((VF){0} + 88.3f) & huge));  \
        const VF shift = (VF){0} + 12582912.0f; /* 1.5 * 2^23: rounds to an integer */                         \
        const VF n = (x * 1.44269504088896341f + shift) - shift;                                                 \
        const VF r = (x - n * 0.693359375f) - n * -2.12194440e-4f;                                               \
        VF p = (VF){0} + 1.9875691500e-4f;                                                                       \
        p = p * r + 1.3981999507e-3f;                                                                            \
        p = p * r + 8.3334519073e-3f;                                                                            \
        p = p * r + 4.1665795894e-2f;                                                                            \
        p = p * r + 1.6666665459e-1f;                                                                            \
        p = p * r + 5.0000001201e-1f;                                                                            \
        p = p * r * r + r + 1.0f;                                                                                \
        return (VF)(((VI)p + (__builtin_convertvector(n, VI) << 23)) & ~tiny);                                  \
    }

DEFINE_VEXP(vexp, v16f, v16i, gt16)

/* The ISA's own vector: 16 floats on AVX-512, 8 (a ymm) elsewhere. Without 64-byte registers (AVX2) GCC
   keeps a 16-float vector that lives across a loop's iterations (a running max or sum) in memory, stored in
   halves and reloaded whole each iteration, and casts one to integers through memory: kernels whose vectors
   live across loops use this type (loadv / storev, their bf16 forms, vexpv, vmaxv). */
#ifdef __AVX512F__
typedef v16f vec;
typedef v16i veci;
typedef v16u vecu;
#else
typedef float vec __attribute__((vector_size(32)));
typedef int32_t veci __attribute__((vector_size(32)));
typedef uint32_t vecu __attribute__((vector_size(32)));
#endif
#define VW ((int)(sizeof(vec) / sizeof(float))) /* floats a vector */

static inline vec loadv(const float *p) {
    vec x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void storev(float *p, vec x) { memcpy(p, &x, sizeof x); }

/* a * b + c, rounded once, as written: a chain of these keeps its order and its bits wherever it is inlined
   (with -ffp-contract=fast the compiler fuses `s = a0 * b0 + a1 * b1` either way round, and did so
   differently in two loops of one kernel) */
ALWAYS_INLINE vec fmav(vec a, vec b, vec c) {
#if defined(__AVX512F__)
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

#ifdef __AVX512F__
#define loadv_bf16 load16_bf16
#define storev_bf16 store16_bf16
#define vexpv vexp
#define vmaxv vmax16
#else
typedef uint16_t vech __attribute__((vector_size(16)));
static inline vec loadv_bf16(const uint16_t *p) { /* exact: the high half of the bits */
    vech h;
    memcpy(&h, p, sizeof h);
    return (vec)(__builtin_convertvector(h, vecu) << 16);
}
DEFINE_STORE_BF16(storev_bf16, vec, vecu, veci, vech)
#define GT_NATIVE(a, b) ((a) > (b))
DEFINE_VEXP(vexpv, vec, veci, GT_NATIVE)
DEFINE_VMAX(vmaxv, vec, veci, GT_NATIVE)
#endif

/* 2 * VW bf16 values, one load, as VW pairs of 32 bits: the pairs' low halves widened (exactly) by a shift
   into *lo, their high halves by a mask into *hi (bf16 panels, f32_panels.h; the MoE block's rows, moe_experts.c). */
static inline void load_bf16_pair(const uint16_t *q, vec *lo, vec *hi) {
    vecu u;
    memcpy(&u, q, sizeof u);
    const vecu l = u << 16, h = u & 0xffff0000u;
    memcpy(lo, &l, sizeof l);
    memcpy(hi, &h, sizeof h);
}

/* n bf16 values (a multiple of 2 * VW) widened, each 2 * VW of them as their VW even then their VW odd values
   (load_bf16_pair's halves), times scale, into dst: a row laid out as kernels that widen bf16 so read their
   other operand (paged_decode.c's even_odd_passes.h, moe_experts.c's dot products on AVX2) */
static inline void widen_row_even_odd(const uint16_t *src, int64_t n, float scale, float *dst) {
    for (int64_t i = 0; i < n; i += 2 * VW) {
        vec e, o;
        load_bf16_pair(src + i, &e, &o);
        storev(dst + i, e * scale), storev(dst + i + VW, o * scale);
    }
}

ALWAYS_INLINE vec loadv_at(const void *base, int64_t at, int bf16) {
    return bf16 ? loadv_bf16((const uint16_t *)base + at) : loadv((const float *)base + at);
}

ALWAYS_INLINE void storev_at(void *base, int64_t at, vec x, int bf16) {
    if (bf16)
        storev_bf16((uint16_t *)base + at, x);
    else
        storev((float *)base + at, x);
}

/* A buffer of at least `bytes` that the calling thread keeps between calls (a fresh one is an mmap and its
   page faults on every call): one per thread in each kernel library, shared by that library's calls (each
   uses it only while it runs); NULL where it cannot be had. */
static inline void *thread_buffer(int64_t bytes) {
    static __thread void *buffer = NULL;
    static __thread int64_t capacity = 0;
    if (bytes > capacity) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        capacity = buffer == NULL ? 0 : bytes;
    }
    return buffer;
}

/* Activation rows copied further apart than their own length, into a buffer a thread keeps: rows whose
   length is a multiple of 4096 bytes put a kernel's block of rows in one set of L1 (8 ways) at each step
   of K (bf16_rows.c and f32_linear.c say what it cost them). The copy's rows lie `gap` bytes further
   apart, the first `offset` bytes into a page (offset < 4096). NULL where the buffer cannot be had
   (then the caller reads x as is). rows_apart_release frees a buffer grown past `keep` bytes (a
   prefill's), so a decode step's calls reuse theirs. */
typedef struct {
    char *buf;
    size_t cap;
} rows_apart_buf;

static inline const void *rows_apart(rows_apart_buf *b, const void *x, int64_t m, size_t row_bytes, size_t gap,
                                     size_t offset) {
    const size_t ld = row_bytes + gap, need = ((size_t)m * ld + offset + 4095) / 4096 * 4096;
    if (need > b->cap) {
        free(b->buf);
        b->buf = aligned_alloc(4096, need);
        b->cap = b->buf ? need : 0;
        if (b->buf == NULL) return NULL;
    }
    char *base = b->buf + offset;
    for (int64_t r = 0; r < m; r++) memcpy(base + r * ld, (const char *)x + r * row_bytes, row_bytes);
    return base;
}

static inline void rows_apart_release(rows_apart_buf *b, size_t keep) {
    if (b->cap > keep) {
        free(b->buf);
        b->buf = NULL, b->cap = 0;
    }
}

#endif
