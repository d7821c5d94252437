/* A decode step's decoder layers (Llama-shaped; bf16 hidden states on AMX linears, or fp32 ones on
   engine/kernels/native/f32_linear.c; weight-only int8 linears in either; a sparse MLP through
   engine/kernels/native/moe_experts.c where a layer has one) in one call.

   Driven layer by layer from Python, a 32-sequence bf16 decode step on 2 cores spent about a third
   of its main thread's time in the interpreter and torch's dispatch between the kernels (views,
   splits, module calls, output allocations: ~20 per layer), while the other core waited. Here the
   same kernels run in the same order on the same buffers, called through the function pointers
   Python hands over (each kernel stays in its own library: engine/models/native_layers.py), so the
   arithmetic, and in bf16 and in an int8 engine every bit of the result, is the Python forward's
   (engine/models/fused_layers.py). In the fp32 engine the norm and silu are C's (layer_glue.c's *_f32)
   where Python runs torch's ops: the same arithmetic to within an ulp or so a value, held to HF's
   logprobs by the fp32 engine's tests.

   The residual add that ends a layer (h + down) is done by the next norm's add (add_rms_norm's
   h = x + r, rounded as torch's add rounds it), the last one by the final norm's.

   Gemma 3's layers (Shape.gemma; engine/models/gemma_model.py) run their own order: Gemma's norm (1 + w,
   layer_glue.c's gemma_norm) before the attention, after it and on each side of the MLP, the residual
   added after a norm (h + norm(o): rounded as torch's add), q/k norms Gemma's, GELU for SiLU, and the
   rope table of the layer's kind (Layer.cos, Layer.sin). */

#include "common.h"

typedef int (*linear_bf16_fn)(const uint16_t *x, int64_t m, int64_t k, const void *w, int64_t n,
                              const uint16_t *bias, uint16_t *out);
typedef int (*linear_w8_fn)(const uint16_t *x, int64_t m, int64_t k, const void *w, int64_t n, uint16_t *out);
typedef int (*linear_rows_fn)(const uint16_t *x, int64_t m, int64_t k, const int64_t *seg_ptr, const int64_t *seg_rows,
                              int64_t nseg, const uint16_t *bias, uint16_t *out);
typedef int (*linear_f32_rows_fn)(const float *x, int64_t m, int64_t k, const int64_t *seg_ptr, const int64_t *seg_rows,
                                  int64_t nseg, const float *bias, float *out);
typedef int (*linear_f32_fn)(const float *x, int64_t m, int64_t k, const float *w, int64_t n, const float *bias,
                             float *out);
typedef int (*linear_w8_f32_fn)(const uint16_t *x, int64_t m, int64_t k, const void *w, int64_t n, float *out);

/* The kernels, as engine/models/native_layers.py lists their addresses: the linears, then the glue and the
   attention in the loop's dtype (layer_glue.c's and paged_decode.c's _bf16 or _f32). */
typedef struct {
    int64_t linear_bf16, linear_w8, linear_f32, linear_w8_f32, linear_bf16_rows, linear_f32_rows, linear_f32_bf16,
        linear_f32_bf16_rows, rope_cache, add_rms_norm, silu_mul, paged_decode, gemma_norm, gelu_mul;
    /* a model with sparse MLPs: moe_experts.c's moe_block_* and the kernel table it takes, and its
       router_logits_* (0 for a dense model) */
    int64_t moe_block, moe_kernels, router_logits;
} Kernels;

/* A linear's packed weight, its kernel (LINEAR_*) and its bias (0: none; in the loop's dtype, added
   as the Python path adds it: by the bf16 and fp32 kernels, after a weight-only int8 one's rounded
   output). LINEAR_BF16_ROWS: `weight` is the segments of weights read in place, [count, 3 pointers,
   3 row counts] (derived_weights.WeightRows); LINEAR_F32_ROWS the same in fp32; LINEAR_F32_BF16 the fp32
   kernel's bf16 panels (a bf16 model's copy on AVX2: f32_linear_bf16_panels); LINEAR_F32_BF16_ROWS its bf16
   weights read in place by it (f32_linear_rows_bf16, ROLLOUT_F32_IN_PLACE=1). */
enum {
    LINEAR_BF16 = 0, LINEAR_W8 = 1, LINEAR_F32 = 2, LINEAR_BF16_ROWS = 3, LINEAR_F32_ROWS = 4, LINEAR_F32_BF16 = 5,
    LINEAR_F32_BF16_ROWS = 6
};
typedef struct {
    int64_t weight, kind, bias;
} Linear;

