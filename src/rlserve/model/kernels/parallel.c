/* The kernels' one thread pool: the caller and up to num_threads - 1 helper threads claim chunks
 * of a loop from an atomic counter (every parallel kernel goes through rlserve_parallel_for).
 *
 * Why not an OpenMP team: its parallel region ends at a barrier that waits for every thread, and
 * on a shared machine the second thread is often descheduled (batch 1 measured 3-4 tok/s on two
 * OpenMP threads against 13-22 on one, with the cores busy; 28-29 on two when they were idle).
 * Here the caller never waits for a chunk nobody has started, only for one a helper is working
 * on. A helper that is late (or absent, e.g. after fork) leaves the whole call to the caller,
 * which is never wrong. And one pool, not two: OpenMP's idle workers spin for a while after each
 * region, and on 2 cores that spinning took the core from this pool's helper in the next GEMV
 * (64-row decode in batch-invariant mode ran at 134 tok/s beside spinning OpenMP threads, 190
 * with their spinning cut short). Each chunk is computed by one thread in one fixed order, so the
 * split never changes a result. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#include "parallel.h"

#define HELPER_SPIN 20000 /* pause-polls (well under a millisecond) before an idle helper sleeps */
#define MAX_HELPERS 63

static struct {
    pthread_mutex_t call;   /* one call at a time uses the helpers; another runs alone */
    pthread_mutex_t mu;     /* guards gen for sleeping helpers */
    pthread_cond_t cv;
    _Atomic uint64_t claim; /* gen << 32 | next chunk */
    _Atomic int64_t done;   /* chunks of this gen finished */
    uint32_t gen;
    int started;            /* helpers running */
    /* the current call: written before gen is published, read after it is seen */
    rlserve_chunk_fn fn;
    const void *job;
    int64_t total, per, chunks;
    int width;              /* helpers [0, width) take part in this call */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void run_chunks(uint32_t gen) {
    for (;;) {
        uint64_t v = atomic_load_explicit(&pool.claim, memory_order_acquire);
        /* the claim below fails once gen has moved on (or the pool is closed for the next call) */
        if ((uint32_t)(v >> 32) != gen || (int64_t)(uint32_t)v >= pool.chunks) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.claim, &v, v + 1, memory_order_acq_rel, memory_order_relaxed))
            continue;
        const int64_t begin = (int64_t)(uint32_t)v * pool.per;
        const int64_t end = begin + pool.per < pool.total ? begin + pool.per : pool.total;
        pool.fn(pool.job, begin, end);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
}

static void *helper(void *arg) {
    const int index = (int)(intptr_t)arg;
    uint32_t seen = 0;
    for (;;) {
        uint64_t v = atomic_load_explicit(&pool.claim, memory_order_acquire);
        for (int spins = 0; (uint32_t)(v >> 32) == seen; v = atomic_load_explicit(&pool.claim, memory_order_acquire)) {
            if (++spins < HELPER_SPIN) {
#if defined(__x86_64__) || defined(__i386__)
                __builtin_ia32_pause();
#endif
                continue;
            }
            pthread_mutex_lock(&pool.mu);
            while (pool.gen == seen) pthread_cond_wait(&pool.cv, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
            spins = 0;
        }
        seen = (uint32_t)(v >> 32);
        if (index < pool.width) run_chunks(seen);
    }
    return 0;
}

static void start_helpers(int want) {
    while (pool.started < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int ok = pthread_create(&t, &attr, helper, (void *)(intptr_t)pool.started) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) return; /* fewer helpers: the caller does more of the chunks */
        ++pool.started;
    }
}

void rlserve_parallel_for(rlserve_chunk_fn fn, const void *job, int64_t total, int64_t per, int num_threads) {
    if (num_threads <= 1 || total <= per || pthread_mutex_trylock(&pool.call) != 0) {
        fn(job, 0, total);
        return;
    }
    const int helpers = num_threads - 1 < MAX_HELPERS ? num_threads - 1 : MAX_HELPERS;
    start_helpers(helpers);
    /* closed first: a helper late from the last call cannot claim a chunk while the fields change
     * (gens go up by 2; the odd one in between is this closed state) */
    const uint32_t gen = pool.gen + 2;
    atomic_store_explicit(&pool.claim, ((uint64_t)(gen - 1) << 32) | UINT32_MAX, memory_order_release);
    pool.fn = fn;
    pool.job = job;
    pool.total = total;
    pool.per = per;
    pool.chunks = (total + per - 1) / per;
    pool.width = helpers;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    pthread_mutex_lock(&pool.mu);
    pool.gen = gen;
    atomic_store_explicit(&pool.claim, (uint64_t)gen << 32, memory_order_release);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    run_chunks(gen);
    /* only chunks the helpers claimed are left; yield so they can finish on this core */
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < pool.chunks) sched_yield();
    pthread_mutex_unlock(&pool.call);
}
