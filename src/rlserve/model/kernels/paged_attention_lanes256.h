/* The lanes form of prompt attention on AVX2 + FMA without AVX-512 (the default build's fp32
 * instance; included by paged_attention_lanes.h): a tile of more than GROUP_QUERIES query vectors
 * runs with its query vectors as the 8 lanes of a ymm register, so one broadcast K or V value feeds
 * the FMAs of 16 query vectors, the max over a chunk's keys runs across registers, and the exp is a
 * vector polynomial. On a 2-core Zen 1 (AVX2 only) plain-C tiles ran at 0.28-0.69x torch's flash
 * SDPA, SDPA at 35-66% of a core's FMA peak, and this form at 65-71%: 1.8x SDPA at 512 positions,
 * 1.2x at 2,048, level at 4,096 (docs/cpu-performance.md).
 *
 * Its sums are not the per-query form's, so a prompt row's bits differ from the same position
 * decoded: fine for the default build (its one-row decode form sums in yet another order), and
 * the batch-invariant build (RLSERVE_ROW_INVARIANT) keeps plain C for every tile. */
#ifndef RLSERVE_PAGED_ATTENTION_LANES256
#define RLSERVE_PAGED_ATTENTION_LANES256

#define LANE_KEYS 4 /* scores: keys a pass, x 2 vectors of query vectors = 8 FMA chains */
#define LANE_DIMS 4 /* values: head dimensions a pass (ATTN_LANES_TAKE asks D % 4 == 0) */

/* e^x for x <= 0, 8 lanes: attn_exp's reduction and polynomial (~1 ulp), 2^n built in the exponent
 * bits (x is clamped to -87 first, so n >= -126 stays a normal float). */
static inline __m256 attn_exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

/* A chunk's scores into s->st[key][lane] for `nv` (even) vectors of 8 query vectors, two at a time. */
static inline __attribute__((always_inline)) void attn_lanes8_scores(struct attn_state *s, const float *k[KEYS],
                                                                     const int nv, const int64_t D) {
    for (int c = 0; c < nv; c += 2)
        for (int g = 0; g < KEYS; g += LANE_KEYS) {
            __m256 acc[LANE_KEYS][2];
            for (int i = 0; i < LANE_KEYS; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; ++d) {
                const __m256 q0 = _mm256_loadu_ps(s->qt[d] + 8 * c), q1 = _mm256_loadu_ps(s->qt[d] + 8 * c + 8);
                for (int i = 0; i < LANE_KEYS; ++i) {
                    const __m256 kv = _mm256_broadcast_ss(k[g + i] + d);
                    acc[i][0] = _mm256_fmadd_ps(q0, kv, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(q1, kv, acc[i][1]);
                }
            }
            for (int i = 0; i < LANE_KEYS; ++i) {
                _mm256_storeu_ps(s->st[g + i] + 8 * c, acc[i][0]);
                _mm256_storeu_ps(s->st[g + i] + 8 * c + 8, acc[i][1]);
            }
        }
}

/* Whether key i of the chunk at `start` lies in each lane's context (all ones / zeros per lane). */
static inline __m256 attn_live8(__m256i valid, int i) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(valid, _mm256_set1_epi32(i)));
}

/* The online-softmax step of lanes [o, o + 8): s->st's scores (the scale already in the queries)
 * become weights, zero past a lane's context, and corr, the running max and sum move on. `full`:
 * every key of the chunk lies in every live lane's context (all but a tile's last chunks), so no
 * lane is masked; padding lanes then carry finite values nobody reads. */
