/* The element-wise steps between a decoder layer's matmuls, fused, for CPU (fp32).
 *
 * In eager PyTorch each is several ops (RMSNorm alone is six), and at decode sizes every op costs
 * its dispatch and a trip through memory; after a matmul that streamed megabytes of weights
 * through the cache, that trip is the expensive part. One call per step does the whole thing
 * in one pass over the rows. The arithmetic follows transformers' order (the residual sum first,
 * then mean of squares, rsqrt, scale by the weight).
 *
 * Rows are split across threads; a row is at most a few KB, so one row is never split.
 */
#include <math.h>
#include <stdint.h>

static inline void rms_norm_row(const float *x, const float *weight, float *out, int64_t dim, float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; ++i) sum += x[i] * x[i];
    const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int64_t i = 0; i < dim; ++i) out[i] = weight[i] * (x[i] * scale);
}

/* hidden [rows, dim] += delta (when delta is not NULL), then out = rms_norm(hidden) * weight */
void rlserve_add_rms_norm(float *hidden, const float *delta, const float *weight, float *out, int64_t rows,
                          int64_t dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows > 8)
    for (int64_t r = 0; r < rows; ++r) {
        float *h = hidden + r * dim;
        if (delta != 0) {
            const float *d = delta + r * dim;
            for (int64_t i = 0; i < dim; ++i) h[i] += d[i];
        }
        rms_norm_row(h, weight, out + r * dim, dim, eps);
    }
}

/* qkv [tokens, (nh + 2 * nkv) * D] in place: q/k heads RMS-normed per head (when q_norm is not
 * NULL; Qwen3), then rotated (rotate-half RoPE, cos/sin [tokens, D] with sin's first half
 * negated); then each token's k and v heads copied to its KV slot in k_cache/v_cache [slots, nkv, D]. */
void rlserve_qk_rope_store(float *qkv, const float *cos, const float *sin_signed, const float *q_norm,
                           const float *k_norm, float eps, const int64_t *slots, float *k_cache, float *v_cache,
                           int64_t tokens, int64_t nh, int64_t nkv, int64_t D, int num_threads) {
    const int64_t half = D / 2, width = (nh + 2 * nkv) * D;
#pragma omp parallel for num_threads(num_threads) if (tokens > 8)
    for (int64_t t = 0; t < tokens; ++t) {
        float *row = qkv + t * width;
        const float *c = cos + t * D, *s = sin_signed + t * D;
        for (int64_t h = 0; h < nh + nkv; ++h) {
            float *x = row + h * D;
            if (q_norm != 0) rms_norm_row(x, h < nh ? q_norm : k_norm, x, D, eps);
            float rotated[256]; /* MAX_HEAD_DIM: rlserve_paged_attention_limits admits no larger head */
            for (int64_t i = 0; i < half; ++i) {
                rotated[i] = x[i] * c[i] + x[i + half] * s[i];
                rotated[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
            }
            for (int64_t i = 0; i < D; ++i) x[i] = rotated[i];
        }
        float *k_dst = k_cache + slots[t] * nkv * D, *v_dst = v_cache + slots[t] * nkv * D;
        const float *k = row + nh * D, *v = row + (nh + nkv) * D;
        for (int64_t i = 0; i < nkv * D; ++i) {
            k_dst[i] = k[i];
            v_dst[i] = v[i];
        }
    }
}

/* gate_up [rows, 2 * inter] -> out [rows, inter] = silu(gate) * up */
void rlserve_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows > 8)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
