/* Attention of query rows over the paged KV cache: decode rows, and prompt rows where the model
 * sends them through here (included once per storage type by paged_attention.c; T, LD, ST from
 * scalar.h; fp32 arithmetic).
 *
 * A tile is up to TILE_ROWS consecutive rows of one sequence (prompt rows: positions p, p+1, ...
 * over the same block table; a decode row is a tile of one), and a work item is a tile and one KV
 * head, so the query vectors of the tile's rows and of the heads that share the KV head read each
 * K and V once. Keys go in chunks of KEYS consecutive positions: a chunk's K is widened and
 * transposed once (one key per vector lane), every query vector's scores come from FMAs over the
 * head dimension, then an online softmax, and the chunk's V is added with FMAs over its keys.
 * Prompt rows thus run as small matrix products; one query per K row read, as before, ran at
 * ~70 GFLOP/s in both dtypes at every prompt length. On AVX-512 a tile of more than GROUP_QUERIES
 * query vectors runs in the lanes form (attend_lanes: query vectors as vector lanes, the same
 * arithmetic per element), 1.3-1.5x the per-query form at 256-4,096 positions; bf16 with AVX512_BF16
 * sums q . k in pair dot products (ATTN_PAIRS), another 1.2x. On AVX2 the default build's fp32
 * prompt tiles take an 8-lane form with sums of its own (ATTN_LANES256, below).
 *
 * Every query vector's arithmetic is fixed by its own position and context alone: its chain over
 * the head dimension, the chunk edges (multiples of KEYS, whatever the block size), the order of
 * every sum. A tile or a batch only changes which vectors run together, never how, and a chunk
 * that lies wholly past a row's context (its tile's later rows reach it) leaves that row's state
 * bit-identical: its lanes are masked, the correction is exp(0) = 1, and it adds zeros. So a row
 * gets the same bits decoded alone, batched, or as a prompt row in a tile of any size (batch-
 * invariant mode relies on it; model/invariant_ops.py checks it on this build).
 *
 * Built at first use by rlserve/model/cpu_kernels.py (gcc -O3 -march=native -ffast-math): on
 * AVX-512 the arithmetic is intrinsics that fast-math cannot reassociate (masked forms), elsewhere
 * plain C whose per-group steps are single out-of-line functions, so every row runs the same code
 * (the default build's AVX2 prompt tiles excepted: plain intrinsics, their sums their own).
 * No infinities reach the arithmetic: masked scores are -FLT_MAX and only positions below the
 * tile's longest context are read (key lanes past it are zeros).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "scalar.h"
#include "transpose16.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef RLSERVE_PAGED_ATTENTION_SHARED
#define RLSERVE_PAGED_ATTENTION_SHARED
#define MAX_GROUP 32     /* query heads per KV head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64     /* tokens per block */
#define KEYS 16          /* positions per chunk: one vector lane each */
#define TILE_QUERIES 48  /* query vectors of a work item: rows x heads of one KV head */
#define GROUP_QUERIES 8  /* query vectors whose scores are computed together (8 accumulators) */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ATTN_AVX512 1
/* masked forms: builtins fast-math leaves alone (the unmasked ones are plain vector arithmetic) */
#define VADD(a, b) _mm512_maskz_add_ps((__mmask16)0xffff, (a), (b))
#define VMUL(a, b) _mm512_maskz_mul_ps((__mmask16)0xffff, (a), (b))

/* e^x for x <= 0: 2^n * e^r with r in [-ln2/2, ln2/2] and a degree-7 Taylor polynomial (~1 ulp);
 * e^0 is exactly 1, and below -87 the result is clamped to e^-87 (the softmax weights there are
 * far below rounding of a sum that contains 1). */
