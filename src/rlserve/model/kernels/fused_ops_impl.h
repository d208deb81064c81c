/* The element-wise steps between a decoder layer's matmuls, fused (included once per storage
 * type by fused_ops.c; T, LD, ST from scalar.h).
 *
 * In eager PyTorch each is several ops (RMSNorm alone is six), and at decode sizes every op costs
 * its dispatch and a trip through memory; after a matmul that streamed megabytes of weights
 * through the cache, that trip is the expensive part. One call per step does the whole thing
 * in one pass over the rows. The arithmetic follows transformers' order (the residual sum first,
 * then mean of squares, rsqrt, scale by the weight), in fp32, rounding to T where it does.
 *
 * Rows are split across parallel.c's threads when there are enough of them (PARALLEL_MIN_WORK); a
 * row is at most a few KB, so one row is never split.
 */
#include <math.h>
#include <stdint.h>

#include "parallel.h"
#include "scalar.h"

static inline void NAME(rms_norm_row)(const T *x, const T *weight, T *out, int64_t dim, float eps) {
    float sum = 0.0f;
    for (int64_t i = 0; i < dim; ++i) sum += LD(x[i]) * LD(x[i]);
    const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
    for (int64_t i = 0; i < dim; ++i) out[i] = ST(LD(weight[i]) * ROUND(LD(x[i]) * scale));
}

struct NAME(norm_job) {
    T *hidden;
    const T *delta, *weight;
    T *out;
    int64_t dim;
    float eps;
};

static void NAME(add_rms_norm_rows)(const void *job_ptr, int64_t begin, int64_t end) {
    const struct NAME(norm_job) *j = job_ptr;
    for (int64_t r = begin; r < end; ++r) {
        T *h = j->hidden + r * j->dim;
        if (j->delta != 0) {
            const T *d = j->delta + r * j->dim;
            for (int64_t i = 0; i < j->dim; ++i) h[i] = ST(LD(h[i]) + LD(d[i]));
        }
        NAME(rms_norm_row)(h, j->weight, j->out + r * j->dim, j->dim, j->eps);
    }
}

/* hidden [rows, dim] += delta (when delta is not NULL), then out = rms_norm(hidden) * weight */
void NAME(rlserve_add_rms_norm)(T *hidden, const T *delta, const T *weight, T *out, int64_t rows, int64_t dim,
                                float eps, int num_threads) {
    const struct NAME(norm_job) job = {hidden, delta, weight, out, dim, eps};
    const int threads = rlserve_threads_for(rows * dim, num_threads);
    rlserve_parallel_for(NAME(add_rms_norm_rows), &job, rows, rlserve_rows_per_chunk(rows, threads), threads);
}

struct NAME(rope_job) {
    T *qkv;
    const T *cos, *sin_signed, *q_norm, *k_norm;
    float eps;
    const int64_t *slots;
    T *k_cache, *v_cache;
    int64_t nh, nkv, D;
};

static void NAME(qk_rope_store_rows)(const void *job_ptr, int64_t begin, int64_t end) {
    const struct NAME(rope_job) *j = job_ptr;
    T *qkv = j->qkv, *k_cache = j->k_cache, *v_cache = j->v_cache;
    const T *cos = j->cos, *sin_signed = j->sin_signed, *q_norm = j->q_norm, *k_norm = j->k_norm;
    const int64_t *slots = j->slots, nh = j->nh, nkv = j->nkv, D = j->D;
    const float eps = j->eps;
    const int64_t half = D / 2, width = (nh + 2 * nkv) * D;
    for (int64_t t = begin; t < end; ++t) {
        T *row = qkv + t * width;
        const T *c = cos + t * D, *s = sin_signed + t * D;
        for (int64_t h = 0; h < nh + nkv; ++h) {
            T *x = row + h * D;
            if (q_norm != 0) NAME(rms_norm_row)(x, h < nh ? q_norm : k_norm, x, D, eps);
            T rotated[256]; /* MAX_HEAD_DIM: rlserve_paged_attention_limits admits no larger head */
            for (int64_t i = 0; i < half; ++i) {
                const float lo = LD(x[i]), hi = LD(x[i + half]);
                rotated[i] = ST(ROUND(lo * LD(c[i])) + ROUND(hi * LD(s[i])));
                rotated[i + half] = ST(ROUND(hi * LD(c[i + half])) + ROUND(lo * LD(s[i + half])));
            }
            for (int64_t i = 0; i < D; ++i) x[i] = rotated[i];
        }
        T *k_dst = k_cache + slots[t] * nkv * D, *v_dst = v_cache + slots[t] * nkv * D;
        const T *k = row + nh * D, *v = row + (nh + nkv) * D;
        for (int64_t i = 0; i < nkv * D; ++i) {
            k_dst[i] = k[i];
            v_dst[i] = v[i];
        }
    }
}

/* qkv [tokens, (nh + 2 * nkv) * D] in place: q/k heads RMS-normed per head (when q_norm is not
 * NULL; Qwen3), then rotated (rotate-half RoPE, cos/sin [tokens, D] with sin's first half
 * negated); then each token's k and v heads copied to its KV slot in k_cache/v_cache [slots, nkv, D]. */
void NAME(rlserve_qk_rope_store)(T *qkv, const T *cos, const T *sin_signed, const T *q_norm, const T *k_norm,
                                 float eps, const int64_t *slots, T *k_cache, T *v_cache, int64_t tokens, int64_t nh,
                                 int64_t nkv, int64_t D, int num_threads) {
    const struct NAME(rope_job) job = {qkv, cos, sin_signed, q_norm, k_norm, eps, slots, k_cache, v_cache, nh, nkv, D};
    const int threads = rlserve_threads_for(tokens * (nh + 2 * nkv) * D, num_threads);
    rlserve_parallel_for(NAME(qk_rope_store_rows), &job, tokens, rlserve_rows_per_chunk(tokens, threads), threads);
}

struct NAME(silu_job) {
    const T *gate_up;
    T *out;
    int64_t inter;
};

static void NAME(silu_mul_rows)(const void *job_ptr, int64_t begin, int64_t end) {
    const struct NAME(silu_job) *j = job_ptr;
    const int64_t inter = j->inter;
    for (int64_t r = begin; r < end; ++r) {
        const T *g = j->gate_up + r * 2 * inter, *u = g + inter;
        T *o = j->out + r * inter;
        for (int64_t i = 0; i < inter; ++i) {
            const float gi = LD(g[i]);
            o[i] = ST(ROUND(gi / (1.0f + expf(-gi))) * LD(u[i]));
        }
    }
}

/* gate_up [rows, 2 * inter] -> out [rows, inter] = silu(gate) * up */
void NAME(rlserve_silu_mul)(const T *gate_up, T *out, int64_t rows, int64_t inter, int num_threads) {
    const struct NAME(silu_job) job = {gate_up, out, inter};
    const int threads = rlserve_threads_for(rows * inter, num_threads);
    rlserve_parallel_for(NAME(silu_mul_rows), &job, rows, rlserve_rows_per_chunk(rows, threads), threads);
}
