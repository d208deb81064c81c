/* Decode attention with whole tiles as work items (included by paged_attention_impl.h once per storage
 * type, after attend_items and the helpers it shares with it).
 *
 * Decode attention waits on memory: 64 decode rows of SmolLM2-135M's shape (bf16, ~100 positions,
 * blocks spread over the pool) read their KV at ~7 GB/s, where the same rows over KV held in cache
 * ran 3x faster. A chunk's slots hold every head's K (and V) row side by side, so walking the heads
 * within each chunk reads its slots once, in order (split by head, each work item read a 1/KVH slice
 * of every slot: 128 of 384 bytes), with the next chunk's whole slots fetched while it computes; and
 * a thread claims a few tiles at a time, so that each chunk also fetches the same chunk of its next
 * tile, one tile ahead (the first chunk of a tile was never fetched before). 1.23-1.30x on those rows
 * in bf16, 1.06-1.19x in fp32 (2 cores, AVX-512, alternated with the per-head items). Each query
 * vector runs the operations it runs in attend_items, in the same order: the same bits. A call takes
 * this form where attn_tiles_whole says so and there are tiles enough to share among the threads
 * (rlserve_paged_attention decides). */

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
            if (next_row >= 0) NAME(attn_fetch_chunk)(j, next_row, 0);
            NAME(attend_one_row)(j, first_row, 0, KVH);
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
