/* How many multiply instructions a second each core retires, every one independent of the last
   (12 accumulators each, all in registers): the ceiling of a step bound by its products, per
   instruction kind. An empty asm after each one keeps GCC from hoisting or merging them. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define KEEP(v) __asm__ volatile("" : "+v"(v))
#define TWELVE(OP) OP(a0); OP(a1); OP(a2); OP(a3); OP(a4); OP(a5); \
                   OP(a6); OP(a7); OP(a8); OP(a9); OP(a10); OP(a11);
#define DECLARE(T, init) T a0 = init, a1 = init, a2 = init, a3 = init, a4 = init, a5 = init, \
                           a6 = init, a7 = init, a8 = init, a9 = init, a10 = init, a11 = init;
#define SINK(a) sink ^= (int64_t)a[0];

/* Each kind: its loop of n x 12 instructions; returns the seconds it took. Its inputs are copied into
   locals first (INPUTS): a thread writing a shared input back would move its cache line between cores. */
#define KIND(name, T, init, INPUTS, OP)                                      \
    static double name(int64_t n, volatile int64_t *out) {                   \
        INPUTS                                                                \
        DECLARE(T, init)                                                      \
        double t = now();                                                     \
        for (int64_t i = 0; i < n; i++) { TWELVE(OP) }                         \
        t = now() - t;                                                        \
        int64_t sink = 0;                                                     \
        TWELVE(SINK)                                                          \
        *out = sink;                                                          \
        return t;                                                             \
    }

#if defined(__AVX512F__)
#define FMA512(a) a = _mm512_fmadd_ps(x, y, a); KEEP(a)
static __m512 fx, fy;
KIND(fma512, __m512, _mm512_set1_ps(1.f), __m512 x = fx; __m512 y = fy;, FMA512)
#endif
#if defined(__AVX512BF16__)
#define DPBF16(a) a = _mm512_dpbf16_ps(a, x, y); KEEP(a)
static __m512bh bx, by;
KIND(dpbf16, __m512, _mm512_set1_ps(1.f), __m512bh x = bx; __m512bh y = by;, DPBF16)
#endif
#if defined(__AVX512VNNI__)
#define DPBUSD(a) a = _mm512_dpbusd_epi32(a, x, y); KEEP(a)
#define DPWSSD(a) a = _mm512_dpwssd_epi32(a, x, y); KEEP(a)
static __m512i ix, iy;
KIND(dpbusd, __m512i, _mm512_set1_epi32(1), __m512i x = ix; __m512i y = iy;, DPBUSD)
KIND(dpwssd, __m512i, _mm512_set1_epi32(1), __m512i x = ix; __m512i y = iy;, DPWSSD)
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define FMA256(a) a = _mm256_fmadd_ps(x, y, a); KEEP(a)
/* the madd's input kept opaque too, or GCC computes the one product once */
#define MADD256(a) KEEP(x); a = _mm256_add_epi32(a, _mm256_madd_epi16(x, y)); KEEP(a)
static __m256 gx, gy;
static __m256i jx, jy;
KIND(fma256, __m256, _mm256_set1_ps(1.f), __m256 x = gx; __m256 y = gy;, FMA256)
KIND(madd256, __m256i, _mm256_set1_epi32(1), __m256i x = jx; __m256i y = jy;, MADD256)
#endif

/* Which kinds this build has, as a bit mask in `names` order below (0: fma512, 1: dpbf16, 2: dpbusd,
   3: dpwssd, 4: fma256, 5: madd256). */
int dot_rates_kinds(void) {
    int m = 0;
#if defined(__AVX512F__)
    m |= 1;
#endif
#if defined(__AVX512BF16__)
    m |= 2;
#endif
#if defined(__AVX512VNNI__)
    m |= 4 | 8;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    m |= 16 | 32;
#endif
    return m;
}

/* Instructions of `kind` retired a second by `threads` threads together, each running n x 12. */
double dot_rates_run(int kind, int64_t n, int threads) {
    double worst = 0;
    volatile int64_t sink = 0;
#if defined(__AVX512F__)
    fx = _mm512_set1_ps(1.0001f); fy = _mm512_set1_ps(0.9999f);
#endif
#if defined(__AVX512BF16__)
    bx = (__m512bh)_mm512_set1_epi16(0x3f80); by = (__m512bh)_mm512_set1_epi16(0x3f81);
#endif
#if defined(__AVX512VNNI__)
    ix = _mm512_set1_epi16(3); iy = _mm512_set1_epi16(5);
#endif
#if defined(__AVX2__) && defined(__FMA__)
    gx = _mm256_set1_ps(1.0001f); gy = _mm256_set1_ps(0.9999f);
    jx = _mm256_set1_epi16(3); jy = _mm256_set1_epi16(5);
#endif
#pragma omp parallel num_threads(threads) reduction(max : worst)
    {
        double t = 0;
        int64_t out = 0;
        switch (kind) {
#if defined(__AVX512F__)
        case 0: t = fma512(n, &out); break;
#endif
#if defined(__AVX512BF16__)
        case 1: t = dpbf16(n, &out); break;
#endif
#if defined(__AVX512VNNI__)
        case 2: t = dpbusd(n, &out); break;
        case 3: t = dpwssd(n, &out); break;
#endif
#if defined(__AVX2__) && defined(__FMA__)
        case 4: t = fma256(n, &out); break;
        case 5: t = madd256(n, &out); break;
#endif
        default: break;
        }
        worst = t;
        sink += out;
    }
    return worst > 0 ? (double)threads * n * 12 / worst : 0;
}
