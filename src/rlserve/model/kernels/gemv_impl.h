/* out = x @ w^T (+ bias) for a few rows of x (included once per storage type by gemv.c; T, LD,
 * ST from scalar.h; fp32 accumulation).
 *
 * At decode with few sequences a projection is a matrix-vector product bound by reading the
 * weight: each weight value is used once per row. A GEMM library tuned for large products reads
 * it slower than the memory allows (MKL's packed sgemm at 1 row streamed ~15 GB/s where llama.cpp
 * reads ~25). Here the weight is read once, in torch's own [out, in] layout (each output's row
 * contiguous, so no packed copy and nothing to refresh after a weight update): a tile of 4
 * (AVX2: 3) output rows against up to 4 rows of x, its accumulators in registers, the x rows
 * staying in L1; one row of x reads each weight row front to back instead (gemv_dot). With
 * num_threads > 1 the outputs are shared over parallel.c's threads (no barrier that waits for a
 * descheduled thread) when the call has PARALLEL_MIN_WORK multiply-adds.
 *
 * bf16 multiplies pairs with AVX512_BF16's dot product (fp32 accumulation) where the CPU has it;
 * elsewhere the same tiles in plain C, bf16 widened to fp32 (the engine takes this routine for
 * bf16 only on CPUs with native bf16).
 */
#include <stdint.h>

#include "parallel.h"
#include "scalar.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* 3 outputs x 4 rows: 12 accumulators, 3 weight vectors and an x vector fill AVX2's 16 registers
 * (4 x 4 spilled: 15-25% slower from 8 to 4096 rows, one thread); AVX-512 has 32. The tile's
 * shape changes no bit: each (row, output) sum walks K in the same lanes either way. */
#if defined(__AVX512F__)
#define GEMV_TILE_OUT 4
#else
#define GEMV_TILE_OUT 3
#endif
#define GEMV_TILE_ROWS 4
#define GEMV_BLOCK_BYTES (128 * 1024)
/* Each weight row is short (K values) and a tile reads 4 of them side by side, so the hardware
 * prefetchers see streams that end every few KB and fall behind: one core read the SmolLM2
 * weights at 13-14 GB/s against 20-21 for a plain sum over the same memory. Asking for the line
 * 16 KB ahead of each stream into L2 (T1; into L1, T0, it was slower) reads at the sum's rate
 * (19-21 GB/s, 1 and 4 rows alike; 8 KB and 32 KB ahead the same within noise). */
#define GEMV_PREFETCH_BYTES 16384

/* acc[r][j] = dot(x row r, w row j) for nr rows of x and nj rows of w (both at most 4; constants
 * once inlined, so the loops unroll and the accumulators live in registers). */
static inline __attribute__((always_inline)) void NAME(gemv_tile)(const T *x, const T *w, int64_t K, int64_t nr,
                                                                  int64_t nj, float acc_out[GEMV_TILE_ROWS][GEMV_TILE_OUT]) {
#if defined(__AVX512F__) && !defined(RLSERVE_BF16)
    __m512 acc[GEMV_TILE_ROWS][GEMV_TILE_OUT];
    for (int64_t r = 0; r < nr; ++r)
        for (int64_t j = 0; j < nj; ++j) acc[r][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[GEMV_TILE_OUT];
        for (int64_t j = 0; j < nj; ++j) _mm_prefetch((const char *)(w + j * K + k) + GEMV_PREFETCH_BYTES, _MM_HINT_T1);
        for (int64_t j = 0; j < nj; ++j) wv[j] = _mm512_loadu_ps(w + j * K + k);
        for (int64_t r = 0; r < nr; ++r) {
            const __m512 xv = _mm512_loadu_ps(x + r * K + k);
            for (int64_t j = 0; j < nj; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
        }
    }
    if (k < K) {
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1u);
        __m512 wv[GEMV_TILE_OUT];
        for (int64_t j = 0; j < nj; ++j) wv[j] = _mm512_maskz_loadu_ps(m, w + j * K + k);
        for (int64_t r = 0; r < nr; ++r) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * K + k);
            for (int64_t j = 0; j < nj; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
        }
    }
    for (int64_t r = 0; r < nr; ++r)
        for (int64_t j = 0; j < nj; ++j) acc_out[r][j] = _mm512_reduce_add_ps(acc[r][j]);
#elif defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(RLSERVE_BF16)
    __m512 acc[GEMV_TILE_ROWS][GEMV_TILE_OUT];
    for (int64_t r = 0; r < nr; ++r)
        for (int64_t j = 0; j < nj; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 m = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
        __m512i wv[GEMV_TILE_OUT];
        for (int64_t j = 0; j < nj; ++j) _mm_prefetch((const char *)(w + j * K + k) + GEMV_PREFETCH_BYTES, _MM_HINT_T1);
        for (int64_t j = 0; j < nj; ++j) wv[j] = _mm512_maskz_loadu_epi16(m, w + j * K + k);
        for (int64_t r = 0; r < nr; ++r) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * K + k);
            for (int64_t j = 0; j < nj; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, (__m512bh)wv[j]);
        }
    }
    for (int64_t r = 0; r < nr; ++r)
        for (int64_t j = 0; j < nj; ++j) acc_out[r][j] = _mm512_reduce_add_ps(acc[r][j]);
