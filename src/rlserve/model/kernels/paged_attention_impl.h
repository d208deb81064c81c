/* Decode attention over the paged KV cache (included once per storage type by paged_attention.c;
 * T, LD, ST from scalar.h; fp32 arithmetic).
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

#include "parallel.h"
#include "scalar.h"

#ifndef MAX_GROUP
#define MAX_GROUP 32     /* query heads per KV head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64     /* tokens per block */
#endif

/* One (sequence, KV head). Inlined with D a constant for the common head sizes, so the loops
 * over D unroll and a query head's accumulator stays in registers. */
static inline __attribute__((always_inline)) void NAME(attend_one)(
    const T *qb, const T *k_cache, const T *v_cache, const int64_t *table, int64_t len, T *ob,
    int64_t G, int64_t KVH, int64_t kvh, const int64_t D, int64_t block_size, float scale) {
    float acc[MAX_GROUP][MAX_HEAD_DIM], q[MAX_GROUP][MAX_HEAD_DIM];
    float run_max[MAX_GROUP], run_sum[MAX_GROUP], probs[MAX_GROUP][MAX_BLOCK];
    for (int64_t g = 0; g < G; ++g) {
        run_max[g] = -FLT_MAX;
        run_sum[g] = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
            acc[g][d] = 0.0f;
            q[g][d] = LD(qb[g * D + d]);
        }
    }
    const int64_t row = KVH * D; /* values between consecutive slots */
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = len - start < block_size ? len - start : block_size;
        const int64_t base = (table[start / block_size] * block_size * KVH + kvh) * D;
        for (int64_t j = 0; j < n; ++j) {
            const T *k = k_cache + base + j * row;
            for (int64_t g = 0; g < G; ++g) {
                float dot = 0.0f;
                for (int64_t d = 0; d < D; ++d) dot += q[g][d] * LD(k[d]);
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
                const T *v = v_cache + base + j * row;
                const float p = probs[g][j];
                for (int64_t d = 0; d < D; ++d) a[d] += p * LD(v[d]);
            }
            for (int64_t d = 0; d < D; ++d) acc[g][d] = a[d];
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        const float inv = len > 0 ? 1.0f / run_sum[g] : 0.0f;
        for (int64_t d = 0; d < D; ++d) ob[g * D + d] = ST(acc[g][d] * inv);
    }
}

struct NAME(attention_job) {
    const T *q, *k_cache, *v_cache;
    const int64_t *blocks, *ctx_lens;
    T *out;
    int64_t q_stride, W, H, KVH, D, block_size;
    float scale;
};

/* Items [begin, end) of (sequence, KV head) pairs. */
static void NAME(attend_items)(const void *job_ptr, int64_t begin, int64_t end) {
    const struct NAME(attention_job) *j = job_ptr;
    const int64_t KVH = j->KVH, D = j->D, G = j->H / KVH;
    for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / KVH, kvh = item % KVH;
        const T *qb = j->q + b * j->q_stride + kvh * G * D;
        T *ob = j->out + (b * j->H + kvh * G) * D;
        const int64_t *table = j->blocks + b * j->W, len = j->ctx_lens[b];
        if (D == 64)
            NAME(attend_one)(qb, j->k_cache, j->v_cache, table, len, ob, G, KVH, kvh, 64, j->block_size, j->scale);
        else if (D == 128)
            NAME(attend_one)(qb, j->k_cache, j->v_cache, table, len, ob, G, KVH, kvh, 128, j->block_size, j->scale);
        else
            NAME(attend_one)(qb, j->k_cache, j->v_cache, table, len, ob, G, KVH, kvh, D, j->block_size, j->scale);
    }
}

/* q: [B, H, D] with q_stride values between sequences (a view into the QKV rows); out: [B, H, D];
 * k_cache, v_cache: [slots, KVH, D] (one layer); blocks: [B, W] block ids; ctx_lens: [B].
 * Slot of position t of sequence b: blocks[b, t / block_size] * block_size + t % block_size.
 * Items are claimed one at a time by parallel.c's threads: contexts differ in length. */
void NAME(rlserve_paged_attention)(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,
                                   const int64_t *blocks, const int64_t *ctx_lens, T *out, int64_t B, int64_t W,
                                   int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale,
                                   int num_threads) {
    int64_t work = 0; /* multiply-adds: every query head against every K and V of its context */
    for (int64_t b = 0; b < B; ++b) work += ctx_lens[b] * H * D * 2;
    const struct NAME(attention_job) job = {q, k_cache, v_cache, blocks, ctx_lens, out, q_stride, W, H, KVH, D,
                                            block_size, scale};
    rlserve_parallel_for(NAME(attend_items), &job, B * KVH, 1, rlserve_threads_for(work, num_threads));
}
