/* The lanes form of prompt attention on AVX-512 (included by paged_attention_impl.h once per
 * storage type, after its state, job and loads; on AVX2 the default build's fp32 instance takes
 * paged_attention_lanes256.h's 8-lane form instead): a tile of more than GROUP_QUERIES query vectors
 * runs with its query vectors as vector lanes. Each element's arithmetic is the per-query form's
 * (attn_direct_n or attn_direct_pairs_n, attn_softmax_step, attn_values) operation for operation,
 * so a row gets the same bits in either form; the max and the sum over a chunk's keys run across
 * registers instead of lanes, and one broadcast K or V value feeds up to 3 vectors of query
 * vectors, so loads stop bounding the FMAs (1.3-1.5x the per-query form at 256-4,096 positions,
 * both dtypes). */
#if defined(ATTN_AVX512)
#ifndef RLSERVE_PAGED_ATTENTION_LANES_SHARED
#define RLSERVE_PAGED_ATTENTION_LANES_SHARED
/* A chunk's scores for `nv` vectors of 16 query vectors (lane l of vector c: query vector 16 c + l)
 * into s->st[key][lane], each the same FMA chain over d as attn_direct_n's. */
static inline __attribute__((always_inline)) void attn_lanes_scores(struct attn_state *s, const float *k[KEYS],
                                                                    const int nv, const int64_t D) {
    for (int half = 0; half < KEYS; half += KEYS / 2) {
        __m512 acc[KEYS / 2][3];
        for (int i = 0; i < KEYS / 2; ++i)
            for (int c = 0; c < nv; ++c) acc[i][c] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
            __m512 q[3];
            for (int c = 0; c < nv; ++c) q[c] = _mm512_loadu_ps(s->qt[d] + 16 * c);
            for (int i = 0; i < KEYS / 2; ++i) {
                const __m512 kv = _mm512_set1_ps(k[half + i][d]);
                for (int c = 0; c < nv; ++c) acc[i][c] = _mm512_fmadd_ps(q[c], kv, acc[i][c]);
            }
        }
        for (int i = 0; i < KEYS / 2; ++i)
            for (int c = 0; c < nv; ++c) _mm512_storeu_ps(s->st[half + i] + 16 * c, acc[i][c]);
    }
}

#if defined(__AVX512BF16__)
/* The same from bf16 pairs (ATTN_PAIRS): s->qpt[c] holds the query vectors' dimensions 2c, 2c + 1,
 * and each key's pair is broadcast as stored, one vdpbf16ps per pair (attn_direct_pairs_n's sums). */
static inline __attribute__((always_inline)) void attn_lanes_scores_pairs(struct attn_state *s, const bf16 *k[KEYS],
                                                                          const int nv, const int64_t D) {
    for (int half = 0; half < KEYS; half += KEYS / 2) {
        __m512 acc[KEYS / 2][3];
        for (int i = 0; i < KEYS / 2; ++i)
            for (int c = 0; c < nv; ++c) acc[i][c] = _mm512_setzero_ps();
        for (int64_t u = 0; u < D / 2; ++u) {
            __m512bh q[3];
            for (int c = 0; c < nv; ++c) q[c] = (__m512bh)_mm512_loadu_si512(s->qpt[u] + 16 * c);
            for (int i = 0; i < KEYS / 2; ++i) {
                int32_t pair;
                memcpy(&pair, k[half + i] + 2 * u, sizeof pair);
                const __m512bh kv = (__m512bh)_mm512_set1_epi32(pair);
                for (int c = 0; c < nv; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], q[c], kv);
            }
        }
        for (int i = 0; i < KEYS / 2; ++i)
            for (int c = 0; c < nv; ++c) _mm512_storeu_ps(s->st[half + i] + 16 * c, acc[i][c]);
    }
}
#endif

/* The online-softmax step of lanes [o, o + 16): s->st's scores become weights, corr and the
 * running max and sum move on (attn_softmax_step's, lane by lane). */
