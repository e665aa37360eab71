/* Prompt attention in bf16 on AMX tiles (Intel Sapphire Rapids and later): the rows of one
 * sequence after P cached positions, K/V bf16 in the paged pool, as kvlab_paged_prefill
 * computes them (cpu_prefill.c), but each score and weighted value a bf16 x bf16 product
 * summed in fp32 by the tile unit (tdpbf16ps: a 16 x 32 by 32 x 16 matmul per instruction)
 * instead of fp32 FMAs on values widened from bf16.
 *
 * A call runs in two phases, each over the library's threads (cpu_pool.c):
 *   pack    the sequence's K and V, 32 positions of one kv head per task, into the layouts
 *           the tile unit multiplies by ("VNNI": pairs of bf16 side by side in 32 bits):
 *             Kp tile (t, dk)  row kk, pair p  = K[16 t + p][32 dk + 2 kk .. + 1]   (K^T)
 *             Vp tile (u, ct)  row pp, pair c  = V[32 u + 2 pp .. + 1][16 ct + c]
 *           each tile 16 rows of 64 bytes; positions past S are zeros.
 *   attend  one task per kv head and block of AMX_QB query positions: its rows (position x
 *           the g query heads of the kv head, padded to a multiple of 32) run flash
 *           attention over chunks of AMX_KC positions up to the block's causal end:
 *             scores  S = Q K^T in 2 x 2 tiles of 16 rows x 16 positions (tmm0-3),
 *                     Q rows (tmm4-5) against Kp tiles (tmm6-7), d / 32 steps;
 *             softmax per row in fp32: scale, mask past the row's end, running max and
 *                     sum, e^x as 2^t to about 3e-6 (exp2_weight), weights rounded to bf16
 *                     by vcvtne2ps2bf16 (the sum adds the rounded weights, in pairs);
 *             values  acc += W V in 2 x 2 tiles of 16 rows x 16 dims, weights (tmm4-5)
 *                     against Vp tiles (tmm6-7), AMX_KC / 32 steps;
 *           then out = acc / sum, rounded to bf16 (nearest even).
 * Tasks depend only on the shapes, so the result is the same bits for any thread count.
 *
 * Compiled wherever the compiler knows the instructions (GCC 11, clang 12), whatever
 * -march says; kvlab_amx_ready() runs them only where the CPU has AMX-BF16, AVX-512 (F,
 * BW) and AVX512-BF16 and Linux grants the process the tile registers (arch_prctl).
 * head_dim a multiple of 32, at most 256.
 */

#include <math.h>

#include "cpu_amx.h"
#include "cpu_common.h"

#if KVLAB_AMX_BUILT

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_QB 32          /* query positions per task */
#define AMX_KC 256     /* positions per chunk: a multiple of 32 */
#define AMX_MAX_DIM 256
#define MIN_PARALLEL (1 << 16) /* (query row, position) pairs */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    const uint16_t *q, *k, *v;
    uint16_t *out;
    const int64_t *slots;
    int rows_q, positions, heads, kv_heads, head_dim, group;
    int64_t k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;
    float scale;
    uint16_t *kp, *vp; /* packed K^T and V tiles, (kv_heads, ...) */
    int blocks32;      /* positions / 32, rounded up */
    float *out_f32, *lse; /* a shared prefix's call: every row sees all S positions, its
                           * output left in fp32 beside its log-sum-exp (else NULL) */
    int tasks, next_task;
} Amx;

/* The first K^T tile of (kv head h, 16 positions t, dims 32 dk ..) and of V's
 * (h, 32 positions u, dims 16 ct ..). */
static inline uint16_t *k_tile(const Amx *a, int h, int t, int dk) {
    return a->kp + (((int64_t)h * a->blocks32 * 2 + t) * (a->head_dim / 32) + dk) * TILE;
}
static inline uint16_t *v_tile(const Amx *a, int h, int u, int ct) {
    return a->vp + (((int64_t)h * a->blocks32 + u) * (a->head_dim / 16) + ct) * TILE;
}

/* ---- pack: 32 positions of one kv head --------------------------------------------- */

static const uint16_t ZEROS[2];

