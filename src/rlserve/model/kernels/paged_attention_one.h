/* The default build's one-row form of decode attention (included by paged_attention_impl.h once per
 * storage type, after its state and loads): a decode row's query heads against its context, one dot
 * product per query head and K row reduced across lanes, the next block fetched while this one
 * computes. The batch-invariant build (RLSERVE_ROW_INVARIANT) and ATTN_PAIRS builds do not take it. */

#if !defined(RLSERVE_ROW_INVARIANT)
/* Prefetch the D values at `from` (a key's row of one head) into L1. */
static inline void NAME(attn_fetch_row)(const T *from, const int64_t D) {
    for (int64_t b = 0; b < D * (int64_t)sizeof(T); b += 64) __builtin_prefetch((const char *)from + b, 0, 3);
}

/* One block of n keys (K rows from k_rows, V rows from v_rows, `row` values apart) for one KV head's G
 * query heads: their scores, online-softmax step and values; each key's K and V rows of the block read
 * next (next_k, next_v: its first next_n keys, the same head) fetched as this one's are read (struct
 * attn_next says why). */
static inline __attribute__((always_inline)) void NAME(attend_one_block)(
    float q[][MAX_HEAD_DIM], float acc[][MAX_HEAD_DIM], float *run_max, float *run_sum, float probs[][MAX_BLOCK],
    const T *k_rows, const T *v_rows, int64_t n, const T *next_k, const T *next_v, int64_t next_n, int64_t G,
    int64_t row, const int64_t D, float scale) {
    for (int64_t j = 0; j < n; ++j) {
        const T *k = k_rows + j * row;
        if (j < next_n) {
            NAME(attn_fetch_row)(next_k + j * row, D);
            NAME(attn_fetch_row)(next_v + j * row, D);
        }
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
            const T *v = v_rows + j * row;
            const float p = probs[g][j];
            for (int64_t d = 0; d < D; ++d) a[d] += p * LD(v[d]);
        }
        for (int64_t d = 0; d < D; ++d) acc[g][d] = a[d];
    }
}

/* The default build's form for a tile of one row (a decode row): one dot product per query head
 * and K row, reduced across lanes. With only G query vectors to share a chunk, that beats the
 * direct form in fp32 (0.9-0.98x at 64-2,048 positions, both prefetching) but not with bf16 pairs
 * (1.13-1.32x there), so ATTN_PAIRS builds take the direct form for every row. Its sums run in
 * another order, so the batch-invariant build (RLSERVE_ROW_INVARIANT) keeps the tiled form for
 * every row: a decode row there equals the same position computed as a prompt row.
 * KV heads [kvh, kvh + heads) of the row (G query heads each, at qb and ob), each block's heads in
 * turn, so that `heads` > 1 reads a block's slots once. Inlined with D a constant for the common head
 * sizes (attend_one_row), so the loops over D unroll and a query head's accumulator stays in registers. */
static inline __attribute__((always_inline)) void NAME(attend_one)(
    const T *qb, const T *k_cache, const T *v_cache, const int64_t *table, int64_t len, const int64_t *next_table,
    int64_t next_len, T *ob, int64_t G, int64_t KVH, int64_t kvh, int64_t heads, const int64_t D, int64_t block_size,
    float scale) {
    float acc[MAX_GROUP][MAX_HEAD_DIM], q[MAX_GROUP][MAX_HEAD_DIM];
    float run_max[MAX_GROUP], run_sum[MAX_GROUP], probs[MAX_GROUP][MAX_BLOCK];
    for (int64_t g = 0; g < heads * G; ++g) {
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
        /* the block read next lies anywhere: this row's next, or after its last the next row's first */
        const int64_t next_block = start + block_size < len ? table[start / block_size + 1] : next_len > 0 ? next_table[0] : 0;
        const int64_t next_left = start + block_size < len ? len - start - block_size : next_len;
        const int64_t next_n = next_left < block_size ? next_left : block_size;
        const int64_t next_base = (next_block * block_size * KVH + kvh) * D;
        for (int64_t h = 0; h < heads; ++h) /* every head of a slot before the next slot: one pass over the block */
            NAME(attend_one_block)(q + h * G, acc + h * G, run_max + h * G, run_sum + h * G, probs + h * G,
                                   k_cache + base + h * D, v_cache + base + h * D, n, k_cache + next_base + h * D,
                                   v_cache + next_base + h * D, next_n, G, row, D, scale);
    }
    for (int64_t g = 0; g < heads * G; ++g) {
        const float inv = len > 0 ? 1.0f / run_sum[g] : 0.0f;
        for (int64_t d = 0; d < D; ++d) ob[g * D + d] = ST(acc[g][d] * inv);
    }
}

/* attend_one for row `row` of a job, KV heads [kvh, kvh + heads), D a constant where it is 64 or 128; the
 * first block of row `next_row` (-1: none) fetched after its last. */
static inline void NAME(attend_one_row)(const struct NAME(attention_job) *j, int64_t row, int64_t kvh, int64_t heads,
                                        int64_t next_row) {
    const int64_t G = j->H / j->KVH, D = j->D, len = j->ctx_lens[row];
    const int64_t *next_table = next_row >= 0 ? j->blocks + next_row * j->W : NULL;
    const int64_t next_len = next_row >= 0 ? j->ctx_lens[next_row] : 0;
    const T *qb = j->q + row * j->q_stride + kvh * G * D, *k = j->k_cache, *v = j->v_cache;
    const int64_t *table = j->blocks + row * j->W;
    T *ob = j->out + (row * j->H + kvh * G) * D;
    if (D == 64)
        NAME(attend_one)(qb, k, v, table, len, next_table, next_len, ob, G, j->KVH, kvh, heads, 64, j->block_size, j->scale);
    else if (D == 128)
        NAME(attend_one)(qb, k, v, table, len, next_table, next_len, ob, G, j->KVH, kvh, heads, 128, j->block_size, j->scale);
    else
        NAME(attend_one)(qb, k, v, table, len, next_table, next_len, ob, G, j->KVH, kvh, heads, D, j->block_size, j->scale);
}

#endif

