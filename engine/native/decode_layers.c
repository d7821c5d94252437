/* A decode step's decoder layers (Llama-shaped, bf16 hidden states, AMX linears) in one call.

   Driven layer by layer from Python, a 32-sequence bf16 decode step on 2 cores spent about a third
   of its main thread's time in the interpreter and torch's dispatch between the kernels (views,
   splits, module calls, output allocations: ~20 per layer), while the other core waited. Here the
   same kernels run in the same order on the same buffers, called through the function pointers
   Python hands over (each kernel stays in its own library: engine/native_layers.py), so the
   arithmetic, and every bit of the result, is the Python forward's (engine/fused_layers.py).

   The residual add that ends a layer (h + down) is done by the next norm's add (add_rms_norm's
   h = x + r, rounded to bf16 as torch's add rounds it), the last one by the final norm's. */

#include <stddef.h>
#include <stdint.h>

typedef int (*linear_bf16_fn)(const uint16_t *x, int64_t m, int64_t k, const void *w, int64_t n,
                              const uint16_t *bias, uint16_t *out);
typedef int (*linear_w8_fn)(const uint16_t *x, int64_t m, int64_t k, const void *w, int64_t n, uint16_t *out);
typedef void (*rope_cache_fn)(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                              const uint16_t *v, int64_t v_stride, int64_t T, int64_t H, int64_t KVH, int64_t D,
                              const uint16_t *cos, const uint16_t *sin_signed, const int64_t *slots,
                              uint16_t *k_slots, uint16_t *v_slots, uint16_t *q_out, uint16_t *k_out);
typedef void (*add_rms_norm_fn)(const uint16_t *x, const uint16_t *r, uint16_t *h_out, const uint16_t *w,
                                float eps, int64_t T, int64_t N, uint16_t *out);
typedef void (*silu_mul_fn)(const uint16_t *gate_up, int64_t stride, int64_t T, int64_t I, uint16_t *out);
typedef int (*paged_decode_fn)(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int64_t *table,
                               int64_t table_stride, const int64_t *lengths, uint16_t *out, int64_t B, int64_t H,
                               int64_t KVH, int64_t D, int64_t bs, int64_t max_len, float scale);

/* The kernels, as engine/native_layers.py lists their addresses. */
typedef struct {
    int64_t linear_bf16, linear_w8, rope_cache, add_rms_norm, silu_mul, paged_decode;
} Kernels;

/* A linear's packed weight, its kernel (0 bf16: amx_linear_bf16, 1 weight-only int8) and its bf16
   bias (0: none; the bf16 kernel's only, which adds it before rounding as the Python path does). */
typedef struct {
    int64_t weight, kind, bias;
} Linear;

/* One layer, as engine/native_layers.py fills a row of int64s (LAYER_FIELDS there). */
typedef struct {
    int64_t input_norm, post_norm;
    Linear qkv, o, gate_up, down;
    int64_t k_cache, v_cache; /* the layer's [num_blocks, bs, KVH, D] (= [slots, KVH, D]) */
} Layer;

/* The model's sizes and the step's rows (T decode rows, one per sequence). */
typedef struct {
    int64_t layers, T, hidden, heads, kv_heads, head_dim, intermediate, block_size, max_len, table_stride;
    float eps, scale;
} Shape;

/* The step's scratch, each [T, width] bf16, allocated by the caller. */
typedef struct {
    uint16_t *x, *qkv, *q, *k, *attn, *o, *h, *h2, *gate_up, *act, *down;
} Scratch;

static int linear(const Kernels *kn, Linear w, const uint16_t *x, int64_t m, int64_t k, int64_t n, uint16_t *out) {
    if (w.kind == 0)
        return ((linear_bf16_fn)kn->linear_bf16)(x, m, k, (const void *)w.weight, n, (const uint16_t *)w.bias, out);
    return ((linear_w8_fn)kn->linear_w8)(x, m, k, (const void *)w.weight, n, out);
}

/* hidden [T, hidden]: the embeddings in, the final norm's output out. Returns 0, or the first
   failing kernel's code (a linear's -1: no memory for padded rows; decode's -1/-2). */
int decode_layers_bf16(const Kernels *kn, const Layer *layers, const Shape *s, const uint16_t *final_norm,
                       const uint16_t *cos, const uint16_t *sin_signed, const int64_t *slots, const int64_t *table,
                       const int64_t *lengths, const Scratch *b, uint16_t *hidden) {
    const add_rms_norm_fn norm = (add_rms_norm_fn)kn->add_rms_norm;
    const int64_t T = s->T, H = s->hidden, D = s->head_dim, nq = s->heads * D, nkv = s->kv_heads * D;
    const int64_t nqkv = nq + 2 * nkv, I = s->intermediate;
    const uint16_t *cur = hidden, *res = NULL; /* the layer's input is cur + res (res NULL: cur) */
    for (int64_t l = 0; l < s->layers; l++) {
        const Layer *L = layers + l;
        norm(cur, res, b->h, (const uint16_t *)L->input_norm, s->eps, T, H, b->x);
        const uint16_t *base = res ? b->h : cur;
        int rc = linear(kn, L->qkv, b->x, T, H, nqkv, b->qkv);
        if (rc) return rc;
        uint16_t *kc = (uint16_t *)L->k_cache, *vc = (uint16_t *)L->v_cache;
        ((rope_cache_fn)kn->rope_cache)(b->qkv, nqkv, b->qkv + nq, nqkv, b->qkv + nq + nkv, nqkv, T, s->heads,
                                        s->kv_heads, D, cos, sin_signed, slots, kc, vc, b->q, b->k);
        rc = ((paged_decode_fn)kn->paged_decode)(b->q, kc, vc, table, s->table_stride, lengths, b->attn, T,
                                                  s->heads, s->kv_heads, D, s->block_size, s->max_len, s->scale);
        if (rc) return rc;
        if ((rc = linear(kn, L->o, b->attn, T, nq, H, b->o))) return rc;
        norm(base, b->o, b->h2, (const uint16_t *)L->post_norm, s->eps, T, H, b->x);
        if ((rc = linear(kn, L->gate_up, b->x, T, H, 2 * I, b->gate_up))) return rc;
        ((silu_mul_fn)kn->silu_mul)(b->gate_up, 2 * I, T, I, b->act);
        if ((rc = linear(kn, L->down, b->act, T, I, H, b->down))) return rc;
        cur = b->h2, res = b->down;
    }
    norm(cur, res, b->h, final_norm, s->eps, T, H, hidden);
    return 0;
}
