/* Decode attention with whole tiles as work items (included by paged_attention_impl.h once per storage
 * type, after attend_items and the helpers it shares with it): every KV head of a tile in one work
 * item, each chunk's slots read once in order, and each thread's next tile fetched one tile ahead.
 * A call takes it where its tiles take the direct form and are enough to share among the threads
 * (attn_tiles_whole; rlserve_paged_attention decides). */
/* Tiles a thread claims at a time, so that it knows its next tile and can fetch it (attend_tiles). */
#define TILES_PER_CLAIM 4

/* Prefetch the chunk at `start` of row `row`'s context (every head's K and V, into L2), where it exists. */
static inline void NAME(attn_fetch_chunk)(const struct NAME(attention_job) *j, int64_t row, int64_t start) {
    const int64_t len = j->ctx_lens[row], bs = j->block_size, slot_bytes = j->KVH * j->D * (int64_t)sizeof(T);
    for (int64_t p = start; p < start + KEYS && p < len; ++p) {
        const int64_t slot = j->blocks[row * j->W + p / bs] * bs + p % bs;
        const char *k = (const char *)(j->k_cache + slot * j->KVH * j->D);
        const char *v = (const char *)(j->v_cache + slot * j->KVH * j->D);
        for (int64_t b = 0; b < slot_bytes; b += 64) {
            __builtin_prefetch(k + b, 0, 2);
            __builtin_prefetch(v + b, 0, 2);
        }
    }
}

static void NAME(attend_tiles)(const void *job_ptr, int64_t begin, int64_t end) {
    const struct NAME(attention_job) *j = job_ptr;
    const int64_t KVH = j->KVH, G = j->H / KVH;
    struct attn_state *s = attn_thread_state();
    s->D = j->D;
    for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t first_row = j->tiles[2 * tile], rows = j->tiles[2 * tile + 1], per = rows * G;
        const int64_t *table = j->blocks + first_row * j->W;
        const int64_t next_row = tile + 1 < end ? j->tiles[2 * (tile + 1)] : -1;
#if !defined(RLSERVE_ROW_INVARIANT) && !defined(ATTN_PAIRS)
        { /* the one-row form (rows == 1 here), every KV head per block; its next block it fetches itself */
            const T *qb = j->q + first_row * j->q_stride;
            T *ob = j->out + first_row * j->H * j->D;
            if (next_row >= 0) NAME(attn_fetch_chunk)(j, next_row, 0);
            if (j->D == 64)
                NAME(attend_one)(qb, j->k_cache, j->v_cache, table, j->ctx_lens[first_row], ob, G, KVH, 0, KVH, 64,
                                 j->block_size, j->scale);
            else
                NAME(attend_one)(qb, j->k_cache, j->v_cache, table, j->ctx_lens[first_row], ob, G, KVH, 0, KVH, j->D,
                                 j->block_size, j->scale);
            continue;
        }
#endif
        s->n_queries = per * KVH;
        for (int64_t kvh = 0; kvh < KVH; ++kvh) NAME(attn_load_queries)(s, j, first_row, rows, kvh, kvh * per);
        const int64_t longest = j->ctx_lens[first_row + rows - 1];
        for (int64_t start = 0; start < longest; start += KEYS) {
            if (next_row >= 0) NAME(attn_fetch_chunk)(j, next_row, start);
            for (int64_t kvh = 0; kvh < KVH; ++kvh) {
                const T *k_rows[KEYS];
                NAME(attn_stage)(s, j, table, kvh, start, longest, k_rows, kvh == 0 ? KVH : 0);
                NAME(attn_chunk)(s, j, k_rows, kvh * per, per, start);
            }
        }
        for (int64_t kvh = 0; kvh < KVH; ++kvh) NAME(attn_store)(s, j, first_row, rows, kvh, kvh * per);
    }
}

/* Whether a call whose largest tile has `widest` rows runs each tile with every KV head in one work
 * item (attend_tiles), on AVX-512: where the tiles take the direct form (a decode step's rows) and
 * the item's vectors fit its state, or in the default build's fp32 where every tile is one row (the
 * one-row form: G x KVH query heads in its arrays). */
static int NAME(attn_tiles_whole)(int64_t widest, int64_t G, int64_t KVH) {
#if defined(ATTN_AVX512) && (defined(RLSERVE_ROW_INVARIANT) || defined(ATTN_PAIRS))
    return widest * G <= GROUP_QUERIES && widest * G * KVH <= TILE_QUERIES;
#elif defined(ATTN_AVX512)
    return widest == 1 && G * KVH <= MAX_GROUP;
#else
    (void)widest, (void)G, (void)KVH;
    return 0;
#endif
}
