/* The kernels' one parallel loop (parallel.c): fn(job, begin, end) over [0, total) in chunks of
 * `per`, shared by the caller and up to num_threads - 1 helper threads. */
#ifndef RLSERVE_PARALLEL_H
#define RLSERVE_PARALLEL_H
#include <stdint.h>

typedef void (*rlserve_chunk_fn)(const void *job, int64_t begin, int64_t end);

__attribute__((visibility("hidden"))) void rlserve_parallel_for(rlserve_chunk_fn fn, const void *job, int64_t total,
                                                                int64_t per, int num_threads);

/* Chunks for element-wise work over `total` rows: a few per thread, so a late thread costs little. */
static inline int64_t rlserve_rows_per_chunk(int64_t total, int num_threads) {
    const int64_t per = total / (4 * (int64_t)(num_threads > 1 ? num_threads : 1));
    return per > 0 ? per : 1;
}
#endif
