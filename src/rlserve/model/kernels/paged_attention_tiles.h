/* Decode attention with whole tiles as work items (included by paged_attention_impl.h once per storage
 * type, after attend_items and the helpers it shares with it).
 *
 * Decode attention waits on memory: 64 decode rows of SmolLM2-135M's shape (bf16, ~100 positions,
 * blocks spread over the pool) read their KV at ~7 GB/s, where the same rows over KV held in cache
 * ran 3x faster. A chunk's slots hold every head's K (and V) row side by side, so walking the heads
 * within each chunk reads its slots once, in order (split by head, each work item read a 1/KVH slice
 * of every slot: 128 of 384 bytes), 1.23-1.30x on those rows in bf16, 1.06-1.19x in fp32 (2 cores,
 * AVX-512, alternated with the per-head items). Each chunk's loads fetch the lines of the chunk read
 * next (struct attn_next), and a thread claims a few tiles at a time, so that a tile's last chunk
 * fetches the next tile's first: 2.5x again on those rows in bf16 over KV in memory (15.2 -> 6.1 ms
 * for 30 layers, benchmarks/attention.py), 1.3x in fp32's one-row form, where the next chunk's lines
 * fetched all at once had been mostly lost. Each query vector runs the operations it runs in attend_items, in the same order: the same bits. A call takes
 * this form where attn_tiles_whole says so and there are tiles enough to share among the threads
 * (rlserve_paged_attention decides). */

/* Tiles a thread claims at a time, so that it knows its next tile and can fetch its first chunk (attend_tiles). */
#define TILES_PER_CLAIM 4

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
        { /* the one-row form (rows == 1 here), every KV head per block */
            NAME(attend_one_row)(j, first_row, 0, KVH, next_row);
            continue;
        }
#endif
        s->n_queries = per * KVH;
        for (int64_t kvh = 0; kvh < KVH; ++kvh) NAME(attn_load_queries)(s, j, first_row, rows, kvh, kvh * per);
        const int64_t longest = j->ctx_lens[first_row + rows - 1];
        for (int64_t start = 0; start < longest; start += KEYS) {
            /* after the last chunk, the next tile's first (each KV head's lines as this chunk reads its own) */
            const struct attn_next next = start + KEYS < longest ? (struct attn_next){table, start + KEYS, longest}
                                          : next_row >= 0 ? (struct attn_next){j->blocks + next_row * j->W, 0, j->ctx_lens[next_row]}
                                                          : (struct attn_next){NULL, 0, 0};
            for (int64_t kvh = 0; kvh < KVH; ++kvh) {
                const T *k_rows[KEYS];
                NAME(attn_stage)(s, j, table, kvh, start, longest, k_rows, next);
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