static inline __m512 attn_exp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(VMUL(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* the sum of 16 lanes, halves added in a fixed tree */
static inline float attn_sum16(__m512 v) {
    __m512 t = VADD(v, _mm512_shuffle_f32x4(v, v, 0x4e));
    t = VADD(t, _mm512_shuffle_f32x4(t, t, 0xb1));
    t = VADD(t, _mm512_permute_ps(t, 0x4e));
    t = VADD(t, _mm512_permute_ps(t, 0xb1));
    return _mm512_cvtss_f32(t);
}
#endif

/* One work item's state: its query vectors (fp32, and as stored pairs), their running max, sum and
 * output, the chunk's V rows where they lie (`v_rows`, a row of zeros in the lanes past the chunk),
 * its softmax weights, and the lanes form's transposed copies. */
struct attn_state {
    int64_t n_queries, D;
    int64_t lens[TILE_QUERIES]; /* each query vector's context */
    float run_max[TILE_QUERIES], run_sum[TILE_QUERIES], corr[TILE_QUERIES];
    float q[TILE_QUERIES][MAX_HEAD_DIM], acc[TILE_QUERIES][MAX_HEAD_DIM];
    uint32_t qp[TILE_QUERIES][MAX_HEAD_DIM / 2]; /* bf16 pair dot products: the stored queries' pairs */
    float kt[MAX_HEAD_DIM][KEYS], p[TILE_QUERIES][KEYS]; /* (kt: plain C) */
    const void *v_rows[KEYS];
    const void *next_k[KEYS], *next_v[KEYS]; /* the rows of the item's next chunk (attn_stage), fetched as these are read */
    /* the lanes form (tiles past GROUP_QUERIES): query vectors as vector lanes */
    int32_t lane_lens[TILE_QUERIES];
    float qt[MAX_HEAD_DIM][TILE_QUERIES], acct[MAX_HEAD_DIM][TILE_QUERIES];
    uint32_t qpt[MAX_HEAD_DIM / 2][TILE_QUERIES];
    float st[KEYS][TILE_QUERIES];                         /* the chunk's scores, then its weights */
    float kw[KEYS][MAX_HEAD_DIM], vw[KEYS][MAX_HEAD_DIM]; /* bf16: the chunk's K and V rows widened */
    uint32_t vp[KEYS / 2][MAX_HEAD_DIM]; /* bf16 pairs: dimension d of keys 2i (low half) and 2i + 1, as stored */
};

static const uint32_t attn_zeros[MAX_HEAD_DIM]; /* a V row for the lanes past a chunk (any type) */

/* Where a work item reads after its current chunk: from `start` of a context of `len` over `table`
 * (len 0: nowhere). Few query vectors read each K and V row once and blocks lie anywhere, so a chunk's
 * loads fetch the same lines of that chunk (ATTN_FETCH_LINE), one prefetch per line as they read their
 * own. Fetched all at once when a chunk began, most of those lines were lost on the way from memory:
 * 64 bf16 decode rows of ~100 positions read their KV at 10 GB/s, no faster than with no prefetch at
 * all, where a plain pass over the same blocks reads 35; spread so, 24 GB/s (2 cores, AVX-512). */
struct attn_next {
    const int64_t *table;
    int64_t start, len;
};

/* Prefetch the line at `d` values into `row` once per line: where d's offset is a multiple of a line
 * (a row's lines, where rows start on lines as the caches' slots do for 32- and 64-value heads). */
#define ATTN_FETCH_LINE(row, d) \
    do { \
        if ((d) * (int64_t)sizeof(T) % 64 == 0) __builtin_prefetch((const T *)(row) + (d), 0, 3); \
    } while (0)

/* this thread's state (~260 KB, kept: a work item is claimed per call, and a fresh block that size
 * would be an mmap each time) */
static struct attn_state *attn_thread_state(void) {
    static _Thread_local struct attn_state *state;
    if (!state && !(state = aligned_alloc(64, (sizeof(struct attn_state) + 63) / 64 * 64))) abort();
    return state;
}

#if defined(ATTN_AVX512)
/* Query vector r's online-softmax step from its dot products with the chunk at `start`. */
static inline __attribute__((always_inline)) void attn_softmax_step(struct attn_state *s, int64_t r, __m512 dots,
                                                                    int64_t start, float scale) {
    const int64_t valid = s->lens[r] - start;
    const __mmask16 live = valid >= KEYS ? (__mmask16)0xffff : valid <= 0 ? 0 : (__mmask16)((1u << valid) - 1u);
    const __m512 sc = _mm512_mask_blend_ps(live, _mm512_set1_ps(-FLT_MAX), VMUL(dots, _mm512_set1_ps(scale)));
    const float top = _mm512_reduce_max_ps(sc), new_max = top > s->run_max[r] ? top : s->run_max[r];
    /* e^0 is exactly 1: a chunk that does not raise the max (most of a long context's) skips the exp */
    const float corr =
        new_max == s->run_max[r] ? 1.0f : _mm512_cvtss_f32(attn_exp(_mm512_set1_ps(s->run_max[r] - new_max)));
    const __m512 p = _mm512_maskz_mov_ps(live, attn_exp(_mm512_maskz_sub_ps(0xffff, sc, _mm512_set1_ps(new_max))));
    _mm512_storeu_ps(s->p[r], p);
    s->run_sum[r] = fmaf(s->run_sum[r], corr, attn_sum16(p));
    s->run_max[r] = new_max;
    s->corr[r] = corr;
}
#endif

#if !defined(ATTN_AVX512)
/* Plain C: scores of query vectors [first, first + count) against the staged chunk at position
 * `start` (s->kt), then their online-softmax step: weights in p, the old output's correction in corr. */
static void attn_scores(struct attn_state *s, int64_t first, int64_t count, int64_t start, float scale) {
    const int64_t D = s->D;
    for (int64_t j = 0; j < count; ++j) {
        const int64_t r = first + j, valid = s->lens[r] - start;
        float sc[KEYS];
        for (int i = 0; i < KEYS; ++i) sc[i] = 0.0f;
        for (int64_t d = 0; d < D; ++d)
            for (int i = 0; i < KEYS; ++i) sc[i] = fmaf(s->q[r][d], s->kt[d][i], sc[i]);
        float top = -FLT_MAX;
        for (int i = 0; i < KEYS; ++i) {
            sc[i] = i < valid ? sc[i] * scale : -FLT_MAX;
            top = sc[i] > top ? sc[i] : top;
        }
        const float new_max = top > s->run_max[r] ? top : s->run_max[r], corr = expf(s->run_max[r] - new_max);
        float part[KEYS];
        for (int i = 0; i < KEYS; ++i) part[i] = s->p[r][i] = i < valid ? expf(sc[i] - new_max) : 0.0f;
        for (int w = KEYS / 2; w > 0; w /= 2)
            for (int i = 0; i < w; ++i) part[i] += part[i + w];
        s->run_sum[r] = fmaf(s->run_sum[r], corr, part[0]);
        s->run_max[r] = new_max;
        s->corr[r] = corr;
    }
}
#endif

#endif /* RLSERVE_PAGED_ATTENTION_SHARED */

/* bf16 where the CPU has AVX512_BF16: each score sums the stored q and k two dimensions per
 * instruction (vdpbf16ps: exact products, d = 2c + 1 then 2c added, both forms alike), and K is
 * read as stored, never widened. The values take two keys per instruction the same way: the
 * softmax weights rounded to bf16 (as flash attention does on GPUs; the sum they are divided by
 * stays the fp32 weights'), V as stored, key 2i + 1's product added before key 2i's. Elsewhere
 * every score and value is an FMA chain over widened values. */
#undef ATTN_PAIRS
#if defined(ATTN_AVX512) && defined(RLSERVE_BF16) && defined(__AVX512BF16__)
#define ATTN_PAIRS 1
/* Dimensions [d, d + 16) of the chunk's keys 2i (low halves) and 2i + 1 (high), from s->v_rows as stored. */
static inline __attribute__((always_inline)) __m512bh attn_value_pair(const struct attn_state *s, int i, int64_t d,
                                                                     __mmask16 m) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const bf16 *)s->v_rows[2 * i] + d));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const bf16 *)s->v_rows[2 * i + 1] + d));
    return (__m512bh)_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