/* One layer, as engine/models/native_layers.py fills a row of int64s (LAYER_FIELDS there). */
typedef struct {
    int64_t input_norm, post_norm;
    Linear qkv, o, gate_up, down;
    int64_t k_cache, v_cache; /* the layer's [num_blocks, bs, KVH, D] (= [slots, KVH, D]) */
    int64_t q_norm, k_norm;   /* Qwen3's RMS norms of each q and k head ([D] weights; 0: none) */
    /* moe != 0: a sparse MLP in gate_up/down's place (engine/models/moe_model.py): its router's weight
       [experts, H] and its experts' [experts, 2 * width, H] and [experts, H, width], read in place;
       the top k, the routing's flags (moe_experts.c's norm and weights_f32); ids: where the step's
       expert ids go, [T, top_k] int64 (a request's routed experts) */
    int64_t moe, router, experts_gate_up, experts_down, experts, top_k, expert_width, norm_topk, weights_f32, ids;
    int64_t window; /* the layer's sliding window in keys (0: full attention) */
    /* Gemma's: the norms before and after the MLP, and the layer's rope tables [T, D] (0: the call's) */
    int64_t pre_ff_norm, post_ff_norm, cos, sin;
    /* the step's cache slot of each row [T] and block table [T, table_stride] in this layer's KV cache group
       (engine/kv_groups.py: a model mixing windowed and full layers keeps a cache of each) */
    int64_t slots, table;
} Layer;

/* The model's sizes and the step's rows (T decode rows, one per sequence). */
typedef struct {
    int64_t layers, T, hidden, heads, kv_heads, head_dim, intermediate, block_size, max_len, table_stride, gemma;
    int64_t rotary; /* a head's rotated values: head_dim, or fewer (a partial rotary: the rope tables' width) */
    float eps, scale;
} Shape;

/* A bf16 model's linear on the fp32 kernel, as packed_linears runs it on a CPU without bf16 kernels (AVX2:
   compute_dtype; its panels fp32 or bf16, or its bf16 weights in place): the input and the bias widened
   (exact), the fp32 kernel's sums and bias, the output rounded to bf16 once: the Python forward's bits. */
static int linear_f32_on_bf16(const Kernels *kn, Linear w, const uint16_t *x, int64_t m, int64_t k, int64_t n,
                              uint16_t *out) {
    float *x32 = thread_buffer((m * k + m * n + n) * (int64_t)sizeof(float));
    if (x32 == NULL) return -1;
    float *out32 = x32 + m * k, *bias = w.bias ? out32 + m * n : NULL;
    widen_bf16(x, m * k, x32);
    if (bias) widen_bf16((const uint16_t *)w.bias, n, bias);
    int rc;
    if (w.kind == LINEAR_F32_BF16_ROWS) {
        const int64_t *seg = (const int64_t *)w.weight;
        rc = ((linear_f32_rows_fn)kn->linear_f32_bf16_rows)(x32, m, k, seg + 1, seg + 4, seg[0], bias, out32);
    } else {
        const int64_t kernel = w.kind == LINEAR_F32_BF16 ? kn->linear_f32_bf16 : kn->linear_f32;
        rc = ((linear_f32_fn)kernel)(x32, m, k, (const float *)w.weight, n, bias, out32);
    }
    narrow_bf16(out32, m * n, out);
    return rc;
}

static int linear_bf16(const Kernels *kn, Linear w, const uint16_t *x, int64_t m, int64_t k, int64_t n,
                       uint16_t *out) {
    if (w.kind == LINEAR_F32 || w.kind == LINEAR_F32_BF16 || w.kind == LINEAR_F32_BF16_ROWS)
        return linear_f32_on_bf16(kn, w, x, m, k, n, out);
    if (w.kind == LINEAR_BF16)
        return ((linear_bf16_fn)kn->linear_bf16)(x, m, k, (const void *)w.weight, n, (const uint16_t *)w.bias, out);
    if (w.kind == LINEAR_W8) {
        const int rc = ((linear_w8_fn)kn->linear_w8)(x, m, k, (const void *)w.weight, n, out);
        if (rc == 0 && w.bias) /* after the output's rounding, as the Python path adds it: a bf16 add */
            for (int64_t i = 0; i < m * n; i++)
                out[i] = f32_to_bf16(bf16_to_f32(out[i]) + bf16_to_f32(((const uint16_t *)w.bias)[i % n]));
        return rc;
    }
    if (w.kind == LINEAR_BF16_ROWS) {
        const int64_t *seg = (const int64_t *)w.weight;
        return ((linear_rows_fn)kn->linear_bf16_rows)(x, m, k, seg + 1, seg + 4, seg[0], (const uint16_t *)w.bias, out);
    }
    return -3;
}

