/* Register tiles for attention of many query rows at once: the inner loop of the prompt
 * kernel (cpu_prefill.c), for a block of a prompt's rows.
 *
 * The rows lie side by side in vectors (lane r % V of vector r / V; `stride` lanes per
 * position in all). tiles_chunk runs one chunk of up to KC positions of flash attention:
 *   scores   s[j][r] = qt[:, r] . k_j, in register tiles of MP positions x up to RV row
 *            vectors: each K value, loaded where it lies in the pool (widened from bf16 or
 *            fp16), is broadcast against the rows' query values for its dimension.
 *   softmax  per row vector: lanes whose row ends at or before position c0 + j are masked
 *            out; the running max grows to the chunk's, the running sum and the row's
 *            accumulator are scaled by e^(old - new max), and s[j] becomes the weight
 *            e^(s[j] - max) (fast_exp, V lanes at a time).
 *   values   acc[r] += w[j][r] v_j, in register tiles of MR rows x VW vectors of head_dim:
 *            each V vector loaded from the pool once per tile, times MR broadcast weights.
 * Both tiles keep their partial sums in registers, so the loop runs at the CPU's matmul
 * rate. Where the compiler targets AVX512-BF16, bf16 rows over bf16 K and V run in pairs
 * instead, each vdpbf16ps twice the products of an FMA, each exact in fp32, the pair
 * summed into the lane's fp32 total:
 *   scores   (score_tile_pairs) the caller fills qt2 (the queries unscaled, in bf16, each
 *            row's dimensions 2c and 2c + 1 side by side) and pairs; a pair of one
 *            position's K values (adjacent in the pool) against 16 rows' pairs; the scale
 *            multiplies the sum once;
 *   values   (value_tile_pairs) the chunk's weights rounded to bf16 (the softmax sums
 *            them as rounded, so each row's weights still sum to its total) and its V
 *            records laid out once per chunk as pairs of positions j, j + 1 (pack_pairs);
 *            a row's pair of weights against 16 dimensions' pairs of values.
 * The caller fills qt (queries times scale, transposed; or qt2, pairs and scale), end, max
 * (-inf), sum (0) and acc (0) for its rows, and reads max, sum and acc after its last
 * chunk.
 */

#ifndef KVLAB_CPU_TILES_H
#define KVLAB_CPU_TILES_H

#include <math.h>

#include "cpu_common.h"

#if defined(__AVX512BF16__) && V == 16 /* vdpbf16ps: bf16 pairs multiplied, summed in fp32 */
#include <immintrin.h>
#define TILES_PAIRS_BUILT 1
#else
#define TILES_PAIRS_BUILT 0
#endif

/* A tile's accumulators, its loaded vectors and one broadcast fill the CPU's vector
 * registers: 32 of 16 floats with AVX-512, else 16 of 8 floats (AVX2). */
#if V == 16
#define RV 4        /* row vectors per score tile, at most */
#define VW 4        /* vectors of head_dim per value tile, at most */
#else
#define RV 2
#define VW 2
#endif

#define KC 256      /* positions per chunk */
#define MP 6        /* positions per score tile: MP x RV accumulators */
#define MR 6        /* rows per value tile: MR x VW accumulators */

typedef struct {      /* rows that attend together, and one thread's scratch for them */
    int stride;       /* lanes per position: the rows, rounded up to vectors, then to MR */
    float *qt;        /* (head_dim, stride): the rows' queries times scale, transposed */
    float *s;         /* (KC, stride): scores, then weights */
    float *acc;       /* (stride, head_dim) */
    float *max, *sum; /* (stride,) */
    int32_t *end;     /* (stride,): positions < end[r] are row r's context; 0 for padding */
    int pairs;        /* 1: score in pairs from qt2 (TILES_PAIRS_BUILT, bf16 rows and K) */
    uint16_t *qt2;    /* (head_dim / 2, stride, 2) bf16, unscaled; in qt's memory */
    float scale;      /* what the pairs' scores are multiplied by */
    uint16_t *wp;     /* (KC / 2, stride, 2) bf16: the weights of positions 2i, 2i + 1 */
    uint16_t *vp;     /* (KC / 2, head_dim, 2) bf16: V of positions 2i, 2i + 1 */
} Tiles;

/* Lanes per position for up to `rows` rows. */
static inline int tiles_stride(int rows) { return ((rows + V - 1) / V * V + MR - 1) / MR * MR; }

