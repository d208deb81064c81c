/* The kernels' one parallel loop (parallel.c): fn(job, begin, end) over [0, total) in chunks of
 * `per`, shared by the caller and up to num_threads - 1 helper threads. */
#ifndef RLSERVE_PARALLEL_H
#define RLSERVE_PARALLEL_H
#include <stdint.h>

/* Below this much work (multiply-adds or elements) a call runs on one thread. Opening a parallel
 * region costs microseconds on an idle machine but up to a scheduler time slice (milliseconds)
 * when the cores are shared, waiting for a descheduled worker at the barrier: decode attention of
 * one sequence (~0.04 ms on one thread) measured 1.35 ms on two threads with the 2 cores loaded. */
#define PARALLEL_MIN_WORK (1 << 18)

/* The threads for a call of `work` multiply-adds (or elements): one below PARALLEL_MIN_WORK. */
static inline int rlserve_threads_for(int64_t work, int num_threads) {
    return work >= PARALLEL_MIN_WORK ? num_threads : 1;
}

typedef void (*rlserve_chunk_fn)(const void *job, int64_t begin, int64_t end);

__attribute__((visibility("hidden"))) void rlserve_parallel_for(rlserve_chunk_fn fn, const void *job, int64_t total,
                                                                int64_t per, int num_threads);

/* Chunks for element-wise work over `total` rows: a few per thread, so a late thread costs little. */
static inline int64_t rlserve_rows_per_chunk(int64_t total, int num_threads) {
    const int64_t per = total / (4 * (int64_t)(num_threads > 1 ? num_threads : 1));
    return per > 0 ? per : 1;
}
#endif