static int pack_tasks(void *arg) {
    Amx *a = arg;
    const int d = a->head_dim;
    for (;;) {
        const int task = __atomic_fetch_add(&a->next_task, 1, __ATOMIC_RELAXED);
        if (task >= a->tasks) return KVLAB_OK;
        const int h = task % a->kv_heads, u = task / a->kv_heads;
        for (int p = 0; p < 32; p++) {
            const int pos = u * 32 + p;
            const uint16_t *kr = NULL, *vr = NULL; /* the position's K and V records */
            if (pos < a->positions) {
                kr = a->k + a->slots[pos] * a->k_slot_stride + h * a->k_head_stride;
                vr = a->v + a->slots[pos] * a->v_slot_stride + h * a->v_head_stride;
            }
            for (int dk = 0; dk < d / 32; dk++) { /* K^T: row kk holds pair kk of each p */
                uint16_t *tile = k_tile(a, h, pos / 16, dk) + (pos % 16) * 2;
                for (int kk = 0; kk < 16; kk++)
                    memcpy(tile + kk * 32, kr ? kr + dk * 32 + kk * 2 : ZEROS, 4);
            }
            for (int ct = 0; ct < d / 16; ct++) { /* V: position p's half of row p / 2 */
                uint16_t *tile = v_tile(a, h, u, ct) + (p / 2) * 32 + p % 2;
                for (int c = 0; c < 16; c++) tile[c * 2] = vr ? vr[ct * 16 + c] : 0;
            }
        }
    }
}

/* ---- attend: one kv head, query positions i0 .. i0 + AMX_QB - 1 ------------------------- */

typedef struct { /* one thread's scratch for up to AMX_QB * g rows, rounded up to 32 */
    uint16_t *qp;  /* (rows, d) bf16: the rows' queries */
    float *s;      /* (rows, AMX_KC) scores */
    uint16_t *w;   /* (rows, AMX_KC) bf16 weights */
    float *acc;    /* (rows, d) */
    float *max, *sum;
    int32_t *end;  /* (rows,): positions < end[r] are row r's context; 0 for padding */
} Scratch;

/* Rows r0 .. r0 + 31 by columns c0 .. c0 + 31 of C (fp32, ldc floats per row) +=
 * A (bf16 rows, lda elements per row) x B tiles (b0 for columns c0.., b1 for c0 + 16..;
 * `steps` of them, b_step elements apart), A's 32 columns per step. */
AMX static void tiles_2x2(float *c, int ldc, int load_c, const uint16_t *a, int lda,
                          int a_step, const uint16_t *b0, const uint16_t *b1, int64_t b_step,
                          int steps) {
    if (load_c) {
        _tile_loadd(0, c, ldc * 4);
        _tile_loadd(1, c + 16, ldc * 4);
        _tile_loadd(2, c + 16 * ldc, ldc * 4);
        _tile_loadd(3, c + 16 * ldc + 16, ldc * 4);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int i = 0; i < steps; i++) {
        _tile_loadd(4, a + i * a_step, lda * 2);
        _tile_loadd(5, a + i * a_step + 16 * lda, lda * 2);
        _tile_loadd(6, b0 + i * b_step, 64);
        _tile_loadd(7, b1 + i * b_step, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, ldc * 4);
    _tile_stored(1, c + 16, ldc * 4);
    _tile_stored(2, c + 16 * ldc, ldc * 4);
    _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
}

/* 2^t for t <= 0 (a scaled score minus its row's max, in base 2) to about 3e-6 relative,
 * enough for a weight rounded to bf16 (2^-9): 2^t = 2^n 2^f with n = round(t), |f| <= 1/2,
 * a degree-4 polynomial for 2^f (fitted for the least relative error) and vscalefps for
 * 2^n, which gives 0 for the weights of masked lanes (keep) and below 2^-149. */
AMX static inline __m512 exp2_weight(__mmask16 keep, __m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.5700949182e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5917859772e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024745001e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312181484e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999926139e-1f));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

/* The lanes of positions j .. j + 15 a row that has seen `seen` positions of the chunk
 * keeps. */
static inline __mmask16 kept(int seen, int j) {
    return seen - j >= 16 ? 0xffff : seen <= j ? 0 : (__mmask16)((1u << (seen - j)) - 1);
}

#define SOFTMAX_ROWS 4 /* rows whose softmax runs interleaved: their chains overlap */

/* Rows r0 .. r0 + 3: each row r's scores at positions c0 .. c0 + n - 1 (n a multiple of
 * 32) become bf16 weights (vcvtne2ps2bf16: nearest even), 0 past the row's end; its max,
 * sum (of the rounded weights, in pairs: vdpbf16ps against ones) and accumulator move to
 * the chunk's max. The max is taken over the raw scores and then scaled (scale > 0 keeps
 * the order). The rows run side by side to the longest one's end, so their max, sum and
 * store chains overlap; a row's lanes past its own end are masked (max unchanged, weights
 * 0, the sum adding 0), so its bits are those it has alone. */