/* The chunk's V rows as key pairs in s->vp (the lanes form broadcasts them one dimension at a time). */
static inline void attn_stage_value_pairs(struct attn_state *s) {
    const int64_t D = s->D;
    for (int i = 0; i < KEYS / 2; ++i)
        for (int64_t d = 0; d < D; d += 16) {
            const __mmask16 m = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1u);
            _mm512_mask_storeu_epi32(s->vp[i] + d, m, (__m512i)attn_value_pair(s, i, d, m));
        }
}
#endif

/* The default build's fp32 prompt tiles on AVX2 + FMA without AVX-512 take an 8-lane form of the
 * lanes form (paged_attention_lanes256.h; its sums differ from the per-query form's, so never in the
 * batch-invariant build). ATTN_LANES: a lanes form exists for this instance. */
#undef ATTN_LANES256
#undef ATTN_LANES
#if !defined(ATTN_AVX512) && defined(__AVX2__) && defined(__FMA__) && !defined(RLSERVE_ROW_INVARIANT) && \
    !defined(RLSERVE_BF16)
#define ATTN_LANES256 1
#endif
#undef ATTN_LANES_TAKE /* whether the lanes form takes a work item's tile */
#if defined(ATTN_AVX512)
#define ATTN_LANES 1
#define ATTN_LANES_TAKE(s) ((s)->n_queries > GROUP_QUERIES)
#elif defined(ATTN_LANES256)
#define ATTN_LANES 1
#define ATTN_LANES_TAKE(s) ((s)->n_queries > GROUP_QUERIES && (s)->D % 4 == 0) /* whole passes of LANE_DIMS */
#endif

