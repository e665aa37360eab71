/* Decode attention on AMX tiles: one task of kvlab_paged_decode (cpu_decode.c), up to a
 * chunk of positions of one sequence (or of several that read them through the same
 * slots), for bf16 queries and K/V, where the CPU has AMX-BF16 (kvlab_amx_ready).
 *
 * The vector path spends most of its time reshaping, not multiplying: widening bf16 values
 * and summing the lanes of every dot product. The tile unit instead takes K and V records
 * as they lie in the pool, 16 positions at a time (one 64-byte tile row per position: 32
 * dims of one kv head), read in place where the 16 slots are consecutive (a block's), else
 * gathered (zeros past the chunk's end):
 *   scores   S^T (16 positions x 16 rows) = K Q^T, K the A tile as it lies, the rows'
 *            queries the B tile (pairs of dims side by side, laid out once per task);
 *            every row of every kv head in one lane of a position's vector, so
 *   softmax  runs down the positions, no lane sums: max, 2^t weights (exp2_weight, about
 *            3e-6), rounded to bf16, the sum adding them as rounded; then 16 x 16 blocks
 *            of weights are transposed into rows of positions;
 *   values   acc += W V, V the B tile as it lies (positions x pairs of dims). A tile
 *            product sums pairs, so each runs twice, with each weight in the low half of
 *            its 32 bits and 0 in the high half (even dims), then the other way (odd dims).
 * The caller merges (max, sum, acc) as the vector path's. A row's sums do not depend on
 * the other rows, so a sequence's result is the same bits with or without company, and
 * for any thread count.
 *
 * Tiles are 16 x 64 bytes throughout: a kv head's rows take column (score) or row (value)
 * groups of 16, and a group short of 16 spills into the next kv head's lanes, which that
 * head's own tile writes later (the buffers have 16 lanes to spare past the last row).
 */

#include <math.h>

#include "cpu_amx.h"
#include "cpu_common.h"

#if KVLAB_AMX_BUILT

#define GROUP 16 /* positions per tile */

typedef struct { /* one thread's scratch for a chunk of up to `chunk` positions */
    uint16_t *qt;    /* (kv_heads, column groups, head_dim / 32) B tiles: the rows' Q^T */
    float *st;       /* (chunk, lanes): scores, then weights, one row of lanes per position */
    uint32_t *odd;   /* (lanes, chunk): each weight's bf16 in the high half of 32 bits */
    uint32_t *even;  /* (lanes, chunk): the same in the low half */
    uint16_t *kg;    /* (GROUP, kv_heads * head_dim): a group's gathered K records */
    uint16_t *vg;    /* (chunk, kv_heads * head_dim): gathered V records, where needed */
    float *eo;       /* (lanes, head_dim): sums of even dims, then odd, per 32 dims */
    uint8_t *direct; /* (chunk / GROUP,): 1 where a group's slots are consecutive */
} Scratch;

static int64_t lanes_for(int rows) { return (rows + 15) / 16 * 16 + 16; }

static int64_t groups_for(int gm) { return (gm + 15) / 16; }

size_t kvlab_decode_amx_bytes(int chunk, int kv_heads, int gm, int d) {
    const int64_t lanes = lanes_for(kv_heads * gm), record = (int64_t)kv_heads * d;
    return (size_t)(kv_heads * groups_for(gm) * (d / 32) * TILE_BF16 * 2 + chunk * lanes * 4 * 3 +
                    GROUP * record * 2 + chunk * record * 2 + lanes * d * 4 + chunk / GROUP +
                    64 * 8);
}

static void *aligned(char **at, int64_t bytes) { /* a 64-byte-aligned piece of the scratch */
    char *p = (char *)(((uintptr_t)*at + 63) & ~(uintptr_t)63);
    *at = p + bytes;
    return p;
}

static Scratch carve(void *buf, int chunk, int kv_heads, int gm, int d) {
    const int64_t lanes = lanes_for(kv_heads * gm), record = (int64_t)kv_heads * d;
    char *at = buf;
    Scratch x;
    x.qt = aligned(&at, kv_heads * groups_for(gm) * (d / 32) * TILE_BF16 * 2);
    x.st = aligned(&at, chunk * lanes * 4);
    x.odd = aligned(&at, chunk * lanes * 4);
    x.even = aligned(&at, chunk * lanes * 4);
    x.kg = aligned(&at, GROUP * record * 2);
    x.vg = aligned(&at, chunk * record * 2);
    x.eo = aligned(&at, lanes * d * 4);
    x.direct = aligned(&at, chunk / GROUP);
    return x;
}

