/* out = x @ w^T (+ bias) at any row count with each (row, output) sum walking K in one fixed order
 * (included once per storage type by gemv_impl.h, whose gemv_put it uses; T, NAME from scalar.h).
 *
 * The outer-product form GEMM libraries use: a panel of GEMM_PANEL_OUT outputs is packed
 * (transposed so that one K step of the panel is contiguous) and a tile of rows broadcasts each x
 * value against it. Each output accumulates x[k] * w[k] for k = 0, 1, ... (bf16: AVX512_BF16's pair
 * dot product, k pairs in order) in its own register lane, whatever tile or thread it falls in:
 * the row count, the tile edges and the thread split choose which lanes are computed, never how.
 * So batch-invariant mode takes it at every row count (gemv_impl.h's dot-product tiles are
 * row-invariant too, but reduce each output horizontally and ran at ~0.55x of oneDNN from 64 rows).
 *
 * Three ways in, one sum: weights packed once (rlserve_gemm_packed: model/linear.py's PanelWeight,
 * which the engine keeps, on AVX-512 in the default mode too, 1.1-1.2x faster than the GEMV and
 * oneDNN from 1 to 128 rows); unpacked, up to GEMM_DIRECT_ROWS rows, each 16 x 16 block transposed
 * in registers and used at once (gemm_direct); more rows pack panels per call into a thread's
 * L2-sized buffer (gemm_panels). The trainer's mirror of the model (rlserve.train) runs unpacked.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "scalar.h"
#include "transpose16.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && (!defined(RLSERVE_BF16) || (defined(__AVX512BF16__) && defined(__AVX512BW__)))
/* 3 vectors of 16 outputs x 8 rows: 24 accumulators, 3 panel vectors and a broadcast of AVX-512's
 * 32 registers. A K unit is one value (fp32) or a pair of bf16 values (one 32-bit lane). */
#define GEMM_AVX512 1
#define GEMM_PANEL_OUT 48
#define GEMM_ROWS 8
#define GEMM_UNIT 4
#elif defined(__AVX2__) && defined(__FMA__)
/* 2 vectors of 8 outputs x 6 rows: 12 accumulators in AVX2's 16 registers; the panel holds fp32
 * (bf16 widened when packed), a unit is one value */
#define GEMM_AVX2 1
#define GEMM_PANEL_OUT 16
#define GEMM_ROWS 6
#define GEMM_UNIT ((int64_t)sizeof(T))
#else
/* plain C; fmaf, not `+=`: -ffast-math may reassociate an add chain differently per tile shape
 * (invariant_ops.py checks the build either way and refuses the mode where rows differ) */
#define GEMM_PANEL_OUT 16
#define GEMM_ROWS 4
#define GEMM_UNIT ((int64_t)sizeof(T))
#endif
#define GEMM_CHUNK_BYTES (256 * 1024) /* packed panels per task: in L2 while the rows pass them */

/* K units of a row: pairs of bf16 on AVX-512 (an odd K's last pair is padded with a zero weight) */
static inline int64_t NAME(gemm_units)(int64_t K) { return (K * (int64_t)sizeof(T) + GEMM_UNIT - 1) / GEMM_UNIT; }

/* bytes of one packed K unit of a panel (fp32 lanes, except plain C's T) */
#if defined(GEMM_AVX512) || defined(GEMM_AVX2)
#define GEMM_PANEL_UNIT_BYTES (GEMM_PANEL_OUT * 4)
#else
#define GEMM_PANEL_UNIT_BYTES (GEMM_PANEL_OUT * (int64_t)sizeof(T))
#endif

#if defined(GEMM_AVX512)
/* 16 units of weight row n starting at unit u (zeros past the row's end or past N) */
static inline __attribute__((always_inline)) __m512 NAME(gemm_load_units)(const T *w, int64_t K, int64_t N, int64_t n,
                                                                          int64_t u) {
    if (n >= N) return _mm512_setzero_ps();
    const int64_t per = GEMM_UNIT / (int64_t)sizeof(T), first = u * per, left = K - first;
    const T *src = w + n * K + first;
#if defined(RLSERVE_BF16)
    const __mmask32 m = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1u);
    return _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(m, src));