struct NAME(attention_job) {
    const T *q, *k_cache, *v_cache;
    const int64_t *blocks, *ctx_lens, *tiles; /* tiles [n, 2]: first row, rows */
    T *out;
    int64_t q_stride, W, H, KVH, D, block_size;
    float scale;
};

#if defined(ATTN_AVX512)
/* 16 stored values (the lanes m), widened to fp32 */
static inline __m512 NAME(attn_load16)(const T *src, __mmask16 m) {
#if defined(RLSERVE_BF16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src)), 16));
#else
    return _mm512_maskz_loadu_ps(m, src);
#endif
}

/* The chunk's K at head dimensions [d, d + 16), widened and transposed: r[c] holds dimension d + c
 * of the 16 keys. Returns how many of the 16 dimensions exist (D - d at the end). */
static inline __attribute__((always_inline)) int64_t NAME(attn_k_block)(const T *k_rows[KEYS], const void *next_k[KEYS],
                                                                        int64_t d, int64_t D, __m512 r[16]) {
    const int64_t w = D - d < 16 ? D - d : 16;
    const __mmask16 m = w == 16 ? (__mmask16)0xffff : (__mmask16)((1u << w) - 1u);
    for (int i = 0; i < KEYS; ++i) {
        ATTN_FETCH_LINE(next_k[i], d);
        r[i] = NAME(attn_load16)(k_rows[i] + d, m);
    }
    rlserve_transpose16(r);
    return w;
}
#endif

/* acc = acc * corr + p @ v for query vectors [first, first + count): each output lane adds the
 * chunk's keys in order. One body per storage type, whatever the tile. */