static inline __attribute__((always_inline)) void attn_lanes8_softmax(struct attn_state *s, int64_t o, int64_t start,
                                                                      const int full) {
    const __m256i valid = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)(s->lane_lens + o)),
                                           _mm256_set1_epi32((int32_t)start));
    const __m256 lowest = _mm256_set1_ps(-FLT_MAX);
    __m256 top = lowest;
    for (int i = 0; i < KEYS; ++i) {
        __m256 sc = _mm256_loadu_ps(s->st[i] + o);
        if (!full) {
            sc = _mm256_blendv_ps(lowest, sc, attn_live8(valid, i));
            _mm256_storeu_ps(s->st[i] + o, sc);
        }
        top = _mm256_max_ps(top, sc);
    }
    const __m256 run_max = _mm256_loadu_ps(s->run_max + o), new_max = _mm256_max_ps(run_max, top);
    const __m256 corr = attn_exp8(_mm256_sub_ps(run_max, new_max));
    __m256 sum = _mm256_setzero_ps();
    for (int i = 0; i < KEYS; ++i) {
        __m256 p = attn_exp8(_mm256_sub_ps(_mm256_loadu_ps(s->st[i] + o), new_max));
        if (!full) p = _mm256_and_ps(attn_live8(valid, i), p);
        _mm256_storeu_ps(s->st[i] + o, p);
        sum = _mm256_add_ps(sum, p);
    }
    _mm256_storeu_ps(s->run_sum + o, _mm256_fmadd_ps(_mm256_loadu_ps(s->run_sum + o), corr, sum));
    _mm256_storeu_ps(s->run_max + o, new_max);
    _mm256_storeu_ps(s->corr + o, corr);
}

/* acct = acct * corr + weights @ v for `nv` (even) vectors of query vectors: two vectors and
 * LANE_DIMS head dimensions a pass, their sums kept in registers over the chunk's keys. */
static inline __attribute__((always_inline)) void attn_lanes8_values(struct attn_state *s, const float *v[KEYS],
                                                                     const int nv, const int64_t D) {
    for (int c = 0; c < nv; c += 2) {
        const __m256 corr0 = _mm256_loadu_ps(s->corr + 8 * c), corr1 = _mm256_loadu_ps(s->corr + 8 * c + 8);
        for (int64_t d = 0; d < D; d += LANE_DIMS) {
            __m256 a[LANE_DIMS][2];
            for (int j = 0; j < LANE_DIMS; ++j) {
                a[j][0] = _mm256_mul_ps(_mm256_loadu_ps(s->acct[d + j] + 8 * c), corr0);
                a[j][1] = _mm256_mul_ps(_mm256_loadu_ps(s->acct[d + j] + 8 * c + 8), corr1);
            }
            for (int i = 0; i < KEYS; ++i) {
                const __m256 p0 = _mm256_loadu_ps(s->st[i] + 8 * c), p1 = _mm256_loadu_ps(s->st[i] + 8 * c + 8);
                for (int j = 0; j < LANE_DIMS; ++j) {
                    const __m256 vv = _mm256_broadcast_ss(v[i] + d + j);
                    a[j][0] = _mm256_fmadd_ps(p0, vv, a[j][0]);
                    a[j][1] = _mm256_fmadd_ps(p1, vv, a[j][1]);
                }
            }
            for (int j = 0; j < LANE_DIMS; ++j) {
                _mm256_storeu_ps(s->acct[d + j] + 8 * c, a[j][0]);
                _mm256_storeu_ps(s->acct[d + j] + 8 * c + 8, a[j][1]);
            }
        }
    }
}

static inline __attribute__((always_inline)) void attn_lanes8_n(struct attn_state *s, const float *k[KEYS],
                                                                const float *v[KEYS], int64_t start, const int nv,
                                                                const int64_t D) {
    attn_lanes8_scores(s, k, nv, D);
    const int full = start + KEYS <= s->lens[0]; /* the tile's first query vector has the shortest context */
    for (int c = 0; c < nv; ++c) {
        if (full)
            attn_lanes8_softmax(s, 8 * c, start, 1);
        else
            attn_lanes8_softmax(s, 8 * c, start, 0);
    }
    attn_lanes8_values(s, v, nv, D);
}

/* One chunk of the tile (its lanes padded to a multiple of 16 by attend_lanes); `pairs` is never
 * set here. The first chunk folds the scale into the transposed queries. */
static inline void attn_lanes(struct attn_state *s, const void *k[KEYS], const float *v[KEYS], int64_t start,
                              float scale, const int pairs) {
    (void)pairs;
    const int nv = (int)((s->n_queries + 15) / 16 * 2);
    const int64_t D = s->D;
    if (start == 0)
        for (int64_t d = 0; d < D; ++d)
            for (int r = 0; r < 8 * nv; ++r) s->qt[d][r] *= scale;
    if (D == 64)
        attn_lanes8_n(s, (const float **)k, v, start, nv, 64);
    else if (D == 128)
        attn_lanes8_n(s, (const float **)k, v, start, nv, 128);
    else
        attn_lanes8_n(s, (const float **)k, v, start, nv, D);
}
#endif /* RLSERVE_PAGED_ATTENTION_LANES256 */