#else
    const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
    return _mm512_maskz_loadu_ps(m, src);
#endif
}
#endif

/* The panel of outputs [n0, n0 + GEMM_PANEL_OUT) as [units][GEMM_PANEL_OUT] (zeros past N). */
static void NAME(gemm_pack)(const T *w, int64_t K, int64_t N, int64_t n0, void *panel_ptr) {
    const int64_t units = NAME(gemm_units)(K);
#if defined(GEMM_AVX512)
    float *panel = panel_ptr; /* 32-bit lanes: an fp32 value or a bf16 pair */
    for (int64_t u = 0; u < units; u += 16) {
        const int64_t nu = units - u < 16 ? units - u : 16;
        for (int v = 0; v < GEMM_PANEL_OUT / 16; ++v) {
            __m512 r[16];
            for (int i = 0; i < 16; ++i) r[i] = NAME(gemm_load_units)(w, K, N, n0 + 16 * v + i, u);
            rlserve_transpose16(r);
            for (int64_t c = 0; c < nu; ++c) _mm512_storeu_ps(panel + (u + c) * GEMM_PANEL_OUT + 16 * v, r[c]);
        }
    }
#elif defined(GEMM_AVX2)
    float *panel = panel_ptr;
    for (int64_t k = 0; k < units; ++k)
        for (int64_t l = 0; l < GEMM_PANEL_OUT; ++l) panel[k * GEMM_PANEL_OUT + l] = n0 + l < N ? LD(w[(n0 + l) * K + k]) : 0.0f;
#else
    T *panel = panel_ptr;
    for (int64_t k = 0; k < units; ++k)
        for (int64_t l = 0; l < GEMM_PANEL_OUT; ++l) panel[k * GEMM_PANEL_OUT + l] = n0 + l < N ? w[(n0 + l) * K + k] : ST(0.0f);
#endif
}

/* acc[r][l] = sum over K of x row r against panel lane l, for nr rows (a constant once inlined) */
static inline __attribute__((always_inline)) void NAME(gemm_tile)(const T *x, int64_t K, const void *panel_ptr,
                                                                  int64_t nr, float acc_out[GEMM_ROWS][GEMM_PANEL_OUT],
                                                                  const char *pf, int64_t pf_step) {
    const int64_t units = NAME(gemm_units)(K);
#if defined(GEMM_AVX512)
    const float *panel = panel_ptr;
#define GEMM_VECS (GEMM_PANEL_OUT / 16)
    __m512 acc[GEMM_ROWS][GEMM_VECS];
    for (int64_t r = 0; r < nr; ++r)
        for (int v = 0; v < GEMM_VECS; ++v) acc[r][v] = _mm512_setzero_ps();
#if defined(RLSERVE_BF16)
    const int64_t pairs = K / 2; /* whole pairs of x; an odd K's last value is its own step below */
#else
    const int64_t pairs = units;
#endif
    for (int64_t u = 0; u < pairs; ++u) {
        __m512 wv[GEMM_VECS];
        if (pf) _mm_prefetch(pf + u * pf_step, _MM_HINT_T1);
        for (int v = 0; v < GEMM_VECS; ++v) wv[v] = _mm512_loadu_ps(panel + u * GEMM_PANEL_OUT + 16 * v);
        for (int64_t r = 0; r < nr; ++r) {
#if defined(RLSERVE_BF16)
            int32_t pair;
            memcpy(&pair, x + r * K + 2 * u, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < GEMM_VECS; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, (__m512bh)wv[v]);
#else
            const __m512 xv = _mm512_set1_ps(x[r * K + u]);
            for (int v = 0; v < GEMM_VECS; ++v) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);
#endif
        }
    }
#if defined(RLSERVE_BF16)
    if (pairs < units) { /* odd K: x's last value paired with a zero (never read past the row) */
        __m512 wv[GEMM_VECS];
        for (int v = 0; v < GEMM_VECS; ++v) wv[v] = _mm512_loadu_ps(panel + pairs * GEMM_PANEL_OUT + 16 * v);
        for (int64_t r = 0; r < nr; ++r) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int32_t)x[r * K + K - 1]);
            for (int v = 0; v < GEMM_VECS; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, (__m512bh)wv[v]);
        }
    }
