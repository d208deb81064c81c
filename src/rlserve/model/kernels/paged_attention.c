/* Decode attention over the paged KV cache, for CPU (fp32).
 *
 * One work item per (sequence, KV head): the query heads that share the KV head walk the
 * sequence's blocks where they lie in the cache, with an online softmax, so K and V are read
 * once and never copied. Items of one sequence run back to back, so blocks that several
 * sequences share (n samples of a prompt) are usually still in cache for the next one.
 *
 * Built at first use by rlserve/model/cpu_kernels.py (gcc -O3 -march=native -ffast-math). No
 * infinities reach the arithmetic: the running max starts at -FLT_MAX and only a sequence's own
 * positions [0, ctx_len) are visited, never padding.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 32     /* query heads per KV head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64     /* tokens per block */

/* The shapes every kernel in this library handles (fused_ops.c's RoPE needs an even head size
 * and sizes its buffer for MAX_HEAD_DIM too); the model keeps its PyTorch path for others. */
int rlserve_paged_attention_limits(int64_t group, int64_t head_dim, int64_t block_size) {
    return group <= MAX_GROUP && head_dim <= MAX_HEAD_DIM && head_dim % 2 == 0 && block_size <= MAX_BLOCK;
}

/* One (sequence, KV head). Inlined with D a constant for the common head sizes, so the loops
 * over D unroll and a query head's accumulator stays in registers. */
static inline __attribute__((always_inline)) void attend_one(
    const float *qb, const float *k_cache, const float *v_cache, const int64_t *table, int64_t len, float *ob,
    int64_t G, int64_t KVH, int64_t kvh, const int64_t D, int64_t block_size, float scale) {
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float run_max[MAX_GROUP], run_sum[MAX_GROUP], probs[MAX_GROUP][MAX_BLOCK];
    for (int64_t g = 0; g < G; ++g) {
        run_max[g] = -FLT_MAX;
        run_sum[g] = 0.0f;
        for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.0f;
    }
    const int64_t row = KVH * D; /* floats between consecutive slots */
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = len - start < block_size ? len - start : block_size;
        const int64_t base = (table[start / block_size] * block_size * KVH + kvh) * D;
        for (int64_t j = 0; j < n; ++j) {
            const float *k = k_cache + base + j * row;
            for (int64_t g = 0; g < G; ++g) {
                const float *qg = qb + g * D;
                float dot = 0.0f;
                for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
                probs[g][j] = dot * scale;
            }
        }
        for (int64_t g = 0; g < G; ++g) {
            float block_max = run_max[g];
            for (int64_t j = 0; j < n; ++j) block_max = probs[g][j] > block_max ? probs[g][j] : block_max;
            const float correction = expf(run_max[g] - block_max);
            run_max[g] = block_max;
            float sum = 0.0f;
            for (int64_t j = 0; j < n; ++j) {
                probs[g][j] = expf(probs[g][j] - block_max);
                sum += probs[g][j];
            }
            run_sum[g] = run_sum[g] * correction + sum;
            float a[MAX_HEAD_DIM];
            for (int64_t d = 0; d < D; ++d) a[d] = acc[g][d] * correction;
            for (int64_t j = 0; j < n; ++j) {
                const float *v = v_cache + base + j * row;
                const float p = probs[g][j];
                for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
            }
            for (int64_t d = 0; d < D; ++d) acc[g][d] = a[d];
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        const float inv = len > 0 ? 1.0f / run_sum[g] : 0.0f;
        for (int64_t d = 0; d < D; ++d) ob[g * D + d] = acc[g][d] * inv;
    }
}

/* q: [B, H, D] with q_stride floats between sequences (a view into the QKV rows); out: [B, H, D];
 * k_cache, v_cache: [slots, KVH, D] (one layer); blocks: [B, W] block ids; ctx_lens: [B].
 * Slot of position t of sequence b: blocks[b, t / block_size] * block_size + t % block_size. */
void rlserve_paged_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                             const int64_t *blocks, const int64_t *ctx_lens, float *out, int64_t B, int64_t W,
                             int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, int num_threads) {
    const int64_t G = H / KVH;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < B * KVH; ++item) {
        const int64_t b = item / KVH, kvh = item % KVH;
        const float *qb = q + b * q_stride + kvh * G * D;
        float *ob = out + (b * H + kvh * G) * D;
        const int64_t *table = blocks + b * W;
        if (D == 64)
            attend_one(qb, k_cache, v_cache, table, ctx_lens[b], ob, G, KVH, kvh, 64, block_size, scale);
        else if (D == 128)
            attend_one(qb, k_cache, v_cache, table, ctx_lens[b], ob, G, KVH, kvh, 128, block_size, scale);
        else
            attend_one(qb, k_cache, v_cache, table, ctx_lens[b], ob, G, KVH, kvh, D, block_size, scale);
    }
}