AMX void kvlab_decode_amx_begin(void) { _tile_loadconfig(&TILES_16X64); }

AMX void kvlab_decode_amx_end(void) { _tile_release(); }

/* B tile (h, column group cg, dims 32 dk ..): row kk holds dims 32 dk + 2 kk, + 1 of the
 * group's 16 rows side by side (zeros past the kv head's gm rows). */
static void lay_out_queries(const DecodeChunk *c, Scratch *x) {
    const int gm = c->gm, d = c->d, groups = (int)groups_for(gm);
    const uint32_t *q = (const uint32_t *)c->q; /* pairs of dims */
    uint32_t *tile = (uint32_t *)x->qt;
    for (int h = 0; h < c->kv_heads; h++)
        for (int cg = 0; cg < groups; cg++)
            for (int dk = 0; dk < d / 32; dk++, tile += TILE_BF16 / 2)
                for (int kk = 0; kk < 16; kk++)
                    for (int nn = 0; nn < 16; nn++) {
                        const int r = cg * 16 + nn;
                        tile[kk * 16 + nn] =
                            r < gm ? q[((int64_t)h * gm + r) * (d / 2) + dk * 16 + kk] : 0;
                    }
}

/* Every line of the records of positions j .. j + 15 (those below n) into L1. */
static void prefetch_group(const uint16_t *base, const int64_t *slots, int j, int n,
                           int64_t stride, int64_t bytes) {
    for (int end = j + GROUP < n ? j + GROUP : n; j < end; j++) {
        const char *at = (const char *)(base + slots[j] * stride);
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(at + b, 0, 3);
    }
}

/* The records of positions j .. j + 15 (zeros past n), kv heads side by side. */
static void gather(const uint16_t *base, const int64_t *slots, int j, int n, int64_t stride,
                   int64_t head_stride, int kv_heads, int d, uint16_t *to) {
    for (int i = 0; i < GROUP; i++, to += (int64_t)kv_heads * d)
        for (int h = 0; h < kv_heads; h++) {
            if (j + i < n)
                memcpy(to + h * d, base + slots[j + i] * stride + h * head_stride, 2 * (size_t)d);
            else
                memset(to + h * d, 0, 2 * (size_t)d);
        }
}

/* st[j + i][lanes of kv head h's rows] = the rows' raw scores q . k at positions j + i:
 * one C tile per (kv head, column group), up to four of them side by side so that their
 * products overlap (each waits only on its own tile). */
AMX static void score_groups(const DecodeChunk *c, Scratch *x, int64_t lanes) {
    const int n = c->n, d = c->d, gm = c->gm, groups = (int)groups_for(gm);
    const int tiles = c->kv_heads * groups, steps = d / 32;
    const int64_t record = ((int64_t)(c->kv_heads - 1) * c->k_head_stride + d) * 2;
    for (int j = 0; j < n; j += GROUP) {
        const int direct = x->direct[j / GROUP];
        if (!direct)
            gather(c->k, c->slots, j, n, c->k_slot_stride, c->k_head_stride, c->kv_heads, d,
                   x->kg);
        prefetch_group(c->k, c->slots, j + GROUP, n, c->k_slot_stride, record);
        const int64_t stride = direct ? c->k_slot_stride * 2 : (int64_t)c->kv_heads * d * 2;
        for (int t0 = 0; t0 < tiles; t0 += 4) {
            const uint16_t *k[4], *qt[4];
            const int count = tiles - t0 < 4 ? tiles - t0 : 4;
            for (int i = 0; i < count; i++) { /* tile t: kv head t / groups, group t % groups */
                const int h = (t0 + i) / groups;
                k[i] = direct ? c->k + c->slots[j] * c->k_slot_stride + h * c->k_head_stride
                              : x->kg + (int64_t)h * d;
                qt[i] = x->qt + (int64_t)(t0 + i) * steps * TILE_BF16;
            }
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int dk = 0; dk < steps; dk++) {
                _tile_loadd(4, k[0] + dk * 32, stride);
                _tile_loadd(6, qt[0] + dk * TILE_BF16, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (count < 2) continue;
                _tile_loadd(5, k[1] + dk * 32, stride);
                _tile_loadd(7, qt[1] + dk * TILE_BF16, 64);
                _tile_dpbf16ps(1, 5, 7);
                if (count < 3) continue;
                _tile_loadd(4, k[2] + dk * 32, stride);
                _tile_loadd(6, qt[2] + dk * TILE_BF16, 64);
                _tile_dpbf16ps(2, 4, 6);
                if (count < 4) continue;
                _tile_loadd(5, k[3] + dk * 32, stride);
                _tile_loadd(7, qt[3] + dk * TILE_BF16, 64);
                _tile_dpbf16ps(3, 5, 7);
            }
            float *st[4]; /* in column order: a short group's spill is written over after */
            for (int i = 0; i < count; i++) {
                const int h = (t0 + i) / groups, cg = (t0 + i) % groups;
                st[i] = x->st + j * lanes + (int64_t)h * gm + cg * 16;
            }
            _tile_stored(0, st[0], lanes * 4);
            if (count > 1) _tile_stored(1, st[1], lanes * 4);
            if (count > 2) _tile_stored(2, st[2], lanes * 4);
            if (count > 3) _tile_stored(3, st[3], lanes * 4);
        }
    }
}