#endif
    for (int64_t r = 0; r < nr; ++r)
        for (int v = 0; v < GEMM_VECS; ++v) _mm512_storeu_ps(acc_out[r] + 16 * v, acc[r][v]);
#undef GEMM_VECS
#elif defined(GEMM_AVX2)
    (void)pf, (void)pf_step;
    const float *panel = panel_ptr;
    __m256 acc[GEMM_ROWS][2];
    for (int64_t r = 0; r < nr; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < units; ++k) {
        const __m256 w0 = _mm256_loadu_ps(panel + k * GEMM_PANEL_OUT), w1 = _mm256_loadu_ps(panel + k * GEMM_PANEL_OUT + 8);
        for (int64_t r = 0; r < nr; ++r) {
            const __m256 xv = _mm256_set1_ps(LD(x[r * K + k]));
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    for (int64_t r = 0; r < nr; ++r) {
        _mm256_storeu_ps(acc_out[r], acc[r][0]);
        _mm256_storeu_ps(acc_out[r] + 8, acc[r][1]);
    }
#else
    (void)pf, (void)pf_step;
    const T *panel = panel_ptr;
    float acc[GEMM_ROWS][GEMM_PANEL_OUT];
    for (int64_t r = 0; r < nr; ++r)
        for (int64_t l = 0; l < GEMM_PANEL_OUT; ++l) acc[r][l] = 0.0f;
    for (int64_t k = 0; k < units; ++k)
        for (int64_t r = 0; r < nr; ++r) {
            const float xv = LD(x[r * K + k]);
            for (int64_t l = 0; l < GEMM_PANEL_OUT; ++l) acc[r][l] = fmaf(xv, LD(panel[k * GEMM_PANEL_OUT + l]), acc[r][l]);
        }
    for (int64_t r = 0; r < nr; ++r) memcpy(acc_out[r], acc[r], sizeof acc[r]);
#endif
}

/* rows [r0, r0 + nr) against the packed panel of outputs from n0, written with the bias */
static inline __attribute__((always_inline)) void NAME(gemm_store)(const T *x, const void *panel, const T *bias,
                                                                   void *out, int out_f32, int64_t K, int64_t N,
                                                                   int64_t r0, int64_t n0, int64_t nr,
                                                                   const char *pf, int64_t pf_step) {
    float acc[GEMM_ROWS][GEMM_PANEL_OUT];
    NAME(gemm_tile)(x + r0 * K, K, panel, nr, acc, pf, pf_step);
    const int64_t nl = N - n0 < GEMM_PANEL_OUT ? N - n0 : GEMM_PANEL_OUT;
    for (int64_t r = 0; r < nr; ++r)
        for (int64_t l = 0; l < nl; ++l) NAME(gemv_put)(out, out_f32, (r0 + r) * N + n0 + l, acc[r][l], bias, n0 + l);
}

struct NAME(gemm_job) {
    const T *x, *w, *bias;
    const char *packed; /* every panel packed already (rlserve_gemm_pack), or 0: packed per call */
    void *out;
    int out_f32;
    int64_t rows, K, N, panel_bytes;
};

#if defined(GEMM_AVX512)
/* Up to this many rows no panel buffer (gemm_direct): packing first serializes reading the weight
 * and the FMAs, which at 8-16 rows streaming the weight from memory ran 1.4-1.7x slower (fp32). */
#define GEMM_DIRECT_ROWS 16
#ifndef GEMM_PREFETCH_BYTES
#define GEMM_PREFETCH_BYTES 16384
#endif
#ifndef GEMM_HINT
#define GEMM_HINT _MM_HINT_T1
#endif

/* acc[r] += x row's unit `unit` (an fp32 value; a bf16 pair, an odd K's last value paired with a
 * zero) times the panel column c */
static inline __attribute__((always_inline)) void NAME(gemm_direct_step)(__m512 *acc, int64_t r, const T *x,
                                                                         int64_t unit, __m512 c, int64_t K) {
#if defined(RLSERVE_BF16)
    int32_t pair = (int32_t)x[K - 1];
    if (2 * unit + 1 < K) memcpy(&pair, x + 2 * unit, sizeof pair);
    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)c);