/* fp32 hidden states: our fp32 kernel, or weight-only int8 (an int8 engine fed fp32 pushes) on the
   input rounded to bf16 (as torch's .to(bfloat16) rounds: to nearest even) into `x16`, out in fp32. */
static int linear_f32(const Kernels *kn, Linear w, const float *x, int64_t m, int64_t k, int64_t n, float *out,
                      uint16_t *x16) {
    if (w.kind == LINEAR_F32)
        return ((linear_f32_fn)kn->linear_f32)(x, m, k, (const float *)w.weight, n, (const float *)w.bias, out);
    if (w.kind == LINEAR_F32_ROWS) {
        const int64_t *seg = (const int64_t *)w.weight;
        return ((linear_f32_rows_fn)kn->linear_f32_rows)(x, m, k, seg + 1, seg + 4, seg[0], (const float *)w.bias, out);
    }
    if (w.kind != LINEAR_W8) return -3;
    narrow_bf16(x, m * k, x16);
    const int rc = ((linear_w8_f32_fn)kn->linear_w8_f32)(x16, m, k, (const void *)w.weight, n, out);
    if (rc == 0 && w.bias) /* after the kernel, as the Python path adds it */
        for (int64_t i = 0; i < m * n; i++) out[i] += ((const float *)w.bias)[i % n];
    return rc;
}

static int linear_bf16_(const Kernels *kn, Linear w, const uint16_t *x, int64_t m, int64_t k, int64_t n,
                        uint16_t *out, uint16_t *x16) {
    (void)x16;
    return linear_bf16(kn, w, x, m, k, n, out);
}

/* The step's scratch, each [T, width] in the loop's dtype, allocated by the caller; hidden
   [T, hidden]: the embeddings in, the final norm's output out. Returns 0, or the first failing
   kernel's code (a linear's -1: no memory for padded rows; -3: a linear of another dtype;
   decode's -1/-2). */