#else
    float acc[GEMV_TILE_ROWS][GEMV_TILE_OUT] = {{0.0f}};
    for (int64_t k = 0; k < K; ++k) {
        float wv[GEMV_TILE_OUT];
        for (int64_t j = 0; j < nj; ++j) wv[j] = LD(w[j * K + k]);
        for (int64_t r = 0; r < nr; ++r) {
            const float xv = LD(x[r * K + k]);
            for (int64_t j = 0; j < nj; ++j) acc[r][j] += xv * wv[j];
        }
    }
    for (int64_t r = 0; r < nr; ++r)
        for (int64_t j = 0; j < nj; ++j) acc_out[r][j] = acc[r][j];
#endif
}

/* out[i] = v + bias (bias[n] or none): fp32 as is (out_f32), else rounded to the storage type. */
static inline __attribute__((always_inline)) void NAME(gemv_put)(void *out, int out_f32, int64_t i, float v,
                                                                 const T *bias, int64_t n) {
    v += bias != 0 ? LD(bias[n]) : 0.0f;
    if (out_f32) ((float *)out)[i] = v;
    else ((T *)out)[i] = ST(v);
}

/* One tile of outputs [n, n + nj) for rows [r0, r0 + nr), written with the bias. */
static inline __attribute__((always_inline)) void NAME(gemv_store)(const T *x, const T *w, const T *bias, void *out,
                                                                   int out_f32, int64_t K, int64_t N, int64_t r0,
                                                                   int64_t n, int64_t nr, int64_t nj) {
    float acc[GEMV_TILE_ROWS][GEMV_TILE_OUT];
    NAME(gemv_tile)(x + r0 * K, w + n * K, K, nr, nj, acc);
    for (int64_t r = 0; r < nr; ++r)
        for (int64_t j = 0; j < nj; ++j) NAME(gemv_put)(out, out_f32, (r0 + r) * N + n + j, acc[r][j], bias, n + j);
}

#include "gemm_impl.h"

#if ((defined(__AVX512F__) && !defined(RLSERVE_BF16)) || (defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(RLSERVE_BF16)))
#define GEMV_ONE_ROW 1
/* dot(x, w row) for one row of x, the weight row read front to back as one stream (4 accumulators
 * hide the FMA latency): at one row the 4-row tile's 4 interleaved streams read ~5% slower. */
static inline float NAME(gemv_dot)(const T *x, const T *w, int64_t K) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#if !defined(RLSERVE_BF16)
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        _mm_prefetch((const char *)(w + k) + GEMV_PREFETCH_BYTES, _MM_HINT_T1);
        _mm_prefetch((const char *)(w + k + 16) + GEMV_PREFETCH_BYTES, _MM_HINT_T1);
        _mm_prefetch((const char *)(w + k + 32) + GEMV_PREFETCH_BYTES, _MM_HINT_T1);
        _mm_prefetch((const char *)(w + k + 48) + GEMV_PREFETCH_BYTES, _MM_HINT_T1);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(w + k + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 32), _mm512_loadu_ps(w + k + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 48), _mm512_loadu_ps(w + k + 48), a3);
    }
    for (; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1u);
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), _mm512_maskz_loadu_ps(m, w + k), a0);
    }
#else
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
        _mm_prefetch((const char *)(w + k) + GEMV_PREFETCH_BYTES, _MM_HINT_T1);
        _mm_prefetch((const char *)(w + k + 32) + GEMV_PREFETCH_BYTES, _MM_HINT_T1);
        _mm_prefetch((const char *)(w + k + 64) + GEMV_PREFETCH_BYTES, _MM_HINT_T1);
        _mm_prefetch((const char *)(w + k + 96) + GEMV_PREFETCH_BYTES, _MM_HINT_T1);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(x + k + 32), (__m512bh)_mm512_loadu_si512(w + k + 32));
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(x + k + 64), (__m512bh)_mm512_loadu_si512(w + k + 64));
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(x + k + 96), (__m512bh)_mm512_loadu_si512(w + k + 96));
    }
    for (; k < K; k += 32) {
        const __mmask32 m = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, x + k), (__m512bh)_mm512_maskz_loadu_epi16(m, w + k));
    }
#endif
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#endif

struct NAME(gemv_job) {
    const T *x, *w, *bias;
    void *out;
    int out_f32; /* 1: out is fp32, the sums unrounded (the fp32 LM head over bf16 weights) */
    int64_t rows, K, N;
};