#else
    (void)K;
    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[unit]), c, acc[r]);
#endif
}

/* The same sums for a few rows with no panel buffer: each 16 x 16-unit block of the weight is
 * transposed in registers and used at once (at one row, storing the panel and reading it back
 * made the call ~2x slower than the GEMV). Lane l of acc is output n0 + l, summed over the units
 * in the same order as gemm_tile. */
static inline __attribute__((always_inline)) void NAME(gemm_direct_tile)(const T *x, const T *w, int64_t K, int64_t N,
                                                                         int64_t n0, int64_t nr, __m512 acc[GEMM_DIRECT_ROWS]) {
    const int64_t units = NAME(gemm_units)(K), per = GEMM_UNIT / (int64_t)sizeof(T);
    for (int64_t r = 0; r < nr; ++r) acc[r] = _mm512_setzero_ps();
    const int full_rows = n0 + 16 <= N;
    for (int64_t u = 0; u < units; u += 16) {
        __m512 c[16];
        const T *block = w + n0 * K + u * per;
        if (full_rows && (u + 16) * per <= K) /* the common case: 16 whole rows of 16 units */
            for (int i = 0; i < 16; ++i) {
                _mm_prefetch((const char *)(block + i * K) + GEMM_PREFETCH_BYTES, GEMM_HINT);
                c[i] = _mm512_loadu_ps((const float *)(block + i * K));
            }
        else
            for (int i = 0; i < 16; ++i) c[i] = NAME(gemm_load_units)(w, K, N, n0 + i, u);
        rlserve_transpose16(c);
        if (u + 16 <= units && (u + 16) * per <= K) /* (bf16: not an odd K's last pair) */
            for (int i = 0; i < 16; ++i)
                for (int64_t r = 0; r < nr; ++r) NAME(gemm_direct_step)(acc, r, x + r * K, u + i, c[i], K);
        else
            for (int64_t i = 0; i < units - u; ++i)
                for (int64_t r = 0; r < nr; ++r) NAME(gemm_direct_step)(acc, r, x + r * K, u + i, c[i], K);
    }
}

/* Output blocks of 16 [begin, end) of a job of at most GEMM_DIRECT_ROWS rows. */
static void NAME(gemm_direct)(const void *job_ptr, int64_t begin, int64_t end) {
    const struct NAME(gemm_job) *j = job_ptr;
    for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = 16 * b, nl = j->N - n0 < 16 ? j->N - n0 : 16;
        __m512 acc[GEMM_DIRECT_ROWS];
        switch (j->rows) { /* constant row counts: the loops unroll, acc stays in registers */
#define GEMM_DIRECT_CASE(n) case n: NAME(gemm_direct_tile)(j->x, j->w, j->K, j->N, n0, n, acc); break;
        GEMM_DIRECT_CASE(1) GEMM_DIRECT_CASE(2) GEMM_DIRECT_CASE(3) GEMM_DIRECT_CASE(4)
        GEMM_DIRECT_CASE(5) GEMM_DIRECT_CASE(6) GEMM_DIRECT_CASE(7) GEMM_DIRECT_CASE(8)
#if GEMM_DIRECT_ROWS > 8
        GEMM_DIRECT_CASE(9) GEMM_DIRECT_CASE(10) GEMM_DIRECT_CASE(11) GEMM_DIRECT_CASE(12)
        GEMM_DIRECT_CASE(13) GEMM_DIRECT_CASE(14) GEMM_DIRECT_CASE(15) GEMM_DIRECT_CASE(16)
#endif
#undef GEMM_DIRECT_CASE
        }
        for (int64_t r = 0; r < j->rows; ++r) {
            float lanes[16];
            _mm512_storeu_ps(lanes, acc[r]);
            for (int64_t l = 0; l < nl; ++l) NAME(gemv_put)(j->out, j->out_f32, r * j->N + n0 + l, lanes[l], j->bias, n0 + l);
        }
    }
}
#endif

