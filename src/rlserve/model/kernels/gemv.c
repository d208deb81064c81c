/* Projections of a few rows (decode at small batch), for CPU; fp32 and bf16 instances of
 * gemv_impl.h, and the helper thread they share.
 *
 * Why not an OpenMP team: its parallel region ends at a barrier that waits for every thread, and
 * on a shared machine the second thread is often descheduled (batch 1 measured 3-4 tok/s on two
 * OpenMP threads against 13-22 on one, with the cores busy; 28-29 on two when they were idle).
 * Here the caller and one helper claim chunks of the outputs from an atomic counter; the caller
 * never waits for a chunk nobody has started, only for one the helper is working on. A helper that
 * is late (or absent, e.g. after fork) leaves the whole call to the caller, which is never wrong. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

typedef void (*gemv_chunk_fn)(const void *job, int64_t begin, int64_t end);

#define HELPER_SPIN 20000 /* pause-polls (well under a millisecond) before the idle helper sleeps */

static struct {
    pthread_mutex_t call;           /* one call at a time uses the helper; another runs alone */
    pthread_mutex_t mu;             /* guards gen for the sleeping helper */
    pthread_cond_t cv;
    _Atomic uint64_t claim;         /* gen << 32 | next chunk */
    _Atomic int64_t done;           /* chunks of this gen finished */
    uint32_t gen;
    int started;                    /* 1: helper running, -1: could not start */
    /* the current call: written before gen is published, read after a chunk of it is claimed */
    gemv_chunk_fn fn;
    const void *job;
    int64_t total, per, chunks;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void run_chunks(uint32_t gen) {
    for (;;) {
        uint64_t v = atomic_load_explicit(&pool.claim, memory_order_acquire);
        /* a stale chunk count only stops early: the claim below fails once gen has moved on */
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
    (void)arg;
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
        run_chunks(seen);
    }
    return 0;
}

/* fn(job, begin, end) over [0, total) in chunks of `per`, by the caller and the helper thread. */
static void gemv_parallel(gemv_chunk_fn fn, const void *job, int64_t total, int64_t per) {
    if (pthread_mutex_trylock(&pool.call) != 0) {
        fn(job, 0, total);
        return;
    }
    if (pool.started == 0) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool.started = pthread_create(&t, &attr, helper, 0) == 0 ? 1 : -1;
        pthread_attr_destroy(&attr);
    }
    pool.fn = fn;
    pool.job = job;
    pool.total = total;
    pool.per = per;
    pool.chunks = (total + per - 1) / per;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    pthread_mutex_lock(&pool.mu);
    const uint32_t gen = ++pool.gen;
    atomic_store_explicit(&pool.claim, (uint64_t)gen << 32, memory_order_release);
    pthread_cond_signal(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    run_chunks(gen);
    /* only chunks the helper claimed are left; yield so it can finish one on this core */
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < pool.chunks) sched_yield();
    pthread_mutex_unlock(&pool.call);
}

#include "gemv_impl.h"
#define RLSERVE_BF16
#include "gemv_impl.h"