/* Output tiles [begin, end) of a job: every row of x against those 4-output tiles of w. */
static void NAME(gemv_tiles)(const void *job_ptr, int64_t begin, int64_t end) {
    const struct NAME(gemv_job) *j = job_ptr;
#ifdef GEMV_ONE_ROW
    if (j->rows == 1) {
        const int64_t n_end = end * GEMV_TILE_OUT < j->N ? end * GEMV_TILE_OUT : j->N;
        for (int64_t n = begin * GEMV_TILE_OUT; n < n_end; ++n)
            NAME(gemv_put)(j->out, j->out_f32, n, NAME(gemv_dot)(j->x, j->w + n * j->K, j->K), j->bias, n);
        return;
    }
#endif
    /* rows in blocks of ~GEMV_BLOCK_BYTES of x, which stay in L2 while this chunk's weight tiles pass
     * them (with all rows at once, a long prompt's x left the cache between tiles: 4096 rows ran at
     * 0.56x of MKL's speed). Row tiles still start at multiples of 4, so no row's tile changes. */
    int64_t block_rows = GEMV_BLOCK_BYTES / (j->K * (int64_t)sizeof(T)) / GEMV_TILE_ROWS * GEMV_TILE_ROWS;
    if (block_rows < GEMV_TILE_ROWS) block_rows = GEMV_TILE_ROWS;
    for (int64_t rb = 0; rb < j->rows; rb += block_rows)
    for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t * GEMV_TILE_OUT, nj = j->N - n < GEMV_TILE_OUT ? j->N - n : GEMV_TILE_OUT;
        const int64_t rows_end = rb + block_rows < j->rows ? rb + block_rows : j->rows;
        for (int64_t r0 = rb; r0 < rows_end; r0 += GEMV_TILE_ROWS) {
            const int64_t nr = rows_end - r0 < GEMV_TILE_ROWS ? rows_end - r0 : GEMV_TILE_ROWS;
            /* the full tiles with constant sizes, so gemv_tile unrolls; edges through the generic one */
            if (nj == GEMV_TILE_OUT && nr == 4) NAME(gemv_store)(j->x, j->w, j->bias, j->out, j->out_f32, j->K, j->N, r0, n, 4, GEMV_TILE_OUT);
            else if (nj == GEMV_TILE_OUT && nr == 3) NAME(gemv_store)(j->x, j->w, j->bias, j->out, j->out_f32, j->K, j->N, r0, n, 3, GEMV_TILE_OUT);
            else if (nj == GEMV_TILE_OUT && nr == 2) NAME(gemv_store)(j->x, j->w, j->bias, j->out, j->out_f32, j->K, j->N, r0, n, 2, GEMV_TILE_OUT);
            else if (nj == GEMV_TILE_OUT && nr == 1) NAME(gemv_store)(j->x, j->w, j->bias, j->out, j->out_f32, j->K, j->N, r0, n, 1, GEMV_TILE_OUT);
            else NAME(gemv_store)(j->x, j->w, j->bias, j->out, j->out_f32, j->K, j->N, r0, n, nr, nj);
        }
    }
}

/* x [rows, K], w [N, K], bias [N] or NULL, out [rows, N]; all contiguous. num_threads > 1 shares
 * the outputs over parallel.c's threads (in 16 chunks) when the call has PARALLEL_MIN_WORK
 * multiply-adds. */
static void NAME(gemv_any)(const T *x, const T *w, const T *bias, void *out, int out_f32, int64_t rows, int64_t K,
                           int64_t N, int num_threads) {
#if defined(RLSERVE_ROW_INVARIANT) /* the batch-invariant build (model/invariant_ops.py): one order at any row count */
    NAME(gemm_any)(x, w, bias, out, out_f32, rows, K, N, num_threads);
#else
    const struct NAME(gemv_job) job = {x, w, bias, out, out_f32, rows, K, N};
    const int64_t tiles = (N + GEMV_TILE_OUT - 1) / GEMV_TILE_OUT;
    rlserve_parallel_for(NAME(gemv_tiles), &job, tiles, tiles >= 16 ? tiles / 16 : 1,
                         rlserve_threads_for(rows * K * N, num_threads));
#endif
}

void NAME(rlserve_gemv)(const T *x, const T *w, const T *bias, T *out, int64_t rows, int64_t K, int64_t N,
                        int num_threads) {
    NAME(gemv_any)(x, w, bias, out, 0, rows, K, N, num_threads);
}

/* The same with fp32 out: for bf16, the exact products summed in fp32 and not rounded, which is
 * what an fp32 linear over the bf16 values widened to fp32 computes (up to summation order),
 * reading half the bytes. */
void NAME(rlserve_gemv_f32out)(const T *x, const T *w, const T *bias, float *out, int64_t rows, int64_t K, int64_t N,
                               int num_threads) {
    NAME(gemv_any)(x, w, bias, out, 1, rows, K, N, num_threads);
}

#undef GEMV_ONE_ROW /* gemv.c includes this file once per storage type */