/* Scratch for up to `rows` rows (all zero), or .qt NULL without memory; free(.qt) frees. */
static inline Tiles tiles_new(int rows, int head_dim) {
    const size_t lanes = (size_t)tiles_stride(rows), d = (size_t)head_dim;
    /* zeroed: a value tile may read weight lanes past the rows (their accumulator rows are
     * never read), which are 0 or an earlier chunk's finite weights */
    const size_t floats = lanes * (2 * d + KC + 3);
    float *buf = calloc(floats + KC * (lanes + d) / 2, sizeof(float)); /* + wp and vp */
    Tiles w = {(int)lanes, buf};
    if (buf) {
        w.s = buf + lanes * d;
        w.acc = buf + lanes * (d + KC);
        w.max = buf + lanes * (2 * d + KC);
        w.sum = buf + lanes * (2 * d + KC + 1);
        w.end = (int32_t *)(buf + lanes * (2 * d + KC + 2));
        w.qt2 = (uint16_t *)buf;
        w.wp = (uint16_t *)(buf + floats);
        w.vp = w.wp + KC * lanes;
    }
    return w;
}

/* ---- vector helpers ------------------------------------------------------------------ */

static ALWAYS_INLINE vf vmax(vf a, vf b) {
    const vi more = (vi)(a > b);
    return (vf)(((vi)a & more) | ((vi)b & ~more));
}

/* e^x per lane, as fast_exp */
static ALWAYS_INLINE vf fast_exp_v(vf x) {
    const float round = 12582912.0f; /* 1.5 * 2^23 */
    const vf lo = (vf){0} - 87.0f, hi = (vf){0} + 88.0f;
    const vi below = (vi)(x < lo), above = (vi)(x > hi); /* NaN is neither: it stays */
    x = (vf)(((vi)lo & below) | ((vi)hi & above) | ((vi)x & ~(below | above)));
    const vf t = x * 1.44269504088896341f + round;
    const vf n = t - round;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf e = (vf){0} + 1.9875691500e-4f;
    e = e * r + 1.3981999507e-3f;
    e = e * r + 8.3334519073e-3f;
    e = e * r + 4.1665795894e-2f;
    e = e * r + 1.6666665459e-1f;
    e = e * r + 5.0000001201e-1f;
    e = e * r * r + r + 1.0f;
    vi round_bits;
    const vf round_v = (vf){0} + round;
    memcpy(&round_bits, &round_v, sizeof round_bits);
    const vi bits = ((vi)t - round_bits + 127) << 23; /* 2^n */
    return e * (vf)bits;
}

/* s[j + p][V t ..] = k_(j + p) . qt[:, V (v0 + t) ..] for p < count positions (count <=
 * MP), t < nv row vectors (nv <= RV) */
static ALWAYS_INLINE void score_tile(const void *k, int stride, const float *qt, const int64_t *at,
                                     int d, int dtype, float *s, int v0, int nv, int count) {
    vf acc[MP][RV];
    for (int m = 0; m < MP; m++)
        for (int t = 0; t < RV; t++) acc[m][t] = (vf){0};
    for (int c = 0; c < d; c++) {
        vf q[RV];
        for (int t = 0; t < nv; t++)
            q[t] = load_f(qt + c * stride + (v0 + t) * V);
        for (int m = 0; m < MP; m++) {
            const float x = load(k, dtype, at[m] + c);
            for (int t = 0; t < nv; t++) acc[m][t] += x * q[t];
        }
    }
    for (int m = 0; m < MP; m++) /* all MP, so acc stays in registers */
        if (m < count)
            for (int t = 0; t < nv; t++) store_f(s + m * stride + (v0 + t) * V, acc[m][t]);
}

#if TILES_PAIRS_BUILT
/* score_tile for bf16 K (k) and rows (qt2): s = scale * (the pairs' fp32 sums) */
static ALWAYS_INLINE void score_tile_pairs(const uint16_t *k, int stride, const uint16_t *qt2,
                                           const int64_t *at, int d, float scale, float *s,
                                           int v0, int nv, int count) {
    __m512 acc[MP][RV];
    for (int m = 0; m < MP; m++)
        for (int t = 0; t < RV; t++) acc[m][t] = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 2) {
        __m512bh q[RV];
        for (int t = 0; t < nv; t++)
            q[t] = (__m512bh)_mm512_loadu_si512(qt2 + ((int64_t)c * stride + (v0 + t) * V * 2));
        for (int m = 0; m < MP; m++) {
            int32_t pair; /* k[at[m] + c], k[at[m] + c + 1] */
            memcpy(&pair, k + at[m] + c, sizeof pair);
            const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
            for (int t = 0; t < nv; t++) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], q[t], x);
        }
    }
    const __m512 mul = _mm512_set1_ps(scale);
    for (int m = 0; m < MP; m++)
        if (m < count)
            for (int t = 0; t < nv; t++)
                _mm512_storeu_ps(s + m * stride + (v0 + t) * V, _mm512_mul_ps(acc[m][t], mul));
}
/* The chunk's n weights (w->s) rounded to bf16 and its V records, as pairs of positions
 * (Tiles' wp and vp; an odd n's last pair completed with zeros). */