AMX static void softmax_rows(Scratch *x, const Amx *a, int r0, int c0, int n) {
    const float *s[SOFTMAX_ROWS];
    uint16_t *w[SOFTMAX_ROWS];
    int seen[SOFTMAX_ROWS], live[SOFTMAX_ROWS], most = 0;
    for (int i = 0; i < SOFTMAX_ROWS; i++) {
        s[i] = x->s + (int64_t)(r0 + i) * AMX_KC;
        w[i] = x->w + (int64_t)(r0 + i) * AMX_KC;
        seen[i] = x->end[r0 + i] - c0;
        live[i] = seen[i] <= 0 ? 0 : seen[i] < n ? (seen[i] + 31) / 32 * 32 : n;
        memset(w[i] + live[i], 0, sizeof(uint16_t) * (size_t)(n - live[i])); /* past its end */
        most = live[i] > most ? live[i] : most;
    }
    if (most == 0) return;
    __m512 top[SOFTMAX_ROWS], base[SOFTMAX_ROWS], total[SOFTMAX_ROWS];
    float m[SOFTMAX_ROWS];
    for (int i = 0; i < SOFTMAX_ROWS; i++) top[i] = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < most; j += 16)
        for (int i = 0; i < SOFTMAX_ROWS; i++)
            top[i] = _mm512_mask_max_ps(top[i], kept(seen[i], j), top[i],
                                        _mm512_loadu_ps(s[i] + j));
    for (int i = 0; i < SOFTMAX_ROWS; i++) {
        m[i] = fmaxf(_mm512_reduce_max_ps(top[i]) * a->scale, x->max[r0 + i]);
        base[i] = _mm512_set1_ps(m[i] * 1.44269504088896341f);
        total[i] = _mm512_setzero_ps();
    }
    const __m512 c = _mm512_set1_ps(a->scale * 1.44269504088896341f); /* to base 2 */
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);        /* bf16 1.0 */
    for (int j = 0; j < most; j += 32)
        for (int i = 0; i < SOFTMAX_ROWS; i++) {
            const __m512 t_lo = _mm512_fmsub_ps(_mm512_loadu_ps(s[i] + j), c, base[i]);
            const __m512 t_hi = _mm512_fmsub_ps(_mm512_loadu_ps(s[i] + j + 16), c, base[i]);
            const __m512 lo = exp2_weight(kept(seen[i], j), t_lo);
            const __m512 hi = exp2_weight(kept(seen[i], j + 16), t_hi);
            const __m512bh pair = _mm512_cvtne2ps_pbh(hi, lo); /* lo's 16 weights, then hi's */
            _mm512_storeu_si512(w[i] + j, (__m512i)pair);
            total[i] = _mm512_dpbf16_ps(total[i], pair, ones); /* as rounded, two per lane */
        }
    for (int i = 0; i < SOFTMAX_ROWS; i++) {
        const int r = r0 + i, d = a->head_dim;
        if (live[i] == 0) continue; /* nothing of this chunk: max, sum and acc stay */
        const float factor = x->max[r] == -INFINITY ? 0.0f : fast_exp(x->max[r] - m[i]);
        x->sum[r] = x->sum[r] * factor + _mm512_reduce_add_ps(total[i]);
        x->max[r] = m[i];
        if (factor != 1.0f)
            for (int col = 0; col < d; col += 16) {
                float *acc = x->acc + (int64_t)r * d + col;
                const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(acc), _mm512_set1_ps(factor));
                _mm512_storeu_ps(acc, scaled);
            }
    }
}