static inline void attn_lanes_softmax(struct attn_state *s, int64_t o, int64_t start, float scale) {
    const __m512i valid = _mm512_sub_epi32(_mm512_loadu_si512(s->lane_lens + o), _mm512_set1_epi32((int32_t)start));
    __mmask16 live[KEYS];
    __m512 sc[KEYS], top = _mm512_set1_ps(-FLT_MAX);
    for (int i = 0; i < KEYS; ++i) {
        live[i] = _mm512_cmpgt_epi32_mask(valid, _mm512_set1_epi32(i));
        sc[i] = _mm512_mask_blend_ps(live[i], _mm512_set1_ps(-FLT_MAX),
                                     VMUL(_mm512_loadu_ps(s->st[i] + o), _mm512_set1_ps(scale)));
        top = _mm512_max_ps(top, sc[i]);
    }
    const __m512 run_max = _mm512_loadu_ps(s->run_max + o);
    const __mmask16 up = _mm512_cmp_ps_mask(top, run_max, _CMP_GT_OQ);
    const __m512 new_max = _mm512_mask_blend_ps(up, run_max, top);
    const __m512 corr = _mm512_mask_blend_ps(
        up, _mm512_set1_ps(1.0f), attn_exp(_mm512_maskz_sub_ps((__mmask16)0xffff, run_max, new_max)));
    for (int i = 0; i < KEYS; ++i) {
        sc[i] = _mm512_maskz_mov_ps(live[i], attn_exp(_mm512_maskz_sub_ps((__mmask16)0xffff, sc[i], new_max)));
        _mm512_storeu_ps(s->st[i] + o, sc[i]);
    }
    __m512 t[KEYS / 2]; /* attn_sum16's tree: lane i + lane i^8, then i^4, i^2, i^1 */
    for (int i = 0; i < 8; ++i) t[i] = VADD(sc[i], sc[i + 8]);
    for (int i = 0; i < 4; ++i) t[i] = VADD(t[i], t[i + 4]);
    for (int i = 0; i < 2; ++i) t[i] = VADD(t[i], t[i + 2]);
    _mm512_storeu_ps(s->run_sum + o, _mm512_fmadd_ps(_mm512_loadu_ps(s->run_sum + o), corr, VADD(t[0], t[1])));
    _mm512_storeu_ps(s->run_max + o, new_max);
    _mm512_storeu_ps(s->corr + o, corr);
}

/* acct = acct * corr + weights @ v, keys in order (the first half's pass applies corr) */
static inline __attribute__((always_inline)) void attn_lanes_values(struct attn_state *s, const float *v[KEYS],
                                                                    const int nv, const int64_t D) {
    for (int half = 0; half < KEYS; half += KEYS / 2) {
        __m512 p[KEYS / 2][3];
        for (int i = 0; i < KEYS / 2; ++i)
            for (int c = 0; c < nv; ++c) p[i][c] = _mm512_loadu_ps(s->st[half + i] + 16 * c);
        for (int64_t d = 0; d < D; ++d) {
            __m512 a[3];
            for (int c = 0; c < nv; ++c) {
                a[c] = _mm512_loadu_ps(s->acct[d] + 16 * c);
                if (half == 0) a[c] = VMUL(a[c], _mm512_loadu_ps(s->corr + 16 * c));
            }
            for (int i = 0; i < KEYS / 2; ++i) {
                const __m512 vv = _mm512_set1_ps(v[half + i][d]);
                for (int c = 0; c < nv; ++c) a[c] = _mm512_fmadd_ps(p[i][c], vv, a[c]);
            }
            for (int c = 0; c < nv; ++c) _mm512_storeu_ps(s->acct[d] + 16 * c, a[c]);
        }
    }
}

#if defined(__AVX512BF16__)
/* The same with bf16 pairs (ATTN_PAIRS): each lane's weights rounded to bf16 as key pairs, V's pairs
 * (s->vp) broadcast, key 2i + 1's product added before key 2i's (attn_values's sums). */
static inline __attribute__((always_inline)) void attn_lanes_values_pairs(struct attn_state *s, const int nv,
                                                                          const int64_t D) {
    __m512bh p[KEYS / 2][3];
    for (int i = 0; i < KEYS / 2; ++i)
        for (int c = 0; c < nv; ++c) {
            const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s->st[2 * i] + 16 * c)));
            const __m512i hi =
                _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s->st[2 * i + 1] + 16 * c)));
            p[i][c] = (__m512bh)_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
        }
    for (int64_t d = 0; d < D; ++d) {
        __m512 a[3];
        for (int c = 0; c < nv; ++c)
            a[c] = VMUL(_mm512_loadu_ps(s->acct[d] + 16 * c), _mm512_loadu_ps(s->corr + 16 * c));
        for (int i = 0; i < KEYS / 2; ++i) {
            const __m512bh vv = (__m512bh)_mm512_set1_epi32((int32_t)s->vp[i][d]);
            for (int c = 0; c < nv; ++c) a[c] = _mm512_dpbf16_ps(a[c], p[i][c], vv);
        }
        for (int c = 0; c < nv; ++c) _mm512_storeu_ps(s->acct[d] + 16 * c, a[c]);
    }
}
#endif

/* k: fp32 rows, or bf16 rows as stored where `pairs` (a constant once inlined) */
static inline __attribute__((always_inline)) void attn_lanes_n(struct attn_state *s, const void *k[KEYS],
                                                               const float *v[KEYS], int64_t start, float scale,
                                                               const int nv, const int64_t D, const int pairs) {
#if defined(__AVX512BF16__)
    if (pairs)
        attn_lanes_scores_pairs(s, (const bf16 **)k, nv, D);
    else
#endif
        attn_lanes_scores(s, (const float **)k, nv, D);
    for (int c = 0; c < nv; ++c) attn_lanes_softmax(s, 16 * c, start, scale);
#if defined(__AVX512BF16__)
    if (pairs) {
        attn_lanes_values_pairs(s, nv, D);
        return;
    }
#endif
    attn_lanes_values(s, v, nv, D);
}