static __attribute__((noinline)) void NAME(attn_values)(struct attn_state *s, int64_t first, int64_t count) {
    const int64_t D = s->D;
#if defined(ATTN_PAIRS)
    uint32_t weights[TILE_QUERIES][KEYS / 2]; /* each query vector's weights as bf16 key pairs */
    for (int64_t j = 0; j < count; ++j)
        _mm256_storeu_si256((__m256i *)weights[j], (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s->p[first + j])));
    for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 m = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1u);
        __m512bh v[KEYS / 2];
        for (int i = 0; i < KEYS; ++i) ATTN_FETCH_LINE(s->next_v[i], d);
        for (int i = 0; i < KEYS / 2; ++i) v[i] = attn_value_pair(s, i, d, m);
        for (int64_t j = 0; j < count; ++j) {
            const int64_t r = first + j;
            __m512 a = VMUL(_mm512_maskz_loadu_ps(m, s->acc[r] + d), _mm512_set1_ps(s->corr[r]));
            for (int i = 0; i < KEYS / 2; ++i)
                a = _mm512_dpbf16_ps(a, v[i], (__m512bh)_mm512_set1_epi32((int32_t)weights[j][i]));
            _mm512_mask_storeu_ps(s->acc[r] + d, m, a);
        }
    }
#elif defined(ATTN_AVX512)
    for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 m = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1u);
        __m512 v[KEYS];
        for (int i = 0; i < KEYS; ++i) {
            ATTN_FETCH_LINE(s->next_v[i], d);
            v[i] = NAME(attn_load16)((const T *)s->v_rows[i] + d, m);
        }
        for (int64_t j = 0; j < count; ++j) {
            const int64_t r = first + j;
            __m512 a = VMUL(_mm512_maskz_loadu_ps(m, s->acc[r] + d), _mm512_set1_ps(s->corr[r]));
            for (int i = 0; i < KEYS; ++i) a = _mm512_fmadd_ps(_mm512_set1_ps(s->p[r][i]), v[i], a);
            _mm512_mask_storeu_ps(s->acc[r] + d, m, a);
        }
    }
#else
    for (int64_t j = 0; j < count; ++j) {
        const int64_t r = first + j;
        for (int64_t d = 0; d < D; ++d) {
            float a = s->acc[r][d] * s->corr[r];
            for (int i = 0; i < KEYS; ++i) a = fmaf(s->p[r][i], LD(((const T *)s->v_rows[i])[d]), a);
            s->acc[r][d] = a;
        }
    }
#endif
}

/* The K and V rows of KV head kvh at the KEYS positions from `start` of a context of `len` (`table` its
 * block ids): a row of zeros for the positions past it. */
static void NAME(attn_rows)(const struct NAME(attention_job) *j, const int64_t *table, int64_t kvh, int64_t start,
                            int64_t len, const void *k_rows[KEYS], const void *v_rows[KEYS]) {
    const int64_t D = j->D, bs = j->block_size, row = j->KVH * D; /* values between consecutive slots */
    int64_t block = start / bs, offset = start % bs; /* walked, not divided, key by key */
    for (int64_t i = 0; i < KEYS; ++i) {
        if (start + i >= len) {
            k_rows[i] = v_rows[i] = attn_zeros;
            continue;
        }
        const int64_t at = (table[block] * bs + offset) * row + kvh * D;
        k_rows[i] = j->k_cache + at;
        v_rows[i] = j->v_cache + at;
        if (++offset == bs) {
            offset = 0;
            ++block;
        }
    }
}

/* The chunk of keys from `start` (at most KEYS, below `longest`) of KV head kvh: the K and V rows'
 * addresses (k_rows, s->v_rows; a row of zeros in the lanes past the chunk), and those of the chunk the item
 * reads next (s->next_k, s->next_v), whose lines the direct form and the values fetch as they read the
 * same lines of this one; plain C also stages K widened and transposed in s->kt. */