/* A thread's panel buffer, grown as needed and kept for its next calls. */
static _Thread_local void *NAME(gemm_buffer);
static _Thread_local int64_t NAME(gemm_buffer_bytes);

/* Panels [begin, end) of a job: packed into this thread's buffer, then every row tile against each,
 * a panel at a time (its row tiles in turn, not each row tile over the task's panels: with the LM
 * head's 49K outputs x 64 rows streamed from memory that ran 1.9-2.0x faster, 1.0-1.05x elsewhere). */
static void NAME(gemm_panels)(const void *job_ptr, int64_t begin, int64_t end) {
    const struct NAME(gemm_job) *j = job_ptr;
    const char *buffer = j->packed + begin * j->panel_bytes;
    if (!j->packed) {
        const int64_t need = (end - begin) * j->panel_bytes;
        if (NAME(gemm_buffer_bytes) < need) {
            free(NAME(gemm_buffer));
            NAME(gemm_buffer) = aligned_alloc(64, (size_t)need);
            NAME(gemm_buffer_bytes) = NAME(gemm_buffer) ? need : 0;
            if (!NAME(gemm_buffer)) abort(); /* a few hundred KB; nothing sensible to do without it */
        }
        for (int64_t p = begin; p < end; ++p)
            NAME(gemm_pack)(j->w, j->K, j->N, p * GEMM_PANEL_OUT, (char *)NAME(gemm_buffer) + (p - begin) * j->panel_bytes);
        buffer = NAME(gemm_buffer);
    }
    const int64_t tiles = (j->rows + GEMM_ROWS - 1) / GEMM_ROWS;
    const int64_t panels = (j->N + GEMM_PANEL_OUT - 1) / GEMM_PANEL_OUT;
    /* Packed weights stream from memory, and a panel's first row tile waits for it. So the tiles after
     * the first fetch the next panel (whichever thread takes it) into L2 while they compute, spread
     * over them at one prefetch per K unit: at 32-128 rows a decode step's projections and LM head ran
     * 1.03-1.14x faster on 2 threads, 1.06-1.27x on one, fp32 and bf16 (benchmarks/gemm.py). Under 4
     * tiles, a line a unit could not cover it. */
    const int64_t units = NAME(gemm_units)(j->K), pf_units = (tiles - 1) * units;
    int64_t pf_step = tiles >= 4 ? (j->panel_bytes + pf_units - 1) / pf_units : 0;
    if (pf_step > 64) pf_step = 64; /* (a panel's 64-byte padding; a prefetch past the weight cannot fault) */
    for (int64_t p = begin; p < end; ++p) {
        const void *panel = buffer + (p - begin) * j->panel_bytes;
        const int64_t n0 = p * GEMM_PANEL_OUT;
        const char *next = j->packed && pf_step && p + 1 < panels ? j->packed + (p + 1) * j->panel_bytes : 0;
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t r0 = t * GEMM_ROWS, nr = j->rows - r0 < GEMM_ROWS ? j->rows - r0 : GEMM_ROWS;
            const char *pf = next && t > 0 ? next + (t - 1) * units * pf_step : 0;
            /* the row count as a constant, so gemm_tile unrolls and its accumulators stay in registers */
#define GEMM_STORE(rows) NAME(gemm_store)(j->x, panel, j->bias, j->out, j->out_f32, j->K, j->N, r0, n0, rows, pf, pf_step)
            switch (nr) {
            case 1: GEMM_STORE(1); break;
            case 2: GEMM_STORE(2); break;
            case 3: GEMM_STORE(3); break;
            case 4: GEMM_STORE(4); break;
            case 5: GEMM_STORE(5); break;
#if GEMM_ROWS > 5
            case 6: GEMM_STORE(6); break;
#endif
#if GEMM_ROWS > 6
            case 7: GEMM_STORE(7); break;
#endif
#if GEMM_ROWS > 7
            case 8: GEMM_STORE(8); break;
#endif
            default: GEMM_STORE(nr);
            }
#undef GEMM_STORE
        }
    }
}

static int64_t NAME(gemm_panel_bytes)(int64_t K) { return (NAME(gemm_units)(K) * GEMM_PANEL_UNIT_BYTES + 63) / 64 * 64; }

