/* Drawing each row's next token from its fp32 logits in one walk over the row, for CPU: the
 * sampler's common case (temperature 1 or greedy, no filters, penalties or masks; engine/sampler.py
 * takes it only then).
 *
 * The torch ops it replaces each stream the whole [rows, vocab] block (amax, subtract, exp, cumsum,
 * searchsorted, then log_softmax for the logprobs): ~6 ms a step at 64 rows of a 49K vocabulary on
 * 2 cores, with an OpenMP barrier after each op. Here a row is one thread's: its max, then the sum
 * of exp(x - max) by blocks (the block sums kept), then the draw: the uniform u (drawn by the
 * caller, from the row's own generator when seeded) scaled by the total picks the block where the
 * running sum passes it, and a walk inside that block picks the token. The row's log-sum-exp comes
 * back with it, so a logprob is x[token] - lse. Sums are in double across blocks.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "parallel.h"

#define SAMPLE_BLOCK 1024 /* logits per block sum */

struct sample_job {
    const float *logits;
    const float *u;
    int64_t vocab;
    int64_t *tokens;
    float *lse;
};

static float block_exp_sum(const float *x, int64_t n, float top) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += expf(x[i] - top);
    return s;
}

static void sample_row(const struct sample_job *j, int64_t r) {
    const int64_t V = j->vocab, blocks = (V + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    const float *x = j->logits + r * V;
    float top = x[0];
    for (int64_t i = 1; i < V; ++i) top = x[i] > top ? x[i] : top;
    float stack_sums[256];
    float *sums = blocks <= 256 ? stack_sums : malloc((size_t)blocks * sizeof(float));
    if (!sums) abort();
    double total = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t start = b * SAMPLE_BLOCK, n = V - start < SAMPLE_BLOCK ? V - start : SAMPLE_BLOCK;
        sums[b] = block_exp_sum(x + start, n, top);
        total += sums[b];
    }
    j->lse[r] = top + (float)log(total);
    int64_t token = -1;
    if (j->u[r] >= 0.0f) {
        const double target = (double)j->u[r] * total;
        double seen = 0.0;
        int64_t b = 0;
        while (b + 1 < blocks && seen + sums[b] <= target) seen += sums[b++];
        for (int64_t i = b * SAMPLE_BLOCK; i < V; ++i) {
            seen += expf(x[i] - top);
            if (seen > target) {
                token = i;
                break;
            }
        }
    }
    if (token < 0) /* greedy (u < 0), or rounding left the target past the last sum: the mode */
        for (token = 0; x[token] != top; ++token) continue;
    j->tokens[r] = token;
    if (sums != stack_sums) free(sums);
}

static void sample_rows(const void *job, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) sample_row(job, r);
}

/* logits [rows, vocab] fp32; u [rows]: the uniform in [0, 1) of each sampled row, negative for a
 * greedy one; out: tokens [rows], lse [rows] (log-sum-exp of each row). */
void rlserve_sample(const float *logits, const float *u, int64_t rows, int64_t vocab, int64_t *tokens, float *lse,
                    int num_threads) {
    const struct sample_job job = {logits, u, vocab, tokens, lse};
    rlserve_parallel_for(sample_rows, &job, rows, 1, rlserve_threads_for(rows * vocab * 8, num_threads));
}