AMX static void attend(Amx *a, int task, Scratch *x) {
    const int d = a->head_dim, g = a->group, blocks = (a->rows_q + AMX_QB - 1) / AMX_QB;
    const int h = task % a->kv_heads, block = blocks - 1 - task / a->kv_heads;
    const int i0 = block * AMX_QB, P = a->positions - a->rows_q;
    const int qn = a->rows_q - i0 < AMX_QB ? a->rows_q - i0 : AMX_QB;
    const int prefix = a->lse != NULL; /* no causal mask: every row sees all S positions */
    const int rows = qn * g, padded = (rows + 31) / 32 * 32;
    const int end = prefix ? a->positions : P + i0 + qn;
    for (int r = 0; r < padded; r++) {
        const uint16_t *q = a->q + ((int64_t)(i0 + r / g) * a->heads + h * g + r % g) * d;
        if (r < rows) memcpy(x->qp + (int64_t)r * d, q, sizeof(uint16_t) * d);
        else memset(x->qp + (int64_t)r * d, 0, sizeof(uint16_t) * d);
        x->end[r] = r >= rows ? 0 : prefix ? end : P + i0 + r / g + 1;
        x->max[r] = -INFINITY;
        x->sum[r] = 0.0f;
    }
    memset(x->acc, 0, sizeof(float) * (size_t)padded * (size_t)d);
    for (int c0 = 0; c0 < end; c0 += AMX_KC) {
        const int n = ((end - c0 < AMX_KC ? end - c0 : AMX_KC) + 31) / 32 * 32;
        for (int r0 = 0; r0 < padded; r0 += 32)
            for (int j = 0; j < n; j += 32)
                tiles_2x2(x->s + (int64_t)r0 * AMX_KC + j, AMX_KC, 0,
                          x->qp + (int64_t)r0 * d, d, 32,
                          k_tile(a, h, (c0 + j) / 16, 0), k_tile(a, h, (c0 + j) / 16 + 1, 0),
                          TILE, d / 32);
        for (int r = 0; r < padded; r += SOFTMAX_ROWS) /* padded: a multiple of 32 */
            softmax_rows(x, a, r, c0, n);
        for (int r0 = 0; r0 < padded; r0 += 32)
            for (int c = 0; c < d; c += 32)
                tiles_2x2(x->acc + (int64_t)r0 * d + c, d, 1,
                          x->w + (int64_t)r0 * AMX_KC, AMX_KC, 32,
                          v_tile(a, h, c0 / 32, c / 16), v_tile(a, h, c0 / 32, c / 16 + 1),
                          (int64_t)(d / 16) * TILE, n / 32);
    }
    for (int r = 0; r < rows; r++) {
        const int64_t row = (int64_t)(i0 + r / g) * a->heads + h * g + r % g;
        if (prefix) {
            store(a->out_f32, DT_F32, row * d, x->acc + (int64_t)r * d, 1.0f / x->sum[r], d);
            a->lse[row] = x->max[r] + logf(x->sum[r]);
        } else {
            store(a->out, DT_BF16, row * d, x->acc + (int64_t)r * d, 1.0f / x->sum[r], d);
        }
    }
}

AMX static int attend_tasks(void *arg) {
    Amx *a = arg;
    const size_t rows = (size_t)(AMX_QB * a->group + 31) / 32 * 32, d = (size_t)a->head_dim;
    char *buf = malloc(rows * (d * 2 + AMX_KC * 4 + AMX_KC * 2 + d * 4 + 12));
    if (!buf) return KVLAB_ENOMEM;
    Scratch x = {.qp = (uint16_t *)buf};
    x.s = (float *)(buf + rows * d * 2);
    x.acc = x.s + rows * AMX_KC;
    x.max = x.acc + rows * d;
    x.sum = x.max + rows;
    x.end = (int32_t *)(x.sum + rows);
    x.w = (uint16_t *)(x.end + rows);
    _tile_loadconfig(&TILES_16X64);
    for (;;) {
        const int task = __atomic_fetch_add(&a->next_task, 1, __ATOMIC_RELAXED);
        if (task >= a->tasks) break;
        attend(a, task, &x);
    }
    _tile_release();
    free(buf);
    return KVLAB_OK;
}

int kvlab_amx_ready(void) {
    static int ready = -1;
    if (ready >= 0) return ready;
    unsigned eax, ebx, ecx, edx, eax1, ebx1, ecx1, edx1;
    ready = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) &&
        __get_cpuid_count(7, 1, &eax1, &ebx1, &ecx1, &edx1)) {
        const int amx = (edx >> 22 & 1) && (edx >> 24 & 1);    /* AMX-BF16, AMX-TILE */
        const int avx512 = (ebx >> 16 & 1) && (ebx >> 30 & 1); /* F, BW */
        if (amx && avx512 && (eax1 >> 5 & 1))                   /* AVX512-BF16 */
            ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return ready;
}

#else

int kvlab_amx_ready(void) { return 0; }

#endif

/* Both entry points: `out` (bf16, causal rows) or, for a shared prefix, `out_f32` and
 * `lse` (every row sees all S positions). */