static ALWAYS_INLINE void pack_pairs(Tiles *w, const uint16_t *v, const int64_t *at, int n,
                                     int d) {
    const __m512i odd_even = _mm512_set_epi16( /* lanes 2i, 2i + 1 <- a's i, b's i */
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
        4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int j = 0; j < n; j += 2) {
        const int more = j + 1 < n;
        for (int r = 0; r < w->stride; r += V) {
            const __m512 a = _mm512_loadu_ps(w->s + (int64_t)j * w->stride + r);
            const __m512 b = more ? _mm512_loadu_ps(w->s + (int64_t)(j + 1) * w->stride + r)
                                  : _mm512_setzero_ps();
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a); /* a low, b high */
            const int lanes = w->stride - r < V ? w->stride - r : V; /* a multiple of MR */
            _mm512_mask_storeu_epi16(w->wp + ((int64_t)j * w->stride + 2 * r),
                                     (__mmask32)(0xffffffffu >> (32 - 2 * lanes)),
                                     _mm512_permutexvar_epi16(odd_even, both));
        }
        for (int c = 0; c < d; c += V) {
            const __m256i *vj = (const void *)(v + at[j] + c);
            const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(vj));
            const __m512i b = more ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                         (const void *)(v + at[j + 1] + c)))
                                   : _mm512_setzero_si512();
            _mm512_storeu_si512(w->vp + ((int64_t)j * d + 2 * c),
                                _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
    }
}