static void NAME(gemm_run_panels)(const struct NAME(gemm_job) *job, int num_threads) {
    const int64_t panels = (job->N + GEMM_PANEL_OUT - 1) / GEMM_PANEL_OUT;
    const int threads = rlserve_threads_for(job->rows * job->K * job->N, num_threads);
    int64_t per = GEMM_CHUNK_BYTES / job->panel_bytes;
    const int64_t balanced = panels / (4 * (int64_t)threads); /* a few chunks per thread */
    if (per > balanced) per = balanced;
    if (per < 1) per = 1;
    rlserve_parallel_for(NAME(gemm_panels), job, panels, per, threads);
}

static void NAME(gemm_any)(const T *x, const T *w, const T *bias, void *out, int out_f32, int64_t rows, int64_t K,
                           int64_t N, int num_threads) {
#if defined(GEMM_AVX512)
    if (rows <= GEMM_DIRECT_ROWS) {
        const struct NAME(gemm_job) job = {x, w, bias, 0, out, out_f32, rows, K, N, 0};
        const int64_t blocks = (N + 15) / 16;
        rlserve_parallel_for(NAME(gemm_direct), &job, blocks, blocks >= 32 ? blocks / 32 : 1,
                             rlserve_threads_for(rows * K * N, num_threads));
        return;
    }
#endif
    const struct NAME(gemm_job) job = {x, w, bias, 0, out, out_f32, rows, K, N, NAME(gemm_panel_bytes)(K)};
    NAME(gemm_run_panels)(&job, num_threads);
}

/* the vector width in bits of the form this instance was built with: 512 (AVX-512), 256 (AVX2 + FMA) or 0 */
int NAME(rlserve_gemm_vectorized)(void) {
#if defined(GEMM_AVX512)
    return 512;
#elif defined(GEMM_AVX2)
    return 256;
#else
    return 0;
#endif
}

/* A weight [N, K] kept packed (model/linear.py's PanelWeight): the same sums as gemm_any
 * without the per-call packing, so one row streams the panels at the memory's rate. */
int64_t NAME(rlserve_gemm_packed_bytes)(int64_t K, int64_t N) {
    return (N + GEMM_PANEL_OUT - 1) / GEMM_PANEL_OUT * NAME(gemm_panel_bytes)(K);
}

struct NAME(gemm_pack_job) {
    const T *w;
    char *packed;
    int64_t K, N, panel_bytes;
};

static void NAME(gemm_pack_panels)(const void *job_ptr, int64_t begin, int64_t end) {
    const struct NAME(gemm_pack_job) *j = job_ptr;
    for (int64_t p = begin; p < end; ++p) NAME(gemm_pack)(j->w, j->K, j->N, p * GEMM_PANEL_OUT, j->packed + p * j->panel_bytes);
}

void NAME(rlserve_gemm_pack)(const T *w, int64_t K, int64_t N, void *packed, int num_threads) {
    const struct NAME(gemm_pack_job) job = {w, packed, K, N, NAME(gemm_panel_bytes)(K)};
    const int64_t panels = (N + GEMM_PANEL_OUT - 1) / GEMM_PANEL_OUT;
    rlserve_parallel_for(NAME(gemm_pack_panels), &job, panels, 1, rlserve_threads_for(K * N, num_threads));
}

void NAME(rlserve_gemm_packed)(const T *x, const void *packed, const T *bias, void *out, int out_f32, int64_t rows,
                               int64_t K, int64_t N, int num_threads) {
    const struct NAME(gemm_job) job = {x, 0, bias, packed, out, out_f32, rows, K, N, NAME(gemm_panel_bytes)(K)};
    NAME(gemm_run_panels)(&job, num_threads);
}

#undef GEMM_AVX512
#undef GEMM_DIRECT_ROWS
#undef GEMM_PREFETCH_BYTES
#undef GEMM_AVX2
#undef GEMM_PANEL_UNIT_BYTES
#undef GEMM_ROWS
#undef GEMM_UNIT
#undef GEMM_PANEL_OUT
#undef GEMM_CHUNK_BYTES