#define DEFINE_DECODE(NAME, T_, LINEAR, ADD)                                                                   \
    typedef struct {                                                                                           \
        T_ *x, *qkv, *q, *k, *attn, *o, *h, *h2, *gate_up, *act, *down;                                        \
        uint16_t *x16; /* [T, the widest input] bf16: a weight-only int8 linear's input in the fp32 loop */   \
        /* a sparse MLP's (moe_experts.c's moe_block_*), for S = T * top_k picks: logits [T, experts], */    \
        /* xg [S, H], gu [S, 2 width], act [S, width], dn [S, H], inv and order [S], ends [experts], */        \
        /* the picks' weights [S] (4 bytes each); NULL in a dense model */                                   \
        T_ *logits, *xg, *gu, *eact, *dn;                                                                      \
        int64_t *inv, *order, *ends;                                                                           \
        void *pick_weights;                                                                                    \
    } NAME##_scratch;                                                                                          \
    typedef void (*NAME##_router)(const T_ *, int64_t, int64_t, const T_ *, int64_t, T_ *);                   \
    typedef int (*NAME##_moe)(const int64_t *, const T_ *, const T_ *, int64_t, int64_t, int64_t, int64_t, int, \
                              int, const T_ *, const T_ *, int64_t, T_ *, T_ *, T_ *, T_ *, int64_t *, int64_t *, \
                              int64_t *, void *, int64_t *, T_ *);                                              \
    typedef void (*NAME##_rope)(const T_ *, int64_t, const T_ *, int64_t, const T_ *, int64_t, int64_t, int64_t, \
                                int64_t, int64_t, int64_t, const T_ *, const T_ *, const int64_t *, T_ *, T_ *, T_ *, \
                                T_ *);                                                                         \
    typedef void (*NAME##_norm)(const T_ *, const T_ *, T_ *, const T_ *, float, int64_t, int64_t, T_ *);       \
    typedef void (*NAME##_silu)(const T_ *, int64_t, int64_t, int64_t, T_ *);                                   \
    typedef void (*NAME##_gnorm)(const T_ *, const T_ *, float, int64_t, int64_t, T_ *);                        \
    typedef int (*NAME##_decode)(const T_ *, const T_ *, const T_ *, const int64_t *, int64_t, const int64_t *, \
                                 T_ *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float);   \
    /* One Gemma layer over cur [T, H] (header): the layer's output in b->h2. */                               \
    static int NAME##_gemma_layer(const Kernels *kn, const Layer *L, const Shape *s, const T_ *cur,           \
                                  const int64_t *lengths, const NAME##_scratch *b) {                          \
        const int64_t *slots = (const int64_t *)L->slots, *table = (const int64_t *)L->table;                  \
        const NAME##_gnorm gnorm = (NAME##_gnorm)kn->gemma_norm;                                               \
        const int64_t T = s->T, H = s->hidden, D = s->head_dim, nq = s->heads * D, nkv = s->kv_heads * D;      \
        const int64_t nqkv = nq + 2 * nkv, I = s->intermediate;                                                \
        gnorm(cur, (const T_ *)L->input_norm, s->eps, T, H, b->x);                                             \
        int rc = LINEAR(kn, L->qkv, b->x, T, H, nqkv, b->qkv, b->x16);                                         \
        if (rc) return rc;                                                                                     \
        for (int64_t t = 0; t < T; t++) { /* each head's q and k normed in place, as Python's q_norm, k_norm */ \
            T_ *row = b->qkv + t * nqkv;                                                                       \
            gnorm(row, (const T_ *)L->q_norm, s->eps, s->heads, D, row);                                       \
            gnorm(row + nq, (const T_ *)L->k_norm, s->eps, s->kv_heads, D, row + nq);                          \
        }                                                                                                      \
        T_ *kc = (T_ *)L->k_cache, *vc = (T_ *)L->v_cache;                                                     \
        ((NAME##_rope)kn->rope_cache)(b->qkv, nqkv, b->qkv + nq, nqkv, b->qkv + nq + nkv, nqkv, T, s->heads,     \
                                      s->kv_heads, D, s->rotary, (const T_ *)L->cos, (const T_ *)L->sin, slots, \
                                      kc, vc,                                                                  \
                                      b->q, b->k);                                                             \
        rc = ((NAME##_decode)kn->paged_decode)(b->q, kc, vc, table, s->table_stride, lengths, b->attn, T,      \
                                                s->heads, s->kv_heads, D, s->block_size, s->max_len, L->window, \
                                                s->scale);                                                     \
        if (rc) return rc;                                                                                     \
        if ((rc = LINEAR(kn, L->o, b->attn, T, nq, H, b->o, b->x16))) return rc;                               \
        gnorm(b->o, (const T_ *)L->post_norm, s->eps, T, H, b->o);                                             \
        ADD(cur, b->o, T * H, b->h); /* h = cur + norm(o) */                                                   \
        gnorm(b->h, (const T_ *)L->pre_ff_norm, s->eps, T, H, b->x);                                           \
        if ((rc = LINEAR(kn, L->gate_up, b->x, T, H, 2 * I, b->gate_up, b->x16))) return rc;                   \
        ((NAME##_silu)kn->gelu_mul)(b->gate_up, 2 * I, T, I, b->act);                                          \
        if ((rc = LINEAR(kn, L->down, b->act, T, I, H, b->down, b->x16))) return rc;                           \
        gnorm(b->down, (const T_ *)L->post_ff_norm, s->eps, T, H, b->down);                                    \
        ADD(b->h, b->down, T * H, b->h2);                                                                      \
        return 0;                                                                                              \
    }                                                                                                          \
    int NAME(const Kernels *kn, const Layer *layers, const Shape *s, const T_ *final_norm, const T_ *cos,      \
             const T_ *sin_signed, const int64_t *lengths, const NAME##_scratch *b, T_ *hidden) {              \
        const NAME##_norm norm = (NAME##_norm)kn->add_rms_norm;                                                \
        const int64_t T = s->T, H = s->hidden, D = s->head_dim, nq = s->heads * D, nkv = s->kv_heads * D;      \
        const int64_t nqkv = nq + 2 * nkv, I = s->intermediate;                                                \
        const T_ *cur = hidden, *res = NULL; /* the layer's input is cur + res (res NULL: cur) */             \
        for (int64_t l = 0; l < s->layers; l++) {                                                              \
            const Layer *L = layers + l;                                                                       \
            const int64_t *slots = (const int64_t *)L->slots, *table = (const int64_t *)L->table;              \
            if (s->gemma) {                                                                                    \
                const int rc = NAME##_gemma_layer(kn, L, s, cur, lengths, b);                                  \
                if (rc) return rc;                                                                             \
                cur = b->h2;                                                                                   \
                continue;                                                                                      \
            }                                                                                                  \
            norm(cur, res, b->h, (const T_ *)L->input_norm, s->eps, T, H, b->x);                               \
            const T_ *base = res ? b->h : cur;                                                                 \
            int rc = LINEAR(kn, L->qkv, b->x, T, H, nqkv, b->qkv, b->x16);                                             \
            if (rc) return rc;                                                                                 \
            if (L->q_norm) /* each head's row normed in place, before the rotation, as HF's layer does */      \
                _Pragma("omp parallel for schedule(static) if (T * nqkv > 16384)")                               \
                for (int64_t t = 0; t < T; t++) {                                                              \
                    T_ *row = b->qkv + t * nqkv;                                                               \
                    norm(row, NULL, NULL, (const T_ *)L->q_norm, s->eps, s->heads, D, row);                    \
                    norm(row + nq, NULL, NULL, (const T_ *)L->k_norm, s->eps, s->kv_heads, D, row + nq);       \
                }                                                                                              \
            T_ *kc = (T_ *)L->k_cache, *vc = (T_ *)L->v_cache;                                                 \
            ((NAME##_rope)kn->rope_cache)(b->qkv, nqkv, b->qkv + nq, nqkv, b->qkv + nq + nkv, nqkv, T, s->heads, \
                                          s->kv_heads, D, s->rotary, L->cos ? (const T_ *)L->cos : cos,        \
                                          L->sin ? (const T_ *)L->sin : sin_signed, slots, kc, vc, b->q, b->k); \
            rc = ((NAME##_decode)kn->paged_decode)(b->q, kc, vc, table, s->table_stride, lengths, b->attn, T,  \
                                                    s->heads, s->kv_heads, D, s->block_size, s->max_len, L->window, \
                                                    s->scale);                                                 \
            if (rc) return rc;                                                                                 \
            if ((rc = LINEAR(kn, L->o, b->attn, T, nq, H, b->o, b->x16))) return rc;                                   \
            norm(base, b->o, b->h2, (const T_ *)L->post_norm, s->eps, T, H, b->x);                             \
            if (L->moe) { /* the router, then the routing and the experts in one call, as Python's block */    \
                ((NAME##_router)kn->router_logits)(b->x, T, H, (const T_ *)L->router, L->experts, b->logits);   \
                rc = ((NAME##_moe)kn->moe_block)((const int64_t *)kn->moe_kernels, b->x, b->logits, T, H,        \
                                                 L->experts, L->top_k, (int)L->norm_topk, (int)L->weights_f32,   \
                                                 (const T_ *)L->experts_gate_up, (const T_ *)L->experts_down,    \
                                                 L->expert_width, b->xg, b->gu, b->eact, b->dn, b->inv,          \
                                                 b->order, b->ends, b->pick_weights, (int64_t *)L->ids, b->down); \
                if (rc) return rc;                                                                             \
            } else {                                                                                           \
                if ((rc = LINEAR(kn, L->gate_up, b->x, T, H, 2 * I, b->gate_up, b->x16))) return rc;           \
                ((NAME##_silu)kn->silu_mul)(b->gate_up, 2 * I, T, I, b->act);                                  \
                if ((rc = LINEAR(kn, L->down, b->act, T, I, H, b->down, b->x16))) return rc;                   \
            }                                                                                                  \
            cur = b->h2, res = b->down;                                                                        \
        }                                                                                                      \
        if (s->gemma)                                                                                          \
            ((NAME##_gnorm)kn->gemma_norm)(cur, final_norm, s->eps, T, H, hidden);                             \
        else                                                                                                   \
            norm(cur, res, b->h, final_norm, s->eps, T, H, hidden);                                            \
        return 0;                                                                                              \
    }

/* out = a + b, n values, rounded as torch's add rounds it */
static void add_bf16(const uint16_t *a, const uint16_t *b, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}
static void add_f32(const float *a, const float *b, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

DEFINE_DECODE(decode_layers_bf16, uint16_t, linear_bf16_, add_bf16)
DEFINE_DECODE(decode_layers_f32, float, linear_f32, add_f32)
