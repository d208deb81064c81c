/* A whole decode step's decoder layers for a few rows, in one call (included once per storage
 * type by decode.c; T, NAME from scalar.h).
 *
 * At batch 1 the layers' weights stream through the GEMV in ~18 ms (SmolLM2-135M, fp32, 2 cores),
 * but the forward took ~28 ms: the other ~10 ms were Python between the C calls (module calls,
 * tensor allocations, ctypes) at ~16 calls per layer. This runs the same calls in the same order
 * on the same buffers as the model's fused Python path, so its output is bit-identical to it; it
 * only drops the interpreter between them. Dense layers without LoRA or tensor parallelism only
 * (the model checks); anything else takes the Python path. */
#include <stdint.h>

#include "scalar.h"

void NAME(rlserve_gemv)(const T *x, const T *w, const T *bias, T *out, int64_t rows, int64_t K, int64_t N,
                        int num_threads);
void NAME(rlserve_gemm_packed)(const T *x, const void *packed, const T *bias, void *out, int out_f32, int64_t rows,
                               int64_t K, int64_t N, int num_threads);

/* a projection through its packed panels when it has them (batch-invariant mode), else the GEMV */
static inline void NAME(decode_project)(const T *x, const T *w, const void *panels, const T *bias, T *out, int64_t rows,
                                        int64_t K, int64_t N, int num_threads) {
    if (panels) NAME(rlserve_gemm_packed)(x, panels, bias, out, 0, rows, K, N, num_threads);
    else NAME(rlserve_gemv)(x, w, bias, out, rows, K, N, num_threads);
}
void NAME(rlserve_add_rms_norm)(T *hidden, const T *delta, const T *weight, T *out, int64_t rows, int64_t dim,
                                float eps, int num_threads);
void NAME(rlserve_qk_rope_store)(T *qkv, const T *cos, const T *sin_signed, const T *q_norm, const T *k_norm,
                                 float eps, const int64_t *slots, T *k_cache, T *v_cache, int64_t tokens, int64_t nh,
                                 int64_t nkv, int64_t D, int num_threads);
void NAME(rlserve_silu_mul)(const T *gate_up, T *out, int64_t rows, int64_t inter, int num_threads);
void NAME(rlserve_paged_attention)(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,
                                   const int64_t *blocks, const int64_t *ctx_lens, T *out, int64_t B, int64_t W,
                                   int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale,
                                   int num_threads);

/* layer_ptrs [layers][DECODE_LAYER_PTRS]: input norm, qkv weight, qkv bias (or 0), q norm (or 0),
 * k norm (or 0), o weight, post-attention norm, gate_up weight, down weight, then the packed panels
 * of qkv, o, gate_up and down (or 0s: model/linear.py's PanelWeight).
 * h [rows, hidden] is the residual stream (updated in place); x [rows, hidden] ends as the final
 * norm (final_norm) of it. kv [layers, 2, slots, nkv, D]; blocks [rows, W]; ctx_lens [rows];
 * slots [rows]; cos/sin_signed [rows, D]. scratch: qkv [rows, (nh + 2 nkv) D], attn [rows, nh D],
 * delta [rows, hidden], gate_up [rows, 2 inter], act [rows, inter]. */
void NAME(rlserve_decode_layers)(const int64_t *layer_ptrs, int64_t layers, const T *final_norm, T *h, T *x,
                                 const T *cos, const T *sin_signed, const int64_t *slots, T *kv, int64_t kv_slots,
                                 const int64_t *blocks, const int64_t *ctx_lens, int64_t W, int64_t block_size,
                                 T *qkv, T *attn, T *delta, T *gate_up, T *act, int64_t rows, int64_t hidden,
                                 int64_t nh, int64_t nkv, int64_t D, int64_t inter, float eps, float scale,
                                 int num_threads, int gemv_threads) {
    const int64_t qkv_width = (nh + 2 * nkv) * D, kv_half = kv_slots * nkv * D;
#define P(l, i) ((const T *)(intptr_t)layer_ptrs[(l) * DECODE_LAYER_PTRS + (i)])
    NAME(rlserve_add_rms_norm)(h, 0, P(0, 0), x, rows, hidden, eps, num_threads);
    for (int64_t l = 0; l < layers; ++l) {
        T *k_cache = kv + 2 * l * kv_half, *v_cache = k_cache + kv_half;
        NAME(decode_project)(x, P(l, 1), P(l, 9), P(l, 2), qkv, rows, hidden, qkv_width, gemv_threads);
        NAME(rlserve_qk_rope_store)(qkv, cos, sin_signed, P(l, 3), P(l, 4), eps, slots, k_cache, v_cache, rows, nh,
                                    nkv, D, num_threads);
        NAME(rlserve_paged_attention)(qkv, qkv_width, k_cache, v_cache, blocks, ctx_lens, attn, rows, W, nh, nkv, D,
                                      block_size, scale, num_threads);
        NAME(decode_project)(attn, P(l, 5), P(l, 10), 0, delta, rows, nh * D, hidden, gemv_threads);
        NAME(rlserve_add_rms_norm)(h, delta, P(l, 6), x, rows, hidden, eps, num_threads);
        NAME(decode_project)(x, P(l, 7), P(l, 11), 0, gate_up, rows, hidden, 2 * inter, gemv_threads);
        NAME(rlserve_silu_mul)(gate_up, act, rows, inter, num_threads);
        NAME(decode_project)(act, P(l, 8), P(l, 12), 0, delta, rows, inter, hidden, gemv_threads);
        NAME(rlserve_add_rms_norm)(h, delta, l + 1 < layers ? P(l + 1, 0) : final_norm, x, rows, hidden, eps,
                                   num_threads);
    }
#undef P
}