static inline __attribute__((always_inline)) void attn_lanes(struct attn_state *s, const void *k[KEYS],
                                                             const float *v[KEYS], int64_t start, float scale,
                                                             const int pairs) {
    switch ((s->n_queries + 15) / 16) {
#define ATTN_LANES_CASE(nv)                                             \
    case nv:                                                            \
        if (s->D == 64)                                                 \
            attn_lanes_n(s, k, v, start, scale, nv, 64, pairs);         \
        else if (s->D == 128)                                           \
            attn_lanes_n(s, k, v, start, scale, nv, 128, pairs);        \
        else                                                            \
            attn_lanes_n(s, k, v, start, scale, nv, s->D, pairs);       \
        break;
        ATTN_LANES_CASE(1) ATTN_LANES_CASE(2) ATTN_LANES_CASE(3)
#undef ATTN_LANES_CASE
    }
}
#endif /* RLSERVE_PAGED_ATTENTION_LANES_SHARED */
#elif defined(ATTN_LANES256)
#include "paged_attention_lanes256.h"
#endif

#if defined(ATTN_LANES)
/* The chunk's K and V rows for the lanes form: where they lie (fp32), widened (bf16), or as stored and V
 * staged in key pairs (ATTN_PAIRS). */
static inline void NAME(attn_lanes_rows)(struct attn_state *s, const T *k_rows[KEYS], const void *k[KEYS],
                                         const float *v[KEYS]) {
#if defined(ATTN_PAIRS)
    attn_stage_value_pairs(s);
    for (int i = 0; i < KEYS; ++i) {
        k[i] = k_rows[i];
        v[i] = NULL; /* the values come from s->vp */
    }
#elif defined(RLSERVE_BF16)
    const int64_t D = s->D;
    for (int i = 0; i < KEYS; ++i) {
        for (int64_t d = 0; d < D; d += 16) {
            const __mmask16 m = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1u);
            _mm512_mask_storeu_ps(s->kw[i] + d, m, NAME(attn_load16)(k_rows[i] + d, m));
            _mm512_mask_storeu_ps(s->vw[i] + d, m, NAME(attn_load16)((const T *)s->v_rows[i] + d, m));
        }
        k[i] = s->kw[i];
        v[i] = s->vw[i];
    }
#else
    for (int i = 0; i < KEYS; ++i) {
        k[i] = k_rows[i];
        v[i] = s->v_rows[i];
    }
#endif
}

/* A tile past GROUP_QUERIES query vectors (prompt rows), in the lanes form: its query vectors
 * (already in s->q, s->lens) transposed into lanes (padded to a multiple of 16), every chunk, then
 * its rows of `out`. */
static void NAME(attend_lanes)(struct attn_state *s, const struct NAME(attention_job) *j, const int64_t *table,
                               int64_t kvh, int64_t longest, int64_t first_row) {
    const int64_t D = s->D, G = j->H / j->KVH, n = s->n_queries, padded = (n + 15) / 16 * 16;
    for (int64_t r = 0; r < padded; ++r) {
        const int live = r < n;
        s->lane_lens[r] = live ? (int32_t)s->lens[r] : 0;
        s->run_max[r] = -FLT_MAX;
        s->run_sum[r] = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
            s->qt[d][r] = live ? s->q[r][d] : 0.0f;
            s->acct[d][r] = 0.0f;
        }
#if defined(ATTN_PAIRS)
        for (int64_t u = 0; u < D / 2; ++u) s->qpt[u][r] = live ? s->qp[r][u] : 0u;
#endif
    }
    for (int64_t start = 0; start < longest; start += KEYS) {
        const T *k_rows[KEYS];
        const void *k[KEYS];
        const float *v[KEYS];
        NAME(attn_stage)(s, j, table, kvh, start, longest, k_rows, (struct attn_next){NULL, 0, 0});
        NAME(attn_lanes_rows)(s, k_rows, k, v);
#if defined(ATTN_PAIRS)
        attn_lanes(s, k, v, start, j->scale, 1);
#else
        attn_lanes(s, k, v, start, j->scale, 0);
#endif
    }
    for (int64_t r = 0; r < n; ++r) {
        const int64_t row = first_row + r / G, head = kvh * G + r % G;
        T *ob = j->out + (row * j->H + head) * D;
        const float inv = s->lens[r] > 0 ? 1.0f / s->run_sum[r] : 0.0f;
        for (int64_t d = 0; d < D; ++d) ob[d] = ST(s->acct[d][r] * inv);
    }
}
#endif /* ATTN_LANES */