/* 16 vectors transposed: r[i] lane k <- r[k] lane i. */
AMX static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 4) { /* within 128-bit lanes: pairs, then quads of rows */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
        t[i + 2] = _mm512_unpacklo_ps(r[i + 2], r[i + 3]);
        t[i + 3] = _mm512_unpackhi_ps(r[i + 2], r[i + 3]);
        r[i] = (__m512)_mm512_unpacklo_pd((__m512d)t[i], (__m512d)t[i + 2]);
        r[i + 1] = (__m512)_mm512_unpackhi_pd((__m512d)t[i], (__m512d)t[i + 2]);
        r[i + 2] = (__m512)_mm512_unpacklo_pd((__m512d)t[i + 1], (__m512d)t[i + 3]);
        r[i + 3] = (__m512)_mm512_unpackhi_pd((__m512d)t[i + 1], (__m512d)t[i + 3]);
    } /* r[4 i + k], 128-bit lane L: element 4 L + k of rows 4 i .. 4 i + 3 */
    for (int k = 0; k < 4; k++) { /* then the 128-bit lanes across the quads */
        const __m512 u = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);     /* L0, L2 */
        const __m512 v = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xdd);     /* L1, L3 */
        const __m512 u2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
        const __m512 v2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xdd);
        t[k] = _mm512_shuffle_f32x4(u, u2, 0x88);      /* element k of every row */
        t[4 + k] = _mm512_shuffle_f32x4(v, v2, 0x88);  /* 4 + k */
        t[8 + k] = _mm512_shuffle_f32x4(u, u2, 0xdd);  /* 8 + k */
        t[12 + k] = _mm512_shuffle_f32x4(v, v2, 0xdd); /* 12 + k */
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* Each row's max (scaled: natural units) and sum; st becomes the bf16-rounded weights
 * e^(scale s - max), 0 from position n on; then odd/even hold them row by row. */
AMX static void softmax(const DecodeChunk *c, Scratch *x, int64_t lanes) {
    const int n = c->n, n16 = (n + GROUP - 1) / GROUP * GROUP, rows = c->kv_heads * c->gm;
    const __m512 to2 = _mm512_set1_ps(c->scale * 1.44269504088896341f); /* to base 2 */
    for (int64_t l = 0; l < lanes - 16; l += 16) { /* the spare 16 lanes hold no row */
        float *st = x->st + l;
        __m512 top = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
        for (int j = 0; j < n; j++) top = _mm512_max_ps(top, _mm512_loadu_ps(st + j * lanes));
        const __m512 base = _mm512_mul_ps(top, to2);
        for (int j = 0; j < n; j++) {
            const __m512 t = _mm512_fmsub_ps(_mm512_loadu_ps(st + j * lanes), to2, base);
            const __m512 w = exp2_weight(0xffff, t);
            const __m512 wr = (__m512)_mm512_slli_epi32(
                _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w)), 16);
            total = _mm512_add_ps(total, wr);
            _mm512_storeu_ps(st + j * lanes, wr);
        }
        for (int j = n; j < n16; j++) _mm512_storeu_ps(st + j * lanes, _mm512_setzero_ps());
        float maxes[16], sums[16];
        _mm512_storeu_ps(maxes, _mm512_mul_ps(top, _mm512_set1_ps(c->scale)));
        _mm512_storeu_ps(sums, total);
        for (int i = 0; i < 16 && l + i < rows; i++) {
            c->maxes[l + i] = maxes[i];
            c->sums[l + i] = sums[i];
        }
        for (int j = 0; j < n16; j += 16) { /* rows l .. l + 15, positions j .. j + 15 */
            __m512 r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(st + (j + i) * lanes);
            transpose16(r);
            for (int i = 0; i < 16; i++) {
                const __m512i bits = (__m512i)r[i];
                _mm512_storeu_si512(x->odd + (l + i) * c->chunk + j, bits);
                _mm512_storeu_si512(x->even + (l + i) * c->chunk + j, _mm512_srli_epi32(bits, 16));
            }
        }
    }
}