/* value_tile from the pairs: acc[r0 + r][c ..] += the chunk's pairs' weights . values */
static ALWAYS_INLINE void value_tile_pairs(const Tiles *w, int d, int r0, int c, int n, int W) {
    __m512 a[MR][VW];
    for (int r = 0; r < MR; r++)
        for (int t = 0; t < W; t++) a[r][t] = _mm512_loadu_ps(w->acc + (r0 + r) * d + c + t * V);
    for (int j = 0; j < n; j += 2) {
        __m512bh v[VW];
        for (int t = 0; t < W; t++)
            v[t] = (__m512bh)_mm512_loadu_si512(w->vp + ((int64_t)j * d + 2 * (c + t * V)));
        for (int r = 0; r < MR; r++) {
            int32_t pair; /* row r0 + r's weights of positions j, j + 1 */
            memcpy(&pair, w->wp + ((int64_t)j * w->stride + 2 * (r0 + r)), sizeof pair);
            const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
            for (int t = 0; t < W; t++) a[r][t] = _mm512_dpbf16_ps(a[r][t], v[t], x);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int t = 0; t < W; t++) _mm512_storeu_ps(w->acc + (r0 + r) * d + c + t * V, a[r][t]);
}

#define SCORE_TILE(nv)                                                                       \
    (dtype == DT_BF16 && w->pairs                                                            \
         ? score_tile_pairs(k, stride, w->qt2, at, d, w->scale, tile, v0, nv, count)         \
         : score_tile(k, stride, w->qt, at, d, dtype, tile, v0, nv, count))
#else
#define SCORE_TILE(nv) score_tile(k, stride, w->qt, at, d, dtype, tile, v0, nv, count)
#endif

/* acc[r0 + r][c ..] += sum_{j < n} w[j][r0 + r] v_j[c ..] for MR rows, W vectors wide */
static ALWAYS_INLINE void value_tile(const void *v_cache, int stride, const float *w,
                                     const int64_t *at, int d, int dtype, float *acc, int r0,
                                     int c, int n, int W) {
    vf a[MR][VW];
    for (int r = 0; r < MR; r++)
        for (int t = 0; t < W; t++) a[r][t] = load_f(acc + (r0 + r) * d + c + t * V);
    for (int j = 0; j < n; j++) {
        vf v[VW];
        for (int t = 0; t < W; t++) v[t] = load_v(v_cache, dtype, at[j] + c + t * V);
        for (int r = 0; r < MR; r++) {
            const float x = w[j * stride + r0 + r];
            for (int t = 0; t < W; t++) a[r][t] += x * v[t];
        }
    }
    for (int r = 0; r < MR; r++)
        for (int t = 0; t < W; t++) store_f(acc + (r0 + r) * d + c + t * V, a[r][t]);
}

/* The chunk's scores at positions c0 .. c0 + n - 1 become weights, row vector by row
 * vector; each row's accumulator is scaled by e^(old max - new max) first. */
static ALWAYS_INLINE void softmax_chunk(Tiles *w, int vectors, int c0,
                                        int n, int d, int masked) {
    for (int t = 0; t < vectors; t++) {
        vf old_max, top, total = {0};
        vi end;
        memcpy(&old_max, w->max + t * V, sizeof old_max);
        memcpy(&end, w->end + t * V, sizeof end);
        vf tops[4] = {old_max, old_max, old_max, old_max}; /* four chains: max is exact */
        for (int j = 0; j < n; j += 4)
            for (int u = 0; u < 4; u++) {
                const int at = j + u < n ? j + u : n - 1; /* n - 1 again: no change */
                vf x = load_f(w->s + at * w->stride + t * V);
                if (masked) {
                    const vi seen = (vi){0} + (c0 + at) < end;
                    x = (vf)(((vi)x & seen) | ((vi)old_max & ~seen)); /* never above the max */
                }
                tops[u] = vmax(x, tops[u]);
            }
        top = vmax(vmax(tops[0], tops[1]), vmax(tops[2], tops[3]));
        const vi empty = (vi)(top == -INFINITY); /* padding, or no position seen yet */
        const vf base = (vf)((vi)top & ~empty);  /* 0 there: no NaN from -inf - -inf */
        const vi had = (vi)(old_max > -INFINITY);
        const vf factor = (vf)((vi)fast_exp_v(old_max - base) & had);
        for (int j = 0; j < n; j++) {
            vf x = load_f(w->s + j * w->stride + t * V);
            vi keep = ~empty;
            if (masked) keep &= (vi){0} + (c0 + j) < end;
            x = (vf)((vi)fast_exp_v(x - base) & keep);
            if (w->pairs) /* the values' pairs take the weights in bf16: so does the sum */
                x = round_bf16(x);
            store_f(w->s + j * w->stride + t * V, x);
            total += x;
        }
        vf sum;
        memcpy(&sum, w->sum + t * V, sizeof sum);
        sum = sum * factor + total;
        memcpy(w->sum + t * V, &sum, sizeof sum);
        memcpy(w->max + t * V, &top, sizeof top);
        for (int lane = 0; lane < V; lane++)
            if (factor[lane] != 1.0f)
                for (int c = 0; c < d; c++) w->acc[(t * V + lane) * d + c] *= factor[lane];
    }
}

/* One chunk: positions c0 .. c0 + n - 1 (n <= KC) whose K and V records start at
 * k_at[j] and v_at[j] (n of each), for the first `rows` rows; `masked` when some row ends
 * inside the chunk. */
static ALWAYS_INLINE void tiles_chunk(Tiles *w, const void *k, const void *v, int dtype,
                                      const int64_t *k_at, const int64_t *v_at, int rows,
                                      int c0, int n, int d, int masked) {
    const int vectors = (rows + V - 1) / V, stride = w->stride;
    for (int j = 0; j < n; j += MP) {
        int64_t at[MP]; /* the tile's K records (the last position's past n) */
        for (int m = 0; m < MP; m++) at[m] = k_at[j + m < n ? j + m : n - 1];
        const int count = n - j < MP ? n - j : MP;
        float *tile = w->s + j * stride;
        for (int v0 = 0; v0 < vectors; v0 += RV) {
            switch (vectors - v0) { /* a constant nv keeps the tile in registers */
            case 1: SCORE_TILE(1); break;
#if RV == 4
            case 2: SCORE_TILE(2); break;
            case 3: SCORE_TILE(3); break;
#endif
            default: SCORE_TILE(RV); break;
            }
        }
    }
    softmax_chunk(w, vectors, c0, n, d, masked);
#if TILES_PAIRS_BUILT
    if (dtype == DT_BF16 && w->pairs) {
        pack_pairs(w, v, v_at, n, d);
        for (int r0 = 0; r0 < rows; r0 += MR) {
            int c = 0;
            for (; c + VW * V <= d; c += VW * V) value_tile_pairs(w, d, r0, c, n, VW);
            for (; c < d; c += V) value_tile_pairs(w, d, r0, c, n, 1);
        }
        return;
    }
#endif
    for (int r0 = 0; r0 < rows; r0 += MR) {
        int c = 0;
        for (; c + VW * V <= d; c += VW * V)
            value_tile(v, stride, w->s, v_at, d, dtype, w->acc, r0, c, n, VW);
        for (; c < d; c += V) value_tile(v, stride, w->s, v_at, d, dtype, w->acc, r0, c, n, 1);
    }
}

#endif