static void NAME(attn_stage)(struct attn_state *s, const struct NAME(attention_job) *j, const int64_t *table,
                             int64_t kvh, int64_t start, int64_t longest, const T *k_rows[KEYS],
                             struct attn_next next) {
    NAME(attn_rows)(j, table, kvh, start, longest, (const void **)k_rows, s->v_rows);
    NAME(attn_rows)(j, next.table, kvh, next.start, next.len, s->next_k, s->next_v);
#if !defined(ATTN_AVX512)
    const int64_t D = j->D;
#if defined(ATTN_LANES256)
    if (ATTN_LANES_TAKE(s)) return; /* the lanes form reads K where it lies */
#endif
    for (int64_t d = 0; d < D; ++d)
        for (int64_t i = 0; i < KEYS; ++i) {
            ATTN_FETCH_LINE(s->next_k[i], d);
            ATTN_FETCH_LINE(s->next_v[i], d);
            s->kt[d][i] = LD(k_rows[i][d]);
        }
#endif
}

#if defined(ATTN_AVX512)
/* A tile of at most GROUP_QUERIES query vectors (a decode row: its G heads) against a chunk, straight
 * from its K rows: each 16 x 16 block is transposed in registers and used at once, never stored
 * (d = 0, 1, ... per score, the chain the lanes form repeats). */
static inline __attribute__((always_inline)) void NAME(attn_direct_n)(struct attn_state *s, const T *k_rows[KEYS],
                                                                      int64_t first, const int count, int64_t start,
                                                                      float scale) {
    const int64_t D = s->D;
    __m512 acc[GROUP_QUERIES];
    for (int j = 0; j < count; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        __m512 r[16];
        const int64_t w = NAME(attn_k_block)(k_rows, s->next_k, d, D, r);
        for (int64_t c = 0; c < w; ++c)
            for (int j = 0; j < count; ++j)
                acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(s->q[first + j][d + c]), r[c], acc[j]);
    }
    for (int j = 0; j < count; ++j) attn_softmax_step(s, first + j, acc[j], start, scale);
}

#if defined(ATTN_PAIRS)
/* The same with pair dot products: each 16 keys x 16 pairs block (32 dimensions) transposed as
 * stored, 32-bit lanes r[c] = dimensions 2c, 2c + 1 of the 16 keys. */
static inline __attribute__((always_inline)) void NAME(attn_direct_pairs_n)(struct attn_state *s, const T *k_rows[KEYS],
                                                                            int64_t first, const int count,
                                                                            int64_t start, float scale) {
    const int64_t D = s->D;
    __m512 acc[GROUP_QUERIES];
    for (int j = 0; j < count; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
        const int64_t w = D - d < 32 ? D - d : 32;
        const __mmask32 m = w == 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << w) - 1u);
        __m512 r[16];
        for (int i = 0; i < KEYS; ++i) {
            ATTN_FETCH_LINE(s->next_k[i], d);
            r[i] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(m, k_rows[i] + d));
        }
        rlserve_transpose16(r);
        for (int64_t c = 0; c < w / 2; ++c)
            for (int j = 0; j < count; ++j)
                acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32((int32_t)s->qp[first + j][d / 2 + c]),
                                          (__m512bh)r[c]);
    }
    for (int j = 0; j < count; ++j) attn_softmax_step(s, first + j, acc[j], start, scale);
}
#endif

/* query vectors [first, first + count) of the work item (count <= GROUP_QUERIES) against a chunk */
static void NAME(attn_direct)(struct attn_state *s, const T *k_rows[KEYS], int64_t first, int64_t count, int64_t start,
                              float scale) {
    switch (count) {
#if defined(ATTN_PAIRS)
#define ATTN_DIRECT_CASE(n) \
    case n: NAME(attn_direct_pairs_n)(s, k_rows, first, n, start, scale); break;
#else
#define ATTN_DIRECT_CASE(n) \
    case n: NAME(attn_direct_n)(s, k_rows, first, n, start, scale); break;
#endif
        ATTN_DIRECT_CASE(1) ATTN_DIRECT_CASE(2) ATTN_DIRECT_CASE(3) ATTN_DIRECT_CASE(4)
        ATTN_DIRECT_CASE(5) ATTN_DIRECT_CASE(6) ATTN_DIRECT_CASE(7) ATTN_DIRECT_CASE(8)
#undef ATTN_DIRECT_CASE
    }
}
#endif

