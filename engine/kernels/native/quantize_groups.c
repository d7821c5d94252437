/* Weight-only int8's copy of a weight in one pass: for each 32 columns and 32 values of K (a chunk
   of amx_linears.pack_w8's layout) the columns' bf16 scales (one per W8_GROUP values of K), then their
   int8 values in the bf16 tiles' order. What int8_linears.quantize_groups and amx_linears.pack_w8 do in
   about twenty torch ops (80 + 46 ms for one 3072 x 576 weight: 7 s for SmolLM2, on every push into an
   int8 engine), with the same bits: scale = max|w| of the group / 127 in fp32, rounded to bf16
   (nearest, ties even), at least bf16's smallest normal; q = w / scale (fp32, scale widened) rounded to
   nearest, ties to even (nearbyintf, as torch.round), clamped to [-127, 127]. Past N and K the chunk
   holds zeros. */

#include <float.h>

#include "common.h"
#include "w8_chunk.h"

#define BF16_TINY 1.17549435e-38f /* bf16's smallest normal: fp32's */

/* scales [N, ceil(K / W8_GROUP)]: each row's groups; a chunk's group past K keeps a zero scale. */
#define DEFINE_QUANTIZE_GROUPS(NAME, T, LOAD)                                                            \
    void NAME(const T *w, int64_t n, int64_t k, uint8_t *packed, uint16_t *scales) {                    \
        const int64_t pn = (n + 31) / 32, kc = (k + 31) / 32, groups = (k + W8_GROUP - 1) / W8_GROUP;    \
        _Pragma("omp parallel for schedule(static) if (n * k > 65536)")                                  \
        for (int64_t b = 0; b < pn; b++) {                                                               \
            for (int64_t c = 0; c < kc; c++) {                                                           \
                uint8_t *chunk = packed + (b * kc + c) * W8_CHUNK_BYTES;                                 \
                uint16_t *chunk_scale = (uint16_t *)chunk;                                               \
                int8_t *q = (int8_t *)(chunk + W8_SCALE_BYTES);                                          \
                memset(chunk, 0, W8_CHUNK_BYTES);                                                        \
                for (int j = 0; j < 32; j++) {                                                           \
                    const int64_t row = b * 32 + j;                                                      \
                    if (row >= n) break;                                                                 \
                    const int t = j / 16, col = j % 16; /* the column's tile and place in it */          \
                    for (int g = 0; g < W8_GROUPS; g++) {                                                \
                        const int64_t k0 = c * 32 + g * W8_GROUP;                                        \
                        if (k0 >= k) break;                                                              \
                        const T *src = w + row * k + k0;                                                 \
                        const int len = k - k0 < W8_GROUP ? (int)(k - k0) : W8_GROUP;                    \
                        float m = 0.f;                                                                   \
                        for (int i = 0; i < len; i++) m = fmaxf(m, fabsf(LOAD(src[i])));                 \
                        uint16_t s16 = f32_to_bf16(m / 127.f);                                           \
                        if (bf16_to_f32(s16) < BF16_TINY) s16 = f32_to_bf16(BF16_TINY);                  \
                        chunk_scale[32 * g + j] = s16;                                                   \
                        scales[row * groups + k0 / W8_GROUP] = s16;                                      \
                        const float s = bf16_to_f32(s16);                                                \
                        for (int i = 0; i < len; i++) {                                                  \
                            const int kk = g * W8_GROUP + i; /* K within the chunk */                    \
                            const float v = fminf(fmaxf(nearbyintf(LOAD(src[i]) / s), -127.f), 127.f);   \
                            q[t * 512 + (kk / 2) * 32 + col * 2 + (kk % 2)] = (int8_t)v;                 \
                        }                                                                                \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }

DEFINE_QUANTIZE_GROUPS(quantize_groups_f32, float, load_f32)
DEFINE_QUANTIZE_GROUPS(quantize_groups_bf16, uint16_t, load_bf16)
