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
        s->n_queries = per * KVH;
        for (int64_t kvh = 0; kvh < KVH; ++kvh) NAME(attn_load_queries)(s, j, first_row, rows, kvh, kvh * per);
        const int64_t longest = j->ctx_lens[first_row + rows - 1];
        const int64_t next_row = tile + 1 < end ? j->tiles[2 * (tile + 1)] : -1;
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

/* Whether a call whose tiles have at most `per_head` query vectors per KV head runs each tile with every
 * KV head in one work item (attend_tiles): where the tiles take the direct form (a decode step's rows,
 * AVX-512; not the fp32 default build's one-row form) and the item's vectors fit its state. */
static int NAME(attn_tiles_whole)(int64_t per_head, int64_t KVH) {
#if defined(ATTN_AVX512) && (defined(RLSERVE_ROW_INVARIANT) || defined(ATTN_PAIRS))
    return per_head <= GROUP_QUERIES && per_head * KVH <= TILE_QUERIES;
#else
    (void)per_head, (void)KVH;
    return 0;
#endif
}