#include "paged_attention_one.h"
#include "paged_attention_lanes.h"

/* The tile's query vectors of KV head kvh into the work item's vectors from `at` (rows x G of them). */
static void NAME(attn_load_queries)(struct attn_state *s, const struct NAME(attention_job) *j, int64_t first_row,
                                    int64_t rows, int64_t kvh, int64_t at) {
    const int64_t D = j->D, G = j->H / j->KVH;
    for (int64_t r = 0; r < rows * G; ++r) {
        const int64_t row = first_row + r / G, head = kvh * G + r % G;
        const T *qv = j->q + row * j->q_stride + head * D;
        s->lens[at + r] = j->ctx_lens[row];
        s->run_max[at + r] = -FLT_MAX;
        s->run_sum[at + r] = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
            s->q[at + r][d] = LD(qv[d]);
            s->acc[at + r][d] = 0.0f;
        }
#if defined(ATTN_PAIRS)
        memcpy(s->qp[at + r], qv, (size_t)D * sizeof(T));
#endif
    }
}

/* The outputs of the query vectors attn_load_queries put at `at`. */
static void NAME(attn_store)(const struct attn_state *s, const struct NAME(attention_job) *j, int64_t first_row,
                             int64_t rows, int64_t kvh, int64_t at) {
    const int64_t D = j->D, G = j->H / j->KVH;
    for (int64_t r = 0; r < rows * G; ++r) {
        const int64_t row = first_row + r / G, head = kvh * G + r % G;
        T *ob = j->out + (row * j->H + head) * D;
        const float inv = s->lens[at + r] > 0 ? 1.0f / s->run_sum[at + r] : 0.0f;
        for (int64_t d = 0; d < D; ++d) ob[d] = ST(s->acc[at + r][d] * inv);
    }
}

/* Query vectors [first, first + count) of the work item against the staged chunk at `start`. */
static inline void NAME(attn_chunk)(struct attn_state *s, const struct NAME(attention_job) *j, const T *k_rows[KEYS],
                                    int64_t first, int64_t count, int64_t start) {
#if defined(ATTN_AVX512)
    NAME(attn_direct)(s, k_rows, first, count, start, j->scale);
#else
    (void)k_rows;
    for (int64_t r = first; r < first + count; r += GROUP_QUERIES)
        attn_scores(s, r, first + count - r < GROUP_QUERIES ? first + count - r : GROUP_QUERIES, start, j->scale);
#endif
    NAME(attn_values)(s, first, count); /* each V row loaded (and widened) once for the whole tile */
}

/* Items [begin, end) of (tile, KV head) pairs. */
static void NAME(attend_items)(const void *job_ptr, int64_t begin, int64_t end) {
    const struct NAME(attention_job) *j = job_ptr;
    const int64_t KVH = j->KVH, D = j->D, G = j->H / KVH;
    struct attn_state *s = attn_thread_state();
    s->D = D;
    for (int64_t item = begin; item < end; ++item) {
        const int64_t tile = item / KVH, kvh = item % KVH;
        const int64_t first_row = j->tiles[2 * tile], rows = j->tiles[2 * tile + 1];
        const int64_t *table = j->blocks + first_row * j->W;
#if !defined(RLSERVE_ROW_INVARIANT) && !defined(ATTN_PAIRS)
        if (rows == 1) {
            NAME(attend_one_row)(j, first_row, kvh, 1, -1);
            continue;
        }
#endif
        s->n_queries = rows * G;
        NAME(attn_load_queries)(s, j, first_row, rows, kvh, 0);
        const int64_t longest = j->ctx_lens[first_row + rows - 1];
#if defined(ATTN_LANES)
        if (ATTN_LANES_TAKE(s)) {
            NAME(attend_lanes)(s, j, table, kvh, longest, first_row);
            continue;
        }
#endif
        for (int64_t start = 0; start < longest; start += KEYS) {
            const T *k_rows[KEYS];
            const struct attn_next next = {table, start + KEYS, longest};
            NAME(attn_stage)(s, j, table, kvh, start, longest, k_rows, next);
            NAME(attn_chunk)(s, j, k_rows, 0, s->n_queries, start);
        }
        NAME(attn_store)(s, j, first_row, rows, kvh, 0);
    }
}