static int run_amx(const void *q, const void *k, const void *v, void *out, float *out_f32,
                   float *lse, const int64_t *slots, int Q, int S, int64_t num_slots,
                   int64_t k_slot_stride, int64_t k_head_stride, int64_t v_slot_stride,
                   int64_t v_head_stride, int heads, int kv_heads, int head_dim, float scale,
                   int num_threads) {
#if KVLAB_AMX_BUILT
    if (!kvlab_amx_ready()) return KVLAB_ENOAMX;
    if (heads < 1 || heads > MAX_HEADS || kv_heads < 1 || heads % kv_heads) return KVLAB_EARG;
    if (head_dim < 32 || head_dim > AMX_MAX_DIM || head_dim % 32) return KVLAB_EARG;
    if (!q || !k || !v || !(out || (out_f32 && lse)) || !slots || k_slot_stride < 0 ||
        k_head_stride < 0 || v_slot_stride < 0 || v_head_stride < 0)
        return KVLAB_EARG;
    if (Q < 1 || S < (lse ? 1 : Q) || S > INT32_MAX - AMX_KC) return KVLAB_ELEN;
    for (int j = 0; j < S; j++)
        if (slots[j] < 0 || slots[j] >= num_slots) return KVLAB_ESLOT;
    Amx a = {.q = q, .k = k, .v = v, .out = out, .slots = slots, .rows_q = Q, .positions = S,
             .heads = heads, .kv_heads = kv_heads, .head_dim = head_dim,
             .group = heads / kv_heads, .k_slot_stride = k_slot_stride,
             .k_head_stride = k_head_stride, .v_slot_stride = v_slot_stride,
             .v_head_stride = v_head_stride, .scale = scale, .blocks32 = (S + 31) / 32,
             .out_f32 = out_f32, .lse = lse};
    const size_t per_head = (size_t)a.blocks32 * 32 * (size_t)head_dim; /* per K or V */
    a.kp = malloc(sizeof(uint16_t) * per_head * (size_t)kv_heads * 2);
    if (!a.kp) return KVLAB_ENOMEM;
    a.vp = a.kp + per_head * (size_t)kv_heads;
    const int64_t pairs = (int64_t)Q * S * kv_heads; /* below MIN_PARALLEL, run inline */
    const int threads = num_threads < 1 || pairs < MIN_PARALLEL ? 1 : num_threads;
    a.tasks = a.blocks32 * kv_heads;
    int status = kvlab_run_parallel(threads < a.tasks ? threads : a.tasks, pack_tasks, &a);
    if (status == KVLAB_OK) {
        a.tasks = (Q + AMX_QB - 1) / AMX_QB * kv_heads;
        a.next_task = 0;
        status = kvlab_run_parallel(threads < a.tasks ? threads : a.tasks, attend_tasks, &a);
    }
    free(a.kp);
    return status;
#else
    (void)q, (void)k, (void)v, (void)out, (void)out_f32, (void)lse, (void)slots, (void)Q;
    (void)S, (void)num_slots, (void)k_slot_stride, (void)k_head_stride, (void)v_slot_stride;
    (void)v_head_stride, (void)heads, (void)kv_heads, (void)head_dim, (void)scale;
    (void)num_threads;
    return KVLAB_ENOAMX;
#endif
}

/* q, out: (Q, heads, head_dim) bf16 contiguous, rows at positions S - Q .. S - 1; k, v:
 * (num_slots, kv_heads, head_dim) bf16 with the given element strides, last dim
 * contiguous; slots: (S,) contiguous. Returns 0, or a KVLAB_E* code (KVLAB_ENOAMX where
 * kvlab_amx_ready() is 0). */
int kvlab_paged_prefill_amx(const void *q, const void *k, const void *v, void *out,
                            const int64_t *slots, int Q, int S, int64_t num_slots,
                            int64_t k_slot_stride, int64_t k_head_stride,
                            int64_t v_slot_stride, int64_t v_head_stride, int heads,
                            int kv_heads, int head_dim, float scale, int num_threads) {
    return run_amx(q, k, v, out, NULL, NULL, slots, Q, S, num_slots, k_slot_stride,
                   k_head_stride, v_slot_stride, v_head_stride, heads, kv_heads, head_dim,
                   scale, num_threads);
}

/* Cascade attention's shared part: Q rows (each a decoding sequence's query, (Q, heads,
 * head_dim) bf16) attend to the same S positions, a prefix every one of them shares (no
 * mask), read once for all of them. out: (Q, heads, head_dim) fp32, each row normalized
 * over the prefix alone; lse: (Q, heads) fp32, log of the row's softmax denominator (scores
 * scaled), to merge with the rest of each sequence (kvlab_paged_decode's prior). */
int kvlab_prefix_amx(const void *q, const void *k, const void *v, float *out, float *lse,
                     const int64_t *slots, int Q, int S, int64_t num_slots,
                     int64_t k_slot_stride, int64_t k_head_stride, int64_t v_slot_stride,
                     int64_t v_head_stride, int heads, int kv_heads, int head_dim, float scale,
                     int num_threads) {
    if (!out || !lse) return KVLAB_EARG;
    return run_amx(q, k, v, NULL, out, lse, slots, Q, S, num_slots, k_slot_stride,
                   k_head_stride, v_slot_stride, v_head_stride, heads, kv_heads, head_dim,
                   scale, num_threads);
}