/* eo[r][32 dc + 16 p + nn] = sum over positions of w[r] v[32 dc + 2 nn + p], for the
 * rows of every kv head (groups of 16) and dims in pieces of 64 (C tiles 0-3). */
AMX static void value_groups(const DecodeChunk *c, Scratch *x) {
    const int n = c->n, d = c->d, gm = c->gm, groups = (int)groups_for(gm);
    const int64_t record = ((int64_t)(c->kv_heads - 1) * c->v_head_stride + d) * 2;
    for (int j = 0; j < n; j += GROUP)
        if (!x->direct[j / GROUP])
            gather(c->v, c->slots, j, n, c->v_slot_stride, c->v_head_stride, c->kv_heads, d,
                   x->vg + (int64_t)j * c->kv_heads * d);
    for (int h = 0; h < c->kv_heads; h++)
        for (int rg = 0; rg < groups; rg++) {
            const int64_t r0 = (int64_t)h * gm + rg * 16;
            for (int dp = 0; dp < d; dp += 64) {
                const int pieces = d - dp >= 64 ? 2 : 1;
                _tile_zero(0); /* tile numbers are immediates */
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int j = 0; j < n; j += GROUP) {
                    if (h == 0 && rg == 0 && dp == 0) /* the first pass over the records */
                        prefetch_group(c->v, c->slots, j + GROUP, n, c->v_slot_stride, record);
                    const int direct = x->direct[j / GROUP];
                    const uint16_t *v = direct
                        ? c->v + c->slots[j] * c->v_slot_stride + h * c->v_head_stride + dp
                        : x->vg + ((int64_t)j * c->kv_heads + h) * d + dp;
                    const int64_t stride =
                        direct ? c->v_slot_stride * 2 : (int64_t)c->kv_heads * d * 2;
                    _tile_loadd(4, x->even + r0 * c->chunk + j, c->chunk * 4);
                    _tile_loadd(5, x->odd + r0 * c->chunk + j, c->chunk * 4);
                    _tile_loadd(6, v, stride);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 5, 6);
                    if (pieces == 2) {
                        _tile_loadd(6, v + 32, stride);
                        _tile_dpbf16ps(2, 4, 6);
                        _tile_dpbf16ps(3, 5, 6);
                    }
                }
                float *eo = x->eo + r0 * d + dp;
                _tile_stored(0, eo, d * 4);
                _tile_stored(1, eo + 16, d * 4);
                if (pieces == 2) {
                    _tile_stored(2, eo + 32, d * 4);
                    _tile_stored(3, eo + 48, d * 4);
                }
            }
        }
}

AMX void kvlab_decode_amx(const DecodeChunk *c, void *scratch) {
    Scratch x = carve(scratch, c->chunk, c->kv_heads, c->gm, c->d);
    const int64_t lanes = lanes_for(c->kv_heads * c->gm);
    for (int j = 0; j < c->n; j += GROUP) { /* a whole block's 16 consecutive slots */
        int direct = j + GROUP <= c->n;
        for (int i = 1; direct && i < GROUP; i++) direct = c->slots[j + i] == c->slots[j] + i;
        x.direct[j / GROUP] = (uint8_t)direct;
    }
    lay_out_queries(c, &x);
    score_groups(c, &x, lanes);
    softmax(c, &x, lanes);
    value_groups(c, &x);
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int64_t r = 0; r < (int64_t)c->kv_heads * c->gm; r++) /* even, odd -> dims in order */
        for (int dc = 0; dc < c->d; dc += 32) {
            const __m512 even = _mm512_loadu_ps(x.eo + r * c->d + dc);
            const __m512 odd = _mm512_loadu_ps(x.eo + r * c->d + dc + 16);
            float *acc = c->acc + r * c->d + dc;
            _mm512_storeu_ps(acc, _mm512_permutex2var_ps(even, lo, odd));
            _mm512_storeu_ps(acc + 16, _mm512_permutex2var_ps(even, hi, odd));
        }
}

#endif