#include "paged_attention_tiles.h" /* attend_tiles: a decode step's tiles with every KV head in one item */

/* Whether row b + 1 continues row b's tile: the next position over the same blocks. Rows with the
 * same table over every block they read see the same keys, so joining them is exact either way. */
static int NAME(attn_continues)(const int64_t *blocks, const int64_t *ctx_lens, int64_t W, int64_t block_size,
                                int64_t b) {
    if (ctx_lens[b + 1] != ctx_lens[b] + 1) return 0;
    const int64_t used = (ctx_lens[b + 1] + block_size - 1) / block_size;
    return memcmp(blocks + b * W, blocks + (b + 1) * W, (size_t)(used < W ? used : W) * sizeof(int64_t)) == 0;
}

/* q: [B, H, D] with q_stride values between rows (a view into the QKV rows); out: [B, H, D];
 * k_cache, v_cache: [slots, KVH, D] (one layer); blocks: [B, W] block ids; ctx_lens: [B] (row b
 * attends positions [0, ctx_lens[b])). Slot of position t of row b: blocks[b, t / block_size] *
 * block_size + t % block_size. Items are claimed one at a time by parallel.c's threads: contexts
 * differ in length. */
void NAME(rlserve_paged_attention)(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,
                                   const int64_t *blocks, const int64_t *ctx_lens, T *out, int64_t B, int64_t W,
                                   int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale,
                                   int num_threads) {
    const int64_t G = H / KVH, tile_rows = TILE_QUERIES / G;
    int64_t *tiles = malloc((size_t)(2 * (B > 0 ? B : 1)) * sizeof(int64_t)), n = 0;
    if (!tiles) abort();
    for (int64_t b = 0; b < B; ++b) {
        if (n > 0 && tiles[2 * n - 1] < tile_rows && NAME(attn_continues)(blocks, ctx_lens, W, block_size, b - 1)) {
            ++tiles[2 * n - 1];
            continue;
        }
        tiles[2 * n] = b;
        tiles[2 * n + 1] = 1;
        ++n;
    }
    int64_t work = 0; /* multiply-adds: every query head against every K and V of its context */
    for (int64_t b = 0; b < B; ++b) work += ctx_lens[b] * H * D * 2;
    const struct NAME(attention_job) job = {q, k_cache, v_cache, blocks, ctx_lens, tiles, out, q_stride, W, H, KVH, D,
                                            block_size, scale};
    int64_t widest = 0; /* rows of the largest tile */
    for (int64_t t = 0; t < n; ++t) widest = tiles[2 * t + 1] > widest ? tiles[2 * t + 1] : widest;
    const int threads = rlserve_threads_for(work, num_threads);
    /* whole tiles where there are enough of them to share among the threads (batch 1 splits by head) */
    if (NAME(attn_tiles_whole)(widest, G, KVH) && n >= 2 * TILES_PER_CLAIM * (int64_t)threads)
        rlserve_parallel_for(NAME(attend_tiles), &job, n, TILES_PER_CLAIM, threads);
    else
        rlserve_parallel_for(NAME(attend_items), &job, n * KVH, 1, threads);
    free(tiles);
}

/* the vector width in bits of this instance's lanes form for prompt tiles: 512 (AVX-512), 256 (AVX2 +
 * FMA, default build, fp32) or 0 (none: plain C) */
int NAME(rlserve_paged_attention_lanes)(void) {
#if defined(ATTN_AVX512)
    return 512;
#elif defined(ATTN_LANES256)
    return 256;
#else
    return 0;
#endif
}
